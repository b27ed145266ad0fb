//! [`RunGate`]: lets the caller of [`run_source`](super::run_source) hold
//! POSTCOPY_RUN back while pages keep loading (HotRestore's Cohort: a VM
//! whose working set is loaded waits for the Coordinator's START).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// What the gate's owner decided; `Closed` until the first of
/// [`RunGate::open`] and [`RunGate::abort`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    Closed,
    Open,
    Aborted,
}

type Waker = Box<dyn Fn() + Send>;

struct State {
    decision: Decision,
    /// Sources waiting on the gate, woken on the decision.
    wakers: Vec<(u64, Waker)>,
    next_waker: u64,
}

/// Holds a postcopy source before DISCARD and RUN (see
/// [`SourceConfig::run_gate`](super::SourceConfig::run_gate)).
///
/// Closed when created; the first of [`open`](Self::open) and
/// [`abort`](Self::abort) decides for good (the other is then ignored).
/// Clones share the gate: one gate may hold several sources (all VMs of a
/// cohort) and be opened from any thread. A source waiting on it sleeps
/// (no polling) until the decision or a message from its destination.
#[derive(Clone)]
pub struct RunGate {
    state: Arc<Mutex<State>>,
}

impl RunGate {
    /// A closed gate.
    pub fn new() -> Self {
        RunGate {
            state: Arc::new(Mutex::new(State {
                decision: Decision::Closed,
                wakers: Vec::new(),
                next_waker: 0,
            })),
        }
    }

    /// Opens the gate: the sources held by it send their DISCARDs and RUN.
    /// No effect if the gate was aborted.
    pub fn open(&self) {
        self.decide(Decision::Open);
    }

    /// Aborts the gate: the restore is abandoned before the start. Every
    /// source held by it stops without sending RUN and fails with
    /// [`PostcopyError::Abandoned`](super::PostcopyError::Abandoned); its
    /// destination's guest never ran. No effect if the gate was opened.
    pub fn abort(&self) {
        self.decide(Decision::Aborted);
    }

    /// Whether [`open`](Self::open) was called (before any
    /// [`abort`](Self::abort)).
    pub fn is_open(&self) -> bool {
        self.decision() == Decision::Open
    }

    /// Whether [`abort`](Self::abort) was called (before any
    /// [`open`](Self::open)).
    pub fn is_aborted(&self) -> bool {
        self.decision() == Decision::Aborted
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock but a waker, which only
        // sends on a channel; the state stays consistent either way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn decide(&self, decision: Decision) {
        let mut s = self.lock();
        if s.decision == Decision::Closed {
            s.decision = decision;
            for (_, wake) in &s.wakers {
                wake();
            }
        }
    }

    pub(crate) fn decision(&self) -> Decision {
        self.lock().decision
    }

    /// Calls `wake` when the gate is decided (if it is not yet), until the
    /// returned guard is dropped (which drops `wake`).
    pub(crate) fn watch(&self, wake: Waker) -> Watch<'_> {
        let mut s = self.lock();
        let id = s.next_waker;
        s.next_waker += 1;
        s.wakers.push((id, wake));
        Watch { gate: self, id }
    }
}

impl Default for RunGate {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for RunGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("RunGate")
            .field("decision", &s.decision)
            .field("waiting", &s.wakers.len())
            .finish()
    }
}

/// A registered waker; unregisters (and drops) it when dropped.
pub(crate) struct Watch<'g> {
    gate: &'g RunGate,
    id: u64,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let removed = {
            let mut s = self.gate.lock();
            let i = s.wakers.iter().position(|(id, _)| *id == self.id);
            i.map(|i| s.wakers.swap_remove(i))
        };
        drop(removed); // outside the lock
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn first_decision_wins_and_wakes_watchers_once() {
        let g = RunGate::new();
        assert!(!g.is_open() && !g.is_aborted());
        let woken = Arc::new(AtomicU32::new(0));
        let w = woken.clone();
        let watch = g.watch(Box::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }));
        let clone = g.clone();
        clone.open();
        g.abort();
        g.open();
        assert!(g.is_open() && !g.is_aborted());
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        drop(watch);
        assert!(format!("{g:?}").contains("waiting: 0"), "{g:?}");

        let g = RunGate::default();
        g.abort();
        g.open();
        assert!(g.is_aborted() && !g.is_open());
    }
}
