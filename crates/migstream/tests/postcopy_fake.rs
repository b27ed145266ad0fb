//! The postcopy source against fake destinations (unix socket servers in
//! the test that parse the stream as QEMU would and answer on the return
//! path): the whole protocol, the order of pages, discards, and every
//! way a destination can fail. No QEMU needed.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::postcopy::{
    discard_ranges, fake_destination, run_guarded, synthetic_pages, Item, MemPages, Pages,
};
use vmcsnap_migstream::postcopy::return_path::{RpError, RpMessage};
use vmcsnap_migstream::postcopy::{
    DestBlock, PageId, Phase, PostcopyError, SourceConfig, SourceEvent, Work,
};

const GUARD: Duration = Duration::from_secs(60);

fn blocks() -> Vec<DestBlock> {
    let b = |name: &str, pages: u64| DestBlock {
        name: name.into(),
        used_length: pages * 4096,
    };
    vec![b("mem", 600), b("/rom@etc/acpi/tables", 2), b("pc.bios", 4)]
}

fn config() -> SourceConfig {
    SourceConfig {
        machine: "microvm".into(),
        blocks: blocks(),
        page_size: 4096,
        ram_section_id: 2,
        device_state: b"\x04DEVICE-STATE".to_vec(),
        before_run: Vec::new(),
        demand_cluster: 1,
        background: Vec::new(),
        background_after: None,
        hold: Default::default(),
        shut_timeout: Duration::from_secs(20),
    }
}

fn id(block: u32, page: u32) -> PageId {
    PageId { block, page }
}

/// A listening socket in a fresh directory, and a connector.
fn socket() -> (tempfile::TempDir, UnixListener, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mig.sock");
    let l = UnixListener::bind(&path).unwrap();
    (dir, l, path)
}

/// What a stream held, checked against the rules QEMU enforces.
struct Seen {
    /// Pages in stream order with whether they came before the package.
    pages: Vec<(PageId, bool)>,
    discards: Vec<(String, u64, u64)>,
    commands: Vec<u16>,
}

