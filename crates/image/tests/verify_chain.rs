//! `Image::verify` checks what a restore checks: pages read through the
//! chain of parents against the child's CRCs, no absent page, and the
//! page hashes (`hashes.bin`) against the pages' bytes. Each image here
//! is damaged with its CRCs resealed, so that only these checks can see it.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use vmcsnap_image::manifest::ParentRef;
use vmcsnap_image::testing::reseal;
use vmcsnap_image::writer::ParentInfo;
use vmcsnap_image::{FileKind, Image, ImageWriter, PageKey, PageState, ReadError, WriterOptions};

const PAGES: u32 = 300;

/// Generation `gen`: every 20th page changes; page 7 is zero.
fn content(gen: u32, p: u32) -> Vec<u8> {
    let mut d = vec![0u8; PS];
    if p == 7 {
        return d;
    }
    let g = if p % 20 == 0 { gen } else { 0 };
    d[..4].copy_from_slice(&[(p & 0xff) as u8, (p >> 8) as u8, g as u8, 1]);
    d[PS - 1] = 0x5a;
    d
}

fn write(dir: &Path, gen: u32, parent: Option<&Path>) {
    let mut w = ImageWriter::create_with(
        dir,
        meta(&[("mem", u64::from(PAGES) * PS as u64)]),
        WriterOptions {
            pages_per_block: 16,
            ..Default::default()
        },
    )
    .unwrap();
    if let Some(pdir) = parent {
        let p = Image::open(pdir).unwrap();
        w.set_parent(ParentInfo {
            reference: ParentRef {
                name: pdir.file_name().unwrap().to_string_lossy().into(),
                image_id: p.manifest().image_id.clone(),
                depth: p.manifest().parent.as_ref().map_or(0, |r| r.depth) + 1,
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
    w.commit().unwrap();
}

/// g0 <- g1 <- g2 in `root`.
fn chain(root: &Path) {
    write(&root.join("g0"), 0, None);
    write(&root.join("g1"), 1, Some(&root.join("g0")));
    write(&root.join("g2"), 2, Some(&root.join("g1")));
}

/// Byte offset of index entry `(0, p)` in `pages.idx`.
fn entry_at(img: &Image, p: u32) -> usize {
    64 + img.blocks().len() * 16 + 16 + p as usize * 12
}

/// Changes file `kind` of the snapshot in `dir` with `f`, CRCs resealed.
fn damage(dir: &Path, kind: FileKind, f: impl FnOnce(&mut Vec<u8>)) {
    let path = dir.join(kind.default_name());
    let mut d = fs::read(&path).unwrap();
    f(&mut d);
    reseal(kind, &mut d);
    fs::write(&path, d).unwrap();
}

#[test]
fn an_intact_chain_verifies_with_every_page_read_where_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    chain(tmp.path());
    let img = Image::open(&tmp.path().join("g2")).unwrap();
    let r = img.verify();
    assert!(r.is_ok(), "{r}");
    let st = img.stats();
    assert_eq!(r.parent_pages_checked, st.pages_in_parent, "{r}");
    assert_eq!(r.pages_checked, st.pages_stored + st.pages_in_parent, "{r}");
    assert_eq!(r.hashes_checked, u64::from(PAGES), "{r}");
    // g2 reads pages from g1 (the 20th pages of generation 1 are not
    // there any more) and from g0: blocks of both are read.
    assert!(r.blocks_checked > img.blocks().len() as u32, "{r}");
}

#[test]
fn an_in_parent_crc_that_is_not_the_parents_page_fails_verify_as_it_fails_restore() {
    let tmp = tempfile::tempdir().unwrap();
    chain(tmp.path());
    let g2 = tmp.path().join("g2");
    let key = PageKey::new(0, 41);
    let img = Image::open(&g2).unwrap();
    let PageState::InParent { crc } = img.locate(key).unwrap() else {
        panic!("page 41 is in the parent")
    };
    let at = entry_at(&img, 41);
    drop(img);
    damage(&g2, FileKind::Index, |d| {
        d[at + 8..at + 12].copy_from_slice(&(crc ^ 1).to_le_bytes())
    });
    let img = Image::open(&g2).unwrap();
    // What a restore meets reading the page.
    let mut buf = vec![0u8; PS];
    let e = img.read_page(key, &mut buf).unwrap_err();
    assert!(matches!(e, ReadError::BadCrc { .. }), "{e}");
    let r = img.verify();
    assert!(!r.is_ok(), "verify passed an image a restore refuses: {r}");
    assert_eq!(r.bad_pages_total, 1, "{r}");
    assert_eq!(r.bad_pages[0].key, key);
    let text = r.to_string();
    assert!(
        text.contains("page 0:41") && text.contains("read from the parent snapshot"),
        "{text}"
    );
}

#[test]
fn an_absent_page_fails_verify() {
    let tmp = tempfile::tempdir().unwrap();
    chain(tmp.path());
    let g2 = tmp.path().join("g2");
    let img = Image::open(&g2).unwrap();
    let at = entry_at(&img, 43);
    drop(img);
    // The in-parent entry made "not stored" (block none, no flags, CRC 0).
    damage(&g2, FileKind::Index, |d| {
        d[at..at + 12].copy_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0])
    });
    let img = Image::open(&g2).unwrap();
    assert_eq!(img.locate(PageKey::new(0, 43)).unwrap(), PageState::Absent);
    let r = img.verify();
    assert!(!r.is_ok(), "{r}");
    assert!(r.to_string().contains("page 0:43 is absent"), "{r}");
}

#[test]
fn a_damaged_parent_block_is_named_with_its_image() {
    let tmp = tempfile::tempdir().unwrap();
    chain(tmp.path());
    let g0 = tmp.path().join("g0");
    let b = Image::open(&g0).unwrap().blocks()[1];
    // Block CRC not resealed: the parent's block itself is bad.
    let path = g0.join("memory.img");
    let mut d = fs::read(&path).unwrap();
    d[(b.payload_offset() + u64::from(b.payload_len()) / 2) as usize] ^= 0x10;
    fs::write(&path, d).unwrap();
    let r = Image::open(&tmp.path().join("g2")).unwrap().verify();
    assert_eq!(r.bad_blocks.len(), 1, "{r}");
    assert_eq!(r.bad_blocks[0].image, g0);
    assert_eq!(r.bad_blocks[0].index, 1, "{r}");
}

#[test]
fn hashes_bin_is_checked_by_its_crc_and_against_the_pages() {
    let tmp = tempfile::tempdir().unwrap();
    chain(tmp.path());
    let g2 = tmp.path().join("g2");
    let hashes = g2.join("hashes.bin");
    let good = fs::read(&hashes).unwrap();
    // 200 hashes flipped, as found: the body CRC fails.
    let mut d = good.clone();
    for p in 0..200usize {
        d[64 + 16 + p * 16] ^= 0x01;
    }
    fs::write(&hashes, &d).unwrap();
    let r = Image::open(&g2).unwrap().verify();
    assert!(!r.is_ok(), "{r}");
    assert!(
        r.other
            .iter()
            .any(|e| matches!(e, ReadError::BadCrc { file, .. } if file == &hashes)),
        "{r}"
    );
    // The same damage with the CRCs resealed: every hash is compared with
    // its page's bytes (stored, zero, and those read from the parents).
    reseal(FileKind::Hashes, &mut d);
    fs::write(&hashes, &d).unwrap();
    let r = Image::open(&g2).unwrap().verify();
    assert_eq!(r.bad_pages_total, 200, "{r}");
    assert!(r.to_string().contains("its hash is not the hash"), "{r}");
    fs::write(&hashes, &good).unwrap();
    assert!(Image::open(&g2).unwrap().verify().is_ok());
}
