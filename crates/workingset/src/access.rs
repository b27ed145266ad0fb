//! Pages the guest accessed during a snapshot, reads included, as the host
//! kernel reported them (DAMON's virtual-address monitoring of QEMU's
//! guest-RAM mapping).
//!
//! Stock QEMU shows vmcsnap only the pages the guest *writes* during a
//! background snapshot. Where the host kernel can tell which pages were
//! accessed, the agent stores them next to the image as
//! `<snapshot>/access/accessed.json` ([`FILE`]), and the restore merges them
//! into the FAFL queue after the written pages. The image format ignores
//! the `access/` directory; a snapshot without the file (no DAMON on the
//! host) or with a file that does not parse restores from the written
//! pages alone and says why.
//!
//! ```text
//! { "format": 1, "source": "damon",
//!   "runs": [ { "ram_block": 0, "first_page": 4096, "pages": 8192, "first_seen_ms": 2100 }, ... ] }
//! ```
//!
//! Runs are in order of first detection (`first_seen_ms`, ms since the
//! snapshot point, never decreasing); a run never crosses the end of its
//! RAM block, and a page is in one run at most (so a file can never name
//! more pages than the VM has).

use serde::{Deserialize, Serialize};
use vmcsnap_image::PageKey;

/// The file, relative to the snapshot directory.
pub const FILE: &str = "access/accessed.json";
/// The format version this code writes and reads.
pub const FORMAT: u32 = 1;

/// One run of accessed pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessRun {
    /// RAM block (index in the image's block table).
    pub ram_block: u32,
    /// First page of the run.
    pub first_page: u32,
    /// Pages in the run (at least 1).
    pub pages: u32,
    /// When the run was first seen accessed, ms after the snapshot point.
    pub first_seen_ms: u32,
}

impl AccessRun {
    /// A run of `pages` pages of RAM block `ram_block` from `first_page`,
    /// first seen `first_seen_ms` after the snapshot point.
    pub const fn new(ram_block: u32, first_page: u32, pages: u32, first_seen_ms: u32) -> Self {
        AccessRun {
            ram_block,
            first_page,
            pages,
            first_seen_ms,
        }
    }
}

/// The accessed pages of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessedPages {
    /// [`FORMAT`].
    pub format: u32,
    /// What reported the accesses (`"damon"`).
    pub source: String,
    /// The runs, in order of first detection.
    pub runs: Vec<AccessRun>,
}

/// Access data that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccessError {
    /// Not JSON of the expected shape.
    #[error("{FILE} does not parse ({0}): it is ignored; take a new snapshot to record access data again")]
    Parse(String),
    /// Another format version.
    #[error("{FILE} has format {0}, this vmcsnap reads format {FORMAT}: it is ignored")]
    Format(u32),
    /// A run outside the VM's RAM or out of order.
    #[error(
        "{FILE} run {index} ({detail}): the file does not belong to this snapshot and is ignored"
    )]
    BadRun {
        /// Index of the run.
        index: usize,
        /// What is wrong.
        detail: String,
    },
}

