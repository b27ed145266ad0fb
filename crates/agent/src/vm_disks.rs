//! The disk files in a VM's directory (`cluster/<vm>/`), which the agent
//! made and nobody else reads once the VM is gone:
//!
//! - `*.qcow2`: the overlays the VM wrote (a lab VM's `disk0.qcow2`, an
//!   image VM's `root.qcow2` and `disk<i>.qcow2`) and the overlay each
//!   snapshot put on top (`data-<ms>.qcow2`), which is the VM's current disk;
//! - `disk-<ms>/`: a restored VM's frozen chain, hard links of the
//!   snapshot's own files (the snapshot keeps its copy).
//!
//! `down` removes them with the VMs (console and QEMU logs stay until the
//! next `up`), and `gc` removes those of a directory that no VM of the
//! cluster up and no live QEMU uses (a `down` of an earlier vmcsnap left
//! them). Frozen disks of snapshots live under `snapshots/.disks/`, never
//! here.
//!
//! A VM taken out of the cluster by `vmcsnap stop` keeps its disks: its
//! directory holds the file [`STOPPED_MARK`] until a VM of the cluster runs
//! there again or `down` removes the cluster. `gc` (the one an agent runs
//! when it restarts included) keeps the disks of a marked directory;
//! without the mark an agent killed between a `stop` and the restore that
//! follows it deleted the stopped VM's disks.

use std::path::{Path, PathBuf};

use crate::log;

/// The disk files of the VM directory `dir` (none if it is not one).
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            match e.file_type() {
                Ok(t) if t.is_file() => name.ends_with(".qcow2"),
                Ok(t) if t.is_dir() => name
                    .strip_prefix("disk-")
                    .is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())),
                _ => false,
            }
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// The file that marks the directory of a VM `vmcsnap stop` took out of
/// the cluster: its disks stay.
pub const STOPPED_MARK: &str = "stopped";

/// Marks `dir` as the directory of a stopped VM whose disks stay.
pub fn mark_stopped(dir: &Path) -> Result<(), crate::AgentError> {
    let text = "This VM was stopped with `vmcsnap stop`: its disks stay here until \
                a VM runs in this directory again or `vmcsnap down`.\n";
    crate::paths::write_atomic(&dir.join(STOPPED_MARK), text.as_bytes())
}

/// `dir` holds a VM of the cluster again (recorded as one).
pub fn unmark_stopped(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(STOPPED_MARK));
}

/// Whether `dir` is the directory of a VM `vmcsnap stop` took out.
pub fn is_stopped(dir: &Path) -> bool {
    dir.join(STOPPED_MARK).is_file()
}

/// What [`remove_unused`] does with the disks of stopped VMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoppedDisks {
    /// `gc`: they stay.
    Keep,
    /// `down`: they go with the cluster, and so does the mark.
    Remove,
}

/// What [`remove_unused`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removal {
    /// The disk files removed.
    pub removed: Vec<PathBuf>,
    /// The disk files kept because their VM was stopped, not removed.
    pub kept_stopped: Vec<PathBuf>,
}

