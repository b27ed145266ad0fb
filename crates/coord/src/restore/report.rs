//! What the coordinator reports: its state, each cohort's phase, and the
//! events of a restore.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::NodeId;

/// Where one cohort is, as the coordinator knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CohortPhase {
    /// `LOAD` sent, no `LOAD_FIN` yet.
    Loading,
    /// `LOAD_FIN` received; the Checker has not let it start yet.
    Loaded,
    /// `START` sent, no `START_FIN` yet.
    Starting,
    /// `START_FIN` received: the VM runs; no `RESTORE_FIN` yet.
    Started,
    /// `START_FIN` and `RESTORE_FIN` received.
    Restored,
}

/// Where the coordinator is. The `Await*` states name the deadline that
/// runs; cohorts progress independently (a VM may run while another still
/// loads), see [`Coordinator::phase`](super::Coordinator::phase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorState {
    /// Created, [`Coordinator::start`](super::Coordinator::start) not called yet.
    NotStarted,
    /// `LOAD` sent; waiting for the `LOAD_FIN` of `missing`.
    AwaitLoad {
        /// Cohorts whose `LOAD_FIN` has not arrived.
        missing: BTreeSet<NodeId>,
    },
    /// Every VM is loaded; waiting for the `START_FIN` of `missing` (held by
    /// the Checker, or `START` sent).
    AwaitStart {
        /// Cohorts whose `START_FIN` has not arrived.
        missing: BTreeSet<NodeId>,
    },
    /// Every VM runs; waiting for the `RESTORE_FIN` of `missing`.
    AwaitRestore {
        /// Cohorts whose `RESTORE_FIN` has not arrived.
        missing: BTreeSet<NodeId>,
    },
    /// `ALL_RESTORE_FIN` sent: the cluster restore is complete.
    Done,
    /// `ABORT` sent: the restore is abandoned, the VMs are stopped.
    Aborted {
        /// Why (names the cohort at fault, if any).
        reason: String,
    },
}

/// What happened, for the log and for progress reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorEventKind {
    /// `LOAD` sent to every cohort.
    Started {
        /// Number of cohorts.
        cohorts: usize,
    },
    /// A cohort's working set is loaded.
    LoadFin {
        /// The cohort.
        cohort: NodeId,
    },
    /// Every working set is loaded (the start deadline runs from here).
    AllLoaded,
    /// The Checker let these VMs start: `START` sent to each (a ring, or
    /// one VM).
    StartSent {
        /// The cohorts, sorted.
        cohorts: Vec<NodeId>,
    },
    /// A cohort's VM runs.
    StartFin {
        /// The cohort.
        cohort: NodeId,
        /// When its guest started (its clock, µs since the Unix epoch).
        started_unix_us: u64,
    },
    /// Every VM runs (the restore deadline runs from here).
    AllStarted,
    /// A cohort loaded all its pages.
    RestoreFin {
        /// The cohort.
        cohort: NodeId,
    },
    /// Every cohort is restored; `ALL_RESTORE_FIN` sent.
    Done,
    /// The restore was aborted; `ABORT` sent to every cohort.
    Aborted {
        /// Why.
        reason: String,
    },
    /// A message was sent again (timer, or answer to a duplicate).
    Retransmit {
        /// The receiver.
        to: NodeId,
        /// The message name, e.g. `"LOAD"`.
        msg: &'static str,
    },
    /// A cohort reported `FAILED` after the restore was complete.
    FailedAfterDone {
        /// The cohort.
        cohort: NodeId,
        /// Its error.
        error: String,
    },
}

/// An entry of [`Coordinator::events`](super::Coordinator::events).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorEvent {
    /// When (the `now` of the input that caused it).
    pub at: Instant,
    /// What.
    pub kind: CoordinatorEventKind,
}
