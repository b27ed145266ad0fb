//! Format 2 references outside the image: incremental snapshots (pages in
//! the parent) and pages on a frozen disk (the detection layer).

mod common;

use std::fs;
use std::path::Path;
use std::sync::Arc;

use common::*;
use vmcsnap_image::manifest::ParentRef;
use vmcsnap_image::reader::DiskPages;
use vmcsnap_image::writer::{DiskMatcher, ParentInfo};
use vmcsnap_image::{DiskRef, Image, ImageWriter, PageKey, PageState, ReadError, WriterOptions};

const PAGES: u32 = 300;

fn content(gen: u32, p: u32) -> Vec<u8> {
    // Every 20th page changes between generations (5%); page 7 is zero.
    if p == 7 {
        return vec![0; PS];
    }
    let g = if p % 20 == 0 { gen } else { 0 };
    let mut d = vec![0u8; PS];
    d[..12].copy_from_slice(&[
        (p & 0xff) as u8,
        (p >> 8) as u8,
        g as u8,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
    ]);
    d[PS - 1] = 0x5a;
    d
}

fn write(dir: &Path, gen: u32, parent: Option<&Image>) -> vmcsnap_image::Committed {
    let mut w = ImageWriter::create_with(
        dir,
        meta(&[("mem", u64::from(PAGES) * PS as u64)]),
        WriterOptions {
            pages_per_block: 16,
            ..Default::default()
        },
    )
    .unwrap();
    if let Some(p) = parent {
        let depth = p.manifest().parent.as_ref().map_or(0, |r| r.depth) + 1;
        w.set_parent(ParentInfo {
            reference: ParentRef {
                name: p.dir().file_name().unwrap().to_string_lossy().into(),
                image_id: p.manifest().image_id.clone(),
                depth,
            },
            ram_blocks: p.manifest().ram_blocks.clone(),
            hashes: p.page_hashes().unwrap().unwrap(),
        })
        .unwrap();
    }
    for p in 0..PAGES {
        w.add_page(0, p, &content(gen, p)).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    w.commit().unwrap()
}

fn check(img: &Image, gen: u32) {
    let mut buf = vec![0u8; PS];
    for p in 0..PAGES {
        img.read_page(PageKey::new(0, p), &mut buf).unwrap();
        assert_eq!(buf, content(gen, p), "gen {gen} page {p}");
    }
    let mut all = vec![0u8; PAGES as usize * PS];
    img.read_ram_block(0, &mut all).unwrap();
    for p in 0..PAGES as usize {
        assert_eq!(
            all[p * PS..(p + 1) * PS],
            content(gen, p as u32)[..],
            "gen {gen} page {p}"
        );
    }
}

#[test]
fn an_incremental_chain_reads_every_generation_and_stores_only_changes() {
    let tmp = tempfile::tempdir().unwrap();
    write(&tmp.path().join("g0"), 0, None);
    let g0 = Image::open(&tmp.path().join("g0")).unwrap();
    write(&tmp.path().join("g1"), 1, Some(&g0));
    let g1 = Image::open(&tmp.path().join("g1")).unwrap();
    write(&tmp.path().join("g2"), 2, Some(&g1));
    let g2 = Image::open(&tmp.path().join("g2")).unwrap();
    check(&g0, 0);
    check(&g1, 1);
    check(&g2, 2);
    let (full, inc) = (g0.stats(), g2.stats());
    assert_eq!(inc.pages_stored, 15, "{inc:?}"); // the 5% that changed
    assert_eq!(inc.pages_in_parent, u64::from(PAGES) - 15 - 1);
    assert!(
        inc.memory_bytes * 10 < full.memory_bytes,
        "{inc:?} vs {full:?}"
    );
    assert_eq!(g2.manifest().parent.as_ref().unwrap().depth, 2);
    // The page resolves to the generation that wrote it.
    let (holder, st) = g2.resolve(PageKey::new(0, 1)).unwrap();
    assert_eq!(holder.dir(), g0.dir());
    assert!(matches!(st, PageState::Stored(_)));
    let (holder, _) = g2.resolve(PageKey::new(0, 20)).unwrap();
    assert_eq!(holder.dir(), g2.dir());
}

#[test]
fn a_missing_or_replaced_parent_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    write(&tmp.path().join("g0"), 0, None);
    let g0 = Image::open(&tmp.path().join("g0")).unwrap();
    write(&tmp.path().join("g1"), 1, Some(&g0));
    drop(g0);
    // Another snapshot under the parent's name.
    fs::rename(tmp.path().join("g0"), tmp.path().join("old")).unwrap();
    write(&tmp.path().join("g0"), 0, None);
    let e = Image::open(&tmp.path().join("g1")).unwrap_err();
    assert!(e.to_string().contains("another snapshot now"), "{e}");
    // No parent at all.
    fs::remove_dir_all(tmp.path().join("g0")).unwrap();
    let e = Image::open(&tmp.path().join("g1")).unwrap_err();
    assert!(matches!(e, ReadError::NotFound(_)), "{e}");
    assert!(
        e.to_string().contains("parent snapshot \"g0\" is missing"),
        "{e}"
    );
    // A writer refuses a parent of another RAM layout.
    let other = tmp.path().join("other");
    build(&other);
    let o = Image::open(&other).unwrap();
    let mut w = ImageWriter::create(
        &tmp.path().join("x"),
        meta(&[("mem", u64::from(PAGES) * PS as u64)]),
    )
    .unwrap();
    let e = w
        .set_parent(ParentInfo {
            reference: ParentRef {
                name: "other".into(),
                image_id: o.manifest().image_id.clone(),
                depth: 1,
            },
            ram_blocks: o.manifest().ram_blocks.clone(),
            hashes: o.page_hashes().unwrap().unwrap(),
        })
        .unwrap_err();
    assert!(e.to_string().contains("other RAM blocks"), "{e}");
}

