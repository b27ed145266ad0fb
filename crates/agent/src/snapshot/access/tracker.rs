//! [`Tracker`]: when each page of QEMU's guest-RAM mapping was first seen
//! accessed, from successive DAMON readings, and the access-data file's
//! runs from that.

use std::collections::BTreeMap;
use std::time::Instant;

use vmcsnap_damon::Region;
use vmcsnap_image::RamBlock;
use vmcsnap_workingset::access::AccessRun;

use super::PAGE;

/// When each page of the mapping was first seen accessed: runs of pages
/// (offsets from the mapping's start, in pages) in order of detection.
#[derive(Debug)]
pub(crate) struct Tracker {
    start: u64,
    end: u64,
    /// Pages seen so far: start page → end page (exclusive), disjoint.
    pub(super) seen: BTreeMap<u64, u64>,
    /// (first page, end page, when), in order of detection.
    found: Vec<(u64, u64, Instant)>,
}

impl Tracker {
    /// A tracker of the mapping `[start, end)`.
    pub(crate) fn new(start: u64, end: u64) -> Tracker {
        Tracker {
            start,
            end,
            seen: BTreeMap::new(),
            found: Vec::new(),
        }
    }

    /// Records the pages of `regions` (accessed ones, clipped to the
    /// mapping) not seen before, as seen at `at`.
    pub(crate) fn observe(&mut self, regions: &[Region], at: Instant) {
        let len = self.end.saturating_sub(self.start);
        let mut sorted: Vec<&Region> = regions.iter().filter(|r| r.nr_accesses > 0).collect();
        sorted.sort_by_key(|r| r.start);
        for r in sorted {
            let lo = r.start.max(self.start).saturating_sub(self.start);
            let hi = r.end.min(self.end).saturating_sub(self.start).min(len);
            if lo >= hi {
                continue;
            }
            let (first, end) = (lo / PAGE, hi.div_ceil(PAGE));
            for (a, b) in self.unseen(first, end) {
                self.seen.insert(a, b);
                match self.found.last_mut() {
                    Some(last) if last.1 == a && last.2 == at => last.1 = b,
                    _ => self.found.push((a, b, at)),
                }
            }
            self.merge_seen();
        }
    }

    /// The parts of `[first, end)` not in `seen`.
    pub(super) fn unseen(&self, first: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = first;
        // A seen interval starting before `first` may cover its start.
        if let Some((_, &e)) = self.seen.range(..=first).next_back() {
            at = at.max(e);
        }
        for (&s, &e) in self.seen.range(first..end) {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    fn merge_seen(&mut self) {
        let mut merged: BTreeMap<u64, u64> = BTreeMap::new();
        let mut cur: Option<(u64, u64)> = None;
        for (&s, &e) in &self.seen {
            cur = match cur {
                Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
                Some(c) => {
                    merged.insert(c.0, c.1);
                    Some((s, e))
                }
                None => Some((s, e)),
            };
        }
        if let Some(c) = cur {
            merged.insert(c.0, c.1);
        }
        self.seen = merged;
    }

    /// The runs for the file: pages of the RAM block that the mapping
    /// holds (named `mem`, the memory backend; else block 0), clipped to
    /// its length, with ms after `point` (0 for pages seen before it).
    /// Adjacent pages seen at the same time make one run.
    pub(crate) fn runs(&self, point: Instant, blocks: &[RamBlock]) -> Vec<AccessRun> {
        let block = blocks.iter().position(|b| b.name == "mem").unwrap_or(0);
        let Some(b) = blocks.get(block) else {
            return Vec::new();
        };
        let block_pages = b.used_length / PAGE;
        let mut out: Vec<AccessRun> = Vec::new();
        for &(first, end, at) in &self.found {
            let end = end.min(block_pages);
            let ms = at.saturating_duration_since(point).as_millis();
            let ms = u32::try_from(ms).unwrap_or(u32::MAX);
            let mut p = first;
            while p < end {
                let n = (end - p).min(u64::from(u32::MAX));
                let (Ok(first_page), Ok(pages)) = (u32::try_from(p), u32::try_from(n)) else {
                    break;
                };
                match out.last_mut() {
                    Some(l)
                        if l.first_seen_ms == ms
                            && u64::from(l.first_page) + u64::from(l.pages) == p
                            && u64::from(l.pages) + n <= u64::from(u32::MAX) =>
                    {
                        l.pages += pages;
                    }
                    _ => out.push(AccessRun {
                        ram_block: block as u32,
                        first_page,
                        pages,
                        first_seen_ms: ms,
                    }),
                }
                p += n;
            }
        }
        out
    }
}
