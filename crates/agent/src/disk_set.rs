//! Which frozen disk of a snapshot stands for which disk of its VM, and
//! whether a snapshot's disks are all its own.
//!
//! A snapshot's manifest lists one frozen disk per writable disk of the VM
//! (`snapshot::disks`), each naming its configuration node in
//! [`CONFIG_NODE`]. Snapshots made before every disk was frozen list one
//! disk without that field: it is the VM's first writable disk, and a VM
//! with more writable disks than that cannot be restored from them (its
//! other disks would be the live files of the VM that was snapshotted,
//! issue 29), which [`frozen_for`] says before anything starts.

use std::path::{Path, PathBuf};

use thiserror::Error;
use vmcsnap_image::{DiskRef, Manifest};

use crate::qemu::QemuConfig;

/// The manifest disk field naming the disk's node in the VM's configuration.
pub const CONFIG_NODE: &str = "config_node";

/// What is wrong with a snapshot's disks.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DiskSetError {
    /// A writable disk of the VM has no frozen copy in the snapshot.
    #[error("the snapshot holds no frozen copy of disk {node} ({path}): it was taken by a vmcsnap that froze only the first disk, and restoring it would use the file the VM went on writing; take a new snapshot")]
    NotFrozen {
        /// The disk's node.
        node: String,
        /// The file the VM's configuration names for it.
        path: PathBuf,
    },
    /// A frozen disk lies outside the snapshot's frozen-disk directory.
    #[error("disk {node} of the snapshot is {path}, not a file of the snapshot's own frozen disks ({own}): the snapshot does not stand alone")]
    NotOwn {
        /// The disk's node.
        node: String,
        /// Where the manifest says it is.
        path: PathBuf,
        /// The snapshot's frozen-disk directory.
        own: PathBuf,
    },
    /// A frozen disk file is missing.
    #[error("the frozen disk {path} of disk {node} is gone")]
    Gone {
        /// The disk's node.
        node: String,
        /// The missing file.
        path: PathBuf,
    },
}

/// One writable disk of the VM and its frozen copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frozen {
    /// The disk's node in the VM's configuration.
    pub node: String,
    /// The top of its frozen chain.
    pub path: PathBuf,
}

/// The frozen copy of every writable disk of `config` (in its order), from
/// a manifest's `disks`.
pub fn frozen_for(config: &QemuConfig, disks: &[DiskRef]) -> Result<Vec<Frozen>, DiskSetError> {
    let labelled = disks.iter().any(|d| d.extra.contains_key(CONFIG_NODE));
    config
        .disks
        .iter()
        .filter(|d| !d.read_only)
        .enumerate()
        .map(|(k, d)| {
            let found = if labelled {
                disks
                    .iter()
                    .find(|r| r.extra.get(CONFIG_NODE).and_then(|v| v.as_str()) == Some(&d.node))
            } else {
                // Before every disk was frozen: one, the first.
                disks.first().filter(|_| k == 0)
            };
            found
                .map(|r| Frozen {
                    node: d.node.clone(),
                    path: PathBuf::from(&r.path),
                })
                .ok_or_else(|| DiskSetError::NotFrozen {
                    node: d.node.clone(),
                    path: d.path.clone(),
                })
        })
        .collect()
}

/// The frozen-disk directory of the snapshot in `dir`: `<root>/.disks/<name>`
/// for a VM snapshot `<root>/<name>`, `<root>/.disks/<cluster>/<vm>` for a
/// VM of a cluster snapshot `<root>/<cluster>/vms/<vm>`.
pub fn own_disks_dir(dir: &Path) -> Option<PathBuf> {
    let name = dir.file_name()?;
    let parent = dir.parent()?;
    if parent.file_name().is_some_and(|n| n == "vms") {
        let cluster = parent.parent()?;
        let root = cluster.parent()?;
        return Some(root.join(".disks").join(cluster.file_name()?).join(name));
    }
    Some(parent.join(".disks").join(name))
}

/// What makes the disks of the snapshot in `dir` (with `manifest`) not all
/// its own: a writable disk of its VM without a frozen copy, a frozen copy
/// outside its frozen-disk directory, or one that is gone. Empty: they are.
/// (`inspect --verify` reports these; restore refuses such a snapshot.)
pub fn own_disk_problems(dir: &Path, manifest: &Manifest) -> Vec<DiskSetError> {
    let Ok(config) = crate::stored_config::StoredVmConfig::from_manifest(manifest) else {
        // No recorded VM configuration (an image made outside the agent):
        // only the listed disks can be checked.
        return manifest
            .disks
            .iter()
            .filter_map(|d| check_one(dir, &d.node, Path::new(&d.path)))
            .collect();
    };
    match frozen_for(&config.qemu, &manifest.disks) {
        Err(e) => vec![e],
        Ok(frozen) => frozen
            .iter()
            .filter_map(|f| check_one(dir, &f.node, &f.path))
            .collect(),
    }
}

