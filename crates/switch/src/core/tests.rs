use super::*;

const A: [u8; 6] = [0x52, 0x54, 0x00, 0x00, 0x00, 0x0a];
const B: [u8; 6] = [0x52, 0x54, 0x00, 0x00, 0x00, 0x0b];
const C: [u8; 6] = [0x52, 0x54, 0x00, 0x00, 0x00, 0x0c];
const BCAST: [u8; 6] = [0xff; 6];
const MCAST: [u8; 6] = [0x01, 0x00, 0x5e, 0x00, 0x00, 0xfb];

fn frame(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(payload);
    f
}

/// Core with `n` connected ports.
fn core(n: usize) -> (SwitchCore, Vec<PortId>) {
    let mut c = SwitchCore::new(1 << 20);
    let ids = (0..n)
        .map(|i| {
            let id = c.add_port(format!("p{i}"));
            c.client_connected(id);
            id
        })
        .collect();
    (c, ids)
}

fn drain(c: &mut SwitchCore, p: PortId) -> Vec<Vec<u8>> {
    std::iter::from_fn(|| c.pop_tx(p))
        .map(|f| f.to_vec())
        .collect()
}

#[test]
fn unknown_unicast_floods_then_learned_unicast() {
    let (mut c, p) = core(3);
    let f1 = frame(B, A, b"hello");
    assert_eq!(c.receive(p[0], &f1), Decision::Flood(vec![p[1], p[2]]));
    assert_eq!(c.lookup(MacAddr(A)), Some(p[0]));
    assert_eq!(drain(&mut c, p[1]), vec![f1.clone()]);
    assert_eq!(drain(&mut c, p[2]), vec![f1]);

    let f2 = frame(A, B, b"reply");
    assert_eq!(c.receive(p[1], &f2), Decision::Unicast(p[0]));
    assert_eq!(drain(&mut c, p[0]), vec![f2]);
    assert!(drain(&mut c, p[2]).is_empty());

    let f3 = frame(B, A, b"again");
    assert_eq!(c.receive(p[0], &f3), Decision::Unicast(p[1]));
    assert!(drain(&mut c, p[2]).is_empty());
}

#[test]
fn never_back_to_ingress() {
    let (mut c, p) = core(2);
    c.receive(p[0], &frame(BCAST, A, b""));
    c.receive(p[0], &frame(BCAST, B, b""));
    assert_eq!(c.receive(p[1], &frame(A, C, b"")), Decision::Unicast(p[0]));
    // A and B both live on p0: traffic between them is filtered.
    assert_eq!(c.receive(p[0], &frame(B, A, b"")), Decision::Filter);
    assert!(drain(&mut c, p[0]).iter().all(|f| f[6..12] == C));
}

#[test]
fn relearn_when_mac_moves() {
    let (mut c, p) = core(3);
    c.receive(p[0], &frame(BCAST, A, b""));
    assert_eq!(c.lookup(MacAddr(A)), Some(p[0]));
    c.receive(p[2], &frame(BCAST, A, b""));
    assert_eq!(c.lookup(MacAddr(A)), Some(p[2]));
    assert_eq!(c.receive(p[1], &frame(A, B, b"")), Decision::Unicast(p[2]));
}

#[test]
fn broadcast_and_multicast_flood_to_connected_or_held_ports() {
    let (mut c, p) = core(4);
    c.receive(p[1], &frame(BCAST, B, b"")); // B is now known ...
    c.client_disconnected(p[3]);
    assert_eq!(
        c.route(p[0], &frame(BCAST, A, b"")),
        Decision::Flood(vec![p[1], p[2]])
    );
    // ... but multicast never goes unicast, even to a learned address.
    assert_eq!(
        c.route(p[0], &frame(MCAST, A, b"")),
        Decision::Flood(vec![p[1], p[2]])
    );
    c.hold(p[3]);
    assert_eq!(
        c.route(p[0], &frame(BCAST, A, b"")),
        Decision::Flood(vec![p[1], p[2], p[3]])
    );
}

#[test]
fn multicast_source_is_not_learned() {
    let (mut c, p) = core(2);
    c.receive(p[0], &frame(BCAST, MCAST, b""));
    c.receive(p[0], &frame(BCAST, [0; 6], b""));
    assert_eq!(c.lookup(MacAddr(MCAST)), None);
    assert_eq!(c.lookup(MacAddr([0; 6])), None);
}

#[test]
fn runt_is_dropped_and_counted() {
    let (mut c, p) = core(2);
    assert_eq!(
        c.receive(p[0], &[0xff; 13]),
        Decision::Drop(DropReason::Runt)
    );
    let k = c.port(p[0]).unwrap().counters;
    assert_eq!((k.rx_frames, k.rx_bytes, k.drops), (1, 13, 1));
    assert_eq!(c.port(p[1]).unwrap().queued_frames, 0);
    assert_eq!(c.totals().drops, 1);
}

