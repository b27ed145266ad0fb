//! Tests on real QEMU 7.2 captures (see tests/data/README.md for how each
//! was made).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{collect, fixture, Collected, PageRec};
use vmcsnap_migstream::{Command, PageOrigin, SectionType};

const PAGE: u64 = 4096;
/// Where the writer guest keeps its counter.
const COUNTER: u64 = 0x1ff000;

/// The pages the writer guest writes, in its loop order: the counter, then
/// every 16th page from 2 MiB to 10 MiB.
fn written_pages() -> Vec<u64> {
    std::iter::once(COUNTER)
        .chain((0x200000..0xa00000).step_by(0x10000))
        .collect()
}

fn word(p: &PageRec) -> u32 {
    p.data
        .as_ref()
        .map_or(0, |d| u32::from_le_bytes(d[..4].try_into().unwrap()))
}

/// The microvm RAM block list with the given name for the RAM block.
fn check_blocks(c: &Collected, ram: &str) {
    let got: Vec<(&str, u64)> = c
        .blocks
        .iter()
        .map(|b| (b.name.as_str(), b.used_length))
        .collect();
    assert_eq!(
        got,
        [
            (ram, 16 << 20),
            ("/rom@etc/acpi/tables", 0x1000),
            ("pc.bios", 0x10000),
            ("/rom@etc/table-loader", 0x1000),
            ("/rom@etc/acpi/rsdp", 0x1000)
        ]
    );
}

/// Device state: starts with the FULL section of "timer", ends with a
/// footer (if any) right before EOF; vmdesc (if any) follows EOF and lists
/// microvm's 14 devices.
fn check_device_state(stream: &[u8], c: &Collected, footers: bool, len: usize) {
    let d = &c.device_state;
    assert_eq!(d.len(), len);
    assert_eq!(d[0], SectionType::Full as u8);
    assert_eq!(&d[5..11], b"\x05timer");
    let eof = c.device_offset as usize + d.len();
    assert_eq!(&stream[c.device_offset as usize..eof], &d[..]);
    assert_eq!(stream[eof], 0, "EOF byte after the device state");
    if footers {
        assert_eq!(d[d.len() - 5], 0x7e, "device state ends with a footer");
    }
    match &c.vmdesc {
        Some(v) => {
            assert_eq!(stream[eof + 1], 6);
            assert_eq!(
                eof + 6 + v.json.len(),
                stream.len(),
                "vmdesc ends the stream"
            );
            assert_eq!(v.page_size, Some(4096));
            let names: Vec<&str> = v.devices.iter().map(|d| d.name.as_str()).collect();
            assert_eq!(names.len(), 14);
            assert_eq!(names.first(), Some(&"timer"));
            assert_eq!(names.last(), Some(&"globalstate"));
        }
        None => assert_eq!(eof + 1, stream.len(), "EOF ends the stream"),
    }
}

/// Global page numbers of the records, block by block in list order.
fn global_pages(c: &Collected) -> Vec<u64> {
    let mut starts = vec![0];
    for b in &c.blocks {
        starts.push(starts.last().unwrap() + b.used_length / PAGE);
    }
    c.pages
        .iter()
        .map(|p| starts[p.block] + p.offset / PAGE)
        .collect()
}

#[test]
fn precopy_paused() {
    let s = fixture("precopy-paused");
    let c = collect(&s).unwrap();
    assert_eq!(c.config.as_ref().unwrap().machine, "microvm");
    assert!(c.config.as_ref().unwrap().capabilities.is_empty());
    check_blocks(&c, "microvm.ram");
    assert_eq!(
        c.sections,
        [
            (SectionType::Start, 2, true),
            (SectionType::Part, 2, true),
            (SectionType::End, 2, true)
        ]
    );
    // A paused VM: one linear pass, every page once, in order.
    assert_eq!(global_pages(&c), (0..4115).collect::<Vec<_>>());
    assert!(c.pages.iter().all(|p| p.origin == PageOrigin::Scan));
    assert_eq!((c.stats.scan.normal, c.stats.scan.zero), (8, 4107));
    assert_eq!(c.device_offset, 70093);
    check_device_state(&s, &c, true, 3573);
    assert_eq!(c.stats.bytes, s.len() as u64);
}

#[test]
fn precopy_bare_without_config_footers_vmdesc() {
    let s = fixture("precopy-bare");
    let c = collect(&s).unwrap();
    assert!(c.config.is_none());
    check_blocks(&c, "microvm.ram");
    assert_eq!(
        c.sections,
        [
            (SectionType::Start, 2, false),
            (SectionType::Part, 2, false),
            (SectionType::End, 2, false)
        ]
    );
    assert_eq!(global_pages(&c), (0..4115).collect::<Vec<_>>());
    assert!(c.vmdesc.is_none());
    // 14 devices × 5 footer bytes fewer than precopy-paused.
    check_device_state(&s, &c, false, 3573 - 14 * 5);
}

