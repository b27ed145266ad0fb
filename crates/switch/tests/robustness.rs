//! Stalled readers, reconnects and protocol errors, over real unix sockets.
//! (More on dialing in tests/dial.rs.)

mod common;

use std::io::Write;

use common::*;
use vmcsnap_switch::{Switch, SwitchConfig};

#[test]
fn stalled_reader_does_not_block_others() {
    const BOUND: usize = 1 << 20;
    const FRAMES: u32 = 5000;
    const LEN: usize = 1000;
    const WINDOW: u32 = 50;
    let config = SwitchConfig {
        max_queue_bytes: BOUND,
        ..Default::default()
    };
    // Port 2's client never reads (a paused VM).
    let mut r = Rig::with_switch(Switch::start_with(config).unwrap(), 3);

    // 5 MB of broadcasts, far more than port 2's socket buffer plus queue.
    // The sender waits for port 1 after each window, so port 1's own queue
    // stays small whatever the scheduling.
    for start in (0..FRAMES).step_by(WINDOW as usize) {
        for seq in start..start + WINDOW {
            r.clients[0].send(&eth(BCAST, mac(0), seq, LEN));
        }
        for seq in start..start + WINDOW {
            assert_eq!(seq_of(&r.clients[1].recv()), seq);
        }
    }

    let s = r.stats();
    let (p1, p2) = (port(&s, r.ports[1]), port(&s, r.ports[2]));
    assert_eq!(
        (p1.counters.tx_frames, p1.counters.drops),
        (FRAMES as u64, 0)
    );
    assert!(
        p2.counters.drops > 0,
        "stalled port should overflow: {p2:?}"
    );
    assert_eq!(
        p2.counters.tx_frames + p2.counters.drops + p2.queued_frames,
        FRAMES as u64
    );
    assert!(
        p2.queued_bytes as usize <= BOUND + 512 * 1024,
        "queue exceeds its bound: {p2:?}"
    );

    // When the stalled client reads again it gets an intact, ordered stream.
    let expected = FRAMES as u64 - p2.counters.drops;
    let mut last = None;
    for _ in 0..expected {
        let f = r.clients[2].recv();
        assert_eq!(f.len(), LEN);
        let seq = seq_of(&f);
        if let Some(l) = last {
            assert!(seq > l, "out of order: {seq} after {l}");
        }
        last = Some(seq);
    }
    let s = wait_for(&r.sw, "stalled port drained", |s| {
        port(s, r.ports[2]).queued_frames == 0
    });
    assert_eq!(port(&s, r.ports[2]).counters.tx_frames, expected);
}

#[test]
fn a_peer_closing_the_connection_is_dialed_again() {
    // QEMU drops a client on a read error and accepts the next one.
    let mut r = Rig::new(2);
    r.clients[0].accept_again();
    wait_connected(&r.sw, r.ports[0], 2);

    r.clients[1].send(&eth(BCAST, mac(1), 9, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 9);
    r.clients[0].send(&eth(mac(1), mac(0), 10, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 10);

    let s = r.stats();
    let p0 = port(&s, r.ports[0]);
    assert!(p0.connected);
    assert_eq!(
        (p0.counters.connections, p0.counters.protocol_errors),
        (2, 0)
    );
}

#[test]
fn disconnect_then_new_client() {
    let mut r = Rig::new(2);
    let old = r.clients.remove(0);
    drop(old);
    wait_for(&r.sw, "disconnect", |s| !port(s, r.ports[0]).connected);
    // A flood skips the disconnected port (nothing to drop there).
    r.clients[0].send(&eth(BCAST, mac(1), 1, 60));
    let s = wait_for(&r.sw, "frame counted", |s| {
        port(s, r.ports[1]).counters.rx_frames == 1
    });
    assert_eq!(
        port(&s, r.ports[0]).counters.drops,
        0,
        "flood skips disconnected ports"
    );

    let mut new = Client::serve(&r.path(0)); // a new QEMU for the VM
    wait_connected(&r.sw, r.ports[0], 2);
    r.clients[0].send(&eth(BCAST, mac(1), 2, 60));
    assert_eq!(seq_of(&new.recv()), 2);
}

#[test]
fn oversize_frame_closes_only_that_connection() {
    let mut r = Rig::new(3);
    let len = (vmcsnap_switch::MAX_FRAME_LEN + 1) as u32;
    r.clients[0].stream.write_all(&len.to_be_bytes()).unwrap();
    r.clients[0].expect_eof();
    let s = wait_for(&r.sw, "port 0 disconnected", |s| {
        !port(s, r.ports[0]).connected
    });
    let p0 = port(&s, r.ports[0]);
    assert_eq!(p0.counters.protocol_errors, 1);
    assert_eq!(s.totals.protocol_errors, 1);

    // The other ports still work.
    r.clients[1].send(&eth(BCAST, mac(1), 5, 60));
    assert_eq!(seq_of(&r.clients[2].recv()), 5);
    r.clients[2].send(&eth(mac(1), mac(2), 6, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 6);
    assert!(port(&r.stats(), r.ports[1]).connected);

    // And port 0 is dialed again: its peer still listens.
    r.clients[0].accept_again();
    wait_connected(&r.sw, r.ports[0], 2);
    r.clients[1].send(&eth(BCAST, mac(1), 7, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 7);
}

#[test]
fn zero_length_frame_is_a_protocol_error() {
    let mut r = Rig::new(2);
    r.clients[0].stream.write_all(&[0, 0, 0, 0]).unwrap();
    r.clients[0].expect_eof();
    let s = wait_for(&r.sw, "port 0 disconnected", |s| {
        !port(s, r.ports[0]).connected
    });
    assert_eq!(port(&s, r.ports[0]).counters.protocol_errors, 1);
}

#[test]
fn frames_split_across_writes() {
    let mut r = Rig::new(2);
    let mut wire = Vec::new();
    for seq in 0..3 {
        let f = eth(BCAST, mac(0), seq, 200);
        wire.extend_from_slice(&(f.len() as u32).to_be_bytes());
        wire.extend_from_slice(&f);
    }
    for chunk in wire.chunks(7) {
        r.clients[0].stream.write_all(chunk).unwrap();
        r.clients[0].stream.flush().unwrap();
    }
    for seq in 0..3 {
        assert_eq!(seq_of(&r.clients[1].recv()), seq);
    }
}