impl AccessedPages {
    /// Parses and checks `bytes` against the snapshot's RAM blocks
    /// (`block_pages[b]` pages in block `b`).
    pub fn parse(bytes: &[u8], block_pages: &[u32]) -> Result<Self, AccessError> {
        let a: AccessedPages =
            serde_json::from_slice(bytes).map_err(|e| AccessError::Parse(e.to_string()))?;
        if a.format != FORMAT {
            return Err(AccessError::Format(a.format));
        }
        let mut last_ms = 0;
        let mut taken: Vec<Vec<bool>> = Vec::new();
        for (index, r) in a.runs.iter().enumerate() {
            let bad = |detail: String| AccessError::BadRun { index, detail };
            let Some(&n) = block_pages.get(r.ram_block as usize) else {
                return Err(bad(format!("RAM block {} does not exist", r.ram_block)));
            };
            let end = u64::from(r.first_page) + u64::from(r.pages);
            if r.pages == 0 || end > u64::from(n) {
                return Err(bad(format!(
                    "pages {}+{} of a block of {n} pages",
                    r.first_page, r.pages
                )));
            }
            if r.first_seen_ms < last_ms {
                return Err(bad(format!(
                    "first seen at {} ms, after a run seen at {last_ms} ms",
                    r.first_seen_ms
                )));
            }
            last_ms = r.first_seen_ms;
            if taken.len() <= r.ram_block as usize {
                taken.resize(r.ram_block as usize + 1, Vec::new());
            }
            let bits = &mut taken[r.ram_block as usize];
            if bits.is_empty() {
                bits.resize(n as usize, false);
            }
            for p in r.first_page..r.first_page + r.pages {
                if std::mem::replace(&mut bits[p as usize], true) {
                    return Err(bad(format!("page {p} is in an earlier run too")));
                }
            }
        }
        Ok(a)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Every accessed page, in order of first detection (address order
    /// within a run). Of a parsed file, each page once.
    pub fn pages(&self) -> Vec<PageKey> {
        self.runs
            .iter()
            .flat_map(|r| {
                (r.first_page..r.first_page + r.pages).map(|p| PageKey::new(r.ram_block, p))
            })
            .collect()
    }
}

/// Fuzzing support: what the restore does with an access file's bytes
/// (parse against `block_pages`, then list the pages). Never panics; the
/// work is bounded by the pages the VM has.
pub fn exercise(bytes: &[u8], block_pages: &[u32]) -> Option<usize> {
    let a = AccessedPages::parse(bytes, block_pages).ok()?;
    let pages = a.pages();
    let total: u64 = block_pages.iter().map(|&n| u64::from(n)).sum();
    assert!(pages.len() as u64 <= total, "more pages than the VM has");
    assert_eq!(
        AccessedPages::parse(&a.to_bytes(), block_pages).as_ref(),
        Ok(&a)
    );
    Some(pages.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(b: u32, p: u32, n: u32, ms: u32) -> AccessRun {
        AccessRun::new(b, p, n, ms)
    }

    #[test]
    fn round_trip_and_pages_in_detection_order() {
        let a = AccessedPages {
            format: FORMAT,
            source: "damon".into(),
            runs: vec![run(0, 10, 2, 0), run(1, 0, 1, 5), run(0, 8, 2, 7)],
        };
        let back = AccessedPages::parse(&a.to_bytes(), &[16, 1]).unwrap();
        assert_eq!(back, a);
        let keys: Vec<_> = back.pages().iter().map(|k| (k.ram_block, k.page)).collect();
        assert_eq!(keys, vec![(0, 10), (0, 11), (1, 0), (0, 8), (0, 9)]);
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let ok = |runs| AccessedPages {
            format: FORMAT,
            source: "damon".into(),
            runs,
        };
        assert!(matches!(
            AccessedPages::parse(b"{not json", &[16]),
            Err(AccessError::Parse(_))
        ));
        let mut other = ok(vec![]);
        other.format = 9;
        assert_eq!(
            AccessedPages::parse(&other.to_bytes(), &[16]),
            Err(AccessError::Format(9))
        );
        for (runs, what) in [
            (vec![run(2, 0, 1, 0)], "does not exist"),
            (vec![run(0, 15, 2, 0)], "of a block of 16"),
            (vec![run(0, 0, 0, 0)], "of a block of 16"),
            (vec![run(0, 0, 1, 9), run(0, 1, 1, 3)], "after a run"),
            (
                vec![run(0, 0, 4, 1), run(0, 3, 2, 3)],
                "page 3 is in an earlier run",
            ),
        ] {
            let e = AccessedPages::parse(&ok(runs).to_bytes(), &[16]).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
    }

    /// The fuzz target's code path without nightly: mutated valid files.
    #[test]
    fn mutated_files_never_panic() {
        let a = AccessedPages {
            format: FORMAT,
            source: "damon".into(),
            runs: vec![run(0, 10, 2, 0), run(1, 0, 1, 5), run(0, 0, 4, 7)],
        };
        let base = a.to_bytes();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut ok = 0;
        for _ in 0..20_000 {
            let mut b = base.clone();
            for _ in 0..1 + (x % 4) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let i = (x >> 33) as usize % b.len();
                b[i] = b"0123456789,:[]{}\"-9"[(x >> 20) as usize % 18];
            }
            ok += usize::from(exercise(&b, &[16, 4]).is_some());
        }
        assert!(exercise(&base, &[16, 4]).is_some());
        // Random runs: some valid, some overlapping or out of range.
        for _ in 0..20_000 {
            let runs = (0..(x % 5))
                .map(|i| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    run(
                        (x >> 60) as u32 % 3,
                        (x >> 40) as u32 % 18,
                        (x >> 20) as u32 % 6,
                        i as u32,
                    )
                })
                .collect();
            let b = AccessedPages { runs, ..a.clone() }.to_bytes();
            ok += usize::from(exercise(&b, &[16, 4]).is_some());
        }
        assert!(ok > 1000, "{ok} valid");
    }
}