/// Checks the order of items (§3.5, §8.4), section ids, names on each
/// section's first record, each page exactly once with the right content,
/// discards = exactly the pages not sent before the package, EOF last.
fn check_stream(items: &[Item], cfg: &SourceConfig, pages: &Pages) -> Seen {
    let names: HashMap<&str, u32> = cfg
        .blocks
        .iter()
        .enumerate()
        .map(|(i, b)| (b.name.as_str(), i as u32))
        .collect();
    assert_eq!(
        items[0],
        Item::Header {
            machine: cfg.machine.clone()
        }
    );
    let cmd = |c: u16, p: &[u8]| Item::Command {
        cmd: c,
        payload: p.to_vec(),
    };
    assert_eq!(items[1], cmd(1, &[]));
    assert_eq!(items[2], cmd(2, &1u32.to_be_bytes()));
    let mut advise = 0x1000u64.to_be_bytes().to_vec();
    advise.extend(0x1000u64.to_be_bytes());
    assert_eq!(items[3], cmd(3, &advise));
    let want_blocks: Vec<(String, u64)> = cfg
        .blocks
        .iter()
        .map(|b| (b.name.clone(), b.used_length))
        .collect();
    assert_eq!(
        items[4],
        Item::RamSetup {
            id: cfg.ram_section_id,
            blocks: want_blocks
        }
    );
    let mut seen = Seen {
        pages: Vec::new(),
        discards: Vec::new(),
        commands: Vec::new(),
    };
    let mut packaged = false;
    let mut sent = BTreeSet::new();
    for (i, item) in items[5..].iter().enumerate() {
        match item {
            Item::Section { kind, id, records } => {
                assert_eq!(*id, cfg.ram_section_id);
                if *kind == 3 {
                    assert!(records.is_empty() && packaged);
                    assert_eq!(items[5 + i + 1], Item::Eof, "END is followed by EOF");
                }
                if let Some(r) = records.first() {
                    assert!(r.named, "first record of a section must name its block");
                }
                for r in records {
                    let b = names[r.block.as_str()];
                    let p = PageId {
                        block: b,
                        page: (r.offset / 4096) as u32,
                    };
                    assert!(sent.insert(p), "{p:?} sent twice");
                    let want = pages[b as usize][p.page as usize].as_deref();
                    assert_eq!(r.data.as_deref(), want, "content of {p:?}");
                    seen.pages.push((p, !packaged));
                }
            }
            Item::Command { cmd, payload } => {
                assert!(!packaged, "command after the package");
                assert_eq!(*cmd, 6, "only DISCARDs between the pages and the package");
                seen.commands.push(*cmd);
                seen.discards.extend(discard_ranges(payload));
            }
            Item::Package { blob } => {
                assert!(!packaged);
                assert!(
                    !seen.discards.is_empty(),
                    "LISTEN needs a DISCARD first (§8.1)"
                );
                packaged = true;
                let mut want = vec![8, 0, 4, 0, 0];
                want.extend_from_slice(&cfg.device_state);
                want.extend([8, 0, 2, 0, 4, 0, 0, 0, 3, 8, 0, 5, 0, 0]);
                assert_eq!(blob, &want);
            }
            Item::Eof => assert_eq!(i + 5, items.len() - 1),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(items.last(), Some(&Item::Eof));
    assert_eq!(
        sent.len() as u64,
        cfg.total_pages(),
        "every page before EOF"
    );
    // Discards: exactly the complement of the pages sent before the package.
    let mut discarded = BTreeSet::new();
    for (name, start, len) in &seen.discards {
        let b = names[name.as_str()];
        assert!(start % 4096 == 0 && len % 4096 == 0 && *len > 0);
        for p in start / 4096..(start + len) / 4096 {
            assert!(discarded.insert(id(b, p as u32)), "discarded twice");
        }
    }
    let before: BTreeSet<PageId> = seen
        .pages
        .iter()
        .filter(|(_, b)| *b)
        .map(|(p, _)| *p)
        .collect();
    let all: BTreeSet<PageId> = (0..cfg.blocks.len() as u32)
        .flat_map(|b| (0..cfg.block_pages(b) as u32).map(move |p| id(b, p)))
        .collect();
    assert_eq!(discarded, &all - &before);
    seen
}

#[test]
fn whole_protocol_with_requests_clusters_and_background_order() {
    let (_dir, listener, path) = socket();
    let mut cfg = config();
    cfg.before_run = vec![id(1, 0), id(0, 5), id(0, 5), id(2, 3), id(0, 6), id(0, 7)];
    cfg.demand_cluster = 4;
    cfg.background = (0..600).rev().map(|p| id(0, p)).collect();
    cfg.background_after = Some(Duration::from_secs(2));
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let dest = fake_destination(listener, |item, rp| {
        match item {
            Item::Package { .. } => {
                // Faults while the source traces, in one write (so in one
                // batch): 100 (cluster 100..=103), an already-sent page, the
                // last page of mem (cluster cut at the block end), a ROM
                // page (cluster skips the page sent before RUN).
                rp.send_all(vec![
                    RpMessage::ReqPagesId {
                        start: 100 * 4096,
                        len: 4096,
                        block: "mem".into(),
                    },
                    RpMessage::ReqPages {
                        start: 5 * 4096,
                        len: 4096,
                    },
                    RpMessage::ReqPages {
                        start: 599 * 4096,
                        len: 4096,
                    },
                    RpMessage::ReqPagesId {
                        start: 0,
                        len: 4096,
                        block: "pc.bios".into(),
                    },
                ]);
            }
            Item::Eof => rp.send(RpMessage::Shut(0)),
            _ => {}
        }
        true
    });
    let stream = UnixStream::connect(&path).unwrap();
    let run = run_guarded(
        cfg.clone(),
        MemPages::new(pages.clone()),
        stream,
        GUARD,
        |_| {},
    );
    let report = run.result.expect("run_source");
    let (items, err) = dest.join().unwrap();
    assert!(err.is_none(), "{err:?}");
    let seen = check_stream(&items, &cfg, &pages);

    // Before the package: the before_run pages, deduplicated, in order.
    let before: Vec<PageId> = seen
        .pages
        .iter()
        .filter(|(_, b)| *b)
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        before,
        vec![id(1, 0), id(0, 5), id(2, 3), id(0, 6), id(0, 7)]
    );
    // After it: the requested pages with their clusters, then background.
    let after: Vec<PageId> = seen
        .pages
        .iter()
        .filter(|(_, b)| !*b)
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        &after[..8],
        &[
            id(0, 100),
            id(0, 599),
            id(2, 0),
            id(0, 101),
            id(0, 102),
            id(0, 103),
            id(2, 1),
            id(2, 2)
        ]
    );
    // Background: mem in descending order (skipping sent pages), then the rest.
    let bg: Vec<PageId> = after[8..].to_vec();
    let mut want: Vec<PageId> = (0..600)
        .rev()
        .map(|p| id(0, p))
        .filter(|p| !before.contains(p) && !after[..8].contains(p))
        .collect();
    want.push(id(1, 1)); // not in the background list: (block, page) order
    assert_eq!(bg, want);

    assert_eq!(report.pages_total, 606);
    assert_eq!(report.pages_before_run, 5);
    let nonzero_before = before
        .iter()
        .filter(|p| pages[p.block as usize][p.page as usize].is_some())
        .count();
    assert_eq!(report.bytes_before_run, nonzero_before as u64 * 4096);
    let demand: Vec<PageId> = report.demand.iter().map(|(_, p)| *p).collect();
    assert_eq!(demand, vec![id(0, 100), id(0, 599), id(2, 0)]);
    assert_eq!(report.requests_already_sent, 1);
    assert_eq!(report.pages_on_demand, 8);
    assert_eq!(report.pages_background, 606 - 5 - 8);
    assert_eq!(report.shut_value, 0);
    assert_eq!(report.pongs, vec![1]);
    assert!(report.all_sent_after >= report.run_sent_after);
    // Events: RunSent, the three Demands, progress, AllSent, in that order.
    let pos = |f: &dyn Fn(&SourceEvent) -> bool| run.events.iter().position(f).unwrap();
    let run_sent = pos(&|e| *e == SourceEvent::RunSent);
    let first_demand = pos(&|e| matches!(e, SourceEvent::Demand { .. }));
    let all_sent = pos(&|e| *e == SourceEvent::AllSent);
    assert!(run_sent < first_demand && first_demand < all_sent);
    // Work changes: preload until RUN, then demand and background work.
    let works: Vec<(usize, Work)> = run
        .events
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            SourceEvent::Work(w) => Some((i, *w)),
            _ => None,
        })
        .collect();
    assert_eq!(works[0], (0, Work::Preload), "the first event");
    assert!(works[1..]
        .iter()
        .all(|&(i, w)| i > run_sent && w != Work::Preload));
    assert!(
        works.windows(2).all(|p| p[0].1 != p[1].1),
        "emitted on changes only"
    );
    let demand_work = pos(&|e| *e == SourceEvent::Work(Work::Demand));
    assert!(demand_work < all_sent && works.iter().any(|&(_, w)| w == Work::Background));
    assert_eq!(
        run.events[all_sent - 1],
        SourceEvent::Progress {
            sent: 606,
            total: 606
        }
    );
    eprintln!(
        "whole protocol: {:?}, {} discard ranges",
        run.took,
        seen.discards.len()
    );
}

