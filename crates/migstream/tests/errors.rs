//! Every specific error, on streams built by the test-only encoder, and
//! hostile lengths.

mod common;

use common::drain;
use common::encoder::{small_stream, Encoder, PAGE, VMDESC};
use vmcsnap_migstream::wire::{ram_flags, CommandKind, SectionType};
use vmcsnap_migstream::{ReaderOptions, StreamError, VmDescPolicy};

/// A valid stream up to the START section and a PART header, then `tail`.
fn after_part(tail: impl FnOnce(&mut Encoder)) -> Vec<u8> {
    let mut e = Encoder::new();
    e.config("microvm", &[])
        .ram_setup(2, &[("a", 4 * PAGE)])
        .short_header(SectionType::Part, 2);
    tail(&mut e);
    e.buf
}

fn err(bytes: &[u8]) -> StreamError {
    drain(bytes, ReaderOptions::default()).expect("expected an error")
}

#[test]
fn unsupported_ram_variants_have_specific_errors() {
    let e = err(&after_part(|e| {
        e.be64(ram_flags::XBZRLE).str8("a");
    }));
    assert!(matches!(e, StreamError::Xbzrle { offset: 73 }), "{e}");
    assert!(e.to_string().contains("disable the xbzrle"));
    let e = err(&after_part(|e| {
        e.be64(ram_flags::COMPRESS_PAGE | ram_flags::CONTINUE);
    }));
    assert!(matches!(e, StreamError::CompressedPage { .. }), "{e}");
    assert!(e.to_string().contains("compress"));
    let e = err(&after_part(|e| {
        e.be64(ram_flags::HOOK);
    }));
    assert!(matches!(e, StreamError::RdmaHook { .. }), "{e}");
    // QEMU 8.0+ (10.0): a multifd sync point, named as such.
    let e = err(&after_part(|e| {
        e.be64(ram_flags::MULTIFD_FLUSH);
    }));
    assert!(matches!(e, StreamError::Multifd { offset: 73 }), "{e}");
    assert!(e.to_string().contains("disable the multifd"), "{e}");
    for flags in [
        ram_flags::FULL,
        ram_flags::PAGE | ram_flags::ZERO,
        0,
        0x200 | ram_flags::PAGE,
        0x800,
    ] {
        let e = err(&after_part(|e| {
            e.be64(flags);
        }));
        assert!(
            matches!(e, StreamError::UnknownRamFlags { flags: f, .. } if f == flags),
            "{flags:#x}: {e}"
        );
    }
}

#[test]
fn ram_section_checks() {
    let mut e = Encoder::new();
    e.full_header(SectionType::Start, 2, "ram", 0, 3);
    assert!(matches!(
        err(&e.buf),
        StreamError::RamSectionVersion {
            offset: 8,
            found: 3
        }
    ));
    let mut e = Encoder::new();
    e.full_header(SectionType::Start, 2, "ram", 1, 4);
    assert!(matches!(
        err(&e.buf),
        StreamError::RamInstance { found: 1, .. }
    ));
    for (idstr, hint) in [
        ("block", "block migration"),
        ("dirty-bitmap", "dirty-bitmaps"),
        ("vfio", "VFIO"),
    ] {
        let mut e = Encoder::new();
        e.full_header(SectionType::Start, 3, idstr, 0, 1);
        let x = err(&e.buf);
        assert!(
            matches!(
                x,
                StreamError::UnknownIterativeSection { section_id: 3, .. }
            ),
            "{x}"
        );
        assert!(x.to_string().contains(hint), "{x}");
    }
    let mut e = Encoder::new();
    e.short_header(SectionType::Part, 9);
    assert!(matches!(
        err(&e.buf),
        StreamError::UnknownSectionId { section_id: 9, .. }
    ));
}

#[test]
fn page_record_checks() {
    let mut e = Encoder::new();
    e.config("m", &[])
        .full_header(SectionType::Start, 2, "ram", 0, 4)
        .zero("a", 0);
    assert!(matches!(
        err(&e.buf),
        StreamError::PageBeforeBlockList { .. }
    ));
    let x = err(&after_part(|e| {
        e.zero("nope", 0);
    }));
    assert!(
        matches!(&x, StreamError::UnknownRamBlock { name, .. } if name == "nope"),
        "{x}"
    );
    let x = err(&after_part(|e| {
        e.be64(ram_flags::ZERO | ram_flags::CONTINUE).u8(0);
    }));
    assert!(matches!(x, StreamError::ContinueWithoutBlock { .. }), "{x}");
    let x = err(&after_part(|e| {
        e.zero("a", 4 * PAGE);
    }));
    assert!(
        matches!(
            x,
            StreamError::PageOutOfRange {
                page_offset: 0x4000,
                length: 0x4000,
                ..
            }
        ),
        "{x}"
    );
    let x = err(&after_part(|e| {
        e.be64(ram_flags::MEM_SIZE | PAGE).str8("b").be64(PAGE);
    }));
    assert!(matches!(x, StreamError::BadRamBlockList { .. }), "{x}");
}

