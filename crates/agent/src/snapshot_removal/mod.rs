//! `vmcsnap snapshots delete` and `vmcsnap snapshots prune`: removing
//! committed snapshots without ever leaving one half there.
//!
//! Both run in the agent with the cluster locked, so no restore reads and
//! no capture writes a snapshot while it goes. Removing one:
//!
//! 1. `<root>/<name>` is renamed to `<name>.tmp-<pid>-del<n>`, a name the
//!    listing skips and `gc` (or the next snapshot's `cleanup_stale`)
//!    removes once this agent is gone, and the parent is fsynced: from here
//!    on the snapshot is gone as a whole. A crash before the rename leaves
//!    it intact, a crash after leaves a temporary directory;
//! 2. the temporary directory is removed;
//! 3. its frozen disks, `<root>/.disks/<name>/` (for a cluster snapshot,
//!    one subdirectory per VM), are removed, unless a running VM or the
//!    frozen disk of a snapshot that stays reads from them
//!    ([`disk_refs`]): those are reported as kept in use, and `gc` removes
//!    them once nothing does. A crash here leaves a frozen-disk directory
//!    of no snapshot, which `gc` removes too.
//!
//! Prune ([`prune`]) picks the snapshots to remove and removes them the
//! same way, in one batch.

mod depth;
mod disk_refs;
mod merge;
mod prune;
mod space;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;
use vmcsnap_control::{RemovedSnapshot, SnapshotKind, SnapshotsDeleteResult};
use vmcsnap_image::list::{temp_dir_pid, TEMP_MARKER};
use vmcsnap_image::manifest::is_plain_name;

use crate::cluster::Cluster;
use crate::{log, RunDir};

pub(crate) use disk_refs::{chain_files, InUse};
pub use prune::{prune, PruneOptions};

/// Why a delete or prune did nothing, or stopped part-way.
#[derive(Debug, Error)]
pub enum RemovalError {
    /// No snapshot of that name.
    #[error("no snapshot named {name:?} in {}; `vmcsnap snapshots` lists the names", root.display())]
    Unknown {
        /// The name given.
        name: String,
        /// The snapshot directory.
        root: PathBuf,
    },
    /// Not something a snapshot can be named.
    #[error("{name:?} is not a snapshot name: give a name as `vmcsnap snapshots` lists it (no `/` or `..`, not hidden, not a `.tmp-` directory)")]
    BadName {
        /// The name given.
        name: String,
    },
    /// The per-VM snapshot of a cluster snapshot: only the whole goes.
    #[error("{name:?} is a VM's snapshot inside the cluster snapshot {cluster:?}, which restores only whole: delete the cluster snapshot with `vmcsnap snapshots delete {cluster}`")]
    InsideCluster {
        /// The name given.
        name: String,
        /// The cluster snapshot holding it.
        cluster: String,
    },
    /// An incremental child could not be rewritten without its parent;
    /// the parent was kept (and the child is as it was).
    #[error("snapshot {child:?} needs the snapshot being deleted and could not be rewritten without it ({detail}); nothing of it was changed, and its parent was kept")]
    Merge {
        /// The child.
        child: String,
        /// Why.
        detail: String,
    },
    /// Nothing named.
    #[error("name the snapshots to delete (`vmcsnap snapshots` lists them)")]
    NoNames,
    /// `prune --keep 0` of every VM.
    #[error("--keep 0 would delete every snapshot: give --vm VM to delete all of one VM's, or name the snapshots to `vmcsnap snapshots delete`")]
    KeepZero,
    /// The snapshot directory could not be read.
    #[error("listing {}: {source}", root.display())]
    List {
        /// The snapshot directory.
        root: PathBuf,
        /// Why.
        source: vmcsnap_image::ListError,
    },
    /// Removing failed part-way.
    #[error("{what} {}: {source}; {}", path.display(), after(removed))]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
        /// The snapshots removed before it.
        removed: Vec<String>,
    },
}

fn after(removed: &[String]) -> String {
    let then = "fix the cause and run the command again; what a half-done removal left is a \
                `.tmp-` or frozen-disk directory that `vmcsnap gc` removes";
    if removed.is_empty() {
        then.into()
    } else {
        format!("removed before that: {}; {then}", removed.join(", "))
    }
}

/// A snapshot about to go.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub name: String,
    pub path: PathBuf,
    pub kind: SnapshotKind,
    /// The VM (cluster) it is of, if its manifest reads.
    pub of: Option<String>,
    pub created_unix_ms: Option<u64>,
}

/// Deletes the snapshots named `names` (per-VM or cluster snapshots, as
/// `vmcsnap snapshots` lists them, valid or not). Every name is checked
/// before anything is removed.
pub fn delete(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    names: &[String],
) -> Result<SnapshotsDeleteResult, RemovalError> {
    let root = run.snapshots_dir();
    if names.is_empty() {
        return Err(RemovalError::NoNames);
    }
    let mut targets: Vec<Target> = Vec::new();
    for name in names {
        let t = resolve(&root, name)?;
        if !targets.iter().any(|o| o.name == t.name) {
            targets.push(t);
        }
    }
    remove(&root, cluster, targets, false)
}

