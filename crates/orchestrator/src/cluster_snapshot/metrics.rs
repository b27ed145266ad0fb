//! What a cluster snapshot measures besides the per-VM reports: HotSnap's
//! TCP backoff per communicating pair. The guests' own view (TCP
//! retransmissions, pingpong's longest gap) is read from their consoles by
//! each VM's agent (`vmcsnap_agent::guest_console`).

use std::collections::BTreeMap;
pub use vmcsnap_control::{Backoff, PairBackoff, TcpCounters, TcpGrowth};

use vmcsnap_control::SnapshotMode as Mode;

/// The moments of one VM's snapshot that backoff is computed from (unix µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moments {
    /// QEMU's STOP event.
    pub pause_start_us: u64,
    /// QEMU's RESUME event.
    pub pause_end_us: u64,
    /// The VM's snapshot completed (image committed).
    pub complete_us: u64,
}

/// HotSnap's TCP backoff (§5.3): for each pair that communicates, from the
/// first pause start of the two to the last pause end (hot) or the last
/// snapshot completion (pre-copy, stop-copy: the VM is only consistent with
/// its peer once its snapshot is complete). Pairs naming a VM without
/// moments are skipped.
pub fn backoff(
    mode: Mode,
    moments: &BTreeMap<String, Moments>,
    pairs: &[(String, String)],
) -> Backoff {
    let mut out = Vec::new();
    for (a, b) in pairs {
        let (Some(ma), Some(mb)) = (moments.get(a), moments.get(b)) else {
            continue;
        };
        let start = ma.pause_start_us.min(mb.pause_start_us);
        let end = match mode {
            Mode::Hot => ma.pause_end_us.max(mb.pause_end_us),
            Mode::StopCopy | Mode::Precopy => ma.complete_us.max(mb.complete_us),
        };
        out.push(PairBackoff {
            a: a.clone(),
            b: b.clone(),
            backoff_ms: end.saturating_sub(start) as f64 / 1000.0,
        });
    }
    let n = out.len();
    let avg_ms = if n == 0 {
        0.0
    } else {
        out.iter().map(|p| p.backoff_ms).sum::<f64>() / n as f64
    };
    let max_ms = out.iter().map(|p| p.backoff_ms).fold(0.0, f64::max);
    Backoff {
        pairs: out,
        avg_ms,
        max_ms,
    }
}

/// Unordered pairs of distinct VMs with traffic in either direction, from
/// directed (from, to, frames) counts; sorted, each pair once.
pub fn communicating_pairs<'a>(
    directed: impl IntoIterator<Item = (&'a str, &'a str, u64)>,
) -> Vec<(String, String)> {
    let mut set = std::collections::BTreeSet::new();
    for (from, to, frames) in directed {
        if frames == 0 || from == to {
            continue;
        }
        let (a, b) = if from < to { (from, to) } else { (to, from) };
        set.insert((a.to_string(), b.to_string()));
    }
    set.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(ps: u64, pe: u64, c: u64) -> Moments {
        Moments {
            pause_start_us: ps,
            pause_end_us: pe,
            complete_us: c,
        }
    }

    #[test]
    fn backoff_follows_hotsnap_per_mode() {
        let mut mo = BTreeMap::new();
        mo.insert("a".to_string(), m(1_000, 21_000, 900_000));
        mo.insert("b".to_string(), m(5_000, 30_000, 2_000_000));
        mo.insert("c".to_string(), m(2_000, 12_000, 400_000));
        let pairs = vec![
            ("a".into(), "b".into()),
            ("b".into(), "c".into()),
            ("a".into(), "zz".into()),
        ];
        let hot = backoff(Mode::Hot, &mo, &pairs);
        assert_eq!(
            hot.pairs.len(),
            2,
            "the pair naming an unknown VM is skipped"
        );
        assert_eq!(hot.pairs[0].backoff_ms, 29.0); // 1 ms .. 30 ms
        assert_eq!(hot.pairs[1].backoff_ms, 28.0); // 2 ms .. 30 ms
        assert_eq!(hot.avg_ms, 28.5);
        assert_eq!(hot.max_ms, 29.0);
        let pre = backoff(Mode::Precopy, &mo, &pairs);
        assert_eq!(pre.pairs[0].backoff_ms, 1999.0); // 1 ms .. 2000 ms
        assert_eq!(backoff(Mode::Hot, &mo, &[]).avg_ms, 0.0);
    }

    #[test]
    fn pairs_are_unordered_distinct_and_need_traffic() {
        let p = communicating_pairs([
            ("b", "a", 3),
            ("a", "b", 1),
            ("a", "c", 0),
            ("c", "c", 9),
            ("c", "a", 2),
        ]);
        assert_eq!(
            p,
            vec![
                ("a".to_string(), "b".to_string()),
                ("a".to_string(), "c".to_string())
            ]
        );
    }

    #[test]
    fn retransmissions_without_a_duplicate_sack_bound_the_losses() {
        let at = TcpCounters::parse(
            "vmcsnap-stat name=a uptime=3.0 retrans=9 tlp=4 tlprec=0 rto=1 dsack=2",
        );
        let spurious = TcpCounters::parse(
            "vmcsnap-stat name=a uptime=9.0 retrans=12 tlp=6 tlprec=0 rto=1 dsack=5",
        );
        let g = spurious.growth_since(&at);
        assert_eq!((g.retrans, g.dsack, g.lost()), (Some(3), Some(3), Some(0)));
        let lossy = TcpCounters::parse(
            "vmcsnap-stat name=a uptime=9.0 retrans=13 tlp=6 tlprec=1 rto=2 dsack=4",
        );
        assert_eq!(lossy.growth_since(&at).lost(), Some(2));
        // More duplicate SACKs than retransmissions (the peer also saw a
        // duplicate the network made): never a negative loss.
        let dup = TcpCounters::parse(
            "vmcsnap-stat name=a uptime=9.0 retrans=9 tlp=4 tlprec=0 rto=1 dsack=3",
        );
        assert_eq!(dup.growth_since(&at).lost(), Some(0));
        // Snapshots written before `dsack` existed still load.
        let old: TcpCounters =
            serde_json::from_str(r#"{"retrans":1,"tlp":0,"tlp_recovered":0,"rto":0}"#).unwrap();
        assert_eq!(old.dsack, None);
    }
}
