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
    fn learned_faults_go_after_the_preloaded_prefix() {
        let snap = [k(1), k(2), k(3), k(4)];
        // The restore preloaded 1, 2 and then faulted on 9, 4, 7.
        let q = fafl_queue(&snap, Some((&[k(1), k(2)], &[k(9), k(4), k(7)])));
        assert_eq!(q, vec![k(1), k(2), k(9), k(4), k(7), k(3)]);
    }
}
