//! Freezing a running switch and thawing it in the same process, over real
//! unix sockets: every frame is delivered exactly once and in order, the
//! connections to the fake QEMUs stay the same (no reconnect), and holds,
//! counters and the MAC table carry over; a port without a connection at
//! the freeze dials again after the thaw.

mod common;

use std::io::Write;
use std::os::fd::IntoRawFd;

use common::*;
use vmcsnap_switch::handover::FORMAT_VERSION;
use vmcsnap_switch::{
    Counters, FrozenState, FrozenSwitch, Switch, SwitchConfig, SwitchError, SwitchHandle,
};

/// Frame length of a prime-sized record (7919 bytes): a long write of such
/// records into a socket that fills up (at a boundary of the kernel's
/// buffers, a multiple of its chunk size from the start of the write) stops
/// in the middle of a record.
const BIG: usize = 7915;

/// `frame` as it travels on the wire.
fn record(frame: &[u8]) -> Vec<u8> {
    let mut r = (frame.len() as u32).to_be_bytes().to_vec();
    r.extend_from_slice(frame);
    r
}

/// Thaws like a new process image would: the state through JSON, the
/// descriptors by number only.
fn thaw_by_numbers(frozen: FrozenSwitch) -> SwitchHandle {
    let (state, fds) = frozen.into_parts();
    let json = serde_json::to_string(&state).unwrap();
    let state: FrozenState = serde_json::from_str(&json).unwrap();
    for fd in fds {
        let _ = fd.into_raw_fd(); // ownership passes to thaw through the number
    }
    Switch::thaw(state, SwitchConfig::default()).unwrap()
}