#[test]
fn block_list_checks() {
    for blocks in [
        vec![("a", PAGE), ("a", PAGE)],
        vec![("a", 0x1800), ("b", 0x800)],
        vec![("", PAGE)],
    ] {
        let mut e = Encoder::new();
        e.ram_setup(2, &blocks);
        let x = err(&e.buf);
        assert!(
            matches!(x, StreamError::BadRamBlockList { .. }),
            "{blocks:?}: {x}"
        );
    }
    // Entries overrunning the total.
    let mut e = Encoder::new();
    e.full_header(SectionType::Start, 2, "ram", 0, 4)
        .be64(PAGE | ram_flags::MEM_SIZE)
        .str8("a")
        .be64(2 * PAGE);
    assert!(matches!(err(&e.buf), StreamError::BadRamBlockList { .. }));
}

#[test]
fn footer_checks() {
    let mut e = Encoder::new();
    e.ram_setup(2, &[("a", PAGE)]);
    let n = e.buf.len();
    e.buf[n - 1] = 3; // footer names section 3
    assert!(matches!(
        err(&e.buf),
        StreamError::BadFooter { section_id: 2, .. }
    ));
    // Footer on the first section, none on the second.
    let mut e = Encoder::new();
    e.ram_setup(2, &[("a", PAGE)])
        .short_header(SectionType::Part, 2)
        .zero("a", 0)
        .be64(ram_flags::EOS)
        .eof();
    assert!(matches!(err(&e.buf), StreamError::BadFooter { .. }));
}

#[test]
fn postcopy_and_unknown_commands_are_errors() {
    for kind in [
        CommandKind::PostcopyListen,
        CommandKind::PostcopyRun,
        CommandKind::PostcopyRamDiscard,
        CommandKind::Packaged,
        CommandKind::PostcopyResume,
        CommandKind::RecvBitmap,
    ] {
        let mut e = Encoder::new();
        e.command(kind, &[]);
        let x = err(&e.buf);
        assert!(
            matches!(x, StreamError::Postcopy { offset: 8, .. }),
            "{kind:?}: {x}"
        );
        assert!(x.to_string().contains(kind.name()));
    }
    let mut e = Encoder::new();
    e.command(CommandKind::EnableColo, &[]);
    assert!(matches!(
        err(&e.buf),
        StreamError::UnsupportedCommand { .. }
    ));
    for cmd in [0u16, 11, 0xffff] {
        let mut e = Encoder::new();
        e.u8(8).be16(cmd).be16(0);
        assert!(matches!(err(&e.buf), StreamError::UnknownCommand { cmd: c, .. } if c == cmd));
    }
    let mut e = Encoder::new();
    e.command(CommandKind::Ping, &[1, 2]);
    assert!(matches!(
        err(&e.buf),
        StreamError::BadCommandLength { len: 2, .. }
    ));
    let mut advise = 0x201000u64.to_be_bytes().to_vec();
    advise.extend_from_slice(&4096u64.to_be_bytes());
    let mut e = Encoder::new();
    e.command(CommandKind::PostcopyAdvise, &advise);
    assert!(matches!(
        err(&e.buf),
        StreamError::HugePages {
            summary: 0x201000,
            ..
        }
    ));
}

#[test]
fn header_and_top_level_checks() {
    assert!(matches!(
        err(b"QEVN\0\0\0\x03"),
        StreamError::BadMagic { found: 0x5145564e }
    ));
    assert!(matches!(
        err(b"QEVM\0\0\0\x02"),
        StreamError::UnsupportedVersion { found: 2 }
    ));
    // 0x05 right after the header (after a configuration section it would
    // start a configuration subsection).
    let x = err(b"QEVM\0\0\0\x03\x05");
    assert!(
        matches!(
            x,
            StreamError::UnexpectedByte {
                offset: 8,
                byte: 5,
                ..
            }
        ),
        "{x}"
    );
    for byte in [0x7eu8, 0x09, 0xff, 0x06, 0x07] {
        let mut e = Encoder::new();
        e.config("m", &[]).u8(byte);
        let x = err(&e.buf);
        assert!(
            matches!(x, StreamError::UnexpectedByte { offset: 14, byte: b, .. } if b == byte),
            "{byte:#x}: {x}"
        );
    }
    let mut e = Encoder::new();
    e.config("m", &[])
        .u8(5)
        .str8("configuration/whatever")
        .be32(1);
    assert!(matches!(
        err(&e.buf),
        StreamError::UnknownConfigSubsection { .. }
    ));
}

