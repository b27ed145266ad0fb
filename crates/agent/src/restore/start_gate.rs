//! [`StartGate`]: holds a restored guest's start until HotRestore's
//! Coordinator says START (or abandons the restore). The Cohort's worker
//! decides it; the thread feeding the VM (`super::feed`) watches it: the
//! guest's QEMU runs with -S and has loaded its device state, pages keep
//! loading, and START becomes a `cont`.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// What the gate's owner decided; `Closed` until the first of
/// [`StartGate::open`] and [`StartGate::abort`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decision {
    Closed,
    Open,
    Aborted,
}

/// What [`StartGate::watch`] calls on the decision: `true` if the gate was
/// opened, `false` if it was aborted.
pub type Waker = Box<dyn Fn(bool) + Send>;

struct State {
    decision: Decision,
    /// The watcher (the restore feeding the VM), called on the decision.
    waker: Option<Waker>,
}

/// One VM's start, held until the Coordinator decides.
///
/// Closed when created; the first of [`open`](Self::open) and
/// [`abort`](Self::abort) decides for good (the other is then ignored).
/// Clones share the gate, which may be decided from any thread. The one
/// that waits for it registers a [`watch`](Self::watch) (no polling).
#[derive(Clone)]
pub struct StartGate {
    state: Arc<Mutex<State>>,
}

impl StartGate {
    /// A closed gate.
    pub fn new() -> Self {
        StartGate {
            state: Arc::new(Mutex::new(State {
                decision: Decision::Closed,
                waker: None,
            })),
        }
    }

    /// Opens the gate (START): the guest is started. No effect if the gate
    /// was aborted.
    pub fn open(&self) {
        self.decide(Decision::Open);
    }

    /// Aborts the gate: the restore is abandoned before the start; the
    /// guest never runs (its QEMU is stopped). No effect if the gate was
    /// opened.
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
            if let Some(wake) = &s.waker {
                wake(decision == Decision::Open);
            }
        }
    }

    fn decision(&self) -> Decision {
        self.lock().decision
    }

    /// Calls `wake` when the gate is decided, at once if it already is
    /// (an abandon may come before the restore watches), until the
    /// returned guard is dropped (which drops `wake`). One watcher at a
    /// time: a new watch replaces the last. `wake` runs with the
    /// gate locked, on the deciding thread or this one: it must be quick
    /// and must not use the gate (e.g. send on a channel).
    pub fn watch(&self, wake: Waker) -> Watch<'_> {
        let mut s = self.lock();
        if s.decision != Decision::Closed {
            wake(s.decision == Decision::Open);
        }
        s.waker = Some(wake);
        Watch { gate: self }
    }
}

impl Default for StartGate {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for StartGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.lock();
        f.debug_struct("StartGate")
            .field("decision", &s.decision)
            .field("waiting", &usize::from(s.waker.is_some()))
            .finish()
    }
}

/// A registered waker; unregisters (and drops) it when dropped.
pub struct Watch<'g> {
    gate: &'g StartGate,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let removed = self.gate.lock().waker.take();
        drop(removed); // outside the lock
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn first_decision_wins_and_wakes_watchers_once() {
        let g = StartGate::new();
        assert!(!g.is_open() && !g.is_aborted());
        let woken = Arc::new(AtomicU32::new(0));
        let w = woken.clone();
        let watch = g.watch(Box::new(move |opened| {
            assert!(opened);
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

        let g = StartGate::default();
        g.abort();
        g.open();
        assert!(g.is_aborted() && !g.is_open());
    }

    /// Regression: a VM whose cluster restore was abandoned while it was
    /// still being set up (before it watched its gate) never heard of it,
    /// loaded, and waited for a START that never came, holding the whole
    /// restore.
    #[test]
    fn a_watch_after_the_decision_is_told_at_once() {
        for (decide, want) in [
            (StartGate::abort as fn(&StartGate), false),
            (StartGate::open, true),
        ] {
            let g = StartGate::new();
            decide(&g);
            let (tx, rx) = std::sync::mpsc::channel();
            let _w = g.watch(Box::new(move |opened| tx.send(opened).unwrap()));
            assert_eq!(rx.try_recv(), Ok(want));
            g.open();
            g.abort();
            assert!(rx.try_recv().is_err(), "told once");
        }
    }
}
