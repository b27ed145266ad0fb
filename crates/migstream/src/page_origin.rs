//! Telling guest-written pages from linear-scan pages (§6).
//!
//! # The rule
//!
//! In a background snapshot QEMU saves every page of every non-ignored
//! block exactly once. Before each page it polls the userfaultfd for one
//! pending write fault; if there is one, the faulting page is saved next,
//! otherwise the linear scan continues: ascending offsets within a block,
//! blocks in the order of the RAM block list, wrapping from the last block
//! to the first, skipping pages already saved. After any saved page, the
//! scan continues from the page after it (§6.1).
//!
//! The reader replays that scan (§6.2). It keeps the set of pages seen and
//! a position `pos` (initially page 0 of the first listed block). For each
//! page record R, in stream order and across sections:
//!
//! * if R was already seen, it is [`PageOrigin::Resent`] (never happens in
//!   a background snapshot; precopy re-sends pages the guest dirtied, and
//!   the last copy wins, §5.1);
//! * else if every page from `pos` up to R (in scan order, wrapping) was
//!   already seen, R is where the scan would be: [`PageOrigin::Scan`];
//! * otherwise the scan would have saved an earlier page, so R was saved
//!   out of turn: [`PageOrigin::GuestWrite`];
//!
//! and then `pos` becomes the page after R.
//!
//! # Limits (§6.2)
//!
//! * A write fault on the very page the scan would save next looks like
//!   the scan: it is reported as `Scan`. (In the reference's experiment,
//!   §6.2, 736 of 737 written pages were found, with 0 false positives.)
//! * Pages the guest writes after the scan passed them never fault and are
//!   invisible in the stream. Because the scan resumes right after each
//!   faulted page, it can run just ahead of a guest that writes ascending
//!   addresses: in `tests/data/bgsnap-writer.mig.gz` 16 of the 129 pages
//!   the guest writes were saved that way, 1 was a fault on the scan's next
//!   page, and the other 112 were `GuestWrite` (and no page the guest does
//!   not write was).
//! * Only writes through QEMU's own mapping fault: writes by another
//!   process to a shared RAM file (e.g. under `/dev/shm`) are neither
//!   reported nor kept out of the snapshot
//!   (`tests/data/bgsnap-hostwrites.mig.gz`).
//! * RAM hotplug during the snapshot restarts QEMU's scan from the first
//!   block; the replay does not model it.
//! * Hugepage-backed blocks are saved a whole host page at a time; only the
//!   first target page of a faulted host page is reported as `GuestWrite`.
//! * In a precopy stream of a running VM there are no faults: first sends
//!   are `Scan` and later rounds `Resent`.
//! * With `x-ignore-shared`, the scan skips ignored (shared) blocks, which
//!   the stream does not mark. The replay then treats a block as skipped
//!   when a record lands on page 0 of a later block, none of whose pages
//!   was seen, and every page in between lies in blocks none of whose
//!   pages was seen either. A guest write to page 0 of such a block is
//!   then misreported as `Scan`.

use std::collections::BTreeMap;

/// Why a page is in the stream where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageOrigin {
    /// Saved by the linear scan: the page the scan would save next.
    Scan,
    /// Saved out of scan order, the first time: in a background snapshot,
    /// because the guest wrote it (a userfaultfd write-protect fault).
    GuestWrite,
    /// Saved again: the page was already in the stream (precopy dirty-page
    /// rounds; the last copy is the valid one).
    Resent,
}

/// A set of page numbers kept as disjoint, non-adjacent half-open runs.
/// Its size is the number of runs: one for a plain scan, one more per
/// island of out-of-order pages.
#[derive(Debug, Default)]
struct RunSet {
    /// start -> end (exclusive).
    runs: BTreeMap<u64, u64>,
    count: u64,
}

impl RunSet {
    /// The run containing `p`, as (start, end).
    fn run_containing(&self, p: u64) -> Option<(u64, u64)> {
        let (&s, &e) = self.runs.range(..=p).next_back()?;
        (p < e).then_some((s, e))
    }

    fn contains(&self, p: u64) -> bool {
        self.run_containing(p).is_some()
    }