#[test]
fn precopy_live_commands_and_resent_pages() {
    let s = fixture("precopy-live");
    let c = collect(&s).unwrap();
    assert_eq!(
        c.commands,
        [
            Command::OpenReturnPath,
            Command::Ping(1),
            Command::PostcopyAdvise {
                page_size_summary: Some(4096),
                target_page_size: Some(4096)
            }
        ]
    );
    check_blocks(&c, "microvm.ram");
    // First pass: every page once in scan order; then the END section
    // re-sends exactly the pages the guest kept writing.
    let first: Vec<&PageRec> = c
        .pages
        .iter()
        .filter(|p| p.origin != PageOrigin::Resent)
        .collect();
    assert_eq!(first.len(), 4115);
    assert!(first.iter().all(|p| p.origin == PageOrigin::Scan));
    let resent: BTreeSet<u64> = c
        .pages
        .iter()
        .filter(|p| p.origin == PageOrigin::Resent)
        .map(|p| p.offset)
        .collect();
    assert_eq!(resent, written_pages().into_iter().collect());
    assert_eq!(c.stats.resent.normal, 129);
    // The last copy of each page wins: marker pages agree with the counter.
    let mut last: BTreeMap<u64, u32> = BTreeMap::new();
    for p in c.pages.iter().filter(|p| p.block == 0) {
        last.insert(p.offset, word(p));
    }
    let counter = last[&COUNTER];
    assert!(counter > 0);
    for m in &written_pages()[1..] {
        assert!(
            last[m] == counter || last[m] + 1 == counter,
            "marker {m:#x}: {} vs counter {counter}",
            last[m]
        );
    }
    check_device_state(&s, &c, true, 3573);
}

#[test]
fn bgsnap_writer_guest_writes() {
    let s = fixture("bgsnap-writer");
    let c = collect(&s).unwrap();
    check_blocks(&c, "mem");
    // No END section in a background snapshot (§5.2).
    assert_eq!(
        c.sections,
        [(SectionType::Start, 2, true), (SectionType::Part, 2, true)]
    );
    // Every page exactly once.
    let g = global_pages(&c);
    assert_eq!(g.len(), 4115);
    assert_eq!(g.iter().collect::<BTreeSet<_>>().len(), 4115);
    assert_eq!(c.stats.resent.total(), 0);

    let written = written_pages();
    let gw: Vec<&PageRec> = c
        .pages
        .iter()
        .filter(|p| p.origin == PageOrigin::GuestWrite)
        .collect();
    // No false positive: every out-of-order page is one the guest writes.
    for p in &gw {
        assert_eq!(p.block, 0);
        assert!(
            written.contains(&p.offset),
            "{:#x} is not written by the guest",
            p.offset
        );
    }
    // This capture: 112 of the 129 written pages (see tests/data/README.md
    // for the 17 that came through the scan).
    assert_eq!(gw.len(), 112);
    assert_eq!(c.stats.guest_write.normal, 112);
    // They come in the guest's loop order, one pass, starting mid-loop.
    let idx: Vec<usize> = gw
        .iter()
        .map(|p| written.iter().position(|&w| w == p.offset).unwrap())
        .collect();
    let wraps = idx.windows(2).filter(|w| w[1] <= w[0]).count();
    assert!(
        wraps <= 1,
        "guest-write order is not the guest's loop order: {idx:?}"
    );

    // Snapshot semantics: pre-write contents. The counter and every marker
    // hold the counter value of the snapshot moment (markers the loop had
    // not reached yet: one less).
    let by_offset: BTreeMap<u64, &PageRec> = c
        .pages
        .iter()
        .filter(|p| p.block == 0)
        .map(|p| (p.offset, p))
        .collect();
    let counter = word(by_offset[&COUNTER]);
    assert!(counter > 0x9000, "the guest ran before the snapshot");
    for m in &written[1..] {
        let v = word(by_offset[m]);
        assert!(
            v == counter || v + 1 == counter,
            "marker {m:#x} holds {v:#x}, counter {counter:#x}"
        );
    }
    check_device_state(&s, &c, true, 3573);
}

#[test]
fn bgsnap_ignore_shared_sends_only_rom_pages() {
    let s = fixture("bgsnap-ignore-shared");
    let c = collect(&s).unwrap();
    assert_eq!(c.config.as_ref().unwrap().capabilities, ["x-ignore-shared"]);
    check_blocks(&c, "mem");
    let addrs: Vec<Option<u64>> = c.blocks.iter().map(|b| b.guest_addr).collect();
    assert_eq!(
        addrs,
        [Some(0), Some(0), Some(0xffff0000), Some(0), Some(0)]
    );
    assert_eq!(c.pages.len(), 19);
    assert!(c.pages.iter().all(|p| p.block != 0));
    assert!(c.pages.iter().all(|p| p.origin == PageOrigin::Scan));
    check_device_state(&s, &c, true, 3573);
}

#[test]
fn bgsnap_host_writes_are_not_guest_writes() {
    let s = fixture("bgsnap-hostwrites");
    let c = collect(&s).unwrap();
    assert_eq!(c.pages.len(), 4115);
    assert_eq!(
        c.stats.guest_write.total(),
        0,
        "host writes through another mapping cause no uffd-wp fault"
    );
    // The host's writes leaked into the snapshot: markers disagree.
    let markers: BTreeSet<u32> = c
        .pages
        .iter()
        .filter(|p| p.block == 0 && written_pages()[1..].contains(&p.offset))
        .map(word)
        .collect();
    assert!(markers.len() > 1, "markers all equal: {markers:?}");
    check_device_state(&s, &c, true, 3573);
}
