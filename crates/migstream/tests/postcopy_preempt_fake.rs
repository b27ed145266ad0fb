//! The postcopy source with QEMU's postcopy-preempt channel, against a fake
//! destination: the main connection is parsed as QEMU would
//! (tests/common/postcopy.rs), the second one as QEMU's preempt thread
//! reads it (bare page records, CONTINUE relative to that channel, EOS at
//! the end; docs/qemu-10.0-wire-format.md). No QEMU needed.

mod common;

use std::collections::HashSet;
use std::io::{self, BufReader, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::postcopy::{fake_destination, synthetic_pages, Item, MemPages, Record};
use vmcsnap_migstream::postcopy::return_path::RpMessage;
use vmcsnap_migstream::postcopy::{run_source_preempt, DestBlock, PageId, SourceConfig};

fn config() -> SourceConfig {
    let b = |name: &str, pages: u64| DestBlock {
        name: name.into(),
        used_length: pages * 4096,
    };
    SourceConfig {
        machine: "pc-q35-7.2".into(),
        blocks: vec![b("pc.ram", 400), b("pc.bios", 4)],
        page_size: 4096,
        ram_section_id: 2,
        device_state: b"\x04DEVICE-STATE".to_vec(),
        before_run: vec![PageId { block: 0, page: 1 }],
        demand_cluster: 2,
        background: Vec::new(),
        // Only requests are served for a while: the requested pages cannot
        // have gone out in the background first.
        background_after: Some(Duration::from_millis(1500)),
        hold: Default::default(),
        shut_timeout: Duration::from_secs(20),
    }
}

/// Reads the preempt channel as QEMU 10.0's `ram_load_postcopy` does:
/// `be64 offset|flags`, the block name unless CONTINUE, the page or the
/// ZERO fill byte; stops at a bare EOS record.
fn read_preempt(conn: UnixStream) -> io::Result<(Vec<Record>, bool)> {
    let mut r = BufReader::new(conn);
    let (mut records, mut last): (Vec<Record>, Option<String>) = (Vec::new(), None);
    loop {
        let mut hdr = [0u8; 8];
        if let Err(e) = r.read_exact(&mut hdr) {
            return match e.kind() {
                io::ErrorKind::UnexpectedEof => Ok((records, false)),
                _ => Err(e),
            };
        }
        let hdr = u64::from_be_bytes(hdr);
        let (offset, flags) = (hdr & !0xfff, hdr & 0xfff);
        if flags == 0x10 {
            return Ok((records, true));
        }
        let named = flags & 0x20 == 0;
        let block = if named {
            let mut n = [0u8];
            r.read_exact(&mut n)?;
            let mut name = vec![0; n[0].into()];
            r.read_exact(&mut name)?;
            last = Some(String::from_utf8(name).unwrap());
            last.clone().unwrap()
        } else {
            last.clone().expect("CONTINUE before any named record")
        };
        let data = match flags & !0x20 {
            0x02 => {
                let mut z = [0u8];
                r.read_exact(&mut z)?;
                assert_eq!(z[0], 0, "ZERO fill");
                None
            }
            0x08 => {
                let mut p = vec![0; 4096];
                r.read_exact(&mut p)?;
                Some(p)
            }
            f => panic!("record flags {f:#x} on the preempt channel"),
        };
        records.push(Record {
            block,
            offset,
            data,
            named,
        });
    }
}

#[test]
fn requested_pages_go_on_the_preempt_channel_each_page_once_and_it_ends_with_eos() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mig.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let cfg = config();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    // The fake QEMU: main (parsed by fake_destination) and preempt on
    // sockets of their own (QEMU tells them apart by order on one socket,
    // which the live test covers).
    let ppath = dir.path().join("preempt.sock");
    let preempt_listener = UnixListener::bind(&ppath).unwrap();
    let dest = fake_destination(listener, |item, rp| {
        match item {
            Item::Package { .. } => rp.send_all(vec![
                RpMessage::ReqPagesId {
                    start: 100 * 4096,
                    len: 4096,
                    block: "pc.ram".into(),
                },
                RpMessage::ReqPages {
                    start: 200 * 4096,
                    len: 4096,
                },
                // Sent before RUN: ignored, nothing on the preempt channel.
                RpMessage::ReqPages {
                    start: 4096,
                    len: 4096,
                },
                RpMessage::ReqPagesId {
                    start: 4096,
                    len: 4096,
                    block: "pc.bios".into(),
                },
            ]),
            Item::Eof => rp.send(RpMessage::Shut(0)),
            _ => {}
        }
        true
    });
    let main = UnixStream::connect(&path).unwrap();
    let preempt = UnixStream::connect(&ppath).unwrap();
    let (pconn, _) = preempt_listener.accept().unwrap();
    let preempt_reader = std::thread::spawn(move || read_preempt(pconn));
    let (tx, rx) = mpsc::channel();
    let (c, p) = (cfg.clone(), pages.clone());
    std::thread::spawn(move || {
        let r = run_source_preempt(&c, &mut MemPages::new(p), main, preempt, &mut |_| {});
        let _ = tx.send(r);
    });
    let report = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the source returned within 60 s")
        .expect("run_source_preempt");
    let (items, err) = dest.join().unwrap();
    assert!(err.is_none(), "{err:?}");
    let (urgent, eos) = preempt_reader.join().unwrap().expect("preempt channel");
    assert!(eos, "the preempt channel ends with EOS");

    // The three requested pages, in request order, with their contents;
    // the block named on the first record and on a change of block only.
    let got: Vec<(String, u64, bool)> = urgent
        .iter()
        .map(|r| (r.block.clone(), r.offset / 4096, r.named))
        .collect();
    assert_eq!(
        got,
        vec![
            ("pc.ram".into(), 100, true),
            ("pc.ram".into(), 200, false),
            ("pc.bios".into(), 1, true),
        ]
    );
    let block_of = |name: &str| cfg.blocks.iter().position(|b| b.name == name).unwrap();
    for r in &urgent {
        let want = &pages[block_of(&r.block)][(r.offset / 4096) as usize];
        assert_eq!(
            r.data.as_deref(),
            want.as_deref(),
            "{} {:#x}",
            r.block,
            r.offset
        );
    }
    // Every page exactly once over both channels.
    let mut seen = HashSet::new();
    for r in urgent.iter().chain(items.iter().flat_map(|i| match i {
        Item::Section { records, .. } => records.as_slice(),
        _ => &[],
    })) {
        assert!(seen.insert((r.block.clone(), r.offset)), "{r:?} twice");
    }
    assert_eq!(seen.len() as u64, cfg.total_pages());
    assert_eq!(report.pages_on_preempt, 3);
    assert_eq!(report.demand_served.len(), 3);
    assert_eq!(report.requests_already_sent, 1);
    // The neighbours (demand_cluster 2) went on the main channel.
    assert_eq!(report.pages_on_demand, 6);
}

#[test]
fn without_requests_the_preempt_channel_carries_only_eos() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mig.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let mut cfg = config();
    cfg.background_after = None;
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let ppath = dir.path().join("preempt.sock");
    let preempt_listener = UnixListener::bind(&ppath).unwrap();
    let dest = fake_destination(listener, |item, rp| {
        if *item == Item::Eof {
            rp.send(RpMessage::Shut(0));
        }
        true
    });
    let main = UnixStream::connect(&path).unwrap();
    let preempt = UnixStream::connect(&ppath).unwrap();
    let (pconn, _) = preempt_listener.accept().unwrap();
    let preempt_reader = std::thread::spawn(move || read_preempt(pconn));
    let report = run_source_preempt(&cfg, &mut MemPages::new(pages), main, preempt, &mut |_| {})
        .expect("run_source_preempt");
    dest.join().unwrap();
    let (urgent, eos) = preempt_reader.join().unwrap().unwrap();
    assert!(urgent.is_empty() && eos);
    assert_eq!(report.pages_on_preempt, 0);
}
