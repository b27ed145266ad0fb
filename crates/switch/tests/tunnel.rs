//! Two switches joined by a UDP tunnel over 127.0.0.1, each with fake
//! QEMUs on its ports; and one switch whose tunnel's other end is a plain
//! UDP socket that sends raw datagrams (duplicated, reordered, malformed).

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use vmcsnap_switch::mediator::Color;
use vmcsnap_switch::tunnel::{self, Header, Kind};
use vmcsnap_switch::{LogReason, PeerCut, PortId, SwitchHandle, TunnelCounters};

/// A free UDP address on loopback (bound and released at once).
fn free_addr() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn counters(sw: &SwitchHandle, tunnel: PortId) -> TunnelCounters {
    port(&sw.stats().unwrap(), tunnel)
        .tunnel
        .as_ref()
        .expect("a tunnel port")
        .counters
}

fn peer_cut(sw: &SwitchHandle, tunnel: PortId) -> Option<PeerCut> {
    port(&sw.stats().unwrap(), tunnel)
        .tunnel
        .as_ref()
        .expect("a tunnel port")
        .peer_cut
}

/// Switch A with `na` VMs, switch B with `nb`, a tunnel between them.
struct Pair {
    a: Rig,
    b: Rig,
    ta: PortId,
    tb: PortId,
}

impl Pair {
    fn new(na: usize, nb: usize) -> Pair {
        let a = Rig::new(na);
        let b = Rig::new(nb);
        let (addr_a, addr_b) = (free_addr(), free_addr());
        let ta = a.sw.add_tunnel("to-b", addr_a, addr_b).unwrap();
        let tb = b.sw.add_tunnel("to-a", addr_b, addr_a).unwrap();
        for (sw, t) in [(&a.sw, ta), (&b.sw, tb)] {
            wait_for(sw, "the peer's keepalive", |s| {
                port(s, t).tunnel.as_ref().unwrap().peer_alive
            });
        }
        Pair { a, b, ta, tb }
    }
}

/// Frames sent into a tunnel: datagrams less keepalives.
fn frames_sent(c: &TunnelCounters) -> u64 {
    c.datagrams_sent - c.keepalives_sent
}

#[test]
fn frames_flow_both_ways_flooded_once_and_unicast_after_learning() {
    let mut p = Pair::new(2, 2);
    let (a0, a1, b0, b1) = (mac(0), mac(1), mac(10), mac(11));
    // A broadcast from A's vm0 reaches everyone else, one datagram.
    p.a.clients[0].send(&eth(BCAST, a0, 1, 60));
    assert_eq!(seq_of(&p.a.clients[1].recv()), 1);
    assert_eq!(seq_of(&p.b.clients[0].recv()), 1);
    assert_eq!(seq_of(&p.b.clients[1].recv()), 1);
    assert_eq!(frames_sent(&counters(&p.a.sw, p.ta)), 1);
    // B's vm1 answers a0, learned on B's tunnel: unicast across.
    p.b.clients[1].send(&eth(a0, b1, 2, 1514));
    assert_eq!(seq_of(&p.a.clients[0].recv()), 2);
    // A's vm0 to b1 (learned on A's tunnel), B delivers it to vm1 only.
    p.a.clients[0].send(&eth(b1, a0, 3, 100));
    assert_eq!(seq_of(&p.b.clients[1].recv()), 3);
    // Markers: a1 and b0 see these next, so neither got a unicast.
    p.b.clients[1].send(&eth(BCAST, b1, 4, 60));
    assert_eq!(seq_of(&p.a.clients[1].recv()), 4);
    assert_eq!(seq_of(&p.b.clients[0].recv()), 4);
    assert_eq!(seq_of(&p.a.clients[0].recv()), 4);
    p.a.clients[1].send(&eth(b0, a1, 5, 60)); // unknown on both: flooded
    assert_eq!(seq_of(&p.a.clients[0].recv()), 5);
    assert_eq!(seq_of(&p.b.clients[0].recv()), 5);
    assert_eq!(seq_of(&p.b.clients[1].recv()), 5);

    let (ca, cb) = (counters(&p.a.sw, p.ta), counters(&p.b.sw, p.tb));
    assert_eq!((frames_sent(&ca), ca.frames_received), (3, 2));
    assert_eq!((frames_sent(&cb), cb.frames_received), (2, 3));
    // A's first keepalive went out before B was bound: B counts it lost.
    for (c, lost) in [(ca, 0), (cb, 1)] {
        assert_eq!(
            (c.duplicates, c.stale, c.lost, c.late),
            (0, 0, lost, 0),
            "{c:?}"
        );
        assert_eq!(c.refused.total(), 0);
    }
    let s = p.a.stats();
    let t = port(&s, p.ta);
    assert_eq!((t.counters.tx_frames, t.counters.rx_frames), (3, 2));
    assert_eq!(t.counters.rx_bytes, 1514 + 60);
    assert!(t.socket_path.as_os_str().is_empty());
    assert_eq!(s.tunnels.frames_received, 2);
    // The stats serialize, tunnel counters included.
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"datagrams_sent\""), "{json}");
}

