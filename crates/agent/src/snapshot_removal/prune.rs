//! `vmcsnap snapshots prune --keep N`: all but the N newest committed
//! snapshots of each VM go, and of each cluster's cluster snapshots.
//!
//! A snapshot's age is the commit time its manifest records (`Manifest`'s
//! `created_unix_ms`, `cluster.json`'s for a cluster snapshot), or the
//! directory's modification time where that is 0; ties go by name. Invalid
//! snapshots (listed as INVALID) are neither counted nor removed: name them
//! to `vmcsnap snapshots delete`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::UNIX_EPOCH;

use vmcsnap_control::{SnapshotKind, SnapshotsDeleteResult};
use vmcsnap_image::{list_cluster_snapshots, list_snapshots};

use super::{remove, resolve, RemovalError, Target};
use crate::cluster::Cluster;
use crate::RunDir;

/// What to prune.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneOptions {
    /// How many snapshots to keep per VM (per cluster).
    pub keep: u32,
    /// Only this VM's per-VM snapshots; cluster snapshots stay.
    pub vm: Option<String>,
    /// Say what would go; remove nothing.
    pub dry_run: bool,
}

/// One committed snapshot, in its series.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub name: String,
    pub kind: SnapshotKind,
    /// The VM (or cluster) whose series it is in.
    pub series: String,
    /// Commit time, Unix ms.
    pub at_ms: u64,
}

/// Removes all but the `opts.keep` newest committed snapshots of each VM
/// (only `opts.vm`'s, if given) and of each cluster.
pub fn prune(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    opts: &PruneOptions,
) -> Result<SnapshotsDeleteResult, RemovalError> {
    if opts.keep == 0 && opts.vm.is_none() {
        return Err(RemovalError::KeepZero);
    }
    let root = run.snapshots_dir();
    let cands = if root.is_dir() {
        candidates(&root, opts.vm.as_deref())?
    } else {
        vec![]
    };
    let (going, kept) = select(cands, opts.keep as usize);
    let targets = going
        .iter()
        .map(|c| resolve(&root, &c.name))
        .collect::<Result<Vec<Target>, _>>()?;
    let mut result = remove(&root, cluster, targets, opts.dry_run)?;
    result.kept = kept.into_iter().map(|c| c.name).collect();
    Ok(result)
}

/// The committed snapshots under `root`: the per-VM ones (only `vm`'s, if
/// given) and, without `vm`, the cluster snapshots.
pub(crate) fn candidates(root: &Path, vm: Option<&str>) -> Result<Vec<Candidate>, RemovalError> {
    let list_err = |source| RemovalError::List {
        root: root.into(),
        source,
    };
    let mut out = Vec::new();
    for e in list_snapshots(root).map_err(list_err)? {
        let Ok(m) = &e.status else { continue };
        if vm.is_some_and(|v| v != m.vm.name) {
            continue;
        }
        out.push(Candidate {
            at_ms: at_ms(m.created_unix_ms, &e.path),
            name: e.name,
            kind: SnapshotKind::Vm,
            series: m.vm.name.clone(),
        });
    }
    if vm.is_none() {
        for e in list_cluster_snapshots(root).map_err(list_err)? {
            let Ok(m) = &e.status else { continue };
            out.push(Candidate {
                at_ms: at_ms(m.created_unix_ms, &e.path),
                name: e.name,
                kind: SnapshotKind::Cluster,
                series: m.cluster.clone(),
            });
        }
    }
    Ok(out)
}

/// `created`, or the modification time of `dir` if that is 0.
fn at_ms(created: u64, dir: &Path) -> u64 {
    if created > 0 {
        return created;
    }
    std::fs::metadata(dir)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// Splits `cands` into those that go (each series' oldest first) and
/// those kept (newest first): the `keep` newest of each series stay.
pub(crate) fn select(cands: Vec<Candidate>, keep: usize) -> (Vec<Candidate>, Vec<Candidate>) {
    let mut series: BTreeMap<(bool, String), Vec<Candidate>> = BTreeMap::new();
    for c in cands {
        let key = (c.kind == SnapshotKind::Cluster, c.series.clone());
        series.entry(key).or_default().push(c);
    }
    let (mut going, mut kept) = (Vec::new(), Vec::new());
    for (_, mut list) in series {
        // Newest first; the later name first among equal times.
        list.sort_by(|a, b| (b.at_ms, &b.name).cmp(&(a.at_ms, &a.name)));
        let old = list.split_off(keep.min(list.len()));
        kept.extend(list);
        going.extend(old.into_iter().rev());
    }
    (going, kept)
}
