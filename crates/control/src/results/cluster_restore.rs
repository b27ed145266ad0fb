//! Results of `restore --cluster`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ClockSync, ClusterRestoreMode, TcpCounters, TcpGrowth};

/// One restored VM. Times are ms since the cluster restore request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmRestoreReport {
    /// The VM.
    pub vm: String,
    /// Request to guest running.
    pub latency_ms: f64,
    /// When the guest started (its RESUME event), unix µs: to line the
    /// restore up with other records of it, e.g. a packet capture.
    pub started_unix_us: Option<u64>,
    /// When the Coordinator's START reached this VM's source (`None` in
    /// modes without a restore line).
    pub start_received_ms: Option<f64>,
    /// When its source had sent the device state and RUN; from there to
    /// `latency_ms` QEMU loads the device state and starts the guest.
    pub run_sent_ms: f64,
    /// When its QEMU had loaded the device state (LOAD_FIN): from
    /// `run_sent_ms` to here QEMU loaded it, from here to
    /// `start_received_ms` the VM waited for START (the restore line).
    #[serde(default)]
    pub loaded_ms: Option<f64>,
    /// When its QEMU listened for the stream and its page source started:
    /// from its restore's begin (after `load_sent_ms` of the cluster) to
    /// here QEMU started; from here to `run_sent_ms` its working set was
    /// sent.
    #[serde(default)]
    pub qemu_ready_ms: Option<f64>,
    /// When its own restore began (LOAD reached it): ms since the cluster
    /// restore's request.
    #[serde(default)]
    pub begun_ms: f64,
    /// Its page source had pushed pages in the background before START
    /// (it holds them until START, so that a VM that waits leaves the CPUs
    /// to the VMs still loading: false).
    #[serde(default)]
    pub background_before_start: bool,
    /// Pages sent before RUN (its working set); `pages_before_start` adds
    /// what was pushed until the start.
    #[serde(default)]
    pub pages_before_run: u64,
    /// HotRestore's backoff approximation: the largest start-time lag of a
    /// VM this one sends to (it starts later than this one), 0 if none.
    pub backoff_ms: f64,
    /// Latency plus backoff.
    pub disruption_ms: f64,
    /// HotRestore's hybrid working-set size (pages).
    pub wss_hybrid: u64,
    /// The size asked for (LP-revised with a restore line).
    pub wss: u64,
    /// Pages loaded before the guest started (working set, plus what loaded
    /// while waiting for START).
    pub pages_before_start: u64,
    /// Demand faults.
    pub demand_faults: u64,
    /// Of those, the ones before the guest started (QEMU loading the device
    /// state waited for these pages).
    pub demand_faults_before_start: u64,
    /// Request until every page was loaded, ms.
    pub full_load_ms: f64,
    /// Frames in flight to it at the cut, replayed once it ran.
    pub frames_replayed: u64,
    /// The guest's TCP RetransSegs at the cut (from the cluster snapshot
    /// when it saw the counter unchanged, else the first console stat line
    /// after the restore) and a few seconds after the restore.
    pub retrans_first: Option<u64>,
    /// The later value.
    pub retrans_later: Option<u64>,
    /// Of the retransmissions counted in `retrans_later` (since boot): tail
    /// loss probes (a peer silent for two round trips plus 200 ms) and
    /// retransmission timeouts, if the guest reports them.
    pub tlp_later: Option<u64>,
    /// See `tlp_later`.
    pub rto_later: Option<u64>,
    /// The guest's TCP counters at the cut (see `retrans_first`).
    pub tcp_at_cut: TcpCounters,
    /// A few seconds after the restore.
    pub tcp_later: TcpCounters,
    /// Their growth because of the restore: retransmitted segments, tail
    /// loss probes, of those the ones that repaired a real loss (a segment
    /// missing from the restored cluster), timeouts, and duplicate SACKs
    /// received (retransmissions the peer already had). A tail loss probe
    /// that repaired nothing was a peer stalled past 2 RTT + 200 ms.
    pub tcp_growth: TcpGrowth,
    /// Retransmissions since the cut that no duplicate SACK answered
    /// (`tcp_growth.retrans - tcp_growth.dsack`; `None` for guests that do
    /// not report duplicate SACKs): an upper bound on the segments lost, as
    /// the peer had every other one (docs/restore.md).
    pub lost_segments: Option<u64>,
    /// The longest gap between two pingpong replies the guest saw since the
    /// restore (pingpong clients only): the disruption as its application
    /// felt it, in guest time.
    pub guest_max_gap_ms: Option<u64>,
    /// The VM's restore record.
    pub record: PathBuf,
}

