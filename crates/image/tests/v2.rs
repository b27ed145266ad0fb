//! Format 2.0: locality blocks, compression, duplicate pages, and reading
//! format 1.0 images (a fixture written by the v1 writer, and the v1
//! option of this writer).

mod common;

use std::fs;
use std::path::Path;

use common::*;
use vmcsnap_image::testing::reseal;
use vmcsnap_image::{
    Codec, FileKind, Image, ImageWriter, PageKey, PageState, ReadError, WriterOptions, FORMAT_V1,
    FORMAT_VERSION,
};

const RAM: &[(&str, u64)] = &[("pc.ram", 50 * PS as u64 - 100), ("vga", 12 * PS as u64)];

fn opts(codec: Codec) -> WriterOptions {
    WriterOptions {
        pages_per_block: 8,
        codec,
        ..Default::default()
    }
}

/// Every page reads back as written, through `read_page`, blocks and plans.
fn check_contents(img: &Image) {
    let mut buf = vec![0u8; PS];
    for r in 0..2u32 {
        for p in 0..img.ram_block_pages(r) {
            let k = PageKey::new(r, p);
            let st = img.read_page(k, &mut buf).unwrap();
            match page_content(k) {
                Some(d) => {
                    assert!(matches!(st, PageState::Stored(_)), "{k:?}");
                    assert_eq!(buf, d, "{k:?}");
                }
                None => assert_eq!(st, PageState::Zero, "{k:?}"),
            }
        }
    }
    let all: Vec<PageKey> = (0..50).map(|p| PageKey::new(0, p)).collect();
    let plan = img.plan_reads(&all, 4096, 1 << 20).unwrap();
    let mut buf = Vec::new();
    for e in &plan.extents {
        img.read_extent(e, &mut buf).unwrap();
        for &(k, at, _) in &e.pages {
            assert_eq!(
                Some(buf[at as usize..at as usize + PS].to_vec()),
                page_content(k)
            );
        }
    }
    for b in plan.whole_blocks {
        for (k, data) in img.read_block(b).unwrap().iter() {
            assert_eq!(Some(data.to_vec()), page_content(k));
        }
    }
    let report = img.verify();
    assert!(report.is_ok(), "{report}");
}

#[test]
fn every_codec_round_trips_with_locality_and_duplicates() {
    let tmp = tempfile::tempdir().unwrap();
    for codec in [Codec::None, Codec::Lz4, Codec::Zstd] {
        let dir = tmp.path().join(codec.name());
        let c = build_opts(&dir, RAM, opts(codec));
        let img = Image::open(&dir).unwrap();
        assert_eq!(img.version(), FORMAT_VERSION);
        check_contents(&img);

        // Hot blocks first hold the guest-written pages in the order given.
        let (_, fafl) = arrival_order(&[50, 12]);
        let hot: Vec<PageKey> = img
            .blocks()
            .iter()
            .enumerate()
            .filter(|(_, b)| b.is_hot())
            .flat_map(|(i, _)| img.read_block(i as u32).unwrap().pages)
            .collect();
        let want: Vec<PageKey> = fafl
            .iter()
            .copied()
            .filter(|k| page_content(*k).is_some())
            .collect();
        assert_eq!(hot, want, "{codec}");

        // Pages p % 11 == 4 share one slot.
        let st = img.stats();
        let same: Vec<PageKey> = (0..2u32)
            .flat_map(|r| (0..img.ram_block_pages(r)).map(move |p| PageKey::new(r, p)))
            .filter(|k| k.page % 11 == 4 && k.page % 5 != 3)
            .collect();
        assert_eq!(st.pages_duplicate, same.len() as u64 - 1, "{codec}");
        let slots: std::collections::BTreeSet<(u32, u16)> = same
            .iter()
            .map(|&k| match img.locate(k).unwrap() {
                PageState::Stored(l) => (l.block, l.slot),
                s => panic!("{k:?} {s:?}"),
            })
            .collect();
        assert_eq!(slots.len(), 1);
        assert_eq!(st.pages_stored + st.pages_duplicate + st.pages_zero, 62);
        let storage = c.manifest.storage.as_ref().unwrap();
        assert_eq!(storage.codec, codec.name());
        assert_eq!(storage.pages_duplicate, st.pages_duplicate);
        assert_eq!(storage.blocks_hot, st.blocks_hot);
        if codec == Codec::None {
            assert_eq!(st.blocks_compressed, 0);
        } else {
            // A third of the pages compress well: some blocks shrink.
            assert!(st.blocks_compressed > 0, "{codec}");
            assert!(st.payload_stored_bytes < st.payload_raw_bytes, "{codec}");
        }
    }
}

