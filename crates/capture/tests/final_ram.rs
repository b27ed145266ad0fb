//! Pre-copy captures checked against the guest's RAM at the switch-over
//! (`CaptureOptions::final_ram`): a write the stream missed is taken from
//! RAM, RAM that changes during the check or cannot be matched to the
//! stream fails the capture and leaves nothing.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::encoder::{page_of, Encoder, PAGE};
use common::{assert_nothing_left, capture_bytes, check_pages, Expect};
use vmcsnap_capture::ram_check::hash_pages;
use vmcsnap_capture::{
    metric, CaptureError, CaptureMode, CaptureOptions, FinalRam, FinalRamCheck, FinalRamSource,
    RamCheckReport,
};
use vmcsnap_image::Image;

const PAGES: u64 = 8;

/// A pre-copy stream of "mem" (8 pages) and "rom" (1 page): a first round,
/// then page 3 again; the last copies are `page_of(1, p)` except page 3
/// (`page_of(2, 3)`) and page 6 (zero).
fn stream() -> Vec<u8> {
    let mut e = Encoder::new();
    e.config("microvm")
        .ram_setup(2, &[("mem", PAGES * PAGE), ("rom", PAGE)]);
    e.part(2);
    for p in 0..PAGES {
        if p == 6 {
            e.zero("mem", p);
        } else {
            e.page("mem", p, &page_of(1, p as u32));
        }
    }
    e.page("rom", 0, &page_of(9, 0));
    e.eos(2).part(2);
    e.page("mem", 3, &page_of(2, 3));
    e.eos(2).end_section(2);
    e.eos(2);
    e.finish();
    e.buf
}

/// The guest's RAM: what the stream's last copies say, except where
/// `missed` says otherwise (writes the stream did not see).
fn ram(missed: &[(u64, Option<Vec<u8>>)]) -> Vec<Option<Vec<u8>>> {
    let mut pages: Vec<Option<Vec<u8>>> = (0..PAGES)
        .map(|p| match p {
            3 => Some(page_of(2, 3)),
            6 => None,
            _ => Some(page_of(1, p as u32)),
        })
        .collect();
    for (p, d) in missed {
        pages[*p as usize] = d.clone();
    }
    pages
}

fn write_ram(path: &Path, pages: &[Option<Vec<u8>>]) {
    let mut f = File::create(path).unwrap();
    for p in pages {
        f.write_all(p.as_deref().unwrap_or(&[0u8; PAGE as usize]))
            .unwrap();
    }
}

/// A source that hashes `path` when asked (or fails with `fail`), and
/// records the outcome it is told.
struct Source {
    path: std::path::PathBuf,
    block: String,
    /// Written to the RAM file after hashing (the guest resumed early).
    change_after_hash: Option<u64>,
    fail: Option<String>,
    outcome: Mutex<Option<Result<RamCheckReport, String>>>,
}

impl FinalRamSource for Source {
    fn final_ram(&self) -> Result<FinalRam, String> {
        if let Some(e) = &self.fail {
            return Err(e.clone());
        }
        let file = File::open(&self.path).map_err(|e| e.to_string())?;
        let len = file.metadata().unwrap().len();
        let hashes = hash_pages(&file, 0, len, PAGE as usize, 3).map_err(|e| e.to_string())?;
        if let Some(p) = self.change_after_hash {
            let f = File::options().write(true).open(&self.path).unwrap();
            std::os::unix::fs::FileExt::write_all_at(&f, &page_of(7, 7), p * PAGE).unwrap();
        }
        Ok(FinalRam {
            block: self.block.clone(),
            file,
            file_offset: 0,
            hashes,
        })
    }

    fn checked(&self, outcome: Result<&RamCheckReport, &CaptureError>) {
        *self.outcome.lock().unwrap() = Some(outcome.cloned().map_err(|e| e.to_string()));
    }
}

fn source(path: &Path) -> Arc<Source> {
    Arc::new(Source {
        path: path.into(),
        block: "mem".into(),
        change_after_hash: None,
        fail: None,
        outcome: Mutex::new(None),
    })
}

fn opts(src: Option<Arc<Source>>) -> CaptureOptions {
    let mut o = CaptureOptions::new(CaptureMode::Precopy, "vm-a");
    o.qemu_version = "7.2.22".into();
    o.final_ram = src.map(|s| FinalRamCheck(s as Arc<dyn FinalRamSource>));
    o
}

fn expect(pages: &[Option<Vec<u8>>]) -> BTreeMap<(u32, u32), Expect> {
    let mut want: BTreeMap<_, _> = pages
        .iter()
        .enumerate()
        .map(|(p, d)| {
            let e = d.clone().map_or(Expect::Zero, Expect::Data);
            ((0, p as u32), e)
        })
        .collect();
    want.insert((1, 0), Expect::Data(page_of(9, 0)));
    want
}

