//! Hit rate and accuracy of a working set (HotRestore §6.1.1).
//!
//! The restored guest runs with the working set of size S loaded and no
//! background loader, and every first access after the start is traced
//! (each is a fault). Of the first S traced pages, those in the working
//! set are hits: **hit rate** = hits / S. Most working-set pages not yet
//! touched are touched soon after, so **accuracy** counts hits among the
//! first 1.2 · S traced pages: accuracy = hits / (1.2 · S).
//!
//! vmcsnap traces with nothing preloaded (`restore --mode lazy --trace
//! --no-background`), so one trace serves every size: the working set of
//! size S is the first S pages of the FAFL queue.

use std::collections::HashSet;

use vmcsnap_image::PageKey;

/// Hit rate and accuracy of one working-set size.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Quality {
    /// Working-set size in pages.
    pub size: u64,
    /// Size as a multiple of the computed WSS.
    pub factor: f64,
    /// Hits among the first `size` traced pages, over `size`.
    pub hit_rate: f64,
    /// Hits among the first `1.2 · size` traced pages, over `1.2 · size`.
    pub accuracy: f64,
    /// Whether the trace had at least `1.2 · size` pages (otherwise the
    /// ratios are over what was traced and overstate nothing, but are
    /// based on fewer pages).
    pub trace_long_enough: bool,
}

/// The quality of the FAFL working set at `factors` × `wss` pages against
/// `trace` (first accesses, in order, duplicates ignored).
pub fn analyze(queue: &[PageKey], trace: &[PageKey], wss: u64, factors: &[f64]) -> Vec<Quality> {
    let mut seen = HashSet::new();
    let trace: Vec<PageKey> = trace.iter().copied().filter(|k| seen.insert(*k)).collect();
    factors
        .iter()
        .map(|&f| {
            let size = ((wss as f64) * f).round().max(1.0) as usize;
            let ws: HashSet<PageKey> = queue.iter().take(size).copied().collect();
            let hits_in = |n: usize| trace.iter().take(n).filter(|k| ws.contains(k)).count() as f64;
            let acc_n = (size as f64 * 1.2).round() as usize;
            Quality {
                size: size as u64,
                factor: f,
                hit_rate: hits_in(size) / size as f64,
                accuracy: hits_in(acc_n) / acc_n as f64,
                trace_long_enough: trace.len() >= acc_n,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(p: u32) -> PageKey {
        PageKey::new(0, p)
    }

    #[test]
    fn hit_rate_and_accuracy_follow_the_paper() {
        let queue: Vec<PageKey> = (0..10).map(k).collect();
        // Trace: 0 1 2 3 then 20 (miss), duplicates ignored.
        let trace = [k(0), k(1), k(1), k(20), k(2), k(3), k(4), k(5)];
        let q = analyze(&queue, &trace, 5, &[1.0]);
        // S = 5: first 5 traced = 0 1 20 2 3 -> 4 hits; 1.2 S = 6: 0 1 20 2 3 4 -> 5 hits.
        assert_eq!(q[0].size, 5);
        assert!((q[0].hit_rate - 0.8).abs() < 1e-9);
        assert!((q[0].accuracy - 5.0 / 6.0).abs() < 1e-9);
        assert!(q[0].trace_long_enough);
        let q = analyze(&queue, &trace, 10, &[2.0]);
        assert!(!q[0].trace_long_enough);
    }
}
