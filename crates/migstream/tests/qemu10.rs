//! Tests on real QEMU 10.0.2 captures (tests/data/README.md, "QEMU 10.0"):
//! the reader with `Dialect::Qemu10_0` reads them whole, a reader told
//! QEMU 7.2 refuses the command 7.2 does not define, and re-encoding the
//! events gives back the very bytes QEMU wrote.

mod common;

use std::collections::BTreeSet;

use common::encoder::Encoder;
use common::{collect_from, fixture};
use vmcsnap_migstream::wire::{CommandKind, SectionType};
use vmcsnap_migstream::{
    Command, Dialect, Event, PageOrigin, ReaderOptions, StreamError, StreamReader,
};

fn q10() -> ReaderOptions {
    ReaderOptions::for_dialect(Dialect::Qemu10_0)
}

/// microvm's RAM blocks under QEMU 10.0 (its qboot ROM, `pc.bios`, is
/// 128 KiB; 7.2's was 64 KiB).
fn microvm_blocks(ram: &str) -> Vec<(String, u64)> {
    [
        (ram, 16 << 20),
        ("/rom@etc/acpi/tables", 0x1000),
        ("pc.bios", 0x20000),
        ("/rom@etc/table-loader", 0x1000),
        ("/rom@etc/acpi/rsdp", 0x1000),
    ]
    .iter()
    .map(|(n, l)| (n.to_string(), *l))
    .collect()
}

fn blocks(c: &common::Collected) -> Vec<(String, u64)> {
    c.blocks
        .iter()
        .map(|b| (b.name.clone(), b.used_length))
        .collect()
}

/// Offset of the one SWITCHOVER_START command of a stream.
fn switchover_offset(stream: &[u8]) -> usize {
    let needle = [8u8, 0, 11, 0, 0];
    let hits: Vec<usize> = stream
        .windows(5)
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect();
    assert!(!hits.is_empty(), "no SWITCHOVER_START in the stream");
    hits[0]
}

#[test]
fn precopy_of_a_paused_microvm_has_switchover_start_before_the_ram_end() {
    let s = fixture("qemu10-precopy-paused");
    let c = collect_from(&s[..], q10()).unwrap();
    assert_eq!(c.config.as_ref().unwrap().machine, "microvm");
    assert_eq!(blocks(&c), microvm_blocks("microvm.ram"));
    assert_eq!(c.commands, [Command::SwitchoverStart]);
    // The "ram" section is section 1 (7.2's microvm streams: 2).
    assert_eq!(
        c.sections,
        [
            (SectionType::Start, 1, true),
            (SectionType::Part, 1, true),
            (SectionType::End, 1, true)
        ]
    );
    // Every page once, in scan order.
    assert_eq!(c.pages.len(), 4131);
    assert!(c.pages.iter().all(|p| p.origin == PageOrigin::Scan));
    assert_eq!(c.device_state.len(), 3573);
    let v = c.vmdesc.as_ref().unwrap();
    assert_eq!(v.page_size, Some(4096));
    // 10.0's VM description starts with the configuration section's layout.
    assert!(
        v.json.starts_with("{\"configuration\""),
        "{}",
        &v.json[..40]
    );
    assert_eq!(v.devices.first().map(|d| d.name.as_str()), Some("timer"));
    assert_eq!(
        v.devices.last().map(|d| d.name.as_str()),
        Some("globalstate")
    );
}

#[test]
fn a_reader_told_qemu_7_2_refuses_switchover_start_naming_the_version() {
    let s = fixture("qemu10-precopy-paused");
    let at = switchover_offset(&s) as u64;
    let e = collect_from(&s[..], ReaderOptions::default()).unwrap_err();
    assert!(
        matches!(e, StreamError::UnknownCommand { offset, cmd: 11, dialect: Dialect::Qemu7_2, max: 10 } if offset == at),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("unknown command 11") && msg.contains("QEMU 7.2 defines commands 1..=10"),
        "{msg}"
    );
    // And a 10.0 reader names 10.0's range for a number beyond it.
    let mut bad = s.clone();
    bad[switchover_offset(&s) + 2] = 12;
    let msg = collect_from(&bad[..], q10()).unwrap_err().to_string();
    assert!(msg.contains("QEMU 10.0 defines commands 1..=11"), "{msg}");
}