fn check_one(dir: &Path, node: &str, path: &Path) -> Option<DiskSetError> {
    let own = own_disks_dir(dir)?;
    let inside = path.starts_with(&own)
        || matches!((path.canonicalize(), own.canonicalize()), (Ok(p), Ok(o)) if p.starts_with(&o));
    if !inside {
        return Some(DiskSetError::NotOwn {
            node: node.into(),
            path: path.into(),
            own,
        });
    }
    if !path.is_file() {
        return Some(DiskSetError::Gone {
            node: node.into(),
            path: path.into(),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qemu::DiskConfig;
    use serde_json::json;

    fn config(disks: Vec<DiskConfig>) -> QemuConfig {
        serde_json::from_value(json!({
            "name": "w", "accel": "tcg", "memory_mib": 256, "vcpus": 1, "ram_file": "/r",
            "kernel": null, "console_log": "/c", "qmp_socket": "/q", "disks": disks,
            "port_socket": "/p", "mac": "52:54:00:77:00:02", "incoming": false,
        }))
        .unwrap()
    }

    fn disk_ref(path: &str, config_node: Option<&str>) -> DiskRef {
        let mut r = DiskRef {
            node: "ov1".into(),
            path: path.into(),
            format: "qcow2".into(),
            extra: Default::default(),
        };
        if let Some(n) = config_node {
            r.extra.insert(CONFIG_NODE.into(), json!(n));
        }
        r
    }

    fn image_vm() -> QemuConfig {
        config(vec![
            DiskConfig::qcow2("root0", "/run/cluster/w/root.qcow2"),
            DiskConfig::qcow2("disk0", "/run/cluster/w/disk0.qcow2"),
            DiskConfig::read_only_raw("seed", "/s/.disks/a/seed.iso"),
        ])
    }

    #[test]
    fn every_writable_disk_is_found_by_its_node() {
        let refs = [
            disk_ref("/s/.disks/a/root.qcow2", Some("root0")),
            disk_ref("/s/.disks/a/disk0/disk0.qcow2", Some("disk0")),
        ];
        let f = frozen_for(&image_vm(), &refs).unwrap();
        assert_eq!(
            f,
            [
                Frozen {
                    node: "root0".into(),
                    path: "/s/.disks/a/root.qcow2".into()
                },
                Frozen {
                    node: "disk0".into(),
                    path: "/s/.disks/a/disk0/disk0.qcow2".into()
                },
            ]
        );
        // A lab VM's snapshot from before: one unlabelled disk, the first.
        let lab = config(vec![DiskConfig::qcow2(
            "disk0",
            "/run/cluster/a/data.qcow2",
        )]);
        let f = frozen_for(&lab, &[disk_ref("/s/.disks/a/data.qcow2", None)]).unwrap();
        assert_eq!(f[0].path, PathBuf::from("/s/.disks/a/data.qcow2"));
    }

    /// Regression (issue 29): a snapshot of a VM with an extra disk froze
    /// only the root disk; its restore opened the live `disk0.qcow2`.
    #[test]
    fn a_disk_without_a_frozen_copy_is_an_error_naming_it() {
        let old = [disk_ref("/s/.disks/a/root.qcow2", None)];
        let e = frozen_for(&image_vm(), &old).unwrap_err();
        assert_eq!(
            e,
            DiskSetError::NotFrozen {
                node: "disk0".into(),
                path: "/run/cluster/w/disk0.qcow2".into()
            }
        );
        assert!(e.to_string().contains("take a new snapshot"), "{e}");
    }

    #[test]
    fn own_directories_of_vm_and_cluster_snapshots() {
        assert_eq!(
            own_disks_dir(Path::new("/r/snapshots/a-1")).unwrap(),
            PathBuf::from("/r/snapshots/.disks/a-1")
        );
        assert_eq!(
            own_disks_dir(Path::new("/r/snapshots/rc/vms/w")).unwrap(),
            PathBuf::from("/r/snapshots/.disks/rc/w")
        );
    }

    #[test]
    fn a_frozen_disk_outside_the_snapshot_or_gone_is_a_problem() {
        let d = tempfile::tempdir().unwrap();
        let snap = d.path().join("a");
        let own = d.path().join(".disks/a");
        std::fs::create_dir_all(own.join("disk0")).unwrap();
        std::fs::write(own.join("root.qcow2"), b"q").unwrap();
        std::fs::write(own.join("disk0/disk0.qcow2"), b"q").unwrap();
        let live = d.path().join("disk0.qcow2");
        std::fs::write(&live, b"q").unwrap();
        let check = |refs: Vec<DiskRef>| {
            let cfg = image_vm();
            let problems = frozen_for(&cfg, &refs).map(|f| {
                f.iter()
                    .filter_map(|f| check_one(&snap, &f.node, &f.path))
                    .collect::<Vec<_>>()
            });
            problems.unwrap_or_else(|e| vec![e])
        };
        let root = own.join("root.qcow2").display().to_string();
        let extra = own.join("disk0/disk0.qcow2").display().to_string();
        assert!(check(vec![
            disk_ref(&root, Some("root0")),
            disk_ref(&extra, Some("disk0"))
        ])
        .is_empty());
        let p = check(vec![
            disk_ref(&root, Some("root0")),
            disk_ref(live.to_str().unwrap(), Some("disk0")),
        ]);
        assert!(
            matches!(&p[..], [DiskSetError::NotOwn { node, .. }] if node == "disk0"),
            "{p:?}"
        );
        std::fs::remove_file(own.join("disk0/disk0.qcow2")).unwrap();
        let p = check(vec![
            disk_ref(&root, Some("root0")),
            disk_ref(&extra, Some("disk0")),
        ]);
        assert!(matches!(&p[..], [DiskSetError::Gone { .. }]), "{p:?}");
    }
}
