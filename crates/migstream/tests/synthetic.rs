//! Tests on streams built by the test-only encoder: round trips, page
//! origins, commands, layout variants.

mod common;

use std::io::{self, Read};

use common::encoder::{filled, small_stream, Encoder, PAGE, VMDESC};
use common::{collect, collect_from};
use vmcsnap_migstream::wire::{ram_flags, CommandKind, SectionType};
use vmcsnap_migstream::{Command, PageOrigin, ReaderOptions, StreamError, StreamReader};

use PageOrigin::{GuestWrite, Resent, Scan};

#[test]
fn round_trip_small_stream() {
    let (stream, device) = small_stream();
    let c = collect(&stream).unwrap();
    assert_eq!(c.config.as_ref().unwrap().machine, "microvm");
    assert_eq!(c.blocks.len(), 2);
    assert_eq!(
        (c.blocks[0].name.as_str(), c.blocks[0].used_length),
        ("ram0", 8 * PAGE)
    );
    assert_eq!(
        (c.blocks[1].name.as_str(), c.blocks[1].used_length),
        ("rom", 2 * PAGE)
    );
    assert_eq!(
        c.sections,
        vec![
            (SectionType::Start, 2, true),
            (SectionType::Part, 2, true),
            (SectionType::Part, 2, true),
            (SectionType::End, 2, true)
        ]
    );
    assert_eq!(c.pages.len(), 10);
    for (i, p) in c.pages[..8].iter().enumerate() {
        assert_eq!((p.block, p.offset, p.origin), (0, i as u64 * PAGE, Scan));
        if i < 5 && i % 2 == 0 {
            assert_eq!(p.data, None);
        } else {
            assert_eq!(p.data.as_deref(), Some(&filled(i as u8)[..]));
        }
    }
    assert_eq!(c.pages[8].data.as_deref(), Some(&filled(0xee)[..]));
    assert_eq!(
        (
            c.pages[9].block,
            c.pages[9].offset,
            c.pages[9].data.is_none()
        ),
        (1, PAGE, true)
    );
    assert_eq!(c.device_state, device);
    assert_eq!(
        &stream[c.device_offset as usize..][..device.len()],
        &device[..]
    );
    assert_eq!(
        stream[c.device_offset as usize + device.len()],
        0,
        "EOF follows the device state"
    );
    let vmdesc = c.vmdesc.unwrap();
    assert_eq!(vmdesc.json, VMDESC);
    assert_eq!(vmdesc.page_size, Some(4096));
    assert_eq!(
        vmdesc
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>(),
        ["timer", "cpu"]
    );
    let s = c.stats;
    assert_eq!(s.bytes, stream.len() as u64);
    assert_eq!((s.scan.normal, s.scan.zero), (6, 4));
    assert_eq!(s.guest_write.total() + s.resent.total(), 0);
    assert_eq!(s.ram_sections, 4);
    assert_eq!(s.device_state_bytes, device.len() as u64);
    assert_eq!(s.vmdesc_bytes, VMDESC.len() as u64);
}

/// A source that hands out one byte per read and interrupts every other
/// call, like a slow socket.
struct Trickle<'a> {
    data: &'a [u8],
    calls: usize,
}

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.calls += 1;
        if self.calls & 1 == 0 {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "signal"));
        }
        if self.data.is_empty() || buf.is_empty() {
            return Ok(0);
        }
        buf[0] = self.data[0];
        self.data = &self.data[1..];
        Ok(1)
    }
}

#[test]
fn byte_at_a_time_source_gives_the_same_events() {
    let (stream, _) = small_stream();
    let whole = collect(&stream).unwrap();
    let trickled = collect_from(
        Trickle {
            data: &stream,
            calls: 0,
        },
        ReaderOptions::default(),
    )
    .unwrap();
    assert_eq!(whole.pages, trickled.pages);
    assert_eq!(whole.device_state, trickled.device_state);
    assert_eq!(whole.stats, trickled.stats);
}

#[test]
fn io_error_names_offset() {
    struct Failing(usize);
    impl Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset"));
            }
            let (stream, _) = small_stream();
            let n = self.0.min(buf.len());
            buf[..n].copy_from_slice(&stream[..n]);
            self.0 -= n;
            Ok(n)
        }
    }
    let err = collect_from(Failing(8), ReaderOptions::default()).unwrap_err();
    assert!(matches!(err, StreamError::Io { offset: 8, .. }), "{err}");
}

/// Blocks "a" (8 pages) and "b" (4 pages); page records in the given
/// order (block index, page); returns the origins.
fn origins(order: &[(usize, u64)]) -> Vec<PageOrigin> {
    let names = ["a", "b"];
    let mut e = Encoder::new();
    e.config("pc-i440fx-7.2", &[])
        .ram_setup(5, &[("a", 8 * PAGE), ("b", 4 * PAGE)]);
    e.short_header(SectionType::Part, 5);
    for (i, &(b, p)) in order.iter().enumerate() {
        if i == order.len() / 2 {
            // a section boundary in the middle changes nothing
            e.eos(5).short_header(SectionType::Part, 5);
        }
        e.zero(names[b], p * PAGE);
    }
    e.eos(5);
    e.device(1, "dev", &[9]);
    e.eof().vmdesc("{}");
    collect(&e.buf)
        .unwrap()
        .pages
        .iter()
        .map(|p| p.origin)
        .collect()
}

