//! Results of `snapshot --cluster`, and the guests' TCP counters it (and a
//! cluster restore) measures.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vmcsnap_image::cluster::Edge;
use vmcsnap_image::PauseBreakdown;
use vmcsnap_switch::SessionStats;

use crate::SnapshotMode;

/// One VM in the cluster snapshot report. Times are ms since the cluster
/// snapshot's request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmSnapshotReport {
    /// The VM.
    pub vm: String,
    /// Guest paused (QMP STOP to RESUME), ms.
    pub downtime_ms: f64,
    /// Where that pause went.
    pub pause: Option<PauseBreakdown>,
    /// The VM's snapshot started (its peer got SNAPSHOT or a trigger).
    pub start_ms: f64,
    /// QMP STOP.
    pub pause_start_ms: f64,
    /// QMP RESUME.
    pub pause_end_ms: f64,
    /// Transient snapshot over, port released.
    pub transient_done_ms: f64,
    /// Image committed.
    pub complete_ms: f64,
    /// Before the pause: how long the switch waited for the VM's QEMU to
    /// read what was written to it, µs.
    pub drain_wait_us: u64,
    /// Whether that wait hit its bound (frames may then reach the VM after
    /// its cut without being logged).
    pub drain_bound_hit: bool,
    /// SIOCOUTQ when the wait ended (0 = everything read).
    pub unread_bytes_at_cut: u64,
    /// Of that wait, µs from the socket drained to the second cut probe
    /// read: until the VM's QEMU had handed the guest everything it read.
    pub settle_us: u64,
    /// The cut probes were not both read within the bound: QEMU may have
    /// held frames the guest had not taken, which a restore of this VM
    /// lacks (its peers' TCP retransmits them).
    pub unsettled: bool,
    /// Frames the switch read from the VM after it paused (sent before the cut).
    pub frames_drained_at_cut: u64,
    /// Hot and stop-copy: its network cut was prepared and it reached the
    /// stop barrier, where it waited for every VM's cut before its `stop`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_prepared_ms: Option<f64>,
    /// How long it waited there, µs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_barrier_wait_us: Option<u64>,
    /// Every VM's cut was prepared when it went on to its `stop` (false: the
    /// barrier's bound ran out, the pauses did not start together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_barrier_complete: Option<bool>,
    /// Hot: guest RAM as QEMU had it mapped before the pause (see
    /// [`RamResidency`](crate::RamResidency)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram: Option<crate::RamResidency>,
    /// The guest's TCP RetransSegs before and after the snapshot.
    pub retrans_before: Option<u64>,
    /// After (the next console stat line after completion).
    pub retrans_after: Option<u64>,
    /// All TCP counters of the guest's last stat line before the snapshot.
    pub tcp_before: TcpCounters,
    /// And of its last stat line after (when the snapshot was measured);
    /// equal to `tcp_before` when nothing was retransmitted meanwhile, and
    /// then also the counters in the snapshot.
    pub tcp_after: TcpCounters,
    /// Pingpong's longest gap between replies during the snapshot, ms.
    pub pingpong_max_gap_ms: Option<u64>,
    /// Pages stored in the image.
    pub pages_stored: u64,
    /// The VM's snapshot directory.
    pub path: PathBuf,
}

/// What `vmcsnap snapshot --cluster` reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterSnapshotReport {
    /// The cluster snapshot's name.
    pub name: String,
    /// Its directory.
    pub path: PathBuf,
    /// The cluster.
    pub cluster: String,
    /// The mode.
    pub mode: SnapshotMode,
    /// Request to commit, ms.
    pub duration_ms: f64,
    /// Per VM, in spec order.
    pub vms: Vec<VmSnapshotReport>,
    /// HotSnap's TCP backoff.
    pub backoff: Backoff,
    /// Average and largest per-VM downtime, ms.
    pub downtime_avg_ms: f64,
    /// Largest per-VM downtime, ms.
    pub downtime_max_ms: f64,
    /// Frames logged as channel state.
    pub channel_state_frames: u64,
    /// Their bytes.
    pub channel_state_bytes: u64,
    /// W(i,j): frames from VM i to VM j logged at the cut.
    pub edges: Vec<Edge>,
    /// The switch's accounting of the session.
    pub switch: SessionStats,
    /// The protocol's figures.
    pub protocol: ProtocolStats,
}

