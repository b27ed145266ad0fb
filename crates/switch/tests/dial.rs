//! The switch dials its peers (fake QEMUs listening like `server=on`) and
//! dials again whenever a port has no connection, one connection per port
//! at most.

mod common;

use std::io::Write;
use std::time::Duration;

use common::*;
use vmcsnap_switch::Switch;

#[test]
fn frames_flow_between_two_listening_peers() {
    let mut r = Rig::new(2);
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 1);
    r.clients[1].send(&eth(mac(0), mac(1), 2, 1514));
    let f = r.clients[0].recv();
    assert_eq!((seq_of(&f), f.len()), (2, 1514));
    let s = r.stats();
    for &p in &r.ports {
        let p = port(&s, p);
        assert!(p.connected);
        assert_eq!((p.counters.connections, p.counters.drops), (1, 0));
    }
}

#[test]
fn a_restarted_peer_is_connected_again() {
    let mut r = Rig::new(2);
    let (p0, p1) = (r.ports[0], r.ports[1]);
    r.clients[1].send(&eth(BCAST, mac(1), 0, 60)); // learn mac(1) on port 1
    r.clients[0].recv();
    // vm1's QEMU exits: listener and connection close, the file stays.
    drop(r.clients.remove(1));
    wait_for(&r.sw, "vm1 disconnected", |s| !port(s, p1).connected);
    assert!(r.path(1).exists());
    // A unicast for the dialing port is dropped and counted (a flood skips
    // it); nothing queues.
    r.clients[0].send(&eth(mac(1), mac(0), 1, 60));
    let s = wait_for(&r.sw, "frame read", |s| port(s, p0).counters.rx_frames == 1);
    let q = port(&s, p1);
    assert_eq!((q.counters.drops, q.queued_frames), (1, 0));

    // A new QEMU binds the same path again.
    let mut new = Client::serve(&r.path(1));
    wait_connected(&r.sw, p1, 2);
    assert_eq!(r.sw.connection_state(p1).unwrap().connections, 2);
    r.clients[0].send(&eth(BCAST, mac(0), 2, 60));
    assert_eq!(seq_of(&new.recv()), 2);
    new.send(&eth(mac(0), mac(1), 3, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 3);

    // And once more.
    drop(new);
    let mut third = Client::serve(&r.path(1));
    let st = r.sw.wait_connected(p1, 3, TIMEOUT).unwrap();
    assert!(st.connected_since(3), "{st:?}");
    r.clients[0].send(&eth(BCAST, mac(0), 4, 60));
    assert_eq!(seq_of(&third.recv()), 4);
    assert_eq!(r.stats().totals.connections, 1 + 3);
}

#[test]
fn a_peer_listening_only_after_add_port_is_connected() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    let (pa, pb) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let a = sw.add_port("a", &pa).unwrap();
    let b = sw.add_port("b", &pb).unwrap();
    assert!(!pa.exists() && !pb.exists(), "the switch creates no file");
    let st = sw.wait_connected(a, 1, Duration::from_millis(50)).unwrap();
    assert!(!st.connected_since(1), "nobody listens yet: {st:?}");

    let mut ca = Client::serve(&pa);
    let mut cb = Client::serve(&pb);
    for id in [a, b] {
        assert!(sw
            .wait_connected(id, 1, TIMEOUT)
            .unwrap()
            .connected_since(1));
    }
    ca.send(&eth(BCAST, mac(0), 7, 60));
    assert_eq!(seq_of(&cb.recv()), 7);
}

#[test]
fn the_switch_holds_one_connection_per_port() {
    let dir = tempfile::tempdir().unwrap();
    let sw = Switch::start().unwrap();
    let path = dir.path().join("a.sock");
    // A peer that does not accept yet: the connection waits in its backlog
    // and already counts as connected.
    let listener = listen(&path);
    let id = sw.add_port("a", &path).unwrap();
    assert!(sw.port_connected(id).unwrap());

    // Many retry periods later (the switch dials every 20 ms while a port
    // has no connection), still one connection: accept it, and nothing else
    // is in the backlog. (A slow machine can only make this pass for the
    // wrong reason, never fail it.)
    std::thread::sleep(Duration::from_millis(300));
    let mut peer = Client::accept_on(listener);
    assert!(!has_pending(&peer.listener), "a second connection was made");
    // Frames written before the accept were waiting in the connection.
    sw.inject(id, vec![eth(mac(1), mac(9), 5, 60)]).unwrap();
    assert_eq!(seq_of(&peer.recv()), 5);

    // After the peer drops the connection the switch dials exactly once more.
    peer.accept_again();
    wait_connected(&sw, id, 2);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!has_pending(&peer.listener), "a third connection was made");
    assert_eq!(sw.connection_state(id).unwrap().connections, 2);
}

#[test]
fn half_a_frame_from_a_lost_connection_is_discarded() {
    let mut r = Rig::new(2);
    // Half a record, then the connection ends (QEMU restarted mid-write).
    let rec = {
        let f = eth(BCAST, mac(0), 1, 200);
        let mut w = (f.len() as u32).to_be_bytes().to_vec();
        w.extend_from_slice(&f);
        w
    };
    r.clients[0].stream.write_all(&rec[..100]).unwrap();
    r.clients[0].accept_again();
    wait_connected(&r.sw, r.ports[0], 2);
    // The new connection starts a fresh stream: a whole frame goes through.
    r.clients[0].send(&eth(BCAST, mac(0), 2, 60));
    let f = r.clients[1].recv();
    assert_eq!((seq_of(&f), f.len()), (2, 60));
    let s = r.stats();
    let p0 = port(&s, r.ports[0]);
    assert_eq!((p0.counters.rx_frames, p0.counters.protocol_errors), (1, 0));
}
