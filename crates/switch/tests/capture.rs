//! Packet capture (`SwitchConfig::capture_dir`), over real unix sockets:
//! each port's pcap file holds what its VM sent and what it was handed, in
//! order, with held frames at their release and injected ones included.

mod common;

use common::*;
use vmcsnap_switch::{Switch, SwitchConfig};

/// (seconds, microseconds, frame) of every record of a classic pcap file.
fn records(bytes: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!(u32_at(0), 0xa1b2_c3d4, "pcap magic");
    assert_eq!(u32_at(20), 1, "Ethernet");
    let (mut at, mut out) = (24, Vec::new());
    while at < bytes.len() {
        let (sec, usec, incl) = (u32_at(at), u32_at(at + 4), u32_at(at + 8) as usize);
        assert_eq!(incl, u32_at(at + 12) as usize, "not cut");
        out.push((sec, usec, bytes[at + 16..at + 16 + incl].to_vec()));
        at += 16 + incl;
    }
    assert_eq!(at, bytes.len(), "no partial record");
    out
}

#[test]
fn each_port_captures_both_directions_in_order() {
    let cap = tempfile::tempdir().unwrap();
    let config = SwitchConfig { capture_dir: Some(cap.path().to_path_buf()), ..Default::default() };
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
    let read = |vm: &str| records(&std::fs::read(cap.path().join(format!("{vm}.pcap"))).unwrap());
    let seqs = |recs: &[(u32, u32, Vec<u8>)]| recs.iter().map(|(_, _, f)| (seq_of(f), f.len())).collect::<Vec<_>>();
    assert_eq!(seqs(&read("vm0")), vec![(1, 60), (2, 1514), (3, 100)], "vm0 sent 1 and 3, got 2");
    assert_eq!(seqs(&read("vm1")), vec![(1, 60), (2, 1514), (3, 100), (4, 80)], "vm1 got 1, sent 2, got 3 and the injected 4");
    let vm1 = read("vm1");
    let us = |r: &(u32, u32, Vec<u8>)| r.0 as u64 * 1_000_000 + r.1 as u64;
    assert!(vm1.windows(2).all(|w| us(&w[0]) <= us(&w[1])), "timestamps in order");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
    assert!(vm1.iter().all(|r| us(r) <= now && now - us(r) < 600_000_000), "unix time stamps");
}

#[test]
fn without_a_capture_dir_nothing_is_written() {
    let mut r = Rig::new(2);
    r.clients[0].send(&eth(BCAST, mac(0), 1, 60));
    r.clients[1].recv();
    let files: Vec<_> = std::fs::read_dir(r.dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(files.iter().all(|f| !f.to_string_lossy().ends_with(".pcap")), "{files:?}");
}
