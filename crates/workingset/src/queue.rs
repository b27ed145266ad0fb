//! The first-access-first-load (FAFL) queue.
//!
//! HotRestore's queue is the order in which the guest touched pages after
//! the snapshot point. vmcsnap records two such orders:
//!
//! * at snapshot time, the pages the guest **wrote** during the full
//!   snapshot (copy-on-write faults, the image's `fafl` trace);
//! * at restore time, the pages the restored guest **faulted on**, reads
//!   included (the demand requests QEMU sent; stored with the snapshot as
//!   the learned trace of the latest restore).
//!
//! The learned order is the guest's real first-access order after the
//! restore point, but it only holds pages that were *not* loaded before
//! the guest started (those never fault). So the merged queue is: the
//! working set that restore loaded up front (a prefix of the queue it used,
//! its order unknown to us and kept), then the pages it faulted on in fault
//! order, then the rest of the snapshot-time queue. Each page appears once.

use std::collections::HashSet;

use vmcsnap_image::PageKey;

/// The FAFL queue: `snapshot_writes`, improved by what an earlier restore
/// learned. `learned` is `(preloaded, faults)`: how many pages of the queue
/// that restore loaded before the guest started, and the pages it faulted
/// on, in order.
pub fn fafl_queue(
    snapshot_writes: &[PageKey],
    learned: Option<(&[PageKey], &[PageKey])>,
) -> Vec<PageKey> {
    let mut seen = HashSet::with_capacity(snapshot_writes.len());
    let mut out = Vec::with_capacity(snapshot_writes.len());
    let mut push = |k: PageKey, out: &mut Vec<PageKey>| {
        if seen.insert(k) {
            out.push(k);
        }
    };
    if let Some((preloaded, faults)) = learned {
        for &k in preloaded {
            push(k, &mut out);
        }
        for &k in faults {
            push(k, &mut out);
        }
    }
    for &k in snapshot_writes {
        push(k, &mut out);
    }
    out
}

