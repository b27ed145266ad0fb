//! `gc` of the detection layer's index cache, `<run>/disk-index/` (see
//! `snapshot::disk_match`): one file per indexed disk file, named by that
//! file's device, inode, length and modification time, at most 64 of them.
//!
//! Same rule as the rest of `gc`: what a live snapshot or VM uses stays.
//! The index of a file stays while that very file (same identity) is a
//! file of a committed snapshot's frozen disk (anything under
//! `snapshots/.disks/`, and every file of those chains) or of a VM's disk
//! chain; every other index names a file that is gone or has changed, and
//! no snapshot can use it again. A temporary file of a cache write (`.tmp-<pid>`)
//! goes once its writer process is gone. Other files are left alone.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use vmcsnap_qcow2::FileIdentity;

use crate::snapshot::disk_match::cache_name;
use crate::snapshot_removal::chain_files;

/// Directories below `snapshots/.disks/` that are walked (a cluster
/// snapshot's disks are two levels down).
const MAX_WALK_DEPTH: usize = 4;

/// Removes the cached indexes in `cache` that no file in use has (see the
/// module docs): `frozen` is `snapshots/.disks`, `in_use` the disk files
/// of VMs and snapshots. Returns what was removed.
pub(super) fn clean(cache: &Path, frozen: &Path, in_use: &BTreeSet<PathBuf>) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(cache) else {
        return Vec::new();
    };
    let live = live_names(frozen, in_use);
    let me = std::process::id();
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let garbage = if name.ends_with(".idx") {
            !live.contains(&name)
        } else if let Some(pid) = temp_pid(&name) {
            pid != me && !vmcsnap_image::process_running(pid)
        } else {
            false
        };
        if !garbage || !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => {
                tracing::info!(path = %e.path().display(), "gc: removed a disk index no file in use has");
                removed.push(e.path());
            }
            Err(err) => {
                tracing::warn!(path = %e.path().display(), error = %err, "gc: could not remove a disk index")
            }
        }
    }
    removed
}

/// The cache names of every file in use.
fn live_names(frozen: &Path, in_use: &BTreeSet<PathBuf>) -> BTreeSet<String> {
    let mut files = Vec::new();
    walk(frozen, 0, &mut files);
    for f in in_use {
        files.extend(chain_files(f));
    }
    files
        .iter()
        .filter_map(|f| identity(f))
        .map(|id| cache_name(&id))
        .collect()
}

/// Every regular file under `dir`.
fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        match e.file_type() {
            Ok(t) if t.is_dir() && depth < MAX_WALK_DEPTH => walk(&e.path(), depth + 1, out),
            Ok(t) if t.is_file() => out.push(e.path()),
            _ => {}
        }
    }
}

/// The identity the index cache keys `path` by (as `Disk::identity`).
fn identity(path: &Path) -> Option<FileIdentity> {
    let m = std::fs::metadata(path).ok()?;
    m.is_file().then(|| FileIdentity {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

/// The writer's pid of a cache file being written (`<name>.tmp-<pid>`).
fn temp_pid(name: &str) -> Option<u32> {
    name.rsplit_once(".tmp-")?.1.parse().ok()
}

#[cfg(test)]
#[path = "disk_index_tests.rs"]
mod tests;