/// Runs the source against a fake destination that answers EOF with
/// SHUT(0); checks the stream and returns the report and what was seen.
fn run_to_shut(cfg: &SourceConfig) -> (vmcsnap_migstream::postcopy::SourceReport, Seen) {
    let (_dir, listener, path) = socket();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let dest = fake_destination(listener, |item, rp| {
        if *item == Item::Eof {
            rp.send(RpMessage::Shut(0));
        }
        true
    });
    let stream = UnixStream::connect(&path).unwrap();
    let run = run_guarded(
        cfg.clone(),
        MemPages::new(pages.clone()),
        stream,
        GUARD,
        |_| {},
    );
    let report = run.result.expect("run_source");
    let (items, _) = dest.join().unwrap();
    let seen = check_stream(&items, cfg, &pages);
    (report, seen)
}

#[test]
fn every_page_before_run_holds_one_back_for_the_discard() {
    let mut cfg = config();
    cfg.before_run = (0..3u32)
        .flat_map(|b| (0..cfg.block_pages(b) as u32).map(move |p| id(b, p)))
        .rev()
        .collect();
    let last = *cfg.before_run.last().unwrap();
    assert_eq!(last, id(0, 0));
    let (report, seen) = run_to_shut(&cfg);
    assert_eq!(seen.discards, vec![("mem".to_string(), 0, 4096)]);
    assert_eq!(seen.commands, vec![6]);
    assert_eq!(seen.pages.last(), Some(&(last, false)));
    assert_eq!(report.pages_before_run, 605);
    assert_eq!(report.pages_background, 1);
}