#[test]
fn switchover_start_with_a_payload_is_refused() {
    let s = fixture("qemu10-precopy-paused");
    let at = switchover_offset(&s);
    let mut bad = s[..at].to_vec();
    bad.extend_from_slice(&[8, 0, 11, 0, 1, 0]);
    bad.extend_from_slice(&s[at + 5..]);
    let e = collect_from(&bad[..], q10()).unwrap_err();
    assert!(
        matches!(
            e,
            StreamError::BadCommandLength {
                name: "SWITCHOVER_START",
                len: 1,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn precopy_of_the_running_writer_resends_its_pages_after_switchover_start() {
    let s = fixture("qemu10-precopy-live");
    let c = collect_from(&s[..], q10()).unwrap();
    assert_eq!(blocks(&c), microvm_blocks("microvm.ram"));
    assert_eq!(c.commands, [Command::SwitchoverStart]);
    assert_eq!(c.stats.scan.total(), 4131);
    // The writer's 129 pages, dirtied while the first pass ran.
    assert_eq!(c.stats.resent.total(), 129);
    assert_eq!(c.sections.last().map(|s| s.0), Some(SectionType::End));
}

#[test]
fn precopy_of_pc_q35_7_2_has_no_switchover_start() {
    // Machine types up to 9.2 turn `send-switchover-start` off.
    let s = fixture("qemu10-precopy-q35");
    let c = collect_from(&s[..], q10()).unwrap();
    assert_eq!(c.config.as_ref().unwrap().machine, "pc-q35-7.2");
    assert!(c.commands.is_empty());
    assert_eq!(c.blocks[0].name, "pc.ram");
    // So the 7.2 reader reads it too.
    let c72 = collect_from(&s[..], ReaderOptions::default()).unwrap();
    assert_eq!(c72.pages.len(), c.pages.len());
    assert_eq!(c72.device_state, c.device_state);
}

#[test]
fn background_snapshot_of_the_writer_sends_each_page_once_guest_writes_first() {
    let s = fixture("qemu10-bgsnap-writer");
    let c = collect_from(&s[..], q10()).unwrap();
    assert_eq!(blocks(&c), microvm_blocks("mem"));
    assert!(c.commands.is_empty());
    assert_eq!(
        c.sections,
        [(SectionType::Start, 1, true), (SectionType::Part, 1, true)]
    );
    let mut seen = BTreeSet::new();
    for p in &c.pages {
        assert!(seen.insert((p.block, p.offset)), "page sent twice");
    }
    assert_eq!(seen.len(), 4131);
    // Out-of-order pages are all pages the writer guest writes: the counter
    // page or every 16th page from 2 MiB to 10 MiB.
    let gw: Vec<u64> = c
        .pages
        .iter()
        .filter(|p| p.origin == PageOrigin::GuestWrite)
        .map(|p| {
            assert_eq!(p.block, 0);
            p.offset
        })
        .collect();
    assert!(!gw.is_empty(), "the guest wrote during the snapshot");
    for o in &gw {
        assert!(
            *o == 0x1ff000 || ((0x200000..0xa00000).contains(o) && o % 0x10000 == 0),
            "{o:#x} is not a page the guest writes"
        );
    }
    assert_eq!(c.stats.resent.total(), 0);
}

/// Re-encodes the stream from the reader's events alone.
fn reencode(stream: &[u8]) -> Vec<u8> {
    let mut r = StreamReader::with_options(stream, q10());
    let mut e = Encoder::new();
    let mut block_names: Vec<String> = Vec::new();
    let mut section = 0;
    while let Some(ev) = r.next_event().unwrap() {
        match ev {
            Event::Header { configuration, .. } => {
                let c = configuration.expect("QEMU 10.0 sends the configuration");
                let caps: Vec<&str> = c.capabilities.iter().map(String::as_str).collect();
                e.config(&c.machine, &caps);
            }
            Event::Command { command, .. } => {
                assert_eq!(command, Command::SwitchoverStart);
                e.command(CommandKind::SwitchoverStart, &[]);
            }
            Event::SectionStart(h) => {
                section = h.section_id;
                match h.ident {
                    Some(i) => {
                        e.full_header(h.kind, h.section_id, &i.idstr, i.instance_id, i.version_id)
                    }
                    None => e.short_header(h.kind, h.section_id),
                };
            }
            Event::RamBlocks(b) => {
                block_names = b.iter().map(|b| b.name.clone()).collect();
                let total: u64 = b.iter().map(|b| b.used_length).sum();
                e.be64(total | vmcsnap_migstream::wire::ram_flags::MEM_SIZE);
                for b in b {
                    e.str8(&b.name).be64(b.used_length);
                }
            }
            Event::Page {
                block,
                offset,
                data,
                ..
            } => {
                e.page(&block_names[block], offset, data);
            }
            Event::ZeroPage {
                block,
                offset,
                fill,
                ..
            } => {
                assert_eq!(fill, 0);
                e.zero(&block_names[block], offset);
            }
            Event::SectionEnd { section_id, .. } => {
                assert_eq!(section_id, section);
                e.eos(section_id);
            }
            Event::DeviceState { data, .. } => {
                e.bytes(data);
            }
            Event::End { vmdesc } => {
                e.eof();
                if let Some(v) = vmdesc {
                    e.vmdesc(&v.json);
                }
            }
        }
    }
    e.buf
}

#[test]
fn every_qemu10_fixture_round_trips_byte_for_byte() {
    for name in [
        "qemu10-precopy-paused",
        "qemu10-precopy-live",
        "qemu10-precopy-q35",
        "qemu10-bgsnap-writer",
    ] {
        let s = fixture(name);
        let out = reencode(&s);
        let first_diff = s.iter().zip(&out).position(|(a, b)| a != b);
        assert!(
            out == s,
            "{name}: re-encoded {} bytes of {}, first difference at {first_diff:?}",
            out.len(),
            s.len()
        );
    }
}

#[test]
fn mapped_ram_is_refused_naming_the_capability() {
    let mut e = Encoder::new();
    e.config("microvm", &["mapped-ram"]);
    let err = collect_from(&e.buf[..], q10()).unwrap_err();
    assert!(
        matches!(err, StreamError::BadConfiguration { .. }),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("disable the mapped-ram capability"),
        "{err}"
    );
}

/// The fuzzing seeds cut from these fixtures (fuzz/seeds_from_qemu.py):
/// options byte 0x09 (pages may be missing, QEMU 10.0), then a stream the
/// reader reads to its end, SWITCHOVER_START included.
#[test]
fn fuzz_seeds_cut_from_the_qemu10_fixtures_read_to_the_end() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    for (name, commands) in [
        ("qemu10-precopy-paused", 1),
        ("qemu10-precopy-live", 1),
        ("qemu10-bgsnap-writer", 0),
    ] {
        let seed = std::fs::read(dir.join(name)).unwrap();
        assert!(
            seed.len() <= 9000,
            "{name}: longer than read_stream's -max_len"
        );
        assert_eq!(seed[0], 0x09, "{name}");
        let opts = ReaderOptions {
            require_all_pages: false,
            ..q10()
        };
        let c = collect_from(&seed[1..], opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.commands.len(), commands, "{name}");
        assert_eq!(c.device_state.len(), 3573, "{name}");
        assert!(c.pages.iter().any(|p| p.data.is_some()), "{name}");
    }
}
