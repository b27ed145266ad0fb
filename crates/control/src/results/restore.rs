//! Results of `restore` (one VM), and a restored guest's clock.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::RestoreMode;

/// What one restore measured (`vmcsnap restore`, with `--wait` or once
/// every page is loaded).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreReport {
    /// The VM.
    pub vm: String,
    /// The snapshot.
    pub snapshot: String,
    /// The mode.
    pub mode: RestoreMode,
    /// Kept paused.
    pub paused: bool,
    /// Request to guest running (to its state loaded, with `--paused`).
    pub restore_latency_ms: f64,
    /// Request to the device state and RUN sent to QEMU: the rest of
    /// `restore_latency_ms` is QEMU loading the device state and starting
    /// the guest.
    pub run_sent_ms: f64,
    /// In a cluster restore, request to the Coordinator's START reaching
    /// this VM's source (the working set was loaded and it waited since).
    pub start_received_ms: Option<f64>,
    /// In a cluster restore, request to the device state loaded: the VM
    /// was ready for START (LOAD_FIN) and waited from here to
    /// `start_received_ms`.
    #[serde(default)]
    pub loaded_ms: Option<f64>,
    /// Request to QEMU listening for the stream (started, its incoming
    /// socket connected) and the page source started; from here to
    /// `run_sent_ms` the working set is sent.
    #[serde(default)]
    pub qemu_ready_ms: Option<f64>,
    /// In a cluster restore: its page source had pushed pages in the
    /// background before START (it holds them until START: false).
    #[serde(default)]
    pub background_before_start: bool,
    /// Pages sent before RUN: the working set proper (`ws_pages` adds, in
    /// a cluster restore, what was pushed until the start).
    #[serde(default)]
    pub pages_before_run: u64,
    /// The request's wall clock time, unix µs (to put the times above on
    /// a cluster restore's clock); not sent.
    #[serde(skip)]
    pub request_unix_us: u64,
    /// Pages loaded before the guest started.
    pub ws_pages: u64,
    /// The working-set size the mode asked for (before capping to the queue).
    pub wss: u64,
    /// HotRestore's inputs: WSS_sample (if sampled) and WSS_snapshot.
    pub wss_sample: Option<u64>,
    /// Pages the guest wrote during the full snapshot.
    pub wss_snapshot: u64,
    /// Whether the working set came from what an earlier restore learned.
    pub learned: bool,
    /// The snapshot's access data (pages the host kernel saw accessed):
    /// used, absent or ignored, and why.
    pub access_data: String,
    /// HotRestore's hit rate and accuracy of the pages loaded first,
    /// measured on this restore (`None` for `eager`, which loads
    /// everything first, or where the accessed bits could not be read).
    pub quality: Option<Quality>,
    /// The working-set size the next `workingset` restore of this snapshot
    /// will load first (learned from this one, bounded).
    pub next_wss: Option<u64>,
    /// Memory-image bytes read before the guest started.
    pub bytes_read_before_start: u64,
    /// Demand faults (requests for pages not yet sent).
    pub demand_faults: u64,
    /// Of those, the ones between RUN and the guest's start: QEMU loading
    /// the device state waited for these pages.
    pub demand_faults_before_start: u64,
    /// Demand faults per 100 ms for the first 10 s after the start.
    pub demand_faults_per_100ms: Vec<u64>,
    /// Request until every page was sent.
    pub full_load_ms: f64,
    /// Pages of the VM.
    pub pages_total: u64,
    /// Pages sent because of demand faults (with their cluster).
    pub pages_on_demand: u64,
    /// Pages pushed in the background.
    pub pages_background: u64,
    /// Requested pages sent on QEMU's postcopy-preempt channel (`--preempt`;
    /// 0 without it).
    #[serde(default)]
    pub pages_on_preempt: u64,
    /// How long the page source took to serve a demand fault: from the
    /// request's arrival to the page written to its socket, over this
    /// restore's faults (`None` without faults).
    #[serde(default)]
    pub demand_served_ms: Option<Spread>,
    /// How long the guest's vCPUs were blocked on demand faults, summed
    /// over the vCPUs, as the destination QEMU measured it
    /// (`postcopy-vcpu-blocktime`, ms; `None` where it did not say, e.g.
    /// a restore finished by an adopting agent).
    #[serde(default)]
    pub vcpu_blocktime_ms: Option<u64>,
    /// QEMU threads on the fault path given a higher priority (2 when it
    /// worked; `None` if this process may not raise priorities).
    pub qemu_threads_raised: Option<usize>,
    /// The overlay the VM runs on.
    pub overlay: PathBuf,
    /// Where this restore's record went.
    pub record: PathBuf,
    /// The guest's clock, set to the host's once it runs (for a restore of
    /// one VM; a cluster restore reports its VMs' clocks).
    pub clock: Option<ClockSync>,
}