/// The snapshot `name` under `root`, or why it is none.
pub(crate) fn resolve(root: &Path, name: &str) -> Result<Target, RemovalError> {
    let bad = || RemovalError::BadName { name: name.into() };
    if name.contains('/') {
        return Err(inside_cluster(root, name).unwrap_or_else(bad));
    }
    if !is_plain_name(name) || name.starts_with('.') || temp_dir_pid(name).is_some() {
        return Err(bad());
    }
    let path = root.join(name);
    if !path.is_dir() {
        return Err(RemovalError::Unknown {
            name: name.into(),
            root: root.into(),
        });
    }
    let (kind, facts) = if vmcsnap_image::is_cluster_snapshot(&path) {
        let m = vmcsnap_image::check_cluster_committed(&path).ok();
        (
            SnapshotKind::Cluster,
            m.map(|m| (m.cluster, m.created_unix_ms)),
        )
    } else {
        let m = vmcsnap_image::check_committed(&path).ok();
        (SnapshotKind::Vm, m.map(|m| (m.vm.name, m.created_unix_ms)))
    };
    let (of, created) = facts.unzip();
    Ok(Target {
        name: name.into(),
        path,
        kind,
        of,
        created_unix_ms: created,
    })
}

/// If `name` (a path with `/`) is inside a cluster snapshot under `root`
/// (`<cluster>/vms/<vm>`, relative or absolute), the error saying so.
fn inside_cluster(root: &Path, name: &str) -> Option<RemovalError> {
    let p = Path::new(name);
    let rel = if p.is_absolute() {
        p.strip_prefix(root).ok()?
    } else {
        p
    };
    let mut parts = rel.components();
    let Some(Component::Normal(first)) = parts.next() else {
        return None;
    };
    let rest: Vec<Component> = parts.collect();
    let plain = rest.iter().all(|c| matches!(c, Component::Normal(_)));
    let cluster = first.to_str()?;
    if rest.is_empty() || !plain || !vmcsnap_image::is_cluster_snapshot(&root.join(cluster)) {
        return None;
    }
    Some(RemovalError::InsideCluster {
        name: name.into(),
        cluster: cluster.into(),
    })
}

/// The snapshots that need snapshot `name` to restore: its incremental
/// children. Removing it first rewrites each of them without it
/// ([`merge`]).
pub(crate) fn children_of(root: &Path, name: &str) -> Vec<String> {
    merge::children_of(root, name)
}

/// Removes `targets` (or, with `dry_run`, says what removing them would
/// do): the one way snapshots are deleted, for delete and prune alike.
pub(crate) fn remove(
    root: &Path,
    cluster: &mut Option<Cluster>,
    targets: Vec<Target>,
    dry_run: bool,
) -> Result<SnapshotsDeleteResult, RemovalError> {
    let leaving: BTreeSet<String> = targets.iter().map(|t| t.name.clone()).collect();
    let in_use = InUse::gather(root, cluster, &leaving);
    let mut kept_in_use = Vec::new();
    let mut disks: Vec<Option<PathBuf>> = Vec::new();
    for t in &targets {
        let d = root.join(".disks").join(&t.name);
        if !d.is_dir() {
            disks.push(None);
        } else if in_use.reads_from(&d) {
            kept_in_use.push(d);
            disks.push(None);
        } else {
            disks.push(Some(d));
        }
    }
    let mut trees: Vec<(usize, &Path)> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        trees.push((i, &t.path));
        if let Some(d) = &disks[i] {
            trees.push((i, d));
        }
    }
    let freed = space::bytes_freed(&trees, targets.len());
    let mut result = SnapshotsDeleteResult {
        root: root.into(),
        dry_run,
        removed: vec![],
        kept: vec![],
        bytes_freed: freed.iter().sum(),
        kept_in_use,
        merged: vec![],
    };
    for ((t, d), bytes_freed) in targets.into_iter().zip(disks).zip(freed) {
        if !dry_run {
            // Its incremental children first: each is rewritten without it
            // (a failure keeps it, and everything after it).
            for child in children_of(root, &t.name) {
                let done: Vec<String> = result.removed.iter().map(|r| r.name.clone()).collect();
                merge::merge_parent_into(root, &child).map_err(|e| match e {
                    RemovalError::Merge { child, detail } if !done.is_empty() => {
                        RemovalError::Merge {
                            child,
                            detail: format!("{detail}; {}", after(&done)),
                        }
                    }
                    e => e,
                })?;
                result.merged.push(child);
            }
            let done: Vec<String> = result.removed.iter().map(|r| r.name.clone()).collect();
            remove_one(root, &t, d.as_deref()).map_err(|e| e.after(done))?;
            log(format!(
                "deleted snapshot {} ({bytes_freed} bytes freed)",
                t.name
            ));
        }
        result.removed.push(RemovedSnapshot {
            name: t.name,
            kind: t.kind,
            of: t.of,
            created_unix_ms: t.created_unix_ms,
            bytes_freed,
            disks_removed: d,
        });
    }
    Ok(result)
}

/// An I/O failure of [`remove_one`], before the list of what went before.
struct Failed(&'static str, PathBuf, io::Error);

impl Failed {
    fn after(self, removed: Vec<String>) -> RemovalError {
        RemovalError::Io {
            what: self.0,
            path: self.1,
            source: self.2,
            removed,
        }
    }
}

/// Steps 1-3 of the module docs for one snapshot.
fn remove_one(root: &Path, t: &Target, disks: Option<&Path>) -> Result<(), Failed> {
    let tmp = root.join(temp_name(&t.name));
    std::fs::rename(&t.path, &tmp).map_err(|e| Failed("renaming", t.path.clone(), e))?;
    sync_dir(root).map_err(|e| Failed("syncing", root.into(), e))?;
    std::fs::remove_dir_all(&tmp).map_err(|e| Failed("removing", tmp.clone(), e))?;
    if let Some(d) = disks {
        match std::fs::remove_dir_all(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Failed("removing", d.into(), e)),
        }
    }
    Ok(())
}

/// `<name>.tmp-<pid>-del<n>`, the name cut short if need be to fit in a
/// directory entry (255 bytes).
pub(crate) fn temp_name(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let suffix = format!(
        "{TEMP_MARKER}{}-del{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let mut cut = name.len().min(255 - suffix.len());
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{suffix}", &name[..cut])
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}
