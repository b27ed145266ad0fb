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

/// Removes the disk files of every VM directory under `cluster_dir` except
/// those in `keep` and those a live QEMU names on its command line; returns
/// what went.
pub fn remove_unused(cluster_dir: &Path, keep: &[PathBuf]) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(cluster_dir) else {
        return vec![];
    };
    let mut removed = vec![];
    for dir in entries.flatten().map(|e| e.path()) {
        if !dir.is_dir() || keep.contains(&dir) {
            continue;
        }
        let leftovers = files(&dir);
        if leftovers.is_empty() {
            continue;
        }
        // (Not an old QEMU whose exit goes on in the background.)
        let users: Vec<u32> = crate::record::qemus_using(&dir)
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
                Ok(()) => removed.push(f),
                Err(e) => log(format!("cannot remove {}: {e}", f.display())),
            }
        }
    }
    removed.sort();
    removed
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
        let removed = remove_unused(&cluster, &[cluster.join("b")]);
        assert_eq!(removed, files_of_before(&a));
        assert!(files(&a).is_empty());
        assert!(a.join("console.log").exists() && a.join("disk-notastamp").exists());
        assert_eq!(files(&cluster.join("b")).len(), 3);
        assert!(remove_unused(&d.path().join("none"), &[]).is_empty());
    }

    fn files_of_before(a: &Path) -> Vec<PathBuf> {
        vec![
            a.join("data-1700000000001.qcow2"),
            a.join("disk-1700000000000"),
            a.join("disk0.qcow2"),
        ]
    }
}
