//! The stop barrier of a cluster snapshot: every VM's network cut is
//! prepared (port held, socket drained, cut probes read by the guest)
//! before any VM is paused, so that the pauses start together.
//!
//! Preparing a cut waits for the guest to read the cut probes, which takes
//! each VM a different time (up to [`super::peer::CUT_DRAIN_BOUND`]): with
//! each VM stopping as soon as its own cut was prepared, the pauses started
//! 22-41 ms apart at 4-8 VMs and the backoff of a pair (first pause start
//! to last pause end) grew by as much. Here each VM prepares its cut,
//! arrives, and stops only once every VM still taking part has arrived.
//!
//! A VM whose snapshot fails before it arrives [`leave`](StopBarrier::leave)s,
//! so the others never wait for it; a VM whose snapshot is abandoned stops
//! waiting; and no VM waits longer than its bound (a VM whose start was
//! delayed, e.g. a lost SNAPSHOT message retransmitted, then stops late and
//! alone, as it did before the barrier).

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a VM whose cut is prepared waits for the others. Its port is
/// held meanwhile; preparing a cut is itself bounded by
/// [`super::peer::CUT_DRAIN_BOUND`], so this is only reached when a VM is
/// late for another reason.
pub const STOP_BARRIER_BOUND: Duration = Duration::from_millis(500);

/// How often a waiting VM checks whether its snapshot was abandoned.
const CANCEL_POLL: Duration = Duration::from_millis(5);

/// What one VM's wait at the barrier came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BarrierWait {
    /// When the VM arrived (its cut prepared), Unix µs.
    pub arrived_unix_us: u64,
    /// How long it waited for the others, µs.
    pub waited_us: u64,
    /// Every VM taking part had arrived (or left) when it went on; false
    /// if the bound ran out or its snapshot was abandoned meanwhile.
    pub complete: bool,
}

#[derive(Debug)]
struct State {
    /// VMs expected that have neither arrived nor left.
    missing: usize,
}

/// See the module docs.
#[derive(Debug)]
pub struct StopBarrier {
    state: Mutex<State>,
    all_in: Condvar,
}

impl StopBarrier {
    /// A barrier for `vms` VMs.
    pub fn new(vms: usize) -> StopBarrier {
        StopBarrier {
            state: Mutex::new(State { missing: vms }),
            all_in: Condvar::new(),
        }
    }

    /// This VM's cut is prepared: waits until every VM has arrived or left,
    /// at most `bound`, or until `cancelled` says the snapshot is abandoned.
    pub fn arrive(&self, bound: Duration, cancelled: &dyn Fn() -> Option<String>) -> BarrierWait {
        let arrived_unix_us = crate::snapshot::unix_us();
        let t = Instant::now();
        let mut st = self.lock();
        st.missing = st.missing.saturating_sub(1);
        if st.missing == 0 {
            self.all_in.notify_all();
        }
        let complete = loop {
            if st.missing == 0 {
                break true;
            }
            let left = bound.saturating_sub(t.elapsed());
            if left.is_zero() {
                break false;
            }
            drop(st);
            if cancelled().is_some() {
                break false;
            }
            st = self.lock();
            if st.missing == 0 {
                break true;
            }
            st = self
                .all_in
                .wait_timeout(st, left.min(CANCEL_POLL))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        BarrierWait {
            arrived_unix_us,
            waited_us: t.elapsed().as_micros() as u64,
            complete,
        }
    }

    /// This VM will not arrive (its snapshot failed or was abandoned
    /// before its cut was prepared): the others stop waiting for it.
    pub fn leave(&self) {
        let mut st = self.lock();
        st.missing = st.missing.saturating_sub(1);
        if st.missing == 0 {
            self.all_in.notify_all();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const LONG: Duration = Duration::from_secs(30);

    #[test]
    fn nobody_goes_on_before_the_last_arrives() {
        let b = Arc::new(StopBarrier::new(3));
        let (tx, rx) = std::sync::mpsc::channel();
        let mut threads = Vec::new();
        for _ in 0..2 {
            let (b, tx) = (b.clone(), tx.clone());
            threads.push(std::thread::spawn(move || {
                let w = b.arrive(LONG, &|| None);
                tx.send(w).unwrap();
            }));
        }
        // Both wait for the third.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        let last = b.arrive(LONG, &|| None);
        assert!(last.complete);
        for _ in 0..2 {
            let w = rx.recv_timeout(LONG).unwrap();
            assert!(w.complete);
            assert!(w.arrived_unix_us <= last.arrived_unix_us);
        }
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_vm_that_leaves_is_not_waited_for() {
        let b = Arc::new(StopBarrier::new(2));
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.arrive(LONG, &|| None));
        std::thread::sleep(Duration::from_millis(50));
        b.leave();
        let w = t.join().unwrap();
        assert!(w.complete, "{w:?}");
        assert!(w.waited_us < LONG.as_micros() as u64);
    }

    #[test]
    fn the_bound_and_an_abandon_end_the_wait() {
        let b = StopBarrier::new(2);
        let w = b.arrive(Duration::from_millis(30), &|| None);
        assert!(!w.complete);
        assert!(w.waited_us >= 30_000, "{w:?}");
        let b = StopBarrier::new(2);
        let w = b.arrive(LONG, &|| Some("abandoned".into()));
        assert!(!w.complete);
        assert!(w.waited_us < LONG.as_micros() as u64);
    }
}