#[test]
fn guest_writes_are_out_of_scan_order() {
    // Scan a0 a1; the guest writes b2 and a6; the scan continues after
    // each fault (b3, a7), wraps over b0 b1, then a2..a5.
    let order = [
        (0, 0),
        (0, 1),
        (1, 2),
        (1, 3),
        (0, 6),
        (0, 7),
        (1, 0),
        (1, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (0, 5),
    ];
    assert_eq!(
        origins(&order),
        [Scan, Scan, GuestWrite, Scan, GuestWrite, Scan, Scan, Scan, Scan, Scan, Scan, Scan]
    );
    // Consecutive faults: each is out of order.
    // After b1 the scan goes on with b2 b3, wraps to a0.., skipping a3 a5.
    let order = [
        (0, 5),
        (0, 3),
        (1, 1),
        (1, 2),
        (1, 3),
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 4),
        (0, 6),
        (0, 7),
        (1, 0),
    ];
    assert_eq!(
        origins(&order),
        [
            GuestWrite, GuestWrite, GuestWrite, Scan, Scan, Scan, Scan, Scan, Scan, Scan, Scan,
            Scan
        ]
    );
}

#[test]
fn precopy_rounds_are_resent() {
    let mut e = Encoder::new();
    e.config("microvm", &[]).ram_setup(2, &[("a", 3 * PAGE)]);
    e.short_header(SectionType::Part, 2);
    e.page("a", 0, &filled(1))
        .page("a", PAGE, &filled(2))
        .page("a", 2 * PAGE, &filled(3))
        .eos(2);
    e.short_header(SectionType::End, 2)
        .page("a", PAGE, &filled(4))
        .eos(2);
    e.device(0, "dev", &[]);
    e.eof().vmdesc("{}");
    let c = collect(&e.buf).unwrap();
    let o: Vec<_> = c.pages.iter().map(|p| p.origin).collect();
    assert_eq!(o, [Scan, Scan, Scan, Resent]);
    assert_eq!(c.stats.resent.normal, 1);
}

#[test]
fn ignore_shared_adds_guest_addresses_and_skips_unsent_blocks() {
    let mut e = Encoder::new();
    e.guest_addrs = true;
    e.config("pc-i440fx-7.2", &["x-ignore-shared"])
        .ram_setup(2, &[("mem", 16 * PAGE), ("pc.bios", 2 * PAGE)]);
    e.short_header(SectionType::Part, 2)
        .page("pc.bios", 0, &filled(1))
        .zero("pc.bios", PAGE)
        .eos(2);
    e.device(0, "dev", &[1]);
    e.eof().vmdesc("{}");
    let c = collect(&e.buf).unwrap();
    assert_eq!(c.config.unwrap().capabilities, ["x-ignore-shared"]);
    assert_eq!(c.blocks[0].guest_addr, Some(0));
    assert_eq!(c.blocks[1].guest_addr, Some(0x1000_0000));
    assert!(c.pages.iter().all(|p| p.origin == Scan));
}

#[test]
fn commands_of_precopy_are_events() {
    let mut e = Encoder::new();
    e.config("pc-i440fx-7.2", &[]);
    e.command(CommandKind::OpenReturnPath, &[])
        .command(CommandKind::Ping, &[0, 0, 0, 1]);
    let mut advise = 4096u64.to_be_bytes().to_vec();
    advise.extend_from_slice(&4096u64.to_be_bytes());
    e.command(CommandKind::PostcopyAdvise, &advise);
    e.ram_setup(2, &[("a", PAGE)])
        .short_header(SectionType::Part, 2)
        .zero("a", 0)
        .eos(2);
    e.eof().vmdesc("{}");
    let c = collect(&e.buf).unwrap();
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
    assert!(
        c.device_state.is_empty(),
        "EOF right after RAM: empty device state"
    );
}

#[test]
fn no_footers_no_config_no_vmdesc() {
    let mut e = Encoder::new();
    e.footers = false;
    e.ram_setup(7, &[("a", PAGE)])
        .short_header(SectionType::Part, 7)
        .page("a", 0, &filled(3))
        .eos(7);
    let dev = e.device(0, "dev", &[1, 2, 0]);
    let dev = e.buf[dev].to_vec();
    e.eof();
    let c = collect(&e.buf).unwrap();
    assert!(c.config.is_none());
    assert_eq!(
        c.sections,
        [
            (SectionType::Start, 7, false),
            (SectionType::Part, 7, false)
        ]
    );
    assert_eq!(c.device_state, dev);
    assert!(c.vmdesc.is_none());
}

#[test]
fn target_page_bits_subsection_sets_page_size() {
    let mut e = Encoder::new();
    e.u8(7)
        .be32(3)
        .bytes(b"arm")
        .u8(5)
        .str8("configuration/target-page-bits")
        .be32(1)
        .be32(16);
    let big = 1u64 << 16;
    e.ram_setup(2, &[("a", 2 * big)])
        .short_header(SectionType::Part, 2);
    e.be64(big | ram_flags::PAGE)
        .str8("a")
        .bytes(&vec![7; big as usize])
        .be64(ram_flags::ZERO | ram_flags::CONTINUE)
        .u8(0);
    e.eos(2).eof().vmdesc("{}");
    let mut r = StreamReader::new(&e.buf[..]);
    let mut pages = Vec::new();
    while let Some(ev) = r.next_event().unwrap() {
        if let vmcsnap_migstream::Event::Page { offset, data, .. } = ev {
            pages.push((offset, data.len()));
        }
    }
    assert_eq!(r.page_size(), big);
    assert_eq!(pages, [(big, big as usize)]);
    assert_eq!(
        r.stats().guest_write.normal,
        1,
        "page 1 before page 0 is out of order"
    );
}
