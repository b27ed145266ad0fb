//! The plan of a cluster restore (HotRestore): the restore dependency
//! graph from what the cluster snapshot logged at its cut, each VM's
//! working-set size, the LP's revised sizes and the restore line; and the
//! same as a report for `vmcsnap inspect --rdg`. The order in which VMs
//! start is restoreline's (`Rdg::start_groups`), applied by the agent's
//! coordinator.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use vmcsnap_control::ClusterRestoreMode as Mode;
use vmcsnap_image::cluster::{check_cluster_committed, ClusterManifest};
use vmcsnap_restoreline::{revise_wss_scaled, Edge, Rdg};

use crate::host::{HostApi, HostError};

/// Why a cluster restore cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The cluster snapshot is not a committed one.
    #[error("cluster snapshot {}: {detail}", dir.display())]
    Snapshot {
        /// Its directory.
        dir: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The graph is not valid (an edge names an unknown VM).
    #[error("restore dependency graph: {0}")]
    Graph(String),
    /// The LP found no revision.
    #[error("revising working-set sizes: {0}")]
    Revise(String),
    /// The host could not say a VM's working-set size.
    #[error(transparent)]
    Host(#[from] HostError),
}

/// For the LP: pages of working-set difference asked per frame logged from
/// a sender to a receiver (the paper's W is a frame count; a difference of
/// a few pages would not order real load times).
pub const PAGES_PER_FRAME: u64 = 64;

/// One VM's part of the plan.
pub struct PlannedVm {
    /// The VM.
    pub name: String,
    /// Its snapshot directory.
    pub dir: PathBuf,
    /// HotRestore's hybrid working-set size (pages).
    pub hybrid: u64,
    /// The size this mode restores with (revised for `hotrestore-rl`).
    pub size: u64,
}

/// The graph, the sizes and the start policy of a cluster restore.
pub struct Plan {
    /// Per VM, in the manifest's order.
    pub vms: Vec<PlannedVm>,
    /// The restore dependency graph.
    pub rdg: Rdg,
    /// The restore line (ascending revised size) or, without one, the VMs.
    pub line: Vec<String>,
    /// Σ|S*_i − S_i| of the revision (0 without one).
    pub lp_objective: f64,
}

/// The plan of a restore of the cluster snapshot `m` in `dir`: the
/// restore dependency graph, each VM's working-set size (asked of `host`)
/// and, for `hotrestore-rl`, the sizes revised by the LP and the restore
/// line.
pub fn plan(
    m: &ClusterManifest,
    dir: &Path,
    mode: Mode,
    host: &dyn HostApi,
) -> Result<Plan, PlanError> {
    let names: Vec<String> = m.vms.iter().map(|v| v.name.clone()).collect();
    let edges = graph_edges(m, &names);
    let rdg = Rdg::new(names.clone(), edges).map_err(|e| PlanError::Graph(e.to_string()))?;
    let mut vms = Vec::new();
    let mut sizes = BTreeMap::new();
    for v in &m.vms {
        let vdir = dir.join(&v.snapshot);
        let hybrid = host.working_set_pages(&vdir)?;
        sizes.insert(v.name.clone(), hybrid);
        vms.push(PlannedVm {
            name: v.name.clone(),
            dir: vdir,
            hybrid,
            size: hybrid,
        });
    }
    let (line, lp_objective) = if mode == Mode::HotrestoreRl {
        let r = revise_wss_scaled(&rdg, &sizes, PAGES_PER_FRAME)
            .map_err(|e| PlanError::Revise(e.to_string()))?;
        for v in &mut vms {
            v.size = r.sizes.get(&v.name).copied().unwrap_or(v.hybrid);
        }
        (r.restore_line, r.objective)
    } else {
        (names, 0.0)
    };
    Ok(Plan {
        vms,
        rdg,
        line,
        lp_objective,
    })
}

/// The edges of the restore dependency graph: VM i → VM j with W(i,j) =
/// frames from i to j logged at the cut (cluster.json's `edges`), plus,
/// with weight 1, every pair that exchanged unicast frames while the cut
/// was being taken (the switch's per-pair counts, `metrics.switch.pairs`).
///
/// vmcsnap's cut is exact and short, so it logs only a handful of frames
/// (often none): the logged frames alone leave most VMs as orphans and
/// their starts unordered, and a VM that starts before a peer it talks to
/// backs off. Traffic during the cut is the same evidence HotRestore uses,
/// "VM i sent to VM j at the cut", over the few milliseconds of the cut
/// instead of only the frames crossing it. A TCP conversation sends both
/// ways, so its VMs form a ring and start together.
pub fn graph_edges(m: &ClusterManifest, names: &[String]) -> Vec<Edge> {
    let mut w: BTreeMap<(String, String), u64> = BTreeMap::new();
    for e in &m.edges {
        *w.entry((e.from.clone(), e.to.clone())).or_default() += e.frames;
    }
    let known = |n: &str| names.iter().any(|x| x == n);
    let switch = vmcsnap_control::ClusterSnapshotMetrics::read(&m.metrics).switch;
    for p in switch.iter().flat_map(|s| &s.pairs) {
        let (from, to) = (p.from.as_str(), p.to.as_str());
        if p.unicast_frames > 0 && from != to && known(from) && known(to) {
            let e = w.entry((from.to_string(), to.to_string())).or_default();
            *e = (*e).max(1);
        }
    }
    w.into_iter()
        .map(|((from, to), weight)| Edge::new(from, to, weight))
        .collect()
}

/// The restore dependency graph of a cluster snapshot and what a
/// `hotrestore-rl` restore would do with it (`vmcsnap inspect --rdg`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RdgReport {
    /// The cluster snapshot.
    pub snapshot: String,
    /// VMs.
    pub vms: Vec<String>,
    /// Edges (from, to, frames logged at the cut).
    pub edges: Vec<(String, String, u64)>,
    /// Rings: VMs that sent to each other (they start together).
    pub rings: Vec<Vec<String>>,
    /// VMs without any edge.
    pub orphans: Vec<String>,
    /// HotRestore's causal restore order (rules 1-6), in groups.
    pub causal_order: Vec<Vec<String>>,
    /// Per VM: the VMs that must run before it starts.
    pub must_start_after: BTreeMap<String, Vec<String>>,
    /// HotRestore's hybrid working-set sizes (pages).
    pub sizes: BTreeMap<String, u64>,
    /// The LP-revised sizes (pages).
    pub revised: BTreeMap<String, u64>,
    /// Σ|S*_i − S_i|.
    pub lp_objective: f64,
    /// The restore line: ascending revised size.
    pub restore_line: Vec<String>,
    /// Graphviz DOT of the graph with the revised sizes.
    pub dot: String,
}