/// What `vmcsnap restore` answers once the guest runs (without `--wait`):
/// the rest of its pages load in the background (`vmcsnap status` shows
/// how far), and the full [`RestoreReport`] goes to the agent's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreRunning {
    /// The VM.
    pub vm: String,
    /// The snapshot.
    pub snapshot: String,
    /// The mode.
    pub mode: RestoreMode,
    /// Kept paused (never, for an early answer).
    pub paused: bool,
    /// Request to guest running.
    pub restore_latency_ms: f64,
    /// When the guest started (its RESUME event), unix µs.
    pub started_unix_us: u64,
    /// Pages loaded when it started.
    pub pages_loaded: u64,
    /// Pages of the VM.
    pub pages_total: u64,
    /// Not known yet: `None`.
    pub full_load_ms: Option<f64>,
    /// Pages still loading in the background.
    pub loading: bool,
    /// The guest's clock, set to the host's once it ran.
    pub clock: Option<ClockSync>,
}

/// Median, 90th percentile and maximum of a set of times.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Median, ms.
    pub p50: f64,
    /// 90th percentile (nearest rank), ms.
    pub p90: f64,
    /// Maximum, ms.
    pub max: f64,
}

impl Spread {
    /// Of `v` (any order); `None` if empty.
    pub fn of(v: &[f64]) -> Option<Spread> {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let rank = |q: f64| s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
        (!s.is_empty()).then(|| Spread {
            p50: rank(0.5),
            p90: rank(0.9),
            max: s[s.len() - 1],
        })
    }
}

/// How well the pages loaded first served the guest, from the start to
/// the full load (when demand faults end).
///
/// HotRestore (§6.1.1) traces every first access of a guest restored with
/// its working set. Stock QEMU shows the agent the first accesses of pages
/// *not* loaded (demand faults, in order), and the host's accessed bits
/// show how many loaded pages the guest touched (not which, nor when). So:
/// * `hit_rate` = used / (used + missed): the share of the guest's first
///   accesses in the window that found their page loaded first;
/// * `accuracy` = used / loaded: the share of the working set the guest
///   touched in the window.
///
/// Accesses to pages pushed in the background before the guest reached
/// them count in neither.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Quality {
    /// The window (ms from the start to the full load).
    pub window_ms: f64,
    /// Pages loaded before the start.
    pub loaded: u64,
    /// Of those, touched in the window.
    pub used: u64,
    /// Distinct pages faulted on in the window.
    pub missed: u64,
    /// used / (used + missed).
    pub hit_rate: f64,
    /// used / loaded.
    pub accuracy: f64,
}

impl Quality {
    /// The ratios from the counts.
    pub fn new(window_ms: f64, loaded: u64, used: u64, missed: u64) -> Quality {
        let used = used.min(loaded);
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        Quality {
            window_ms,
            loaded,
            used,
            missed,
            hit_rate: ratio(used, used + missed),
            accuracy: ratio(used, loaded),
        }
    }
}

/// What happened to a restored guest's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClockOutcome {
    /// Set to the host's (see `method`).
    Set,
    /// Not set: the guest has no guest agent (the lab guest); it keeps the
    /// snapshot's time.
    NoAgent,
    /// Not set: the guest was restored paused.
    Paused,
    /// Not set: the guest agent did not answer or refused (see `error`).
    Failed,
}

/// A restored guest's clock, before and after the agent set it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClockSync {
    /// The VM.
    pub vm: String,
    /// What happened.
    pub outcome: ClockOutcome,
    /// How the clock was set: `guest-set-time`, or `date` (through
    /// `guest-exec`, for a guest without hwclock).
    pub method: Option<String>,
    /// The guest's clock minus the host's before, ms (about minus the
    /// snapshot's age).
    pub offset_before_ms: Option<f64>,
    /// The same after.
    pub offset_after_ms: Option<f64>,
    /// Why it was not set.
    pub error: Option<String>,
}

impl ClockSync {
    /// `vm`'s clock with `outcome` and nothing measured yet.
    pub fn new(vm: &str, outcome: ClockOutcome) -> ClockSync {
        ClockSync {
            vm: vm.to_string(),
            outcome,
            method: None,
            offset_before_ms: None,
            offset_after_ms: None,
            error: None,
        }
    }
}
