//! What a cluster snapshot's `cluster.json` records as measurements (its
//! `metrics`, and each VM's): written by the agent once, read back by a
//! cluster restore and `vmcsnap snapshots`. The image crate stores them as
//! JSON it does not interpret; these types are their one definition.
//!
//! Readers are lenient field by field: a field that is absent or not in
//! today's layout (a manifest from before it existed) reads as `None`,
//! never failing the whole manifest.

use serde::{Deserialize, Deserializer, Serialize};
use vmcsnap_switch::SessionStats;

use super::cluster_snapshot::{Backoff, ProtocolStats, TcpCounters};

/// `cluster.json`'s `metrics`. Fields in alphabetical order, the order
/// of the `json!` map this replaced, so manifests keep their bytes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ClusterSnapshotMetrics {
    /// TCP backoff of the pairs that talked during the snapshot.
    #[serde(default, deserialize_with = "lenient")]
    pub backoff: Option<Backoff>,
    /// Mean of the VMs' pauses, ms.
    #[serde(default, deserialize_with = "lenient")]
    pub downtime_avg_ms: Option<f64>,
    /// Longest pause, ms.
    #[serde(default, deserialize_with = "lenient")]
    pub downtime_max_ms: Option<f64>,
    /// Request to commit, ms.
    #[serde(default, deserialize_with = "lenient")]
    pub duration_ms: Option<f64>,
    /// The snapshot protocol's messages and log.
    #[serde(default, deserialize_with = "lenient")]
    pub protocol: Option<ProtocolStats>,
    /// The switch's cut session (its `pairs` are the traffic during the
    /// cut, which orders a restore's starts).
    #[serde(default, deserialize_with = "lenient")]
    pub switch: Option<SessionStats>,
}

impl ClusterSnapshotMetrics {
    /// Reads `cluster.json`'s `metrics` (lenient, see the module docs).
    pub fn read(metrics: &serde_json::Value) -> Self {
        Self::deserialize(metrics).unwrap_or_default()
    }

    /// As `cluster.json` holds it.
    pub fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("cluster metrics serialise")
    }
}

/// What a restore reads back of one VM's `metrics` in `cluster.json`
/// (written as its [`VmSnapshotReport`](super::cluster_snapshot::VmSnapshotReport),
/// whose field names these are): the guest's TCP counters around the cut.
/// Snapshots from before `tcp_before`/`tcp_after` have only the
/// `retrans_*` pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub struct VmCutCounters {
    /// RetransSegs before the snapshot.
    #[serde(default, deserialize_with = "lenient")]
    pub retrans_before: Option<u64>,
    /// RetransSegs after it.
    #[serde(default, deserialize_with = "lenient")]
    pub retrans_after: Option<u64>,
    /// Every counter of the last stat line before the snapshot.
    #[serde(default, deserialize_with = "lenient")]
    pub tcp_before: Option<TcpCounters>,
    /// And of the stat line after.
    #[serde(default, deserialize_with = "lenient")]
    pub tcp_after: Option<TcpCounters>,
}

impl VmCutCounters {
    /// Reads a VM's `metrics` (lenient).
    pub fn read(metrics: &serde_json::Value) -> Self {
        Self::deserialize(metrics).unwrap_or_default()
    }
}