#[test]
fn nothing_before_run_discards_every_block_whole() {
    let mut cfg = config();
    // Long names and many ranges: several DISCARD commands per block.
    cfg.before_run = (0..600).step_by(2).map(|p| id(0, p)).collect();
    cfg.blocks[0].name = "m".repeat(255);
    let (report, seen) = run_to_shut(&cfg);
    assert_eq!(seen.discards.len(), 300 + 2);
    assert!(report.discard_commands >= 3, "{}", report.discard_commands);
    assert_eq!(report.discard_commands as usize, seen.commands.len());
}

fn expect_err(
    cfg: SourceConfig,
    on_item: impl FnMut(&Item, &mut common::postcopy::Rp) -> bool + Send + 'static,
) -> PostcopyError {
    let (_dir, listener, path) = socket();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let dest = fake_destination(listener, on_item);
    let stream = UnixStream::connect(&path).unwrap();
    let run = run_guarded(cfg, MemPages::new(pages), stream, GUARD, |_| {});
    let _ = dest.join();
    let e = run.result.expect_err("run_source must fail");
    eprintln!("{e} (after {:?})", run.took);
    e
}

#[test]
fn destination_closing_before_run() {
    // Enough pages before RUN that the source is still writing them when
    // the destination goes away.
    let mut cfg = config();
    cfg.blocks[0].used_length = 64 << 20;
    cfg.before_run = (0..2000).map(|p| id(0, p)).collect();
    let e = expect_err(cfg, |item, _| !matches!(item, Item::RamSetup { .. }));
    assert!(
        matches!(
            e,
            PostcopyError::DestinationClosed {
                phase: Phase::BeforeRun,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("before RUN"));
}

#[test]
fn destination_closing_after_run_names_outstanding_pages() {
    let mut cfg = config();
    cfg.background_after = Some(Duration::from_secs(30));
    let e = expect_err(cfg, |item, _| !matches!(item, Item::Package { .. }));
    match e {
        PostcopyError::DestinationClosed {
            phase: Phase::AfterRun { outstanding },
            ..
        } => {
            assert_eq!(outstanding, 606)
        }
        e => panic!("{e}"),
    }
}

#[test]
fn shut_with_an_error() {
    let e = expect_err(config(), |item, rp| {
        if matches!(item, Item::Package { .. }) {
            rp.send(RpMessage::Shut(1));
        }
        true
    });
    assert!(
        matches!(e, PostcopyError::ShutFailed { value: 1, .. }),
        "{e}"
    );
}

#[test]
fn no_shut_times_out() {
    let mut cfg = config();
    cfg.shut_timeout = Duration::from_millis(300);
    let (_dir, listener, path) = socket();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    // Keeps the connection open (holds the socket) until told to go.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let dest = fake_destination(listener, move |item, _| {
        if *item == Item::Eof {
            let _ = rx.recv_timeout(GUARD);
        }
        true
    });
    let stream = UnixStream::connect(&path).unwrap();
    let run = run_guarded(cfg, MemPages::new(pages), stream, GUARD, |_| {});
    let _ = tx.send(());
    let _ = dest.join();
    let e = run.result.expect_err("no SHUT");
    assert!(matches!(e, PostcopyError::NoShut { .. }), "{e}");
}