    /// Adds `p` (which must not be in the set), merging with neighbours.
    fn insert(&mut self, p: u64) {
        self.count += 1;
        let before = self.runs.range(..p).next_back().map(|(&s, &e)| (s, e));
        let after_end = self.runs.get(&(p + 1)).copied();
        match (before, after_end) {
            (Some((s, e)), Some(ae)) if e == p => {
                self.runs.remove(&(p + 1));
                self.runs.insert(s, ae);
            }
            (Some((s, e)), None) if e == p => {
                self.runs.insert(s, p + 1);
            }
            (_, Some(ae)) => {
                self.runs.remove(&(p + 1));
                self.runs.insert(p, ae);
            }
            _ => {
                self.runs.insert(p, p + 1);
            }
        }
    }

    /// The first page at or after `p` (and before `end`) not in the set.
    fn first_missing(&self, p: u64, end: u64) -> Option<u64> {
        let p = self.run_containing(p).map_or(p, |(_, e)| e);
        (p < end).then_some(p)
    }
}

/// Replays QEMU's RAM scan to classify page records (see the module docs).
#[derive(Debug)]
pub(crate) struct ScanReplay {
    /// Global page number of each block's first page, plus the total at the end.
    block_starts: Vec<u64>,
    /// Pages seen so far, by global page number.
    seen: RunSet,
    /// Pages seen per block.
    seen_in_block: Vec<u64>,
    /// Blocks the scan skips (x-ignore-shared heuristic).
    skipped: Vec<bool>,
    /// Global page number where the scan continues.
    pos: u64,
    ignore_shared: bool,
}

impl ScanReplay {
    /// A replay over blocks with the given page counts, in list order.
    pub(crate) fn new(block_pages: impl IntoIterator<Item = u64>, ignore_shared: bool) -> Self {
        let mut block_starts = vec![0];
        for n in block_pages {
            let last = *block_starts.last().unwrap_or(&0);
            block_starts.push(last + n);
        }
        let blocks = block_starts.len() - 1;
        ScanReplay {
            block_starts,
            seen: RunSet::default(),
            seen_in_block: vec![0; blocks],
            skipped: vec![false; blocks],
            pos: 0,
            ignore_shared,
        }
    }

    fn total(&self) -> u64 {
        *self.block_starts.last().unwrap_or(&0)
    }

    /// The block holding global page `g` (< total).
    fn block_of(&self, g: u64) -> usize {
        self.block_starts.partition_point(|&s| s <= g) - 1
    }

    /// Whether every page in `[a, b)` was seen or lies in a skipped block;
    /// with `unseen_blocks_ok`, blocks with no page seen also pass and are
    /// collected in `unseen`.
    fn covered(&self, mut a: u64, b: u64, unseen_blocks_ok: bool, unseen: &mut Vec<usize>) -> bool {
        while a < b {
            let blk = self.block_of(a);
            if self.skipped[blk] || (unseen_blocks_ok && self.seen_in_block[blk] == 0) {
                if !self.skipped[blk] {
                    unseen.push(blk);
                }
                a = self.block_starts[blk + 1];
            } else if let Some((_, e)) = self.seen.run_containing(a) {
                a = e;
            } else {
                return false;
            }
        }
        true
    }

    /// `covered` over the cyclic range from `pos` to `g`.
    fn covered_cyclic(&self, g: u64, unseen_blocks_ok: bool, unseen: &mut Vec<usize>) -> bool {
        if self.pos <= g {
            self.covered(self.pos, g, unseen_blocks_ok, unseen)
        } else {
            self.covered(self.pos, self.total(), unseen_blocks_ok, unseen)
                && self.covered(0, g, unseen_blocks_ok, unseen)
        }
    }

    /// Classifies the record for page `page` of block `block` (both
    /// already checked to be in range) and records it as seen.
    pub(crate) fn classify(&mut self, block: usize, page: u64) -> PageOrigin {
        let g = self.block_starts[block] + page;
        let origin = if self.seen.contains(g) {
            PageOrigin::Resent
        } else {
            let mut unseen = Vec::new();
            let origin = if self.skipped[block] {
                // A block presumed skipped has a page after all.
                self.skipped[block] = false;
                PageOrigin::GuestWrite
            } else if self.covered_cyclic(g, false, &mut unseen) {
                PageOrigin::Scan
            } else if self.ignore_shared
                && page == 0
                && self.seen_in_block[block] == 0
                && self.covered_cyclic(g, true, &mut unseen)
            {
                for b in unseen {
                    self.skipped[b] = true;
                }
                PageOrigin::Scan
            } else {
                PageOrigin::GuestWrite
            };
            self.seen.insert(g);
            self.seen_in_block[block] += 1;
            origin
        };
        self.pos = if g + 1 == self.total() { 0 } else { g + 1 };
        origin
    }