/// `Some` if the field reads as a `T`, `None` if it is absent, `null` or
/// in another layout.
fn lenient<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let v = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(v).ok())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::results::cluster_snapshot::{PairBackoff, VmSnapshotReport};

    /// `metrics` of a cluster snapshot main (a2be2f4) wrote with `json!`
    /// (real, lab guests; the protocol's event log shortened).
    fn main_a2be2f4() -> serde_json::Value {
        json!({"backoff":{"avg_ms":80.17,"max_ms":80.17,"pairs":[{"a":"a","b":"b","backoff_ms":80.17}]},
            "downtime_avg_ms":59.6235,"downtime_max_ms":80.17,"duration_ms":6134.98396,
            "protocol":{"events":["0.0 ms: SNAPSHOT sent to 2 peers","protocol ended after 3917.9 ms"],"messages_dropped":0,"messages_sent":12},
            "switch":{"bound_hits":0,"dropped":0,"epoch":1795847331493_u64,"forwarded":393,"held":1,"log_overflow":0,"logged":1,"logged_bytes":130,
                "pairs":[{"bytes":70,"frames":1,"from":"_host","to":"a","unicast_frames":0},{"bytes":25480,"frames":196,"from":"a","to":"b","unicast_frames":196}],
                "pending_pre_frames":0,
                "ports":[{"auto_held":false,"color":"post","cut_unix_us":1795847331734851_u64,"name":"a","partial_pending":false,"port":1,"session_hold":false,"triggered":false}],
                "triggers":0,"unlogged_at_end":0,"unread_bytes_at_cut":0,"unsettled_cuts":0,"violations":0}})
    }

    #[test]
    fn metrics_main_wrote_read_typed_and_write_back_the_same() {
        let m = ClusterSnapshotMetrics::read(&main_a2be2f4());
        let b = m.backoff.as_ref().unwrap();
        assert_eq!(b.avg_ms, 80.17);
        assert_eq!(
            b.pairs,
            vec![PairBackoff {
                a: "a".into(),
                b: "b".into(),
                backoff_ms: 80.17
            }]
        );
        let sw = m.switch.as_ref().unwrap();
        assert_eq!(sw.pairs[1].unicast_frames, 196);
        assert_eq!(m.protocol.as_ref().unwrap().messages_sent, 12);
        assert_eq!(m.to_value(), main_a2be2f4());
    }

    #[test]
    fn a_field_in_another_layout_loses_only_itself() {
        let mut v = main_a2be2f4();
        v["switch"] = json!({ "pairs": "not a list" });
        v.as_object_mut().unwrap().remove("backoff");
        let m = ClusterSnapshotMetrics::read(&v);
        assert_eq!(m.switch, None);
        assert_eq!(m.backoff, None);
        assert_eq!(m.downtime_max_ms, Some(80.17));
        assert_eq!(
            ClusterSnapshotMetrics::read(&serde_json::Value::Null),
            Default::default()
        );
    }

    #[test]
    fn cut_counters_read_what_a_vm_report_writes() {
        // VM b's `metrics` in the same cluster.json, a VmSnapshotReport.
        let written = json!({"complete_ms": 3351.14, "downtime_ms": 39.077, "drain_bound_hit": false,
            "drain_wait_us": 1551, "frames_drained_at_cut": 0, "pages_stored": 16680,
            "path": "/tmp/typedstore-run/rd/snapshots/cl1/vms/b",
            "pause": {"parts": [{"name": "stop", "us": 7843}, {"name": "disk_snapshot", "us": 30946}], "total_us": 39077},
            "pause_end_ms": 283.163, "pause_start_ms": 244.086, "pingpong_max_gap_ms": 152,
            "retrans_after": 3, "retrans_before": 3, "settle_us": 1516, "start_ms": 1.059,
            "tcp_after": {"dsack": 3, "retrans": 3, "rto": 2, "tlp": 1, "tlp_recovered": 0},
            "tcp_before": {"dsack": 3, "retrans": 3, "rto": 2, "tlp": 1, "tlp_recovered": 0},
            "transient_done_ms": 291.698, "unread_bytes_at_cut": 0, "unsettled": false, "vm": "b"});
        let mut report: VmSnapshotReport = serde_json::from_value(written.clone()).unwrap();
        assert_eq!(serde_json::to_value(&report).unwrap(), written);
        let c = VmCutCounters::read(&written);
        assert_eq!((c.retrans_before, c.retrans_after), (Some(3), Some(3)));
        assert_eq!(c.tcp_before, Some(report.tcp_before));
        // The names are the report's: a change there shows here.
        report.retrans_after = Some(4);
        report.tcp_after.retrans = Some(4);
        let c = VmCutCounters::read(&serde_json::to_value(&report).unwrap());
        assert_eq!(c.retrans_after, Some(4));
        assert_eq!(c.tcp_after.and_then(|t| t.retrans), Some(4));
        // Before the counters were recorded: the retransmits only.
        let old = VmCutCounters::read(&json!({"retrans_before": 7, "retrans_after": 7}));
        assert_eq!((old.retrans_before, old.tcp_before), (Some(7), None));
    }
}
