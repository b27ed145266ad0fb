//! Test helpers: a stream encoder for synthetic streams, the real-QEMU
//! harness, and checks on images and snapshot roots.
#![allow(dead_code)]

pub mod encoder;
pub mod qemu;

use std::collections::BTreeMap;
use std::path::Path;

use vmcsnap_capture::{capture, CaptureError, CaptureOptions, CaptureProgress, Captured};
use vmcsnap_image::{list_snapshots, Image, PageKey, PageState};

/// `capture` from an in-memory stream into `root/name`.
pub fn capture_bytes(
    stream: &[u8],
    root: &Path,
    name: &str,
    opts: CaptureOptions,
) -> Result<Captured, CaptureError> {
    capture(
        stream,
        &root.join(name),
        opts,
        &mut |_: &CaptureProgress| {},
    )
}

/// What a page of an image must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Stored with these bytes (never all zero).
    Data(Vec<u8>),
    /// In the zero bitmap.
    Zero,
}

/// Checks that every page of `img` is exactly as `expected` says (every
/// page of every RAM block must be in `expected`), and that the image
/// verifies.
pub fn check_pages(img: &Image, expected: &BTreeMap<(u32, u32), Expect>) {
    let ps = img.page_size();
    let mut buf = vec![0u8; ps];
    let mut n = 0;
    for rb in 0..img.ram_blocks().len() as u32 {
        for p in 0..img.ram_block_pages(rb) {
            let want = expected
                .get(&(rb, p))
                .unwrap_or_else(|| panic!("test bug: no expectation for page {rb}:{p}"));
            let state = img.read_page(PageKey::new(rb, p), &mut buf).unwrap();
            match (want, state) {
                (Expect::Data(d), PageState::Stored(_)) => {
                    assert!(buf == *d, "page {rb}:{p} content differs")
                }
                (Expect::Zero, PageState::Zero) => {}
                (w, s) => panic!("page {rb}:{p}: expected {w:?}, image has {s:?}"),
            }
            n += 1;
        }
    }
    assert_eq!(n, expected.len(), "expectations for pages the image lacks");
    let report = img.verify();
    assert!(report.is_ok(), "image does not verify: {report:?}");
}

/// Asserts that a failed capture left nothing under `root`: no valid
/// snapshot, and no directory at all (the temporary one was removed).
pub fn assert_nothing_left(root: &Path) {
    let listed = list_snapshots(root).unwrap();
    assert!(
        listed.iter().all(|e| !e.is_valid()),
        "a valid snapshot after a failed capture: {listed:?}"
    );
    let left: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        left.is_empty(),
        "left behind under {}: {left:?}",
        root.display()
    );
}