#[test]
fn counters_and_totals() {
    let (mut c, p) = core(3);
    let f = frame(BCAST, A, &[0; 46]); // 60 bytes
    c.receive(p[0], &f);
    for &q in &p[1..] {
        while let Some(fr) = c.pop_tx(q) {
            c.record_tx(q, fr.len());
        }
    }
    let k0 = c.port(p[0]).unwrap().counters;
    assert_eq!(
        (k0.rx_frames, k0.rx_bytes, k0.tx_frames, k0.connections),
        (1, 60, 0, 1)
    );
    let k1 = c.port(p[1]).unwrap().counters;
    assert_eq!((k1.rx_frames, k1.tx_frames, k1.tx_bytes), (0, 1, 60));
    let t = c.totals();
    assert_eq!(
        (t.rx_frames, t.rx_bytes, t.tx_frames, t.tx_bytes),
        (1, 60, 2, 120)
    );
    assert_eq!(t.connections, 3);
}

#[test]
fn unconnected_unheld_port_drops() {
    let (mut c, p) = core(2);
    c.receive(p[1], &frame(BCAST, B, b""));
    c.client_disconnected(p[1]);
    assert_eq!(c.receive(p[0], &frame(B, A, b"")), Decision::Unicast(p[1]));
    let v = c.port(p[1]).unwrap();
    assert_eq!((v.queued_frames, v.counters.drops), (0, 1));
}

#[test]
fn disconnect_discards_queue_unless_held() {
    let (mut c, p) = core(2);
    c.receive(p[0], &frame(BCAST, A, b"1"));
    c.client_disconnected(p[1]);
    assert_eq!(c.port(p[1]).unwrap().counters.drops, 1);

    c.client_connected(p[1]);
    c.hold(p[1]);
    c.receive(p[0], &frame(BCAST, A, b"2"));
    c.client_disconnected(p[1]);
    assert_eq!(c.port(p[1]).unwrap().queued_frames, 1);
    c.client_connected(p[1]);
    c.release(p[1]);
    assert_eq!(drain(&mut c, p[1]), vec![frame(BCAST, A, b"2")]);
}

#[test]
fn hold_queues_in_order_and_release_flushes() {
    let (mut c, p) = core(2);
    c.hold(p[1]);
    let frames: Vec<_> = (0..5u8).map(|i| frame(BCAST, A, &[i])).collect();
    for f in &frames {
        c.receive(p[0], f);
    }
    assert_eq!(c.pop_tx(p[1]), None);
    let v = c.port(p[1]).unwrap();
    assert!(v.holding);
    assert_eq!((v.queued_frames, v.counters.held), (5, 5));
    assert_eq!(c.totals().held, 5);
    c.release(p[1]);
    assert_eq!(drain(&mut c, p[1]), frames);
}

#[test]
fn release_while_disconnected_discards() {
    let (mut c, p) = core(2);
    c.hold(p[1]);
    c.client_disconnected(p[1]);
    c.receive(p[0], &frame(BCAST, A, b""));
    assert_eq!(c.port(p[1]).unwrap().queued_frames, 1);
    c.release(p[1]);
    let v = c.port(p[1]).unwrap();
    assert_eq!(
        (v.queued_frames, v.counters.drops, v.counters.held),
        (0, 1, 1)
    );
}

#[test]
fn queue_bound_drops_excess() {
    let mut c = SwitchCore::new(100);
    let a = c.add_port("a");
    let b = c.add_port("b");
    c.client_connected(a);
    c.client_connected(b);
    let f = frame(BCAST, A, &[0; 26]); // 40 bytes
    for _ in 0..3 {
        c.receive(a, &f);
    }
    let v = c.port(b).unwrap();
    assert_eq!(
        (v.queued_frames, v.queued_bytes, v.counters.drops),
        (2, 80, 1)
    );
}

#[test]
fn requeue_front_keeps_order() {
    let (mut c, p) = core(2);
    for i in 0..4u8 {
        c.receive(p[0], &frame(BCAST, A, &[i]));
    }
    let x = c.pop_tx(p[1]).unwrap();
    let y = c.pop_tx(p[1]).unwrap();
    c.requeue_front(p[1], vec![x, y]);
    let got: Vec<u8> = drain(&mut c, p[1]).iter().map(|f| f[14]).collect();
    assert_eq!(got, vec![0, 1, 2, 3]);
}

#[test]
fn remove_port_forgets_macs() {
    let (mut c, p) = core(3);
    c.receive(p[1], &frame(BCAST, B, b""));
    assert!(c.remove_port(p[1]));
    assert!(!c.remove_port(p[1]));
    assert_eq!(c.lookup(MacAddr(B)), None);
    assert_eq!(
        c.receive(p[0], &frame(B, A, b"")),
        Decision::Flood(vec![p[2]])
    );
    assert_eq!(
        c.receive(p[1], &frame(B, A, b"")),
        Decision::Drop(DropReason::UnknownIngress)
    );
}

#[test]
fn mac_table_cap() {
    let (mut c, p) = core(2);
    c.set_max_macs(1);
    c.receive(p[0], &frame(BCAST, A, b""));
    c.receive(p[1], &frame(BCAST, B, b""));
    assert_eq!(c.lookup(MacAddr(B)), None);
    c.receive(p[1], &frame(BCAST, A, b"")); // known addresses still move
    assert_eq!(c.lookup(MacAddr(A)), Some(p[1]));
}
