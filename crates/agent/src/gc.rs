//! `vmcsnap gc`: removes what dead operations left in the snapshot
//! directory.
//!
//! - a snapshot's temporary directory (`<name>.tmp-<pid>-…`) whose writer is
//!   gone, or is this agent: gc runs with the cluster locked, so no snapshot
//!   of ours is being written (one abandoned by a failed request, a panic
//!   included, is garbage);
//! - a frozen-disk directory `.disks/<name>` with no snapshot `<name>` beside
//!   it (a snapshot killed after the disk was frozen and before it was
//!   committed, or one deleted), unless a running VM's disk chain still
//!   reads from it (a VM restored from a snapshot since deleted) or the
//!   frozen disk of a snapshot that stays does (one taken of such a VM; see
//!   `snapshot_removal::disk_refs`);
//! - the disk files of a VM directory under `cluster/` that no VM of the
//!   cluster up and no live QEMU uses, unless `vmcsnap stop` stopped that VM
//!   ([`vm_dir_leftovers`]);
//! - a cached disk index (`<run>/disk-index/`) of a file that no snapshot
//!   and no VM has any more ([`disk_index`]).

mod disk_index;

use std::path::PathBuf;

use vmcsnap_control::GcResult;

use crate::cluster::Cluster;
use crate::{log, AgentError, RunDir};

/// Removes the leftovers; reports what went and what was kept in use.
pub fn collect(run: &RunDir, cluster: &mut Option<Cluster>) -> Result<GcResult, AgentError> {
    let root = run.snapshots_dir();
    let mut result = GcResult {
        removed: vec![],
        kept_in_use: vec![],
        kept_stopped: vec![],
    };
    let cache = run.root().join("disk-index");
    let vm_dirs = vm_dir_leftovers(run, cluster);
    result.removed.extend(vm_dirs.removed);
    result.kept_stopped = vm_dirs.kept_stopped;
    if !root.is_dir() {
        let in_use = crate::snapshot_removal::InUse::gather(&root, cluster, &Default::default());
        result.removed.extend(disk_index::clean(
            &cache,
            &root.join(".disks"),
            in_use.files(),
        ));
        return Ok(result);
    }
    let me = std::process::id();
    let temps = vmcsnap_image::cleanup_where(&root, |pid| {
        pid.is_some_and(|p| p != me && vmcsnap_image::process_running(p))
    })
    .map_err(|e| AgentError::BadRequest(format!("cleaning {}: {e}", root.display())))?;
    result.removed.extend(temps);
    let in_use = crate::snapshot_removal::InUse::gather(&root, cluster, &Default::default());
    let disks = root.join(".disks");
    let entries = std::fs::read_dir(&disks).into_iter().flatten();
    for ent in entries.flatten() {
        let dir = ent.path();
        let name = ent.file_name();
        if root.join(&name).exists() {
            continue;
        }
        if in_use.reads_from(&dir) {
            result.kept_in_use.push(dir);
            continue;
        }
        std::fs::remove_dir_all(&dir).map_err(AgentError::io("removing", &dir))?;
        log(format!("gc: removed {}", dir.display()));
        result.removed.push(dir);
    }
    // After the frozen disks above: what is left under `.disks` is in use.
    result
        .removed
        .extend(disk_index::clean(&cache, &disks, in_use.files()));
    result.removed.sort();
    result.kept_in_use.sort();
    Ok(result)
}

/// The disk files of VM directories that no member of the cluster has
/// (a VM gone with a `down` that left them; see `vm_disks`); those of VMs
/// `vmcsnap stop` took out stay.
fn vm_dir_leftovers(run: &RunDir, cluster: &Option<Cluster>) -> crate::vm_disks::Removal {
    let members: Vec<PathBuf> = cluster
        .iter()
        .flat_map(|c| &c.members)
        .filter_map(|m| m.vm.config.console_log.parent().map(PathBuf::from))
        .collect();
    let done = crate::vm_disks::remove_unused(
        &run.cluster_dir(),
        &members,
        crate::vm_disks::StoppedDisks::Keep,
    );
    for f in &done.removed {
        log(format!("gc: removed {}", f.display()));
    }
    for f in &done.kept_stopped {
        log(format!(
            "gc: kept {} (its VM is stopped, not removed)",
            f.display()
        ));
    }
    done
}

/// Every file a VM of the cluster reads or writes as disk: the recorded
/// paths, and each live QEMU's backing chains.
pub(crate) fn disk_files_in_use(cluster: &mut Option<Cluster>) -> Vec<PathBuf> {
    let Some(c) = cluster.as_mut() else {
        return vec![];
    };
    let mut files = vec![];
    for m in &mut c.members {
        files.extend(m.vm.config.disks.iter().map(|d| d.path.clone()));
        if m.vm.exited().is_some() {
            continue;
        }
        let Ok(chains) = crate::block_chains::device_chains(&mut m.vm) else {
            continue;
        };
        files.extend(chains.into_iter().flat_map(|c| c.files));
    }
    files
}
