//! Listing the snapshots under a directory, and removing what interrupted
//! snapshots left behind.
//!
//! A snapshot directory is `<root>/<name>`. A writer works in
//! `<root>/<name>.tmp-<pid>-<n>` and renames it at commit, so a temporary
//! directory is never listed; a directory without a valid manifest whose
//! files have the sizes it names is listed as invalid. Cluster snapshots
//! (directories holding a `cluster.json`) are listed by
//! [`crate::cluster::list_cluster_snapshots`], not here.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::cluster::is_cluster_snapshot;
use crate::error::ReadError;
use crate::format::FileKind;
use crate::manifest::Manifest;

/// What separates a snapshot name from the writer's pid in a temporary
/// directory name.
pub const TEMP_MARKER: &str = ".tmp-";

/// Why listing or cleaning failed.
#[derive(Debug, Error)]
pub enum ListError {
    /// The root could not be read, or a stale directory not removed.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// One entry of [`list_snapshots`].
#[derive(Debug)]
pub struct SnapshotEntry {
    /// Directory name.
    pub name: String,
    /// Directory path.
    pub path: PathBuf,
    /// Whether it is a committed, intact-looking snapshot.
    pub status: Result<Box<Manifest>, ReadError>,
}

impl SnapshotEntry {
    /// True if the snapshot's manifest is valid and its files have the
    /// sizes the manifest names. (Use [`crate::Image::verify`] for a full check.)
    pub fn is_valid(&self) -> bool {
        self.status.is_ok()
    }
}

/// If `name` is a writer's temporary directory, the writer's pid.
pub fn temp_dir_pid(name: &str) -> Option<Option<u32>> {
    let (_, rest) = name.rsplit_once(TEMP_MARKER)?;
    Some(rest.split('-').next().and_then(|p| p.parse().ok()))
}

/// Checks that `dir` holds a committed snapshot: a valid manifest and data
/// files of the sizes it names. Cheap (reads only the manifest).
pub fn check_committed(dir: &Path) -> Result<Manifest, ReadError> {
    let (_, m) = Manifest::load(&dir.join(FileKind::Manifest.default_name()))?;
    for (_, f) in m.files.all() {
        let path = dir.join(&f.name);
        let found = fs::metadata(&path)
            .map_err(|e| ReadError::io(&path, e))?
            .len();
        if found < f.size {
            return Err(ReadError::Truncated {
                file: path,
                expected: f.size,
                found,
            });
        }
        if found > f.size {
            return Err(ReadError::corrupt(
                path,
                format!("{found} bytes, the manifest says {}", f.size),
            ));
        }
    }
    Ok(m)
}

/// Lists the snapshot directories under `root`, sorted by name. Temporary
/// directories of writers (finished or not), hidden entries, plain files
/// and cluster snapshots ([`crate::cluster::is_cluster_snapshot`], listed by
/// [`crate::cluster::list_cluster_snapshots`]) are skipped.
pub fn list_snapshots(root: &Path) -> Result<Vec<SnapshotEntry>, ListError> {
    Ok(snapshot_dirs(root)?
        .into_iter()
        .filter(|(_, path)| !is_cluster_snapshot(path))
        .map(|(name, path)| {
            let status = check_committed(&path).map(Box::new);
            SnapshotEntry { name, path, status }
        })
        .collect())
}

/// The directories under `root` that may be snapshots (per-VM or cluster),
/// sorted by name: hidden entries, writers' temporary directories and plain
/// files are skipped.
pub(crate) fn snapshot_dirs(root: &Path) -> Result<Vec<(String, PathBuf)>, ListError> {
    let io = |e| ListError::Io {
        path: root.into(),
        source: e,
    };
    let mut out = Vec::new();
    for ent in fs::read_dir(root).map_err(io)? {
        let ent = ent.map_err(io)?;
        let Ok(name) = ent.file_name().into_string() else {
            continue;
        };
        if name.starts_with('.') || temp_dir_pid(&name).is_some() {
            continue;
        }
        let path = ent.path();
        if path.is_dir() {
            out.push((name, path));
        }
    }
    out.sort();
    Ok(out)
}

/// Removes the temporary directories under `root` whose writer process
/// is no longer running (or whose name carries no pid). Returns what was
/// removed. A running writer's directory is left alone.
pub fn cleanup_stale(root: &Path) -> Result<Vec<PathBuf>, ListError> {
    cleanup_where(root, |pid| pid.is_some_and(process_running))
}

/// Whether process `pid` still runs: it exists and is neither a zombie nor
/// dying. A killed writer stays in `/proc` as a zombie until its parent
/// reaps it, and an agent's parent is whatever adopted it (an init that
/// may reap late, or never): its temporary directories are garbage then.
pub fn process_running(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S ...`: comm may hold spaces and parentheses, the state
    // follows the last ')'.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    !matches!(state, Some('Z' | 'X' | 'x') | None)
}

/// Removes the temporary directories under `root` except those for which
/// `keep` (given the writer's pid, if the name carries one) says true.
/// Returns what was removed.
pub fn cleanup_where(
    root: &Path,
    keep: impl Fn(Option<u32>) -> bool,
) -> Result<Vec<PathBuf>, ListError> {
    let rd = fs::read_dir(root).map_err(|e| ListError::Io {
        path: root.into(),
        source: e,
    })?;
    let mut removed = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| ListError::Io {
            path: root.into(),
            source: e,
        })?;
        let Ok(name) = ent.file_name().into_string() else {
            continue;
        };
        let Some(pid) = temp_dir_pid(&name) else {
            continue;
        };
        if keep(pid) {
            continue;
        }
        let path = ent.path();
        let r = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match r {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ListError::Io { path, source: e }),
        }
    }
    removed.sort();
    Ok(removed)
}