#[test]
fn v1_fixture_written_by_the_v1_writer_still_reads() {
    // crates/image/tests/fixtures/v1-small: written by vmcsnap's 1.0
    // writer (before format 2): RAM blocks pc.ram (40 pages, every fifth
    // zero) and bios (3 pages + 100 bytes, 0xA0 + page), 8 pages a block.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1-small");
    let img = Image::open(&dir).unwrap();
    assert_eq!(img.version(), FORMAT_V1);
    assert!(img.manifest().storage.is_none());
    let mut buf = vec![0u8; 4096];
    for p in 0..40u32 {
        img.read_page(PageKey::new(0, p), &mut buf).unwrap();
        let want: Vec<u8> = if p % 5 == 0 {
            vec![0; 4096]
        } else {
            (0..4096).map(|i| (p as usize * 31 + i * 7) as u8).collect()
        };
        assert_eq!(buf, want, "page {p}");
    }
    for p in 0..4u32 {
        img.read_page(PageKey::new(1, p), &mut buf).unwrap();
        assert_eq!(buf, vec![0xA0 + p as u8; 4096]);
    }
    assert_eq!(img.device_state().unwrap(), b"device-state-v1-fixture");
    assert_eq!(img.fafl().len(), 6);
    assert!(img.verify().is_ok());
}

#[test]
fn v1_writer_option_writes_what_v1_readers_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    build_v1(&dir);
    let img = Image::open(&dir).unwrap();
    assert_eq!(img.version(), FORMAT_V1);
    for kind in [
        FileKind::Memory,
        FileKind::Index,
        FileKind::Zero,
        FileKind::Device,
    ] {
        let d = fs::read(dir.join(kind.default_name())).unwrap();
        assert_eq!(&d[8..10], &1u16.to_le_bytes(), "{kind:?}");
    }
    assert!(img
        .blocks()
        .iter()
        .all(|b| b.flags == 0 && b.compression == 0));
    assert_eq!(img.stats().pages_duplicate, 0);
    check_contents(&img);
    // v1 cannot have compression or duplicates.
    let bad = WriterOptions {
        codec: Codec::Lz4,
        ..WriterOptions::v1()
    };
    let e = ImageWriter::create_with(&tmp.path().join("t"), meta(RAM), bad).unwrap_err();
    assert!(e.to_string().contains("v1 has neither"), "{e}");
}

/// A copy of `good` with `file` changed by `f` and its CRCs resealed, so
/// the damage reaches the checks behind the CRCs.
fn resealed(good: &Path, to: &Path, kind: FileKind, f: impl FnOnce(&mut Vec<u8>)) {
    copy_dir(good, to);
    let path = to.join(kind.default_name());
    let mut d = fs::read(&path).unwrap();
    f(&mut d);
    reseal(kind, &mut d);
    fs::write(&path, d).unwrap();
}

/// Byte offset of index entry `(r, p)` in `pages.idx` (64-byte header).
fn entry_at(img: &Image, r: u32, p: u32) -> usize {
    let mut at = 64 + img.blocks().len() * 16;
    for rb in 0..r {
        at += 16 + img.ram_block_pages(rb) as usize * 12;
    }
    at + 16 + p as usize * 12
}