/// The restore dependency graph of the cluster snapshot in `dir`.
pub fn dependency_report(dir: &Path, host: &dyn HostApi) -> Result<RdgReport, PlanError> {
    let m = check_cluster_committed(dir).map_err(|e| PlanError::Snapshot {
        dir: dir.to_path_buf(),
        detail: e.to_string(),
    })?;
    let p = plan(&m, dir, Mode::HotrestoreRl, host)?;
    let sizes: BTreeMap<String, u64> = p.vms.iter().map(|v| (v.name.clone(), v.hybrid)).collect();
    let revised: BTreeMap<String, u64> = p.vms.iter().map(|v| (v.name.clone(), v.size)).collect();
    Ok(RdgReport {
        snapshot: m.name.clone(),
        vms: p.vms.iter().map(|v| v.name.clone()).collect(),
        edges: p
            .rdg
            .edges()
            .iter()
            .map(|e| (e.from.clone(), e.to.clone(), e.weight))
            .collect(),
        rings: p.rdg.rings(),
        orphans: p.rdg.orphans(),
        causal_order: p.rdg.causal_order(),
        must_start_after: p
            .rdg
            .nodes()
            .iter()
            .map(|n| (n.clone(), p.rdg.must_start_before(n)))
            .collect(),
        dot: p.rdg.to_dot(Some(&revised)),
        sizes,
        revised,
        lp_objective: p.lp_objective,
        restore_line: p.line,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn manifest(edges: serde_json::Value, pairs: serde_json::Value) -> ClusterManifest {
        let vm = |n: &str| {
            json!({ "name": n, "snapshot": format!("vms/{n}"), "memory_mib": 128, "ip": "", "mac": "",
                    "timeline": { "start_us": 0, "pause_start_us": 0, "pause_end_us": 0, "transient_done_us": 0, "complete_us": 0 } })
        };
        serde_json::from_value(json!({
            "format": "vmcsnap-cluster-snapshot", "version": 1, "name": "s", "cluster": "c", "mode": "hot",
            "created_unix_ms": 0, "network": {}, "vms": [vm("a"), vm("b"), vm("c")],
            "channel_state": { "file": "channel-state.bin", "frames": 0, "bytes": 0, "file_size": 0 },
            "edges": edges, "metrics": { "switch": {
                "epoch": 0, "forwarded": 0, "held": 0, "logged": 0, "logged_bytes": 0, "dropped": 0,
                "violations": 0, "triggers": 0, "bound_hits": 0, "unread_bytes_at_cut": 0,
                "pending_pre_frames": 0, "log_overflow": 0, "unlogged_at_end": 0, "ports": [],
                "pairs": pairs,
            } },
        }))
        .unwrap()
    }

    #[test]
    fn graph_edges_join_logged_frames_and_unicast_pairs() {
        let m = manifest(
            json!([{ "from": "a", "to": "b", "frames": 3, "bytes": 300 }]),
            json!([
                { "from": "a", "to": "b", "frames": 50, "bytes": 1, "unicast_frames": 40 },
                { "from": "b", "to": "a", "frames": 50, "bytes": 1, "unicast_frames": 40 },
                { "from": "c", "to": "a", "frames": 5, "bytes": 1, "unicast_frames": 0 },
                { "from": "c", "to": "zz", "frames": 5, "bytes": 1, "unicast_frames": 5 },
            ]),
        );
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let e: Vec<(String, String, u64)> = graph_edges(&m, &names)
            .into_iter()
            .map(|e| (e.from, e.to, e.weight))
            .collect();
        // Logged frames keep their count; a talking pair adds weight 1;
        // broadcasts only (no unicast) and unknown VMs add nothing.
        assert_eq!(
            e,
            vec![("a".into(), "b".into(), 3), ("b".into(), "a".into(), 1)]
        );
        let rdg = Rdg::new(
            names,
            graph_edges(&m, &["a".into(), "b".into(), "c".into()]),
        )
        .unwrap();
        assert_eq!(rdg.rings(), vec![vec!["a".to_string(), "b".to_string()]]);
        assert_eq!(rdg.orphans(), vec!["c".to_string()]);
    }
}
