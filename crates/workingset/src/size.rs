//! The hybrid working-set size (HotRestore §3.2).
//!
//! `WSS = α · WSS_sample + β · WSS_snapshot` with α = 0.7 and β = 0.3, and
//! the restore loads `WSS / 2` pages before the guest starts: the FAFL queue
//! scales, so the background loader and demand paging cover the rest at a
//! small cost (§6.1.3).
//!
//! * `WSS_sample`: pages the guest dirtied per sampling window while it ran
//!   normally (the agent's periodic `calc-dirty-rate` page sampling; QEMU's
//!   sampling hashes pages, so it sees writes, not reads).
//! * `WSS_snapshot`: pages the guest touched (wrote) during the full
//!   snapshot, i.e. the FAFL trace's length.

/// Weight of the sampled size.
pub const ALPHA: f64 = 0.7;
/// Weight of the snapshot-time size.
pub const BETA: f64 = 0.3;

/// HotRestore's working-set size in pages: `(0.7 · sample + 0.3 · snapshot) / 2`,
/// rounded up. Without a sample (the VM was snapshotted before the agent
/// sampled it) the snapshot count stands for both.
pub fn hybrid_wss(sample: Option<u64>, snapshot: u64) -> u64 {
    let sample = sample.unwrap_or(snapshot) as f64;
    ((ALPHA * sample + BETA * snapshot as f64) / 2.0).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_and_halving() {
        assert_eq!(hybrid_wss(Some(1000), 2000), 650);
        assert_eq!(hybrid_wss(Some(0), 0), 0);
        assert_eq!(hybrid_wss(None, 100), 50);
        assert_eq!(hybrid_wss(Some(1), 0), 1, "rounds up");
    }
}