/// Switch with one VM, its tunnel's other end a plain socket.
fn raw_rig() -> (Rig, PortId, UdpSocket) {
    let r = Rig::new(1);
    let raw = UdpSocket::bind("127.0.0.1:0").unwrap();
    raw.set_read_timeout(Some(TIMEOUT)).unwrap();
    let local = free_addr();
    let t =
        r.sw.add_tunnel("raw", local, raw.local_addr().unwrap())
            .unwrap();
    raw.connect(local).unwrap();
    (r, t, raw)
}

fn datagram(incarnation: u64, seq: u64, tag: Option<(Color, u64)>, frame: &[u8]) -> Vec<u8> {
    let header = Header {
        kind: Kind::Frame,
        tag,
        incarnation,
        seq,
    };
    let mut out = Vec::new();
    tunnel::encode(&header, frame, &mut out);
    out
}

#[test]
fn duplicated_and_reordered_datagrams_are_delivered_at_most_once() {
    let (mut r, t, raw) = raw_rig();
    // The switch's first datagram is a keepalive, numbered 1.
    let mut buf = [0u8; 2048];
    let n = raw.recv(&mut buf).unwrap();
    let (h, payload) = tunnel::decode(&buf[..n]).unwrap();
    assert_eq!(
        (h.kind, h.seq, h.tag, payload.len()),
        (Kind::Keepalive, 1, None, 0)
    );

    let frame = |seq| eth(BCAST, mac(10), seq as u32, 60);
    for seq in [1u64, 2, 2, 4, 3, 3, 1, 5] {
        raw.send(&datagram(100, seq, None, &frame(seq))).unwrap();
    }
    let got: Vec<u32> = (0..5).map(|_| seq_of(&r.clients[0].recv())).collect();
    assert_eq!(got, vec![1, 2, 4, 3, 5]);
    let c = wait_for(&r.sw, "8 datagrams", |s| {
        port(s, t)
            .tunnel
            .as_ref()
            .unwrap()
            .counters
            .datagrams_received
            == 8
    });
    let c = port(&c, t).tunnel.as_ref().unwrap().counters;
    assert_eq!(c.frames_received, 5);
    assert_eq!(
        (c.duplicates, c.late, c.lost, c.stale),
        (3, 1, 0, 0),
        "{c:?}"
    );

    // A gap is counted as lost; the sender restarting (a larger
    // incarnation) numbers from 1 again, and its old datagrams are stale.
    raw.send(&datagram(100, 8, None, &frame(8))).unwrap();
    raw.send(&datagram(200, 1, None, &frame(9))).unwrap();
    raw.send(&datagram(100, 9, None, &frame(10))).unwrap();
    raw.send(&datagram(200, 2, None, &frame(11))).unwrap();
    assert_eq!(seq_of(&r.clients[0].recv()), 8);
    assert_eq!(seq_of(&r.clients[0].recv()), 9);
    assert_eq!(seq_of(&r.clients[0].recv()), 11);
    let c = counters(&r.sw, t);
    assert_eq!(
        (c.lost, c.stale, c.restarts, c.frames_received),
        (2, 1, 1, 8),
        "{c:?}"
    );
}

