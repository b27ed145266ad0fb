//! Learning, unicast, flooding and counters, over real unix sockets.

mod common;

use common::*;

#[test]
fn learning_then_unicast() {
    let mut r = Rig::new(3);
    let (m0, m1) = (mac(0), mac(1));

    // Unknown destination: flooded to both other ports.
    r.clients[0].send(&eth(m1, m0, 1, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 1);
    assert_eq!(seq_of(&r.clients[2].recv()), 1);

    // m0 was learned on port 0: the reply is unicast.
    r.clients[1].send(&eth(m0, m1, 2, 60));
    assert_eq!(seq_of(&r.clients[0].recv()), 2);
    // m1 was learned on port 1.
    r.clients[0].send(&eth(m1, m0, 3, 1514));
    assert_eq!(seq_of(&r.clients[1].recv()), 3);

    // A marker broadcast: client 2 must see it next, i.e. it got neither unicast.
    r.clients[0].send(&eth(BCAST, m0, 4, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 4);
    assert_eq!(seq_of(&r.clients[2].recv()), 4);
    assert_eq!(r.sw.stats().unwrap().totals.tx_frames, 6);

    let s = r.stats();
    let (p0, p1, p2) = (
        port(&s, r.ports[0]),
        port(&s, r.ports[1]),
        port(&s, r.ports[2]),
    );
    assert_eq!(
        (p0.counters.rx_frames, p0.counters.rx_bytes),
        (3, 60 + 1514 + 60)
    );
    assert_eq!((p1.counters.rx_frames, p1.counters.rx_bytes), (1, 60));
    assert_eq!(p2.counters.rx_frames, 0);
    assert_eq!((p0.counters.tx_frames, p0.counters.tx_bytes), (1, 60));
    assert_eq!(
        (p1.counters.tx_frames, p1.counters.tx_bytes),
        (3, 60 + 1514 + 60)
    );
    assert_eq!((p2.counters.tx_frames, p2.counters.tx_bytes), (2, 120));
    assert_eq!(s.totals.rx_frames, 4);
    assert_eq!(s.totals.drops, 0);
    assert_eq!(s.queued_bytes, 0);
}

#[test]
fn broadcast_reaches_every_other_port() {
    let mut r = Rig::new(3);
    for i in 0..3u8 {
        r.clients[i as usize].send(&eth(BCAST, mac(i), i as u32, 100));
    }
    for i in 0..3u8 {
        let mut srcs: Vec<u8> = (0..2)
            .map(|_| src_of(&r.clients[i as usize].recv())[5])
            .collect();
        srcs.sort();
        let others: Vec<u8> = (0..3).filter(|&j| j != i).collect();
        assert_eq!(srcs, others, "client {i}");
    }
    let s = wait_for(&r.sw, "all floods written", |s| s.totals.tx_frames == 6);
    for p in &s.ports {
        assert_eq!(p.counters.tx_frames, 2, "{} got its own broadcast", p.name);
        assert_eq!((p.queued_frames, p.counters.drops), (0, 0));
    }
}

#[test]
fn multicast_is_flooded_even_after_learning() {
    let mut r = Rig::new(3);
    let mcast = [0x01, 0x00, 0x5e, 0x00, 0x00, 0x01];
    // A station (wrongly) using a multicast source address is not learned.
    r.clients[1].send(&eth(BCAST, mcast, 0, 60));
    r.clients[0].recv();
    r.clients[2].recv();
    r.clients[0].send(&eth(mcast, mac(0), 1, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 1);
    assert_eq!(seq_of(&r.clients[2].recv()), 1);
}

#[test]
fn runt_frames_are_dropped_and_counted() {
    let mut r = Rig::new(2);
    r.clients[0].send(&[0xff; 13]);
    r.clients[0].send(&eth(BCAST, mac(0), 7, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 7); // the runt was not forwarded
    let s = r.stats();
    let p0 = port(&s, r.ports[0]);
    assert_eq!((p0.counters.rx_frames, p0.counters.drops), (2, 1));
    assert!(p0.connected, "a runt is not a protocol error");
}

#[test]
fn stats_serialize_flat() {
    let mut r = Rig::new(2);
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    r.clients[1].recv();
    let s = r.stats();
    let json = serde_json::to_value(&s).unwrap();
    let p0 = &json["ports"][0];
    assert_eq!(p0["name"], "vm0");
    assert_eq!(p0["connected"], true);
    assert_eq!(p0["rx_frames"], 1);
    assert_eq!(p0["connections"], 1);
    assert_eq!(json["totals"]["tx_frames"], 1);
    let back: vmcsnap_switch::SwitchStats = serde_json::from_value(json).unwrap();
    assert_eq!(back, s);
}
