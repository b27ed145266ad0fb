//! Learning from restores, with a bound.
//!
//! A restore shows vmcsnap part of what the guest touched in its first
//! seconds: the pages it faulted on (in order, with times), and, measured
//! from the host's accessed bits ([`Observation::ws_used`]), how many of
//! the pages loaded before the start it touched. What the next restore of
//! the same snapshot loads first is derived from that and from what the
//! last one learned, never from the union of everything ever faulted:
//!
//! * **size**: `next = max(⌈DECAY · used_size + (1 − DECAY) · touched⌉,
//!   floor)`, where `touched` = working-set pages used + distinct pages
//!   faulted on within the first [`Observation::window_ms`], and the floor
//!   is HotRestore's hybrid size from the snapshot (which sees reads). Both
//!   terms are at most the pages the guest really touches in that window,
//!   so the size converges to the larger of that and the floor, and never
//!   exceeds the larger of that and the first restore's size. (Pages the
//!   background loader placed before the guest reached them are in neither
//!   count: without the floor a fast background load would shrink the
//!   working set below what the guest uses.) Without the accessed-bit
//!   measurement the whole loaded set counts as used, and the size is
//!   capped at [`Observation::cap`].
//! * **order**: the pages faulted on in the window, in fault order, then
//!   the queue that restore used: evidence of the latest restore first, so
//!   pages not seen again drift back and fall off the end. The learned
//!   queue keeps at most [`QUEUE_FACTOR`] × the size.

use std::collections::HashSet;

use vmcsnap_image::PageKey;

/// Weight of the previous size.
pub const DECAY: f64 = 0.5;
/// The learned queue holds at most this many times the learned size.
pub const QUEUE_FACTOR: u64 = 2;

/// What one restore saw.
#[derive(Debug, Clone)]
pub struct Observation<'a> {
    /// The queue that restore used (its working set is the first
    /// `ws_size` pages).
    pub queue: &'a [PageKey],
    /// The working-set size it asked for (pages).
    pub size: u64,
    /// Pages it loaded before the start.
    pub ws_size: u64,
    /// Of those, how many the guest touched in the window (`None` if not
    /// measured).
    pub ws_used: Option<u64>,
    /// Pages the guest faulted on, in order, with ms since the start.
    pub faults: &'a [(PageKey, f64)],
    /// The learning window (ms after the start).
    pub window_ms: f64,
    /// The least the size may become.
    pub floor: u64,
    /// The most the size may become when `ws_used` is unknown.
    pub cap: u64,
}

/// What the next restore starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Learned {
    /// Working-set size in pages.
    pub size: u64,
    /// The learned queue (the snapshot's own queue follows it).
    pub queue: Vec<PageKey>,
    /// Pages the guest was seen to touch in the window.
    pub touched: u64,
}

/// Learns from one restore.
pub fn learn(o: &Observation) -> Learned {
    let mut seen = HashSet::new();
    let faults: Vec<PageKey> = o
        .faults
        .iter()
        .filter(|(_, ms)| *ms <= o.window_ms)
        .map(|(k, _)| *k)
        .filter(|k| seen.insert(*k))
        .collect();
    let used = o.ws_used.unwrap_or(o.ws_size).min(o.ws_size);
    let touched = used + faults.len() as u64;
    let mut size = (DECAY * o.size as f64 + (1.0 - DECAY) * touched as f64).ceil() as u64;
    size = size.max(o.floor);
    if o.ws_used.is_none() {
        size = size.min(o.cap.max(o.floor));
    }
    let keep = usize::try_from(size.saturating_mul(QUEUE_FACTOR)).unwrap_or(usize::MAX);
    let mut queue = faults;
    queue.extend(o.queue.iter().copied().filter(|k| seen.insert(*k)));
    queue.truncate(keep);
    Learned {
        size,
        queue,
        touched,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(p: u32) -> PageKey {
        PageKey::new(0, p)
    }

    fn obs<'a>(queue: &'a [PageKey], faults: &'a [(PageKey, f64)], size: u64) -> Observation<'a> {
        Observation {
            queue,
            size,
            ws_size: size.min(queue.len() as u64),
            ws_used: None,
            faults,
            window_ms: 10_000.0,
            floor: 0,
            cap: 1_000,
        }
    }

    #[test]
    fn faults_in_the_window_go_first_and_late_ones_are_ignored() {
        let q = [k(1), k(2), k(3)];
        let f = [(k(9), 5.0), (k(2), 6.0), (k(7), 20_000.0)];
        let mut o = obs(&q, &f, 2);
        o.ws_used = Some(1);
        let l = learn(&o);
        // touched = 1 used + 2 faults (9, 2) = 3; size = ceil(0.5 * 2 + 0.5 * 3) = 3.
        assert_eq!(l.touched, 3);
        assert_eq!(l.size, 3);
        assert_eq!(l.queue, vec![k(9), k(2), k(1), k(3)]);
    }

    /// A guest that touches the same 1000 pages in its first seconds, plus
    /// 50 pages of noise that differ every time: repeated restores settle
    /// near 1000 pages and never grow past it, whatever they start from.
    #[test]
    fn repeated_restores_converge_and_stay_bounded() {
        let truth: Vec<PageKey> = (0..1000).map(k).collect();
        for start in [100u64, 3000] {
            let mut queue: Vec<PageKey> = (5000..5000 + start as u32).map(k).collect();
            let mut size = start;
            let mut sizes = vec![];
            for round in 0..10u32 {
                let ws: HashSet<PageKey> = queue.iter().take(size as usize).copied().collect();
                let noise = (0..50).map(|i| k(100_000 + round * 50 + i));
                let touched: Vec<PageKey> = truth.iter().copied().chain(noise).collect();
                let used = touched.iter().filter(|p| ws.contains(p)).count() as u64;
                let faults: Vec<(PageKey, f64)> = touched
                    .iter()
                    .filter(|p| !ws.contains(p))
                    .enumerate()
                    .map(|(i, p)| (*p, i as f64))
                    .collect();
                let l = learn(&Observation {
                    queue: &queue,
                    size,
                    ws_size: ws.len() as u64,
                    ws_used: Some(used),
                    faults: &faults,
                    window_ms: 10_000.0,
                    floor: 0,
                    cap: 0,
                });
                assert!(l.size <= start.max(1050), "round {round}: {}", l.size);
                assert!(l.queue.len() as u64 <= QUEUE_FACTOR * l.size);
                size = l.size;
                queue = l.queue;
                sizes.push(size);
            }
            let last = *sizes.last().unwrap();
            assert!((1000..=1060).contains(&last), "from {start}: {sizes:?}");
        }
    }

    #[test]
    fn without_a_measurement_the_cap_holds() {
        let q: Vec<PageKey> = (0..100).map(k).collect();
        let f: Vec<(PageKey, f64)> = (1000..1500).map(|p| (k(p), 1.0)).collect();
        let l = learn(&obs(&q, &f, 100));
        assert_eq!(l.size, 350, "0.5 * 100 + 0.5 * (100 + 500)");
        let mut o = obs(&q, &f, 100);
        o.cap = 150;
        assert_eq!(learn(&o).size, 150);
        o.floor = 400;
        assert_eq!(learn(&o).size, 400, "the floor wins over the cap");
        let mut o = obs(&q, &f, 100);
        o.ws_used = Some(0);
        o.faults = &[];
        o.floor = 80;
        assert_eq!(learn(&o).size, 80, "0.5 * 100 + 0 is below the floor");
    }
}