#[test]
fn writes_the_stream_missed_are_taken_from_the_paused_guests_ram() {
    let dir = tempfile::tempdir().unwrap();
    let ram_file = dir.path().join("ram");
    // Page 1 written again, page 6 (zero in the stream) written, page 3
    // cleared: none of it re-sent, as QEMU's dirty tracking under TCG can do.
    let pages = ram(&[
        (1, Some(page_of(5, 1))),
        (6, Some(page_of(5, 6))),
        (3, None),
    ]);
    write_ram(&ram_file, &pages);
    let root = dir.path().join("snaps");
    std::fs::create_dir(&root).unwrap();

    // Without the check the image holds the stream's stale copies.
    let plain = capture_bytes(&stream(), &root, "plain", opts(None))
        .unwrap()
        .commit()
        .unwrap();
    let stale = Image::open(&plain.path).unwrap();
    let mut buf = vec![0u8; PAGE as usize];
    stale
        .read_page(vmcsnap_image::PageKey::new(0, 1), &mut buf)
        .unwrap();
    assert_eq!(buf, page_of(1, 1));
    assert!(!plain
        .manifest
        .metrics
        .other
        .contains_key(metric::PRECOPY_PAGES_PATCHED));

    let src = source(&ram_file);
    let c = capture_bytes(&stream(), &root, "checked", opts(Some(src.clone())))
        .unwrap()
        .commit()
        .unwrap();
    check_pages(&Image::open(&c.path).unwrap(), &expect(&pages));
    let other = &c.manifest.metrics.other;
    assert_eq!(other[metric::PRECOPY_PAGES_CHECKED], PAGES);
    assert_eq!(other[metric::PRECOPY_PAGES_PATCHED], 3);
    let told = src.outcome.lock().unwrap().clone().expect("told");
    assert_eq!(
        told.unwrap(),
        RamCheckReport {
            pages_checked: PAGES,
            pages_patched: 3,
            first_patched: vec![1, 3, 6],
        }
    );
}

#[test]
fn a_stream_that_matches_the_ram_is_left_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let ram_file = dir.path().join("ram");
    let pages = ram(&[]);
    write_ram(&ram_file, &pages);
    let root = dir.path().join("snaps");
    std::fs::create_dir(&root).unwrap();
    let c = capture_bytes(&stream(), &root, "s", opts(Some(source(&ram_file))))
        .unwrap()
        .commit()
        .unwrap();
    check_pages(&Image::open(&c.path).unwrap(), &expect(&pages));
    assert_eq!(c.manifest.metrics.other[metric::PRECOPY_PAGES_PATCHED], 0);
}

/// Runs a capture with `src` that must fail; returns its message and what
/// the source was told.
fn failing(src: Source, root: &Path) -> (String, String) {
    let src = Arc::new(src);
    let err = capture_bytes(&stream(), root, "s", opts(Some(src.clone())))
        .expect_err("the capture must fail")
        .to_string();
    assert_nothing_left(root);
    let told = src.outcome.lock().unwrap().clone().expect("told");
    (err, told.expect_err("told of the failure"))
}

#[test]
fn ram_that_cannot_be_trusted_fails_the_capture_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ram_file = dir.path().join("ram");
    let root = dir.path().join("snaps");
    std::fs::create_dir(&root).unwrap();
    let base = || Source {
        path: ram_file.clone(),
        block: "mem".into(),
        change_after_hash: None,
        fail: None,
        outcome: Mutex::new(None),
    };

    // RAM written after it was hashed (the guest was not really paused).
    write_ram(&ram_file, &ram(&[(2, Some(page_of(5, 2)))]));
    let (err, told) = failing(
        Source {
            change_after_hash: Some(2),
            ..base()
        },
        &root,
    );
    assert!(err.contains("page 2 of RAM block \"mem\" changed"), "{err}");
    assert_eq!(err, told);

    // No such block in the stream.
    let (err, _) = failing(
        Source {
            block: "pc.ram".into(),
            ..base()
        },
        &root,
    );
    assert!(
        err.contains("no RAM block \"pc.ram\"") && err.contains("no snapshot was written"),
        "{err}"
    );

    // A RAM file of another size.
    write_ram(&ram_file, &ram(&[])[..5]);
    let (err, _) = failing(base(), &root);
    assert!(err.contains("8 pages in the stream but 5"), "{err}");

    // The RAM could not be hashed.
    let (err, _) = failing(
        Source {
            fail: Some("cannot open /dev/shm/x".into()),
            ..base()
        },
        &root,
    );
    assert!(err.contains("cannot open /dev/shm/x"), "{err}");
}

#[test]
fn hash_pages_splits_the_work_and_refuses_partial_pages() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f");
    let pages: Vec<Option<Vec<u8>>> = (0..37).map(|i| Some(page_of(3, i))).collect();
    write_ram(&p, &pages);
    let f = File::open(&p).unwrap();
    let want: Vec<u128> = pages
        .iter()
        .map(|d| vmcsnap_image::hashes::page_hash(d.as_deref().unwrap()))
        .collect();
    for threads in [1, 2, 5, 64] {
        assert_eq!(
            hash_pages(&f, 0, 37 * PAGE, PAGE as usize, threads).unwrap(),
            want
        );
    }
    assert_eq!(
        hash_pages(&f, 2 * PAGE, 3 * PAGE, PAGE as usize, 2).unwrap(),
        want[2..5]
    );
    assert!(hash_pages(&f, 0, PAGE + 1, PAGE as usize, 1).is_err());
    assert!(hash_pages(&f, 0, 38 * PAGE, PAGE as usize, 1).is_err());
}