#[test]
fn request_outside_the_ram() {
    let mut cfg = config();
    cfg.background_after = Some(Duration::from_secs(30));
    for (block, start) in [("mem", 600 * 4096), ("nosuch", 0), ("pc.bios", 0x800)] {
        let block = block.to_string();
        let e = expect_err(cfg.clone(), move |item, rp| {
            if matches!(item, Item::Package { .. }) {
                rp.send(RpMessage::ReqPagesId {
                    start,
                    len: 4096,
                    block: block.clone(),
                });
            }
            true
        });
        assert!(matches!(e, PostcopyError::RequestOutOfRange { .. }), "{e}");
    }
}

#[test]
fn req_pages_before_any_block() {
    let mut cfg = config();
    cfg.background_after = Some(Duration::from_secs(30));
    let e = expect_err(cfg, |item, rp| {
        if matches!(item, Item::Package { .. }) {
            rp.send(RpMessage::ReqPages {
                start: 0,
                len: 4096,
            });
        }
        true
    });
    assert!(
        matches!(
            e,
            PostcopyError::ReturnPath {
                error: RpError::NoBlockYet,
                offset: 8,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn page_source_failure() {
    let mut cfg = config();
    cfg.before_run = vec![id(0, 1), id(0, 2)];
    let (_dir, listener, path) = socket();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let dest = fake_destination(listener, |_, _| true);
    let stream = UnixStream::connect(&path).unwrap();
    let mut src = MemPages::new(pages);
    src.fail_on = Some(id(0, 2));
    let run = run_guarded(cfg, src, stream, GUARD, |_| {});
    let _ = dest.join();
    match run.result {
        Err(PostcopyError::PageSource {
            id: p,
            phase: Phase::BeforeRun,
            ..
        }) => assert_eq!(p, id(0, 2)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_configs() {
    type Change = Box<dyn Fn(&mut SourceConfig)>;
    let cases: Vec<(&str, Change)> = vec![
        ("block list is empty", Box::new(|c| c.blocks.clear())),
        ("page_size", Box::new(|c| c.page_size = 512)),
        ("page_size", Box::new(|c| c.page_size = 0)),
        ("ram_section_id", Box::new(|c| c.ram_section_id = 0)),
        (
            "before_run page 600 of block 0",
            Box::new(|c| c.before_run = vec![id(0, 600)]),
        ),
        (
            "before_run page 0 of block 3",
            Box::new(|c| c.before_run = vec![id(3, 0)]),
        ),
        (
            "background page",
            Box::new(|c| c.background = vec![id(1, 2)]),
        ),
        (
            "listed twice",
            Box::new(|c| c.blocks[1].name = "mem".into()),
        ),
        (
            "not a positive multiple",
            Box::new(|c| c.blocks[2].used_length = 4095),
        ),
        (
            "not a positive multiple",
            Box::new(|c| c.blocks[2].used_length = 0),
        ),
        (
            "1 to 255 bytes",
            Box::new(|c| c.blocks[2].name = String::new()),
        ),
        ("machine name", Box::new(|c| c.machine = String::new())),
    ];
    for (want, change) in cases {
        let mut cfg = config();
        change(&mut cfg);
        // Nothing is written: the peer sees an immediate close.
        let (a, b) = UnixStream::pair().unwrap();
        let pages = Arc::new(Vec::new());
        let run = run_guarded(cfg, MemPages::new(pages), a, GUARD, |_| {});
        drop(b);
        match run.result {
            Err(e @ PostcopyError::InvalidConfig { .. }) => {
                assert!(e.to_string().contains(want), "{e} should mention {want:?}")
            }
            other => panic!("{want}: {other:?}"),
        }
    }
}

#[test]
fn garbage_while_the_source_is_blocked_writing() {
    // The destination reads nothing, so the source blocks in write once the
    // socket buffer is full; garbage on the return path must still end it.
    let (_dir, listener, path) = socket();
    let mut cfg = config();
    cfg.blocks[0].used_length = 64 << 20;
    cfg.before_run = (0..2000).map(|p| id(0, p)).collect();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let t = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        use std::io::{Read, Write};
        conn.write_all(&[0x00, 0x09, 0x00, 0x04, 0xde, 0xad, 0xbe, 0xef])
            .unwrap();
        // Then hold the connection until the source gives up on it.
        let _ = conn.read_to_end(&mut Vec::new());
    });
    let stream = UnixStream::connect(&path).unwrap();
    let run = run_guarded(cfg, MemPages::new(pages), stream, GUARD, |_| {});
    t.join().unwrap();
    let e = run.result.expect_err("garbage");
    assert!(
        matches!(
            e,
            PostcopyError::ReturnPath {
                error: RpError::UnknownType { ty: 9, len: 4 },
                offset: 0,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("00 09 00 04 de ad be ef"), "{e}");
}

/// Regression: QEMU sends SHUT(0) and closes the socket at once; when both
/// arrived in one read, the close was taken for a destination that died
/// before SHUT (seen restoring a real VM with vmcsnap).
#[test]
fn shut_followed_at_once_by_the_close_is_success() {
    for _ in 0..20 {
        let (_dir, listener, path) = socket();
        let cfg = config();
        let pages = Arc::new(synthetic_pages(&cfg.blocks));
        let dest = fake_destination(listener, |item, rp| {
            if *item == Item::Eof {
                rp.send(RpMessage::Shut(0));
                return false; // returns and closes the connection at once
            }
            true
        });
        let stream = UnixStream::connect(&path).unwrap();
        let run = run_guarded(cfg, MemPages::new(pages), stream, GUARD, |_| {});
        let _ = dest.join();
        assert_eq!(
            run.result
                .expect("SHUT(0) then close is a good end")
                .shut_value,
            0
        );
    }
}

#[test]
fn a_held_background_push_serves_only_requests_until_the_hold_is_lifted() {
    let (_dir, listener, path) = socket();
    let mut cfg = config();
    cfg.before_run = vec![id(0, 0)];
    cfg.hold
        .hold_until(Instant::now() + Duration::from_secs(600));
    let hold = cfg.hold.clone();
    let pages = Arc::new(synthetic_pages(&cfg.blocks));
    let dest = fake_destination(listener, move |item, rp| {
        match item {
            // A fault once the guest "runs"; no background page may come
            // first, and the hold is lifted once the page is in.
            Item::Package { .. } => rp.send(RpMessage::ReqPagesId {
                start: 100 * 4096,
                len: 4096,
                block: "mem".into(),
            }),
            Item::Section { records, .. }
                if records
                    .iter()
                    .any(|r| r.block == "mem" && r.offset == 100 * 4096) =>
            {
                hold.hold_until(Instant::now())
            }
            Item::Eof => rp.send(RpMessage::Shut(0)),
            _ => {}
        }
        true
    });
    let stream = UnixStream::connect(&path).unwrap();
    let run = run_guarded(
        cfg.clone(),
        MemPages::new(pages.clone()),
        stream,
        GUARD,
        |_| {},
    );
    let report = run.result.expect("run_source");
    let (items, err) = dest.join().unwrap();
    assert!(err.is_none(), "{err:?}");
    let seen = check_stream(&items, &cfg, &pages);
    let after: Vec<PageId> = seen
        .pages
        .iter()
        .filter(|(_, b)| !b)
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        after[0],
        id(0, 100),
        "the requested page before any background page"
    );
    assert_eq!(report.pages_on_demand, 1);
    assert_eq!(report.pages_background, cfg.total_pages() - 2);
}