#[test]
fn bad_datagrams_are_refused_and_counted_and_the_switch_runs_on() {
    let (mut r, t, raw) = raw_rig();
    let good = datagram(100, 1, None, &eth(BCAST, mac(10), 7, 60));
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    let mut bad_version = good.clone();
    bad_version[4] = 2;
    let mut bad_flags = good.clone();
    bad_flags[7] = 1;
    let mut bad_len = good[..tunnel::HEADER_LEN + 5].to_vec();
    bad_len[5] = 0; // a frame of 5 bytes
    for d in [
        &bad_magic,
        &bad_version,
        &bad_flags,
        &good[..10].to_vec(),
        &bad_len,
    ] {
        raw.send(d).unwrap();
    }
    raw.send(&good).unwrap();
    assert_eq!(seq_of(&r.clients[0].recv()), 7);
    let c = counters(&r.sw, t);
    let f = c.refused;
    assert_eq!(
        (
            f.magic,
            f.version,
            f.flags,
            f.short,
            f.payload_len,
            f.total()
        ),
        (1, 1, 1, 1, 1, 5),
        "{c:?}"
    );
    assert_eq!((c.datagrams_received, c.frames_received), (1, 1));
    // Frames still go out through the tunnel.
    r.clients[0].send(&eth(BCAST, mac(0), 8, 60));
    let mut buf = [0u8; 2048];
    let frame = loop {
        let n = raw.recv(&mut buf).unwrap();
        let (h, payload) = tunnel::decode(&buf[..n]).unwrap();
        if h.kind == Kind::Frame {
            break payload.to_vec();
        }
    };
    assert_eq!(seq_of(&frame), 8);
}

#[test]
fn a_frame_too_large_for_the_path_is_dropped_and_counted() {
    let mut r = Rig::new(1);
    let raw = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut config =
        vmcsnap_switch::TunnelConfig::new("raw", free_addr(), raw.local_addr().unwrap());
    config.max_datagram_len = 1500 - 28;
    let t = r.sw.add_tunnel_with(config).unwrap();
    r.clients[0].send(&eth(BCAST, mac(0), 1, 1514));
    r.clients[0].send(&eth(BCAST, mac(0), 2, 1500 - 28 - tunnel::HEADER_LEN));
    let s = wait_for(&r.sw, "both frames switched", |s| {
        port(s, t).counters.tx_frames + port(s, t).counters.drops == 2
    });
    let tp = port(&s, t);
    assert_eq!((tp.counters.tx_frames, tp.counters.drops), (1, 1));
    assert_eq!(tp.tunnel.as_ref().unwrap().counters.too_large, 1);
    // Out of range bounds are refused.
    let mut bad = vmcsnap_switch::TunnelConfig::new("x", free_addr(), free_addr());
    bad.max_datagram_len = 65536;
    let e = r.sw.add_tunnel_with(bad).unwrap_err();
    assert!(e.to_string().contains("max_datagram_len 65536"), "{e}");
}

/// The whole cut of a port whose fake QEMU reads nothing meanwhile.
fn cut_port(sw: &SwitchHandle, port: PortId) {
    sw.prepare_cut_with(port, Duration::from_secs(5), 0)
        .unwrap();
    sw.cut(port).unwrap();
    sw.release(port).unwrap();
}

/// A: vm0 (mac 0); B: vm0, vm1 (mac 10, 11); every MAC learned everywhere.
fn learned_pair() -> Pair {
    let mut p = Pair::new(1, 2);
    p.a.clients[0].send(&eth(BCAST, mac(0), 0, 60));
    p.b.clients[0].recv();
    p.b.clients[1].recv();
    for i in 0..2 {
        p.b.clients[i].send(&eth(BCAST, mac(10 + i as u8), 0, 60));
        p.a.clients[0].recv();
        p.b.clients[1 - i].recv();
    }
    p
}

