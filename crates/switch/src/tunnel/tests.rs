use super::*;

fn frame(len: usize) -> Vec<u8> {
    (0..len).map(|i| i as u8).collect()
}

fn header(tag: Option<(Color, u64)>, seq: u64) -> Header {
    Header {
        kind: Kind::Frame,
        tag,
        incarnation: 1_764_000_000_000,
        seq,
    }
}

#[test]
fn every_header_round_trips_with_its_payload() {
    for tag in [None, Some((Color::Pre, 7)), Some((Color::Post, u64::MAX))] {
        for len in [MIN_FRAME_LEN, 60, MAX_FRAME_LEN] {
            let h = header(tag, 42);
            let mut out = vec![];
            encode(&h, &frame(len), &mut out);
            assert_eq!(out.len(), HEADER_LEN + len);
            let (back, payload) = decode(&out).unwrap();
            assert_eq!(back, h);
            assert_eq!(payload, frame(len).as_slice());
        }
    }
    let k = Header {
        kind: Kind::Keepalive,
        ..header(None, 3)
    };
    let mut out = vec![];
    encode(&k, &[], &mut out);
    assert_eq!(decode(&out).unwrap(), (k, &[][..]));
}

/// The layout docs/network.md and the module docs draw, byte by byte.
#[test]
fn the_layout_is_the_documented_one() {
    let mut out = vec![];
    let h = Header {
        kind: Kind::Frame,
        tag: Some((Color::Post, 0x0102030405060708)),
        incarnation: 0x1112131415161718,
        seq: 0x2122232425262728,
    };
    encode(&h, &frame(14), &mut out);
    let expect_head: [u8; HEADER_LEN] = [
        b'V', b'M', b'T', b'N', 1, 0, 2, 0, //
        1, 2, 3, 4, 5, 6, 7, 8, //
        0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, //
        0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28,
    ];
    assert_eq!(out[..HEADER_LEN], expect_head);
}

#[test]
fn each_bad_field_is_its_own_error() {
    let mut good = vec![];
    encode(&header(Some((Color::Pre, 5)), 1), &frame(60), &mut good);
    let with = |i: usize, b: u8| {
        let mut d = good.clone();
        d[i] = b;
        decode(&d).map(|_| ()).unwrap_err()
    };
    assert_eq!(decode(&good[..10]).unwrap_err(), TunnelError::Short(10));
    assert_eq!(with(0, b'X'), TunnelError::Magic(*b"XMTN"));
    assert_eq!(with(4, 2), TunnelError::Version(2));
    assert_eq!(with(5, 9), TunnelError::Kind(9));
    assert_eq!(with(6, 3), TunnelError::Color(3));
    assert_eq!(with(7, 0x80), TunnelError::Flags(0x80));
    assert_eq!(with(6, 0), TunnelError::UntaggedEpoch(5));
    let short = &good[..HEADER_LEN + MIN_FRAME_LEN - 1];
    assert_eq!(
        decode(short).unwrap_err(),
        TunnelError::PayloadLen {
            kind: Kind::Frame,
            len: MIN_FRAME_LEN - 1
        }
    );
    let e = with(5, 1);
    assert_eq!(
        e,
        TunnelError::PayloadLen {
            kind: Kind::Keepalive,
            len: 60
        }
    );
    assert!(with(4, 2)
        .to_string()
        .contains("same vmcsnap on both hosts"));
}

/// Like `dhcp::tests::random_bytes_never_panic`; the fuzz target
/// `tunnel_datagram` does the same with coverage guidance.
#[test]
fn random_bytes_never_panic_and_what_decodes_encodes_back() {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut decoded = 0;
    for round in 0..20_000 {
        let len = (next() % 120) as usize;
        let mut d: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if round % 2 == 0 && d.len() >= HEADER_LEN {
            // Mostly valid headers, so the later checks are reached too.
            d[..4].copy_from_slice(&MAGIC);
            d[4] = VERSION;
            d[5] %= 3;
            d[6] %= 4;
            d[7] = (next() % 8 == 0) as u8;
        }
        if let Ok((h, payload)) = decode(&d) {
            decoded += 1;
            let mut again = vec![];
            encode(&h, payload, &mut again);
            assert_eq!(again, d);
        }
    }
    assert!(decoded > 100, "the valid paths were reached ({decoded})");
}

#[test]
fn in_order_datagrams_are_delivered_and_repeats_dropped() {
    let mut w = SeqWindow::new();
    for s in 1..=200 {
        assert_eq!(w.observe(1, s), SeqVerdict::New { skipped: 0 });
        assert_eq!(w.observe(1, s), SeqVerdict::Duplicate);
        if s > 1 {
            assert_eq!(w.observe(1, s - 1), SeqVerdict::Duplicate);
        }
    }
    let c = w.counts();
    assert_eq!((c.delivered, c.lost, c.stale, c.restarts), (200, 0, 0, 0));
    assert_eq!(c.duplicates, 399);
}

