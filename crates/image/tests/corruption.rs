//! Damaged images: each kind of damage gives its specific error, never a panic.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::*;
use vmcsnap_image::{Image, PageKey, ReadError};

const DATA_FILES: [&str; 5] = [
    "memory.img",
    "pages.idx",
    "zero.bmp",
    "device.bin",
    "trace.bin",
];
const ALL_FILES: [&str; 6] = [
    "manifest",
    "memory.img",
    "pages.idx",
    "zero.bmp",
    "device.bin",
    "trace.bin",
];

struct Fixture {
    _tmp: tempfile::TempDir,
    good: PathBuf,
    n: std::cell::Cell<u32>,
}

impl Fixture {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let good = tmp.path().join("good");
        build(&good);
        Fixture {
            good,
            _tmp: tmp,
            n: 0.into(),
        }
    }

    /// A fresh copy of the good image, with `file` changed by `f`.
    fn damaged(&self, file: &str, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
        self.n.set(self.n.get() + 1);
        let dir = self._tmp.path().join(format!("copy{}", self.n.get()));
        copy_dir(&self.good, &dir);
        let path = dir.join(file);
        let mut data = fs::read(&path).unwrap();
        f(&mut data);
        fs::write(&path, data).unwrap();
        dir
    }
}

fn open_err(dir: &Path) -> ReadError {
    match Image::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn bad_magic_in_each_file() {
    let fx = Fixture::new();
    for file in ALL_FILES {
        let dir = fx.damaged(file, |d| d[..4].copy_from_slice(b"JUNK"));
        let e = open_err(&dir);
        assert!(
            matches!(&e, ReadError::BadMagic { file: f, .. } if f.ends_with(file)),
            "{file}: {e}"
        );
        assert!(e.to_string().contains("bad magic"), "{e}");
    }
}

#[test]
fn foreign_file_of_the_right_size() {
    let fx = Fixture::new();
    for file in DATA_FILES {
        let dir = fx.damaged(file, |d| {
            let mut r = Rng(0x1234_5678 + d.len() as u64);
            d.iter_mut().for_each(|b| *b = r.next() as u8);
        });
        assert!(
            matches!(open_err(&dir), ReadError::BadMagic { .. }),
            "{file}"
        );
    }
    // Foreign files of another size are still reported as foreign.
    for file in DATA_FILES {
        let dir = fx.damaged(file, |d| {
            *d = b"\x7fELF\x02\x01\x01\x00 not ours at all".to_vec()
        });
        assert!(
            matches!(open_err(&dir), ReadError::BadMagic { .. }),
            "{file}"
        );
    }
    let dir = fx.damaged("manifest", |d| *d = br#"{"not": "ours"}"#.to_vec());
    assert!(matches!(open_err(&dir), ReadError::BadMagic { .. }));
}

#[test]
fn unknown_major_version_in_each_file() {
    let fx = Fixture::new();
    for file in DATA_FILES {
        let dir = fx.damaged(file, |d| d[8] = 3);
        let e = open_err(&dir);
        match &e {
            ReadError::UnsupportedVersion {
                found, supported, ..
            } => {
                assert_eq!((found.major, supported.major), (3, 2));
            }
            _ => panic!("{file}: {e}"),
        }
        assert!(e.to_string().contains("3.0 is not supported"), "{e}");
    }
    let dir = fx.damaged("manifest", |d| d[17] = b'3');
    assert!(matches!(
        open_err(&dir),
        ReadError::UnsupportedVersion { .. }
    ));
}

#[test]
fn newer_minor_version_is_accepted() {
    let fx = Fixture::new();
    // A manifest from version 2.9 with a field this build does not know.
    let dir = fx.damaged("manifest", |d| {
        let nl = d.iter().position(|&c| c == b'\n').unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(&d[nl + 1..]).unwrap();
        v["future_field"] = serde_json::json!({"x": 1});
        v["metrics"]["new_metric"] = serde_json::json!(5);
        let body = serde_json::to_vec(&v).unwrap();
        let head = format!(
            "VMCSNAP-MANIFEST 2.9 len={} crc32c={:08x}\n",
            body.len(),
            crc32c::crc32c(&body)
        );
        *d = [head.into_bytes(), body].concat();
    });
    let img = Image::open(&dir).unwrap();
    assert_eq!(img.version().minor, 9);
    assert_eq!(img.manifest().metrics.other["new_metric"], 5);
}

#[test]
fn bad_crc_in_each_file() {
    let fx = Fixture::new();
    // Header CRCs (byte 20 is in the image id, covered by the header CRC).
    for file in DATA_FILES {
        let dir = fx.damaged(file, |d| d[20] ^= 0x40);
        let e = open_err(&dir);
        assert!(
            matches!(&e, ReadError::BadCrc { what, offset: 0, .. } if what == "file header"),
            "{file}: {e}"
        );
    }
    // Body CRCs of the files read at open.
    for file in ["pages.idx", "zero.bmp", "trace.bin"] {
        let dir = fx.damaged(file, |d| *d.last_mut().unwrap() ^= 1);
        let e = open_err(&dir);
        assert!(
            matches!(&e, ReadError::BadCrc { what, offset: 64, block: None, .. } if what == "body"),
            "{file}: {e}"
        );
    }
    let dir = fx.damaged("manifest", |d| {
        let i = d.len() - 10;
        d[i] ^= 1;
    });
    assert!(matches!(open_err(&dir), ReadError::BadCrc { .. }));
    // The device state is checked when read, and by verify.
    let dir = fx.damaged("device.bin", |d| *d.last_mut().unwrap() ^= 1);
    let img = Image::open(&dir).unwrap();
    assert!(matches!(img.device_state(), Err(ReadError::BadCrc { .. })));
    let report = img.verify();
    assert!(
        report.bad_blocks.is_empty() && report.other.len() == 1,
        "{report}"
    );
}

#[test]
fn verify_names_the_corrupted_block() {
    let fx = Fixture::new();
    let img = Image::open(&fx.good).unwrap();
    let target = img.blocks()[3];
    let other = img.blocks()[5];
    drop(img);
    // One byte in block 3's payload and one in block 5's page list.
    let dir = fx.damaged("memory.img", |d| {
        d[(target.payload_offset() + 5000) as usize] ^= 0x01;
        d[(other.offset + 40) as usize] ^= 0x80;
    });
    let img = Image::open(&dir).unwrap();
    let report = img.verify();
    assert!(!report.is_ok());
    let named: Vec<(u32, u64)> = report
        .bad_blocks
        .iter()
        .map(|b| (b.index, b.offset))
        .collect();
    assert_eq!(named, vec![(3, target.offset), (5, other.offset)]);
    for b in &report.bad_blocks {
        assert!(
            matches!(b.error, ReadError::BadCrc { block: Some(i), .. } if i == b.index),
            "{}",
            b.error
        );
    }
    let text = report.to_string();
    assert!(
        text.contains("block 3 at offset") && text.contains("block 5 at offset"),
        "{text}"
    );
    assert_eq!(report.blocks_checked as usize, img.blocks().len());
    // Reading block 3 fails with its number; the page itself fails its page CRC.
    assert_eq!(img.read_block(3).unwrap_err().block(), Some(3));
    let block = fx_block_pages(&fx.good, 3);
    let mut buf = vec![0u8; PS];
    let slot = 5000 / PS;
    let e = img.read_page(block[slot], &mut buf).unwrap_err();
    assert!(matches!(e, ReadError::BadCrc { block: Some(3), .. }), "{e}");
    // Pages of good blocks still read.
    img.read_page(fx_block_pages(&fx.good, 0)[0], &mut buf)
        .unwrap();
}

fn fx_block_pages(dir: &Path, i: u32) -> Vec<PageKey> {
    Image::open(dir).unwrap().read_block(i).unwrap().pages
}

#[test]
fn truncation_of_each_file_is_reported() {
    let fx = Fixture::new();
    for file in ALL_FILES {
        let dir = fx.damaged(file, |d| d.truncate(d.len() - 1));
        let e = open_err(&dir);
        match &e {
            ReadError::Truncated {
                file: f,
                expected,
                found,
            } => {
                assert!(f.ends_with(file), "{e}");
                assert_eq!(*expected, *found + 1, "{e}");
            }
            _ => panic!("{file}: {e}"),
        }
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}

#[test]
fn truncation_at_many_offsets() {
    let fx = Fixture::new();
    for file in ALL_FILES {
        let len = fs::metadata(fx.good.join(file)).unwrap().len() as usize;
        let step = (len / 97).max(1);
        let mut cuts: Vec<usize> = (0..len).step_by(step).collect();
        cuts.extend([1, 7, 8, 15, 16, 63, 64, 65, len - 1]);
        for cut in cuts.into_iter().filter(|&c| c < len) {
            let dir = fx.damaged(file, |d| d.truncate(cut));
            let e = open_err(&dir);
            assert!(
                matches!(e, ReadError::Truncated { .. }),
                "{file} cut at {cut}: {e}"
            );
            fs::remove_dir_all(&dir).unwrap();
        }
    }
}

#[test]
fn trailing_garbage_and_missing_files() {
    let fx = Fixture::new();
    for file in ALL_FILES {
        let dir = fx.damaged(file, |d| d.extend_from_slice(b"extra"));
        assert!(
            matches!(open_err(&dir), ReadError::Corrupt { .. }),
            "{file}"
        );
    }
    for file in ALL_FILES {
        let dir = fx.damaged(file, |_| {});
        fs::remove_file(dir.join(file)).unwrap();
        let e = open_err(&dir);
        assert!(
            matches!(&e, ReadError::Missing { file: f } if f.ends_with(file)),
            "{file}: {e}"
        );
    }
    let e = open_err(&fx._tmp.path().join("nope"));
    assert!(matches!(e, ReadError::Missing { .. }));
}

#[test]
fn files_from_another_snapshot_are_rejected() {
    let fx = Fixture::new();
    let other = fx._tmp.path().join("other");
    build(&other);
    // Same content, different image id: every file but the manifest.
    let dir = fx.damaged("pages.idx", |d| {
        *d = fs::read(other.join("pages.idx")).unwrap()
    });
    let e = open_err(&dir);
    assert!(e.to_string().contains("different snapshot"), "{e}");
}