/// A "disk" in memory: 64 blocks of 4 KiB, block i holds content(0, 100 + i).
#[derive(Debug)]
struct MemDisk(Vec<u8>);

impl MemDisk {
    fn new() -> Self {
        MemDisk((0..64).flat_map(|i| content(0, 100 + i)).collect())
    }
}

struct Matcher(Arc<MemDisk>);

impl DiskMatcher for Matcher {
    fn find(&mut self, _hash: u128, data: &[u8]) -> Option<(u16, u32)> {
        self.0
             .0
            .chunks_exact(PS)
            .position(|b| b == data)
            .map(|i| (0, i as u32))
    }
}

impl DiskPages for MemDisk {
    fn read(&self, _disk: &DiskRef, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let at = offset as usize;
        out.copy_from_slice(
            self.0
                .get(at..at + out.len())
                .ok_or_else(|| std::io::Error::other("past the end of the disk"))?,
        );
        Ok(())
    }
}

#[test]
fn pages_found_on_the_frozen_disk_are_references_checked_by_crc() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let disk = Arc::new(MemDisk::new());
    let mut w = ImageWriter::create_with(
        &dir,
        meta(&[("mem", u64::from(PAGES) * PS as u64)]),
        WriterOptions {
            pages_per_block: 16,
            ..Default::default()
        },
    )
    .unwrap();
    w.set_disk_matcher(Box::new(Matcher(disk.clone())));
    for p in 0..PAGES {
        w.add_page(0, p, &content(0, p)).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    w.commit().unwrap();
    let img = Image::open_with(&dir, Some(disk.clone())).unwrap();
    assert_eq!(img.stats().pages_on_disk, 64);
    check(&img, 0);
    assert_eq!(
        img.locate(PageKey::new(0, 101)).unwrap(),
        PageState::OnDisk {
            disk: 0,
            offset: PS as u64,
            crc: crc32c::crc32c(&content(0, 101))
        }
    );
    // Without a disk reader: a clear error, not a wrong page.
    let plain = Image::open(&dir).unwrap();
    let mut buf = vec![0u8; PS];
    let e = plain.read_page(PageKey::new(0, 101), &mut buf).unwrap_err();
    assert!(e.to_string().contains("frozen disk"), "{e}");
    // The disk changed under the snapshot: the CRC catches it.
    let mut changed = MemDisk::new();
    changed.0[PS + 5] ^= 1;
    let img = Image::open_with(&dir, Some(Arc::new(changed))).unwrap();
    let e = img.read_page(PageKey::new(0, 101), &mut buf).unwrap_err();
    assert!(matches!(e, ReadError::BadCrc { .. }), "{e}");
    // Verify reads every page on the disk, as a restore does.
    let r = img.verify();
    assert_eq!(
        (r.bad_pages_total, r.bad_pages[0].key),
        (1, PageKey::new(0, 101)),
        "{r}"
    );
    let r = Image::open_with(&dir, Some(disk)).unwrap().verify();
    assert!(r.is_ok() && r.disk_pages_checked == 64, "{r}");
    // Without a disk reader they cannot be checked: not OK.
    let r = plain.verify();
    assert_eq!(r.bad_pages_total, 64, "{r}");
}
