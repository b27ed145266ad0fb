//! Holding and releasing ports, over real unix sockets.

mod common;

use common::*;
use vmcsnap_switch::{Switch, SwitchConfig};

#[test]
fn hold_then_release_delivers_in_order() {
    let mut r = Rig::new(3);
    r.sw.hold(r.ports[1]).unwrap();
    for seq in 0..20 {
        r.clients[0].send(&eth(BCAST, mac(0), seq, 60 + seq as usize));
    }
    // Port 2 is not held: it gets everything right away.
    for seq in 0..20 {
        assert_eq!(seq_of(&r.clients[2].recv()), seq);
    }
    let s = wait_for(&r.sw, "frames held", |s| {
        port(s, r.ports[1]).counters.held == 20
    });
    let p1 = port(&s, r.ports[1]);
    assert!(p1.holding);
    assert_eq!((p1.queued_frames, p1.counters.tx_frames), (20, 0));
    assert_eq!(p1.queued_bytes, (0..20).map(|i| 60 + i).sum::<u64>());
    assert_eq!(port(&s, r.ports[2]).counters.held, 0);

    r.sw.release(r.ports[1]).unwrap();
    for seq in 0..20 {
        let f = r.clients[1].recv();
        assert_eq!((seq_of(&f), f.len()), (seq, 60 + seq as usize));
    }
    let s = wait_for(&r.sw, "released", |s| {
        port(s, r.ports[1]).counters.tx_frames == 20
    });
    let p1 = port(&s, r.ports[1]);
    assert!(!p1.holding);
    assert_eq!((p1.queued_frames, p1.counters.drops), (0, 0));
}

#[test]
fn hold_across_reconnect() {
    // The restore case: hold the VM's port, its QEMU goes away, a new QEMU
    // listens and is connected, then release: frames sent meanwhile reach
    // the new QEMU.
    let mut r = Rig::new(2);
    r.clients[1].send(&eth(BCAST, mac(1), 0, 60)); // learn mac(1) on port 1
    r.clients[0].recv();
    r.sw.hold(r.ports[1]).unwrap();
    drop(r.clients.remove(1));
    wait_for(&r.sw, "disconnect", |s| !port(s, r.ports[1]).connected);

    for seq in 1..=5 {
        r.clients[0].send(&eth(mac(1), mac(0), seq, 100)); // unicast
        r.clients[0].send(&eth(BCAST, mac(0), 100 + seq, 100)); // flood
    }
    wait_for(&r.sw, "frames held", |s| {
        port(s, r.ports[1]).counters.held == 10
    });

    let mut new = Client::serve(&r.path(1));
    wait_connected(&r.sw, r.ports[1], 2);
    assert_eq!(
        port(&r.stats(), r.ports[1]).counters.tx_frames,
        0,
        "held frames were written"
    );
    r.sw.release(r.ports[1]).unwrap();
    let got: Vec<u32> = (0..10).map(|_| seq_of(&new.recv())).collect();
    assert_eq!(got, vec![1, 101, 2, 102, 3, 103, 4, 104, 5, 105]);
}

#[test]
fn held_queue_is_bounded() {
    let config = SwitchConfig {
        max_queue_bytes: 1000,
        ..Default::default()
    };
    let mut r = Rig::with_switch(Switch::start_with(config).unwrap(), 2);
    r.sw.hold(r.ports[1]).unwrap();
    for seq in 0..5 {
        r.clients[0].send(&eth(BCAST, mac(0), seq, 300));
    }
    let s = wait_for(&r.sw, "all received", |s| {
        port(s, r.ports[0]).counters.rx_frames == 5
    });
    let p1 = port(&s, r.ports[1]);
    assert_eq!(
        (p1.counters.held, p1.counters.drops, p1.queued_bytes),
        (3, 2, 900)
    );
    r.sw.release(r.ports[1]).unwrap();
    let got: Vec<u32> = (0..3).map(|_| seq_of(&r.clients[1].recv())).collect();
    assert_eq!(got, vec![0, 1, 2]);
}

#[test]
fn release_while_disconnected_drops_queue() {
    let mut r = Rig::new(2);
    r.sw.hold(r.ports[1]).unwrap();
    drop(r.clients.remove(1));
    wait_for(&r.sw, "disconnect", |s| !port(s, r.ports[1]).connected);
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    wait_for(&r.sw, "held", |s| port(s, r.ports[1]).queued_frames == 1);
    r.sw.release(r.ports[1]).unwrap();
    let s = r.stats();
    let p1 = port(&s, r.ports[1]);
    assert_eq!(
        (p1.queued_frames, p1.counters.drops, p1.counters.held),
        (0, 1, 1)
    );
}

#[test]
fn injected_frames_reach_the_client_in_order_after_a_hold() {
    let mut r = Rig::new(2);
    r.sw.hold(r.ports[1]).unwrap();
    let frames: Vec<Vec<u8>> = (0..5).map(|s| eth(mac(1), mac(0), s, 70)).collect();
    let rep = r.sw.inject(r.ports[1], frames).unwrap();
    assert_eq!((rep.queued, rep.dropped), (5, 0));
    let s = r.stats();
    let p1 = port(&s, r.ports[1]);
    assert_eq!(
        (p1.queued_frames, p1.counters.tx_frames, p1.counters.held),
        (5, 0, 5),
        "held: nothing delivered yet"
    );
    r.sw.release(r.ports[1]).unwrap();
    for seq in 0..5 {
        assert_eq!(seq_of(&r.clients[1].recv()), seq);
    }
    r.sw.remove_port(r.ports[0]).unwrap();
    assert!(
        r.sw.inject(r.ports[0], vec![]).is_err(),
        "a removed port is an error"
    );
}