/// What `vmcsnap restore --cluster` reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterRestoreReport {
    /// The cluster snapshot.
    pub snapshot: String,
    /// The cluster.
    pub cluster: String,
    /// The mode.
    pub mode: ClusterRestoreMode,
    /// How long after each start only demand faults were served (`--start-quiet`).
    pub start_quiet_ms: u64,
    /// Per VM, in start order.
    pub vms: Vec<VmRestoreReport>,
    /// VMs in the order their guests started.
    pub start_order: Vec<String>,
    /// The restore line the plan asked for (ascending revised size), or
    /// the VMs without one.
    pub restore_line: Vec<String>,
    /// Every VM started after the VMs it sends to (rings excepted).
    pub starts_follow_dependencies: bool,
    /// Rings (VMs that send to each other) of the restore dependency graph.
    pub rings: Vec<Vec<String>>,
    /// The graph's edges: (from, to, frames logged at the cut).
    pub edges: Vec<(String, String, u64)>,
    /// Σ|S*_i − S_i| of the working-set revision (pages).
    pub lp_objective: f64,
    /// Average backoff, ms.
    pub backoff_avg_ms: f64,
    /// Median backoff, ms.
    pub backoff_median_ms: f64,
    /// Largest backoff, ms.
    pub backoff_max_ms: f64,
    /// Average restore latency, ms.
    pub latency_avg_ms: f64,
    /// Average disruption, ms.
    pub disruption_avg_ms: f64,
    /// Request to every guest running (the last start), ms.
    pub running_ms: f64,
    /// Request to every page of every VM loaded, ms.
    pub full_load_ms: Option<f64>,
    /// Pages still loading in the background (never, in this report).
    pub loading: bool,
    /// Request to report, ms.
    pub duration_ms: f64,
    /// Request to the plan made (graph, working-set sizes, the LP) and
    /// every VM's snapshot checked, ms.
    #[serde(default)]
    pub planned_ms: f64,
    /// Request to LOAD sent to every VM (the cluster's network is up), ms:
    /// each VM's own restore (its QEMU, working set, device state) begins
    /// here.
    #[serde(default)]
    pub load_sent_ms: f64,
    /// Each guest's clock, set to the host's once every guest ran
    /// (`crate::guest_clock`).
    pub guest_clocks: Vec<ClockSync>,
}

/// One VM of a [`ClusterRunning`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmRunning {
    /// The VM.
    pub vm: String,
    /// Request to guest running, ms.
    pub latency_ms: f64,
    /// When the guest started (its RESUME event), unix µs.
    pub started_unix_us: u64,
}

/// What `vmcsnap restore --cluster` answers once every guest runs (without
/// `--wait`): the latencies; the rest of the pages load in the background
/// (`vmcsnap status` shows how far), and the full report goes to the
/// agent's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterRunning {
    /// The cluster snapshot.
    pub snapshot: String,
    /// The cluster.
    pub cluster: String,
    /// The mode.
    pub mode: ClusterRestoreMode,
    /// How long after each start only demand faults are served.
    pub start_quiet_ms: u64,
    /// Per VM, in start order.
    pub vms: Vec<VmRunning>,
    /// VMs in the order their guests started.
    pub start_order: Vec<String>,
    /// The restore line the plan asked for.
    pub restore_line: Vec<String>,
    /// Average restore latency, ms.
    pub latency_avg_ms: f64,
    /// Request to every guest running (the last start), ms.
    pub running_ms: f64,
    /// Not known yet: `None`.
    pub full_load_ms: Option<f64>,
    /// Pages still loading in the background.
    pub loading: bool,
    /// Each guest's clock, set to the host's once every guest ran.
    pub guest_clocks: Vec<ClockSync>,
}