#[test]
fn a_cut_session_on_both_switches_holds_and_logs_across_the_tunnel() {
    let mut p = learned_pair();
    let (ta_tx, _ta_rx) = mpsc::channel();
    let (tb_tx, tb_rx) = mpsc::channel();
    p.a.sw.begin_cut_session(5, &p.a.ports, ta_tx).unwrap();
    p.b.sw.begin_cut_session(5, &p.b.ports, tb_tx).unwrap();
    let (b0, b1) = (p.b.ports[0], p.b.ports[1]);
    cut_port(&p.b.sw, b1);
    // A's vm0 (pre) to B's vm1 (post): channel state, logged on B.
    p.a.clients[0].send(&eth(mac(11), mac(0), 1, 60));
    assert_eq!(seq_of(&p.b.clients[1].recv()), 1);
    // A's vm0 is cut; its frame to B's vm0 (pre) holds vm0 and triggers
    // its cut.
    assert_eq!(peer_cut(&p.b.sw, p.tb), None);
    cut_port(&p.a.sw, p.a.ports[0]);
    // A's keepalive says so; B has every datagram A sent before it.
    wait_for(&p.b.sw, "A's word that its cut is complete", |s| {
        port(s, p.tb).tunnel.as_ref().unwrap().peer_cut
            == Some(PeerCut {
                epoch: 5,
                missing: 0,
            })
    });
    p.a.clients[0].send(&eth(mac(10), mac(0), 2, 60));
    assert_eq!(tb_rx.recv_timeout(TIMEOUT).unwrap(), b0);
    let s = p.b.stats();
    assert!(port(&s, b0).holding);
    assert_eq!(port(&s, b0).queued_frames, 1);
    assert_eq!(
        p.b.sw.release(b0).unwrap_err().to_string(),
        vmcsnap_switch::SwitchError::HeldByCutSession(b0).to_string()
    );
    cut_port(&p.b.sw, b0);
    assert_eq!(seq_of(&p.b.clients[0].recv()), 2);

    let log_b = p.b.sw.end_cut_session().unwrap();
    let log_a = p.a.sw.end_cut_session().unwrap();
    let got: Vec<_> = log_b
        .frames
        .iter()
        .map(|f| {
            (
                seq_of(&f.data),
                f.sender.as_str(),
                f.receiver.as_str(),
                f.reason,
            )
        })
        .collect();
    assert_eq!(got, vec![(1, "to-a", "vm1", LogReason::InFlight)]);
    assert_eq!((log_b.stats.violations, log_b.stats.triggers), (0, 1));
    assert_eq!((log_a.frames.len(), log_a.stats.violations), (0, 0));
    assert_eq!(counters(&p.b.sw, p.tb).other_epoch, 0);
}

#[test]
fn a_frame_of_another_epoch_is_switched_untagged_and_counted() {
    let mut p = learned_pair();
    let (ta_tx, _ta_rx) = mpsc::channel();
    let (tb_tx, tb_rx) = mpsc::channel();
    p.a.sw.begin_cut_session(5, &p.a.ports, ta_tx).unwrap();
    p.b.sw.begin_cut_session(6, &p.b.ports, tb_tx).unwrap();
    cut_port(&p.a.sw, p.a.ports[0]);
    // Post of epoch 5 means nothing in B's session 6: no hold.
    p.a.clients[0].send(&eth(mac(10), mac(0), 3, 60));
    assert_eq!(seq_of(&p.b.clients[0].recv()), 3);
    assert!(tb_rx.try_recv().is_err(), "no trigger");
    assert_eq!(counters(&p.b.sw, p.tb).other_epoch, 1);
    let log_b = p.b.sw.end_cut_session().unwrap();
    assert_eq!((log_b.frames.len(), log_b.stats.triggers), (0, 0));
    p.a.sw.end_cut_session().unwrap();
}

#[test]
fn a_tunnel_is_no_session_member_and_refuses_to_freeze() {
    let p = Pair::new(1, 1);
    let (tx, _rx) = mpsc::channel();
    let e =
        p.a.sw
            .begin_cut_session(1, &[p.a.ports[0], p.ta], tx)
            .unwrap_err();
    assert!(e.to_string().contains("is a tunnel"), "{e}");
    let e = p.a.sw.freeze().unwrap_err();
    assert!(e.to_string().contains("1 tunnel port"), "{e}");
    p.a.sw.remove_port(p.ta).unwrap();
    assert!(p.a.stats().port(p.ta).is_none());
}

/// The next frame datagram the raw end receives (keepalives skipped).
fn next_frame(raw: &UdpSocket) -> (Header, Vec<u8>) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = raw.recv(&mut buf).unwrap();
        let (h, payload) = tunnel::decode(&buf[..n]).unwrap();
        if h.kind == Kind::Frame {
            return (h, payload.to_vec());
        }
    }
}