#[test]
fn gaps_count_as_lost_until_the_late_datagrams_come() {
    let mut w = SeqWindow::new();
    assert_eq!(w.observe(1, 1), SeqVerdict::New { skipped: 0 });
    assert_eq!(w.observe(1, 5), SeqVerdict::New { skipped: 3 });
    assert_eq!(w.counts().lost, 3);
    assert_eq!(w.observe(1, 3), SeqVerdict::Late);
    assert_eq!(w.observe(1, 3), SeqVerdict::Duplicate);
    assert_eq!(w.observe(1, 1), SeqVerdict::Duplicate);
    assert_eq!(w.counts().lost, 2);
    // A jump of exactly the window: the old newest is still known.
    assert_eq!(
        w.observe(1, 5 + WINDOW),
        SeqVerdict::New {
            skipped: WINDOW - 1
        }
    );
    assert_eq!(w.observe(1, 5), SeqVerdict::Duplicate);
    assert_eq!(w.observe(1, 4), SeqVerdict::Stale, "beyond the window");
    // A jump beyond it.
    assert_eq!(
        w.observe(1, 6 + 3 * WINDOW),
        SeqVerdict::New {
            skipped: 2 * WINDOW
        }
    );
    assert_eq!(w.observe(1, 5 + WINDOW), SeqVerdict::Stale);
    assert_eq!(w.observe(1, 0), SeqVerdict::Stale, "never sent");
}

#[test]
fn a_restarted_sender_starts_again_and_its_old_datagrams_are_stale() {
    let mut w = SeqWindow::new();
    for s in 1..=10 {
        w.observe(100, s);
    }
    assert_eq!(w.observe(200, 1), SeqVerdict::New { skipped: 0 });
    assert_eq!(w.observe(100, 11), SeqVerdict::Stale, "the old incarnation");
    assert_eq!(w.observe(200, 2), SeqVerdict::New { skipped: 0 });
    let c = w.counts();
    assert_eq!((c.delivered, c.restarts, c.stale), (12, 1, 1));
}

/// Any arrival order of a sequence with repeats: each datagram delivered
/// exactly once while it is within the window.
#[test]
fn shuffled_and_repeated_arrivals_deliver_each_datagram_once() {
    let mut x: u64 = 12345;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut w = SeqWindow::new();
    let mut delivered = std::collections::BTreeSet::new();
    // Arrivals: 1..=2000, each displaced by up to 40 and repeated 1 in 5.
    let mut arrivals: Vec<(u64, u64)> = (1..=2000u64)
        .map(|s| (s * 100 + next() % 4000, s))
        .collect();
    let mut repeats = vec![];
    for &(t, s) in &arrivals {
        if next() % 5 == 0 {
            repeats.push((t + next() % 2000, s));
        }
    }
    arrivals.extend(repeats);
    arrivals.sort_unstable();
    for (_, s) in arrivals {
        match w.observe(7, s) {
            SeqVerdict::New { .. } | SeqVerdict::Late => {
                assert!(delivered.insert(s), "{s} delivered twice")
            }
            SeqVerdict::Duplicate | SeqVerdict::Stale => {}
        }
    }
    assert_eq!(delivered.len(), 2000, "all within the window");
    assert_eq!(w.counts().lost, 0);
}

#[test]
fn missing_below_counts_what_has_not_arrived_since_the_first() {
    let mut w = SeqWindow::new();
    assert_eq!(w.missing_below(5, 3), None, "nothing heard yet");
    // Seq 1 and 2 went before the receiver heard anything: not waited for.
    for seq in [3, 4, 7] {
        w.observe(5, seq);
    }
    assert_eq!(w.missing_below(5, 7), Some(2)); // 5 and 6
    assert_eq!(w.missing_below(5, 5), Some(0));
    assert_eq!(w.missing_below(5, 9), Some(3)); // 5, 6 and 8
    assert_eq!(w.missing_below(4, 7), None, "another incarnation");
    w.observe(5, 6);
    w.observe(5, 5);
    assert_eq!(w.missing_below(5, 7), Some(0));
    // More than WINDOW behind the newest is settled (delivered or lost).
    w.observe(5, 7 + WINDOW + 10);
    assert_eq!(w.missing_below(5, 7 + WINDOW + 10), Some(WINDOW));
    // A restart starts over.
    w.observe(6, 4);
    assert_eq!(w.missing_below(6, 4), Some(0));
    assert_eq!(w.missing_below(5, 8), None);
}

/// Found by the `tunnel_datagram` fuzz target: two huge jumps of the
/// sequence number overflowed `lost` (a panic with overflow checks, a
/// wrapped count without).
#[test]
fn lost_saturates_when_a_sender_jumps_far() {
    let mut w = SeqWindow::new();
    w.observe(1, u64::MAX - 1);
    w.observe(2, u64::MAX);
    assert_eq!(w.counts().lost, u64::MAX);
    assert_eq!(w.counts().delivered, 2);
    // Counting what is missing below a far number is bounded too.
    assert_eq!(w.missing_below(2, u64::MAX), Some(0));
    assert_eq!(w.missing_below(2, 5), Some(0));
}