#[test]
fn freeze_and_thaw_keep_every_frame_and_all_state() {
    let mut r = Rig::new(3);
    let (p0, p1, p2) = (r.ports[0], r.ports[1], r.ports[2]);
    // Learn mac(i) on port i.
    for i in 0..3 {
        r.clients[i].send(&eth(BCAST, mac(i as u8), i as u32, 60));
        for j in (0..3).filter(|&j| j != i) {
            assert_eq!(seq_of(&r.clients[j].recv()), i as u32);
        }
    }
    // Port 1 is held with frames queued for it.
    r.sw.hold(p1).unwrap();
    for seq in 100..110 {
        r.clients[0].send(&eth(mac(1), mac(0), seq, 200));
    }
    // Port 2's client does not read: far more than its socket buffer takes.
    // Queued while held, then released: the switch writes them in large
    // batches, so the socket fills up in the middle of a frame.
    const SLOW: u32 = 300;
    r.sw.hold(p2).unwrap();
    for seq in 1000..1000 + SLOW {
        r.clients[0].send(&eth(mac(2), mac(0), seq, BIG));
    }
    let rx0 = 1 + 10 + u64::from(SLOW);
    wait_for(&r.sw, "all read", |s| port(s, p0).counters.rx_frames == rx0);
    r.sw.release(p2).unwrap();
    wait_for(&r.sw, "port 2 backed up", |s| {
        port(s, p2).counters.tx_frames > 2
    });
    // Client 0 writes a whole frame and half of the next in one write; once
    // the whole one is counted, the half is in the switch's decoder.
    let half = record(&eth(mac(1), mac(0), 111, 1000));
    let cut = half.len() / 2;
    let mut wire = record(&eth(mac(1), mac(0), 110, 200));
    wire.extend_from_slice(&half[..cut]);
    r.clients[0].stream.write_all(&wire).unwrap();
    let before = wait_for(&r.sw, "whole frame read", |s| {
        port(s, p0).counters.rx_frames == rx0 + 1
    });

    let frozen = r.sw.freeze().unwrap();
    assert!(matches!(r.sw.stats(), Err(SwitchError::Stopped)));
    for i in 0..3 {
        assert!(r.path(i).exists(), "socket file {i} unlinked by freeze");
    }
    let st = frozen.state();
    assert_eq!(st.version, FORMAT_VERSION);
    let c0 = st.ports[0].connection.as_ref().unwrap();
    assert_eq!(c0.rx_pending, half[..cut], "decoder input carried over");
    let c2 = st.ports[2].connection.as_ref().unwrap();
    let partial = c2.tx_partial.as_ref().expect(
        "port 2 should have a partly written frame: its socket filled up in the middle of a record",
    );
    assert_eq!(partial.frame_len, BIG);
    assert!(st.ports[1].holding);
    assert!(st.ports[1]
        .connection
        .as_ref()
        .unwrap()
        .tx_partial
        .is_none());
    let held: Vec<u32> = st.ports[1].queue.iter().map(|f| seq_of(f)).collect();
    assert_eq!(held, (100..=110).collect::<Vec<_>>());
    let macs: Vec<_> = st.macs.iter().map(|m| (m.mac.0, m.port)).collect();
    assert_eq!(macs, vec![(mac(0), p0), (mac(1), p1), (mac(2), p2)]);
    for (i, p) in st.ports.iter().enumerate() {
        assert_eq!(p.counters, before.ports[i].counters, "port {i} counters");
    }
    assert_eq!(st.totals, before.totals);

    // While frozen, clients keep writing; it waits in the kernel buffers.
    r.clients[0].stream.write_all(&half[cut..]).unwrap();
    r.clients[0].send(&eth(mac(2), mac(0), 1000 + SLOW, 60));

    r.sw = thaw_by_numbers(frozen);
    // The slow reader gets its frames intact, in order, exactly once,
    // starting with the rest of the partly written one.
    for seq in 1000..1000 + SLOW {
        let f = r.clients[2].recv();
        assert_eq!((seq_of(&f), f.len()), (seq, BIG));
    }
    assert_eq!(seq_of(&r.clients[2].recv()), 1000 + SLOW);
    // Port 1 is still held, with the completed half frame queued too.
    let s = wait_for(&r.sw, "frames written while frozen read", |s| {
        port(s, p0).counters.rx_frames == rx0 + 3
    });
    let s1 = port(&s, p1);
    assert!(s1.holding);
    assert_eq!((s1.queued_frames, s1.counters.tx_frames), (12, 2));
    r.sw.release(p1).unwrap();
    for seq in 100..=111 {
        assert_eq!(seq_of(&r.clients[1].recv()), seq);
    }
    // Nothing else was delivered: a broadcast is everyone's next frame.
    r.clients[0].send(&eth(BCAST, mac(0), 9999, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 9999);
    assert_eq!(seq_of(&r.clients[2].recv()), 9999);
    // The MAC table survived: a unicast to mac(2) reaches port 2 only.
    r.clients[1].send(&eth(mac(2), mac(1), 7777, 60));
    assert_eq!(seq_of(&r.clients[2].recv()), 7777);
    r.clients[2].send(&eth(BCAST, mac(2), 8888, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 8888, "port 0 got the unicast");
    assert_eq!(seq_of(&r.clients[1].recv()), 8888);

    // Counters continued from before the freeze.
    let slow_bytes = u64::from(SLOW) * BIG as u64;
    let expect0 = Counters {
        rx_frames: rx0 + 4,
        rx_bytes: 60 + 11 * 200 + slow_bytes + 1000 + 60 + 60,
        tx_frames: 3,
        tx_bytes: 180,
        connections: 1,
        ..Counters::default()
    };
    let expect1 = Counters {
        rx_frames: 2,
        rx_bytes: 120,
        tx_frames: 16,
        tx_bytes: 120 + 11 * 200 + 1000 + 60 + 60,
        held: 12,
        connections: 1,
        ..Counters::default()
    };
    let expect2 = Counters {
        rx_frames: 2,
        rx_bytes: 120,
        tx_frames: 2 + u64::from(SLOW) + 3,
        tx_bytes: 120 + slow_bytes + 180,
        held: u64::from(SLOW),
        connections: 1,
        ..Counters::default()
    };
    let all = |s: &vmcsnap_switch::SwitchStats| {
        let c = |p| port(s, p).counters;
        (c(p0), c(p1), c(p2))
    };
    // Bounded wait: a client may read a frame before the switch counts it.
    let s = wait_for(&r.sw, "all counted", |s| {
        all(s).2.tx_frames == expect2.tx_frames
    });
    assert_eq!(all(&s), (expect0, expect1, expect2));
    assert_eq!(s.totals.tx_frames, 3 + 16 + expect2.tx_frames);
    assert_eq!(s.totals.rx_frames, expect0.rx_frames + 4);
    assert_eq!(
        (s.totals.drops, s.totals.connections, s.totals.held),
        (0, 3, 12 + u64::from(SLOW))
    );
}

#[test]
fn repeated_freeze_thaw_during_a_stream_loses_nothing() {
    const N: u32 = 30_000;
    let mut r = Rig::new(3);
    let p0 = r.ports[0];
    let mut receivers: Vec<_> = r.clients.drain(1..).collect();
    let mut sender = r.clients.pop().unwrap();
    let send_thread = std::thread::spawn(move || {
        // Odd-sized writes cut records anywhere, so freezes catch partial input.
        let mut wire = Vec::new();
        for seq in 0..N {
            wire.extend_from_slice(&record(&eth(BCAST, mac(0), seq, 60 + (seq % 200) as usize)));
        }
        for chunk in wire.chunks(1009) {
            sender.stream.write_all(chunk).unwrap();
        }
        sender
    });
    let recv_threads: Vec<_> = receivers
        .drain(..)
        .map(|mut c| {
            std::thread::spawn(move || {
                for seq in 0..N {
                    let f = c.recv();
                    assert_eq!((seq_of(&f), f.len()), (seq, 60 + (seq % 200) as usize));
                }
                c
            })
        })
        .collect();

    for (k, threshold) in [N / 4, N / 2, 3 * N / 4].into_iter().enumerate() {
        wait_for(&r.sw, "traffic", |s| {
            port(s, p0).counters.rx_frames >= u64::from(threshold)
        });
        let frozen = r.sw.freeze().unwrap();
        r.sw = if k % 2 == 0 {
            thaw_by_numbers(frozen)
        } else {
            frozen.resume(SwitchConfig::default()).unwrap()
        };
    }
    let _sender = send_thread.join().unwrap();
    let _receivers: Vec<_> = recv_threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let s = wait_for(&r.sw, "all counted", |s| {
        r.ports[1..]
            .iter()
            .all(|&p| port(s, p).counters.tx_frames == u64::from(N))
    });
    assert_eq!(port(&s, p0).counters.rx_frames, u64::from(N));
    assert_eq!((s.totals.drops, s.totals.connections), (0, 3));
}

#[test]
fn frozen_state_round_trips_through_json() {
    let mut r = Rig::new(2);
    r.clients[1].send(&eth(BCAST, mac(1), 1, 60));
    r.clients[0].recv();
    r.sw.hold(r.ports[0]).unwrap();
    // A whole frame and the start of another in one write: once the whole
    // one is queued, the rest is in the decoder.
    let mut wire = record(&eth(mac(0), mac(1), 2, 64));
    wire.extend_from_slice(&[0, 0, 0, 60, 1, 2]);
    r.clients[1].stream.write_all(&wire).unwrap();
    wait_for(&r.sw, "held", |s| port(s, r.ports[0]).queued_frames == 1);
    let frozen = r.sw.freeze().unwrap();
    let state = frozen.state().clone();
    state.validate().unwrap();

    let json = serde_json::to_string_pretty(&state).unwrap();
    assert!(
        json.contains("\"52:54:00:12:34:01\""),
        "MACs as text:\n{json}"
    );
    assert!(json.contains("\"0000003c0102\""), "bytes as hex:\n{json}");
    let back: FrozenState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, state);
    back.validate().unwrap();
    // And the state still thaws.
    let mut r2 = r;
    r2.sw = frozen.resume(SwitchConfig::default()).unwrap();
    r2.sw.release(r2.ports[0]).unwrap();
    assert_eq!(seq_of(&r2.clients[0].recv()), 2);
}

#[test]
fn thaw_rejects_bogus_state_or_fds_and_takes_nothing() {
    let mut r = Rig::new(2);
    let frozen = r.sw.freeze().unwrap();
    let (state, fds) = frozen.into_parts(); // `fds` stay owned (open) here
    let devnull = std::fs::File::open("/dev/null").unwrap();
    let thaw_err = |edit: &dyn Fn(&mut FrozenState)| {
        let mut s = state.clone();
        edit(&mut s);
        let err = Switch::thaw(s, SwitchConfig::default()).unwrap_err();
        (err.to_string(), err)
    };
    let fd_problem = |edit: &dyn Fn(&mut FrozenState)| match thaw_err(edit) {
        (msg, SwitchError::InheritedFd { problem, .. }) => (msg, problem),
        (msg, _) => panic!("expected an InheritedFd error, got: {msg}"),
    };

    let conn = |s: &FrozenState, i: usize| -> i32 { s.ports[i].connection.as_ref().unwrap().fd };
    let set =
        |s: &mut FrozenState, i: usize, fd: i32| s.ports[i].connection.as_mut().unwrap().fd = fd;
    let (msg, problem) = fd_problem(&|s| set(s, 1, 1 << 30));
    assert!(problem.contains("is not open"), "{msg}");
    assert!(
        msg.contains("fd 1073741824 (connection of port \"vm1\""),
        "{msg}"
    );
    assert!(msg.contains("keep_across_exec"), "{msg}");
    let null = std::os::fd::AsRawFd::as_raw_fd(&devnull);
    let (msg, problem) = fd_problem(&|s| set(s, 0, null));
    assert!(problem.contains("is not a socket"), "{msg}");
    let listener = std::os::fd::AsRawFd::as_raw_fd(&r.clients[0].listener);
    let (msg, problem) = fd_problem(&|s| set(s, 0, listener));
    assert!(
        problem.contains("listening socket, not a connection"),
        "{msg}"
    );
    let (msg, problem) = fd_problem(&|s| {
        let (c0, c1) = (conn(s, 0), conn(s, 1));
        set(s, 0, c1);
        set(s, 1, c0);
    });
    assert!(problem.contains("is connected to"), "{msg}");

    let invalid = |edit: &dyn Fn(&mut FrozenState), what: &str| match thaw_err(edit) {
        (msg, SwitchError::InvalidFrozenState(_)) => assert!(msg.contains(what), "{msg}"),
        (msg, _) => panic!("expected InvalidFrozenState, got: {msg}"),
    };
    invalid(&|s| s.version = 1, "layout version 1");
    invalid(
        &|s| {
            let fd = conn(s, 0);
            set(s, 1, fd)
        },
        "used twice",
    );
    invalid(
        &|s| s.ports[1].socket_path = s.ports[0].socket_path.clone(),
        "used twice",
    );
    invalid(
        &|s| s.ports[1].socket_path = "".into(),
        "not usable for a unix socket",
    );
    invalid(&|s| s.ports[1].name = "vm0".into(), "used twice");
    invalid(&|s| s.ports[0].queue.push(Vec::new()), "zero-length");
    invalid(
        &|s| s.ports[0].connection.as_mut().unwrap().rx_pending = vec![0, 0, 0, 1, 9],
        "complete frame",
    );

    // The failed attempts took and closed nothing: the real thaw works.
    for fd in fds {
        let _ = fd.into_raw_fd();
    }
    r.sw = Switch::thaw(state, SwitchConfig::default()).unwrap();
    r.clients[0].send(&eth(BCAST, mac(0), 5, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 5);
}

#[test]
fn a_port_dialing_at_the_freeze_is_connected_after_the_thaw() {
    let mut r = Rig::new(2);
    drop(r.clients.remove(1)); // vm1's QEMU exits
    wait_for(&r.sw, "vm1 gone", |s| !port(s, r.ports[1]).connected);
    let frozen = r.sw.freeze().unwrap();
    let st = frozen.state();
    assert!(st.ports[0].connection.is_some() && st.ports[1].connection.is_none());
    let listener = listen(&r.path(1)); // a new QEMU starts during the handover
    r.sw = thaw_by_numbers(frozen);
    let mut new = Client::accept_on(listener);
    wait_connected(&r.sw, r.ports[1], 2);
    r.clients[0].send(&eth(BCAST, mac(0), 3, 60));
    assert_eq!(seq_of(&new.recv()), 3);
    new.send(&eth(BCAST, mac(1), 4, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 4);
    let s = r.stats();
    assert_eq!(
        (
            port(&s, r.ports[0]).counters.connections,
            s.totals.connections
        ),
        (1, 3),
        "port 0 kept its connection through the handover"
    );
}