    /// The first page never seen, as (block, page in block), ignoring
    /// blocks with no page seen when `allow_unseen_blocks`, and the number
    /// of such missing pages.
    pub(crate) fn missing(&self, allow_unseen_blocks: bool) -> Option<(usize, u64, u64)> {
        let mut first = None;
        let mut missing = 0;
        for blk in 0..self.seen_in_block.len() {
            let (start, end) = (self.block_starts[blk], self.block_starts[blk + 1]);
            let n = end - start;
            if self.seen_in_block[blk] == n || (allow_unseen_blocks && self.seen_in_block[blk] == 0)
            {
                continue;
            }
            missing += n - self.seen_in_block[blk];
            if first.is_none() {
                first = self
                    .seen
                    .first_missing(start, end)
                    .map(|g| (blk, g - start));
            }
        }
        first.map(|(b, p)| (b, p, missing))
    }

    /// Number of distinct pages seen.
    #[cfg(test)]
    fn seen_count(&self) -> u64 {
        self.seen.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PageOrigin::*;

    #[test]
    fn run_set_merges() {
        let mut s = RunSet::default();
        for p in [5, 7, 6, 1, 0, 3, 2, 4] {
            assert!(!s.contains(p));
            s.insert(p);
        }
        assert_eq!(s.runs.len(), 1);
        assert_eq!(s.runs.get(&0), Some(&8));
        assert_eq!(s.first_missing(0, 10), Some(8));
        assert_eq!(s.first_missing(0, 8), None);
    }

    #[test]
    fn linear_scan_is_scan() {
        let mut r = ScanReplay::new([4, 2], false);
        for (b, p) in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)] {
            assert_eq!(r.classify(b, p), Scan);
        }
        assert_eq!(r.missing(false), None);
        assert_eq!(r.classify(0, 2), Resent);
    }

    #[test]
    fn fault_then_continue_then_wrap() {
        // Blocks of 8 and 2 pages. Scan 0,1; fault at 5; scan continues 6,7,
        // block 1; wraps to 2,3,4.
        let mut r = ScanReplay::new([8, 2], false);
        let seq = [
            (0, 0, Scan),
            (0, 1, Scan),
            (0, 5, GuestWrite),
            (0, 6, Scan),
            (0, 7, Scan),
            (1, 0, Scan),
            (1, 1, Scan),
            (0, 2, Scan),
            (0, 3, Scan),
            (0, 4, Scan),
        ];
        for (b, p, o) in seq {
            assert_eq!(r.classify(b, p), o, "block {b} page {p}");
        }
        assert_eq!(r.seen_count(), 10);
        assert_eq!(r.missing(false), None);
    }

    #[test]
    fn fault_on_next_page_is_invisible() {
        let mut r = ScanReplay::new([4], false);
        assert_eq!(r.classify(0, 0), Scan);
        assert_eq!(r.classify(0, 1), Scan); // a fault, but where the scan was anyway
        assert_eq!(r.classify(0, 3), GuestWrite);
        assert_eq!(r.classify(0, 2), Scan); // wrap: 0,1 seen; 2 is next unseen
    }

    #[test]
    fn missing_pages_reported() {
        let mut r = ScanReplay::new([2, 3], false);
        r.classify(0, 0);
        r.classify(1, 1);
        assert_eq!(r.missing(false), Some((0, 1, 3)));
    }

    #[test]
    fn ignore_shared_skips_unseen_blocks() {
        // Block 0 (8 pages) ignored; blocks 1 and 2 sent in order.
        let mut r = ScanReplay::new([8, 2, 1], true);
        assert_eq!(r.classify(1, 0), Scan);
        assert_eq!(r.classify(1, 1), Scan);
        assert_eq!(r.classify(2, 0), Scan);
        assert_eq!(r.missing(true), None);
        assert_eq!(r.missing(false), Some((0, 0, 8)));
        // Without x-ignore-shared the same order is a guest write.
        let mut r = ScanReplay::new([8, 2, 1], false);
        assert_eq!(r.classify(1, 0), GuestWrite);
    }
}