/// Grows `queue` to `target` pages with pages near those already in it,
/// for hosts that cannot tell which pages the guest reads: a guest uses
/// memory in runs (the rest of a buffer it wrote to is likely read too),
/// and the image's locality blocks make neighbours cheap to load together.
///
/// Memory is cut into aligned windows of `window` pages. First the window
/// of each queued page (in queue order); then, round by round moving one
/// window outward, for each of those in the same order the window after it
/// and the one before it; each page once, only pages `keep` accepts (the caller skips zero pages, which cost
/// nothing on demand), until `target` pages are queued.
pub fn fill_by_locality(
    queue: &mut Vec<PageKey>,
    block_pages: &[u32],
    target: usize,
    window: u32,
    keep: impl Fn(PageKey) -> bool,
) {
    let window = window.max(1);
    if queue.len() >= target {
        return;
    }
    let mut seen: HashSet<PageKey> = queue.iter().copied().collect();
    let mut seeds = Vec::new();
    let mut seed_seen = HashSet::new();
    for k in queue.iter() {
        let w = (k.ram_block, k.page / window);
        if seed_seen.insert(w) {
            seeds.push(w);
        }
    }
    let windows_of = |b: u32| {
        block_pages
            .get(b as usize)
            .map_or(0, |&n| n.div_ceil(window))
    };
    let most = block_pages
        .iter()
        .map(|&n| n.div_ceil(window))
        .max()
        .unwrap_or(0);
    // Each window is taken whole the first time a ring reaches it; a later
    // visit would offer `keep` the same pages again, to no effect (those it
    // took are queued, the others it refuses again). Without this, a large
    // guest whose stored pages do not reach `target` had every window
    // re-read once per seed: 16,384 rings × every seed × 64 `keep` calls
    // for 4 GiB, 2.5-20 s of a restore's planning before its QEMU started.
    let mut visited: HashSet<(u32, u32)> = HashSet::new();
    for ring in 0..=most {
        for &(b, w) in &seeds {
            let here = [Some(w + ring), w.checked_sub(ring).filter(|_| ring > 0)];
            for w in here.into_iter().flatten().filter(|&w| w < windows_of(b)) {
                if !visited.insert((b, w)) {
                    continue;
                }
                let end = ((w + 1) * window).min(block_pages[b as usize]);
                for p in w * window..end {
                    let k = PageKey::new(b, p);
                    if keep(k) && seen.insert(k) {
                        queue.push(k);
                        if queue.len() >= target {
                            return;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(p: u32) -> PageKey {
        PageKey::new(0, p)
    }

    #[test]
    fn snapshot_order_alone_without_duplicates() {
        assert_eq!(
            fafl_queue(&[k(5), k(1), k(5), k(3)], None),
            vec![k(5), k(1), k(3)]
        );
    }

    #[test]
    fn locality_fill_takes_the_windows_around_queued_pages_outward() {
        let mut q = vec![k(17), k(2)];
        // Windows of 4 pages: 17 is in window 4 (16..20), 2 in window 0.
        fill_by_locality(&mut q, &[40], 14, 4, |k| k.page != 18);
        assert_eq!(
            q,
            [17, 2, 16, 19, 0, 1, 3, 20, 21, 22, 23, 12, 13, 14]
                .map(k)
                .to_vec(),
            "own windows (18 skipped), then the one after and before 17's"
        );
        let mut q = vec![k(1)];
        fill_by_locality(&mut q, &[6], 100, 4, |_| true);
        assert_eq!(q.len(), 6, "stops at the end of the block");
        let mut full = vec![k(0), k(1)];
        fill_by_locality(&mut full, &[6], 1, 4, |_| true);
        assert_eq!(full.len(), 2, "a queue at its target is left alone");
    }

    /// Regression: the fill offered the same pages to `keep` once per
    /// seed and ring, so planning a workingset restore of a 4 GiB guest
    /// took 2.5-20 s. Each page is offered at most once now, and the queue
    /// is the one the earlier rule built.
    #[test]
    fn locality_fill_offers_each_page_once_and_queues_as_before() {
        let block_pages = [5000u32, 300];
        let seeds: Vec<PageKey> = [7u32, 4000, 1234, 2500, 64, 4990]
            .iter()
            .map(|&p| PageKey::new(0, p))
            .chain([PageKey::new(1, 150)])
            .collect();
        // Few pages are stored (the rest zero): `target` is never reached.
        let stored = |k: PageKey| k.page % 97 == 0 || k.page % 13 == 5;
        let calls = std::cell::Cell::new(0u64);
        let mut q = seeds.clone();
        fill_by_locality(&mut q, &block_pages, usize::MAX, 16, |k| {
            calls.set(calls.get() + 1);
            stored(k)
        });
        let pages: u64 = block_pages.iter().map(|&n| u64::from(n)).sum();
        assert!(
            calls.get() <= pages,
            "{} calls for {pages} pages",
            calls.get()
        );
        let mut old = seeds;
        reference_fill(&mut old, &block_pages, usize::MAX, 16, stored);
        assert_eq!(q, old);
    }

    /// The rule as it was before windows were visited once (slow, same
    /// result).
    fn reference_fill(
        queue: &mut Vec<PageKey>,
        block_pages: &[u32],
        target: usize,
        window: u32,
        keep: impl Fn(PageKey) -> bool,
    ) {
        let mut seen: HashSet<PageKey> = queue.iter().copied().collect();
        let mut seeds = Vec::new();
        let mut seed_seen = HashSet::new();
        for k in queue.iter() {
            if seed_seen.insert((k.ram_block, k.page / window)) {
                seeds.push((k.ram_block, k.page / window));
            }
        }
        let windows_of = |b: u32| block_pages[b as usize].div_ceil(window);
        let most = block_pages
            .iter()
            .map(|&n| n.div_ceil(window))
            .max()
            .unwrap();
        for ring in 0..=most {
            for &(b, w) in &seeds {
                let here = [Some(w + ring), w.checked_sub(ring).filter(|_| ring > 0)];
                for w in here.into_iter().flatten().filter(|&w| w < windows_of(b)) {
                    for p in w * window..((w + 1) * window).min(block_pages[b as usize]) {
                        let k = PageKey::new(b, p);
                        if keep(k) && seen.insert(k) {
                            queue.push(k);
                            if queue.len() >= target {
                                return;
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn learned_faults_go_after_the_preloaded_prefix() {
        let snap = [k(1), k(2), k(3), k(4)];
        // The restore preloaded 1, 2 and then faulted on 9, 4, 7.
        let q = fafl_queue(&snap, Some((&[k(1), k(2)], &[k(9), k(4), k(7)])));
        assert_eq!(q, vec![k(1), k(2), k(9), k(4), k(7), k(3)]);
    }
}