/// TCP backoff of one pair of VMs that exchanged frames during the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairBackoff {
    /// One VM.
    pub a: String,
    /// The other.
    pub b: String,
    /// HotSnap's TCP backoff duration of the pair, ms.
    pub backoff_ms: f64,
}

/// HotSnap's backoff figures for a cluster snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Backoff {
    /// Per communicating pair.
    pub pairs: Vec<PairBackoff>,
    /// The cluster's backoff: the average over the pairs, ms (0 without pairs).
    pub avg_ms: f64,
    /// The largest pair backoff, ms.
    pub max_ms: f64,
}

/// A guest's TCP counters from one `vmcsnap-stat` line (since its boot;
/// `None` where the line does not have the field: older guests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TcpCounters {
    /// `retrans=`: RetransSegs, every retransmitted segment.
    pub retrans: Option<u64>,
    /// `tlp=`: TCPLossProbes, tail loss probes (sent when a peer stays
    /// silent for 2 RTT + 200 ms with one segment out).
    pub tlp: Option<u64>,
    /// `tlprec=`: TCPLossProbeRecovery, tail loss probes that repaired a
    /// real loss (the others were answered by a duplicate SACK: the peer
    /// had the segment and was only slow).
    pub tlp_recovered: Option<u64>,
    /// `rto=`: TCPTimeouts, retransmission timeouts.
    pub rto: Option<u64>,
    /// `dsack=`: TCPDSACKRecv + TCPDSACKOfoRecv, duplicate SACKs received:
    /// one per retransmitted segment the peer already had.
    #[serde(default)]
    pub dsack: Option<u64>,
}

impl TcpCounters {
    /// The counters of one stat line.
    pub fn parse(line: &str) -> TcpCounters {
        TcpCounters {
            retrans: field(line, "retrans"),
            tlp: field(line, "tlp"),
            tlp_recovered: field(line, "tlprec"),
            rto: field(line, "rto"),
            dsack: field(line, "dsack"),
        }
    }

    /// Per-field growth from `earlier` (`None` where either lacks it).
    pub fn growth_since(&self, earlier: &TcpCounters) -> TcpGrowth {
        let d = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b?));
        TcpGrowth {
            retrans: d(self.retrans, earlier.retrans),
            tlp: d(self.tlp, earlier.tlp),
            tlp_recovered: d(self.tlp_recovered, earlier.tlp_recovered),
            rto: d(self.rto, earlier.rto),
            dsack: d(self.dsack, earlier.dsack),
        }
    }
}

impl TcpGrowth {
    /// Retransmissions the peer did not answer with a duplicate SACK: an
    /// upper bound on those that repaired a real loss (every other one the
    /// peer already had). `None` for guests that do not print `dsack=`.
    pub fn lost(&self) -> Option<u64> {
        Some(self.retrans?.saturating_sub(self.dsack?))
    }
}

/// How much each [`TcpCounters`] field grew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TcpGrowth {
    /// Retransmitted segments.
    pub retrans: Option<u64>,
    /// Tail loss probes.
    pub tlp: Option<u64>,
    /// Tail loss probes that repaired a loss.
    pub tlp_recovered: Option<u64>,
    /// Retransmission timeouts.
    pub rto: Option<u64>,
    /// Duplicate SACKs received: retransmissions that were not needed.
    #[serde(default)]
    pub dsack: Option<u64>,
}

/// Protocol figures for the report.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ProtocolStats {
    /// Messages sent on the transport.
    pub messages_sent: u64,
    /// Messages the transport dropped (a peer gone).
    pub messages_dropped: u64,
    /// The initiator's log, one line per event, with ms since the start.
    pub events: Vec<String>,
}

/// The value of `key=N` in a `vmcsnap-stat` line.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}