#[test]
fn damage_to_v2_structures_is_named_never_a_wrong_page() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    build_opts(&good, RAM, opts(Codec::Lz4));
    let img = Image::open(&good).unwrap();
    let (ci, cb) = img
        .blocks()
        .iter()
        .enumerate()
        .find(|(_, b)| b.compression != 0)
        .map(|(i, b)| (i as u32, *b))
        .unwrap();

    // A flipped byte in a compressed payload, block CRC resealed: the
    // decompressor or a page CRC names the block.
    let d1 = tmp.path().join("d1");
    resealed(&good, &d1, FileKind::Memory, |d| {
        let at = cb.payload_offset() as usize + cb.payload_len() as usize / 2;
        d[at] ^= 0x55;
        // reseal only fixes file headers; fix the block CRC by hand.
        let start = cb.offset as usize;
        let end = start + cb.stored_len as usize;
        let mut crc = crc32c::crc32c(&d[start..start + 28]);
        crc = crc32c::crc32c_append(crc, &d[start + 32..end]);
        d[start + 28..start + 32].copy_from_slice(&crc.to_le_bytes());
    });
    let img = Image::open(&d1).unwrap();
    let e = img.read_block(ci).unwrap_err();
    assert_eq!(e.block(), Some(ci), "{e}");
    let report = img.verify();
    assert_eq!(report.bad_blocks.len(), 1, "{report}");

    // A duplicate entry that names a slot holding other bytes.
    let owner = PageKey::new(0, 0);
    let (PageState::Stored(ol), dup) = (img.locate(owner).unwrap(), PageKey::new(0, 15)) else {
        panic!()
    };
    let d2 = tmp.path().join("d2");
    let at = entry_at(&img, dup.ram_block, dup.page);
    resealed(&good, &d2, FileKind::Index, |d| {
        d[at..at + 4].copy_from_slice(&ol.block.to_le_bytes());
        d[at + 4..at + 6].copy_from_slice(&ol.slot.to_le_bytes());
        d[at + 6..at + 8].copy_from_slice(&1u16.to_le_bytes());
    });
    let e = Image::open(&d2).unwrap_err();
    assert!(matches!(e, ReadError::Corrupt { .. }), "{e}");
    assert!(
        e.to_string().contains("another CRC") || e.to_string().contains("pages are indexed"),
        "{e}"
    );

    // Unknown entry flags, and a duplicate flag on an unstored page.
    let d3 = tmp.path().join("d3");
    let zero_page = entry_at(&img, 0, 3);
    resealed(&good, &d3, FileKind::Index, |d| {
        d[zero_page + 6..zero_page + 8].copy_from_slice(&1u16.to_le_bytes());
    });
    let e = Image::open(&d3).unwrap_err();
    assert!(e.to_string().contains("flags"), "{e}");

    // Unknown block flags and an unknown codec in the block table.
    for (byte, val, what) in [(15usize, 0x80u8, "flags"), (14, 9, "codec")] {
        let d4 = tmp.path().join(format!("d4-{what}"));
        resealed(&good, &d4, FileKind::Index, |d| d[64 + byte] = val);
        match Image::open(&d4) {
            Err(e) => assert!(e.to_string().contains("flags"), "{what}: {e}"),
            Ok(img) => {
                let e = img.read_block(0).unwrap_err();
                assert!(
                    matches!(e, ReadError::UnsupportedCompression { codec: 9, .. })
                        || e.to_string().contains("does not match"),
                    "{what}: {e}"
                );
            }
        }
    }

    // A v1 image may not carry v2 structures: flags set in a 1.0 file.
    let v1 = tmp.path().join("v1");
    build_v1(&v1);
    let d5 = tmp.path().join("d5");
    resealed(&v1, &d5, FileKind::Index, |d| d[64 + 15] = 1);
    let e = Image::open(&d5).unwrap_err();
    assert!(e.to_string().contains("format 1.x does not have"), "{e}");
}

#[test]
fn many_blocks_keep_their_order_through_the_pool() {
    // Enough blocks that the worker pool runs several at once; the file
    // must still hold them in submission order (cold pages by address).
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let pages = 4000u32;
    let mut w = ImageWriter::create_with(
        &dir,
        meta(&[("mem", u64::from(pages) * PS as u64)]),
        WriterOptions {
            pages_per_block: 16,
            compress_threads: 3,
            ..Default::default()
        },
    )
    .unwrap();
    for p in 0..pages {
        let mut d = vec![0u8; PS];
        d[..8].copy_from_slice(&u64::from(p).to_le_bytes());
        d[100] = 1;
        w.add_page(0, p, &d).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    w.commit().unwrap();
    let img = Image::open(&dir).unwrap();
    let order: Vec<u32> = img
        .iter_blocks()
        .flat_map(|b| b.unwrap().pages.into_iter().map(|k| k.page))
        .collect();
    assert_eq!(order, (0..pages).collect::<Vec<_>>());
    assert!(img.verify().is_ok());
    let st = img.stats();
    assert!(
        st.payload_stored_bytes * 10 < st.payload_raw_bytes,
        "{st:?}"
    );
}

#[test]
fn the_scatter_control_mixes_pages_across_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let pages = 2000u32;
    let mut w = ImageWriter::create_with(
        &dir,
        meta(&[("mem", u64::from(pages) * PS as u64)]),
        WriterOptions {
            pages_per_block: 16,
            scatter_blocks: 32,
            ..Default::default()
        },
    )
    .unwrap();
    for p in 0..pages {
        let mut d = vec![0u8; PS];
        d[..4].copy_from_slice(&p.to_le_bytes());
        d[9] = 1;
        w.add_page(0, p, &d).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    w.commit().unwrap();
    let img = Image::open(&dir).unwrap();
    // Every page reads back; a block's pages are far apart.
    let mut spread = Vec::new();
    for b in img.iter_blocks() {
        let b = b.unwrap();
        for (k, data) in b.iter() {
            assert_eq!(data[..4], k.page.to_le_bytes());
        }
        let (lo, hi) = (b.pages.first().unwrap().page, b.pages.last().unwrap().page);
        spread.push(hi - lo);
    }
    spread.sort_unstable();
    assert!(
        spread[spread.len() / 2] > 100,
        "median block spread {}",
        spread[spread.len() / 2]
    );
    let v1 = WriterOptions {
        scatter_blocks: 4,
        ..WriterOptions::v1()
    };
    assert!(ImageWriter::create_with(&tmp.path().join("t"), meta(&[("mem", 4096)]), v1).is_err());
}