#[test]
fn missing_pages_mean_multifd() {
    let mut e = Encoder::new();
    e.config("microvm", &[]).ram_setup(2, &[("a", 4 * PAGE)]);
    e.short_header(SectionType::Part, 2)
        .zero("a", 0)
        .zero("a", 2 * PAGE)
        .eos(2);
    e.device(0, "dev", &[1]);
    e.eof().vmdesc("{}");
    let x = err(&e.buf);
    assert!(
        matches!(
            &x,
            StreamError::IncompleteRam {
                missing: 2,
                first_offset: 0x1000,
                ..
            }
        ),
        "{x}"
    );
    assert!(x.to_string().contains("multifd"));
    let opts = ReaderOptions {
        require_all_pages: false,
        ..ReaderOptions::default()
    };
    assert!(drain(&e.buf, opts).is_none());
}

#[test]
fn end_of_stream_checks() {
    let (stream, _) = small_stream();
    let eof = stream.len() - VMDESC.len() - 5 - 1;
    // Cut right after EOF: with a configuration section the vmdesc is required.
    let x = err(&stream[..eof + 1]);
    assert!(matches!(x, StreamError::BadStreamEnd { .. }), "{x}");
    let opts = ReaderOptions {
        vmdesc: VmDescPolicy::Optional,
        ..ReaderOptions::default()
    };
    assert!(drain(&stream[..eof + 1], opts).is_none());
    // A vmdesc that is not JSON.
    let mut bad = stream.clone();
    let n = bad.len();
    bad[n - 1] = b'x';
    assert!(matches!(err(&bad), StreamError::BadStreamEnd { .. }));
    // The device state must end with a footer when sections have them.
    let mut e = Encoder::new();
    e.config("m", &[])
        .ram_setup(2, &[("a", PAGE)])
        .short_header(SectionType::Part, 2)
        .zero("a", 0)
        .eos(2);
    e.full_header(SectionType::Full, 0, "dev", 0, 1)
        .bytes(&[1, 2, 3])
        .eof()
        .vmdesc("{}");
    assert!(matches!(err(&e.buf), StreamError::BadStreamEnd { .. }));
    // Too large.
    let opts = ReaderOptions {
        max_device_state_bytes: 16,
        ..ReaderOptions::default()
    };
    assert!(matches!(
        drain(&stream, opts),
        Some(StreamError::DeviceStateTooLarge { limit: 16, .. })
    ));
}

#[test]
fn hostile_lengths_do_not_allocate() {
    // Machine name length 4 GiB.
    let mut e = Encoder::new();
    e.u8(7).be32(u32::MAX);
    assert!(matches!(err(&e.buf), StreamError::BadConfiguration { .. }));
    // Capability count 4 G.
    let mut e = Encoder::new();
    e.config("m", &[])
        .u8(5)
        .str8("configuration/capabilities")
        .be32(1)
        .be32(u32::MAX);
    assert!(matches!(err(&e.buf), StreamError::BadConfiguration { .. }));
    // An exabyte of RAM in one block: the reader tracks pages as runs, so
    // two far-apart pages cost nothing; the missing pages are reported.
    let huge = 1u64 << 60;
    let mut e = Encoder::new();
    e.config("m", &[])
        .ram_setup(2, &[("a", huge)])
        .short_header(SectionType::Part, 2);
    e.zero("a", huge - PAGE)
        .zero("a", 0)
        .zero("a", huge / 2)
        .eos(2)
        .eof()
        .vmdesc("{}");
    let x = err(&e.buf);
    assert!(
        matches!(x, StreamError::IncompleteRam { missing, .. } if missing == (huge / PAGE) - 3),
        "{x}"
    );
    // Many block list entries.
    let mut e = Encoder::new();
    e.full_header(SectionType::Start, 2, "ram", 0, 4)
        .be64(huge | ram_flags::MEM_SIZE);
    for i in 0..1100 {
        e.str8(&format!("b{i}")).be64(PAGE);
    }
    assert!(matches!(err(&e.buf), StreamError::BadRamBlockList { .. }));
    // vmdesc claiming 4 GiB: just a bad end.
    let (mut stream, _) = small_stream();
    let at = stream.len() - VMDESC.len() - 4;
    stream[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(err(&stream), StreamError::BadStreamEnd { .. }));
}