#[test]
fn a_frame_keeps_its_color_at_reception_when_the_session_ends_before_it_is_sent() {
    let (mut r, t, raw) = raw_rig();
    let (tx, _rx) = mpsc::channel();
    r.sw.begin_cut_session(9, &r.ports, tx).unwrap();
    // The tunnel port is held, so the frame waits in its queue.
    r.sw.hold(t).unwrap();
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    wait_for(&r.sw, "the frame queued", |s| port(s, t).queued_frames == 1);
    r.sw.end_cut_session().unwrap();
    r.clients[0].send(&eth(BCAST, mac(0), 2, 60));
    wait_for(&r.sw, "the frame queued", |s| port(s, t).queued_frames == 2);
    r.sw.release(t).unwrap();
    let (h1, f1) = next_frame(&raw);
    let (h2, f2) = next_frame(&raw);
    assert_eq!((seq_of(&f1), h1.tag), (1, Some((Color::Pre, 9))));
    assert_eq!((seq_of(&f2), h2.tag), (2, None));
    assert!(h1.seq < h2.seq);
}

fn keepalive(incarnation: u64, seq: u64, tag: Option<(Color, u64)>) -> Vec<u8> {
    let header = Header {
        kind: Kind::Keepalive,
        tag,
        incarnation,
        seq,
    };
    let mut out = Vec::new();
    tunnel::encode(&header, &[], &mut out);
    out
}

#[test]
fn the_peers_cut_is_complete_once_every_datagram_before_its_word_is_in() {
    let (mut r, t, raw) = raw_rig();
    let (tx, _rx) = mpsc::channel();
    r.sw.begin_cut_session(4, &r.ports, tx).unwrap();
    cut_port(&r.sw, r.ports[0]);
    // The switch's own word, right after its last cut.
    let mut buf = [0u8; 2048];
    loop {
        let n = raw.recv(&mut buf).unwrap();
        let (h, _) = tunnel::decode(&buf[..n]).unwrap();
        if h.kind == Kind::Keepalive && h.tag == Some((Color::Post, 4)) {
            break;
        }
    }
    // The raw peer: a keepalive, then its word (seq 4) overtakes two pre
    // frames (seq 2, 3) that arrive after it.
    let pre = Some((Color::Pre, 4));
    raw.send(&keepalive(50, 1, pre)).unwrap();
    raw.send(&keepalive(50, 4, Some((Color::Post, 4)))).unwrap();
    let missing = |m| {
        Some(PeerCut {
            epoch: 4,
            missing: m,
        })
    };
    wait_for(&r.sw, "the word", |_| peer_cut(&r.sw, t) == missing(2));
    raw.send(&datagram(50, 3, pre, &eth(mac(0), mac(10), 3, 60)))
        .unwrap();
    assert_eq!(seq_of(&r.clients[0].recv()), 3);
    assert_eq!(peer_cut(&r.sw, t), missing(1));
    raw.send(&datagram(50, 2, pre, &eth(mac(0), mac(10), 2, 60)))
        .unwrap();
    assert_eq!(seq_of(&r.clients[0].recv()), 2);
    assert_eq!(peer_cut(&r.sw, t), missing(0));
    // Both were in flight to a cut VM: channel state, logged here.
    let log = r.sw.end_cut_session().unwrap();
    let got: Vec<u32> = log.frames.iter().map(|f| seq_of(&f.data)).collect();
    assert_eq!(got, vec![3, 2]);
}

#[test]
fn a_local_address_in_use_or_a_taken_name_is_refused() {
    let r = Rig::new(1);
    let busy = UdpSocket::bind("127.0.0.1:0").unwrap();
    let at = busy.local_addr().unwrap();
    let e = r.sw.add_tunnel("t", at, free_addr()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("bind") && msg.contains(&at.to_string()),
        "{msg}"
    );
    let e =
        r.sw.add_tunnel("vm0", free_addr(), free_addr())
            .unwrap_err();
    assert!(e.to_string().contains("already used"), "{e}");
    // Nothing was added.
    assert_eq!(r.stats().ports.len(), 1);
}