/// Removes the disk files of every VM directory under `cluster_dir` except
/// those in `keep` (where a stale stop mark goes: a VM runs there), those
/// a live QEMU names on its command line and, with [`StoppedDisks::Keep`],
/// those of stopped VMs.
pub fn remove_unused(cluster_dir: &Path, keep: &[PathBuf], stopped: StoppedDisks) -> Removal {
    let Ok(entries) = std::fs::read_dir(cluster_dir) else {
        return Removal::default();
    };
    let mut done = Removal::default();
    for dir in entries.flatten().map(|e| e.path()) {
        if !dir.is_dir() {
            continue;
        }
        if keep.contains(&dir) {
            unmark_stopped(&dir);
            continue;
        }
        let leftovers = files(&dir);
        if is_stopped(&dir) {
            if stopped == StoppedDisks::Keep {
                done.kept_stopped.extend(leftovers);
                continue;
            }
            unmark_stopped(&dir);
        }
        if leftovers.is_empty() {
            continue;
        }
        // (Not an old QEMU whose exit goes on in the background.)
        let users: Vec<u32> = crate::qemu_find::qemus_using(&dir)
            .into_iter()
            .filter(|&p| !crate::qemu_exit::exiting(p))
            .collect();
        if !users.is_empty() {
            log(format!(
                "keeping the disks of {}: QEMU {users:?} still uses them",
                dir.display()
            ));
            continue;
        }
        for f in leftovers {
            let r = if f.is_dir() {
                std::fs::remove_dir_all(&f)
            } else {
                std::fs::remove_file(&f)
            };
            match r {
                Ok(()) => done.removed.push(f),
                Err(e) => log(format!("cannot remove {}: {e}", f.display())),
            }
        }
    }
    done.removed.sort();
    done.kept_stopped.sort();
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_disk_files_of_unused_vm_directories_go() {
        let d = tempfile::tempdir().unwrap();
        let cluster = d.path().join("cluster");
        for vm in ["a", "b"] {
            let dir = cluster.join(vm);
            std::fs::create_dir_all(dir.join("disk-1700000000000")).unwrap();
            std::fs::create_dir_all(dir.join("disk-notastamp")).unwrap();
            for f in [
                "disk0.qcow2",
                "data-1700000000001.qcow2",
                "console.log",
                "qemu.log",
            ] {
                std::fs::write(dir.join(f), b"x").unwrap();
            }
            std::fs::write(dir.join("disk-1700000000000/data-1.qcow2"), b"x").unwrap();
        }
        let a = cluster.join("a");
        assert_eq!(
            files(&a),
            vec![
                a.join("data-1700000000001.qcow2"),
                a.join("disk-1700000000000"),
                a.join("disk0.qcow2"),
            ]
        );
        // `b` is kept (a VM of the cluster up uses it).
        let done = remove_unused(&cluster, &[cluster.join("b")], StoppedDisks::Keep);
        assert_eq!(done.removed, files_of_before(&a));
        assert!(files(&a).is_empty());
        assert!(a.join("console.log").exists() && a.join("disk-notastamp").exists());
        assert_eq!(files(&cluster.join("b")).len(), 3);
        let none = remove_unused(&d.path().join("none"), &[], StoppedDisks::Keep);
        assert_eq!(none, Removal::default());
    }

    /// Regression: an agent killed after `vmcsnap stop` (before the restore
    /// that was to follow) deleted the stopped VM's disks when the next
    /// agent collected leftovers (seed 1795867408064540299 of
    /// `agent_killed.rs`).
    #[test]
    fn a_stopped_vms_disks_stay_until_down_and_its_mark_goes_when_it_runs_again() {
        let d = tempfile::tempdir().unwrap();
        let cluster = d.path().join("cluster");
        let (a, b) = (cluster.join("a"), cluster.join("b"));
        for dir in [&a, &b] {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join("disk0.qcow2"), b"x").unwrap();
            mark_stopped(dir).unwrap();
        }
        assert!(is_stopped(&a));
        // gc: `a` is stopped, `b` runs again (a member): its mark is stale.
        let done = remove_unused(&cluster, std::slice::from_ref(&b), StoppedDisks::Keep);
        assert!(done.removed.is_empty());
        assert_eq!(done.kept_stopped, vec![a.join("disk0.qcow2")]);
        assert!(is_stopped(&a) && !is_stopped(&b));
        assert!(a.join("disk0.qcow2").exists() && b.join("disk0.qcow2").exists());
        // down: everything goes, the mark too.
        let done = remove_unused(&cluster, &[], StoppedDisks::Remove);
        assert_eq!(
            done.removed,
            vec![a.join("disk0.qcow2"), b.join("disk0.qcow2")]
        );
        assert!(done.kept_stopped.is_empty());
        assert!(!is_stopped(&a) && files(&a).is_empty());
    }

    fn files_of_before(a: &Path) -> Vec<PathBuf> {
        vec![
            a.join("data-1700000000001.qcow2"),
            a.join("disk-1700000000000"),
            a.join("disk0.qcow2"),
        ]
    }
}
