//! Packet capture (`SwitchConfig::capture_dir`), over real unix sockets:
//! each port's pcapng file holds what its VM sent and what it was handed, in
//! order and marked with their direction, with held frames at their release
//! and injected ones included.

mod common;

use common::*;
use vmcsnap_switch::{Switch, SwitchConfig};

/// (unix µs, direction flags, frame) of every packet of a pcapng file as
/// the switch writes it.
fn records(bytes: &[u8]) -> Vec<(u64, u32, Vec<u8>)> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!(
        (u32_at(0), u32_at(8)),
        (0x0A0D_0D0A, 0x1A2B_3C4D),
        "pcapng section header"
    );
    assert_eq!(
        (u32_at(28), u32_at(36) & 0xffff),
        (1, 1),
        "one Ethernet interface"
    );
    let (mut at, mut out) = (48, Vec::new());
    while at < bytes.len() {
        let (kind, len) = (u32_at(at), u32_at(at + 4) as usize);
        assert_eq!(kind, 6, "an enhanced packet block");
        assert_eq!(u32_at(at + len - 4) as usize, len, "trailing length");
        let ts = ((u32_at(at + 12) as u64) << 32) | u32_at(at + 16) as u64;
        let incl = u32_at(at + 20) as usize;
        assert_eq!(incl, u32_at(at + 24) as usize, "not cut");
        let opts = at + 28 + incl.div_ceil(4) * 4;
        assert_eq!(u32_at(opts), 2 | 4 << 16, "epb_flags");
        out.push((
            ts,
            u32_at(opts + 4),
            bytes[at + 28..at + 28 + incl].to_vec(),
        ));
        at += len;
    }
    assert_eq!(at, bytes.len(), "no partial block");
    out
}

const IN: u32 = 1;
const OUT: u32 = 2;

#[test]
fn each_port_captures_both_directions_in_order() {
    let cap = tempfile::tempdir().unwrap();
    let config = SwitchConfig {
        capture_dir: Some(cap.path().to_path_buf()),
        ..Default::default()
    };
    let mut r = Rig::with_switch(Switch::start_with(config).unwrap(), 2);
    let (m0, m1) = (mac(0), mac(1));
    r.clients[0].send(&eth(BCAST, m0, 1, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 1);
    r.clients[1].send(&eth(m0, m1, 2, 1514));
    assert_eq!(seq_of(&r.clients[0].recv()), 2);
    // Held frames are captured when they are handed over, after the release.
    r.sw.hold(r.ports[1]).unwrap();
    r.clients[0].send(&eth(m1, m0, 3, 100));
    wait_for(&r.sw, "held", |s| port(s, r.ports[1]).counters.held == 1);
    r.sw.inject(r.ports[1], vec![eth(m1, m0, 4, 80)]).unwrap();
    r.sw.release(r.ports[1]).unwrap();
    assert_eq!(seq_of(&r.clients[1].recv()), 3);
    assert_eq!(seq_of(&r.clients[1].recv()), 4);
    r.sw.stop(); // flushes the files
    let read = |vm: &str| records(&std::fs::read(cap.path().join(format!("{vm}.pcapng"))).unwrap());
    let seqs = |recs: &[(u64, u32, Vec<u8>)]| {
        recs.iter()
            .map(|(_, d, f)| (seq_of(f), f.len(), *d))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        seqs(&read("vm0")),
        vec![(1, 60, OUT), (2, 1514, IN), (3, 100, OUT)],
        "vm0 sent 1 and 3, got 2"
    );
    assert_eq!(
        seqs(&read("vm1")),
        vec![(1, 60, IN), (2, 1514, OUT), (3, 100, IN), (4, 80, IN)],
        "vm1 got 1, sent 2, got 3 and the injected 4"
    );
    let vm1 = read("vm1");
    assert!(
        vm1.windows(2).all(|w| w[0].0 <= w[1].0),
        "time stamps in order"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    assert!(
        vm1.iter().all(|r| r.0 <= now && now - r.0 < 600_000_000),
        "unix time stamps"
    );
}

#[test]
fn without_a_capture_dir_nothing_is_written() {
    let mut r = Rig::new(2);
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    r.clients[1].recv();
    let files: Vec<_> = std::fs::read_dir(r.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        files.iter().all(|f| !f.to_string_lossy().contains(".pcap")),
        "{files:?}"
    );
}
