//! The disks of a snapshot: **every** writable disk of the VM (an image
//! VM's root and extra disks, the lab guest's data disk) is frozen in the
//! same pause, by one QMP `transaction` of `blockdev-snapshot` actions
//! (atomic: all or none), and continues on an overlay of its own.
//!
//! Everything else happens outside the pause: for each disk, its chain is
//! hard-linked into the snapshot's frozen-disk directory (`disk_chain`),
//! its overlay created next to the file it backs on and opened by QEMU. A
//! disk that cannot be frozen (not qcow2, not found among QEMU's block
//! devices) refuses the snapshot there, before the guest is paused: a
//! snapshot never names a file the VM goes on writing.
//!
//! Layout: the first writable disk's chain goes into the frozen-disk
//! directory itself (where it always went), each other disk's into a
//! subdirectory named by its node (`disk0/`, ...), so that chains whose
//! files share a name never meet. The manifest lists them in the VM's disk
//! order, each with its configuration node (`config_node`), which is how a
//! restore finds the frozen copy of each disk (`crate::disk_set`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use vmcsnap_capture::DiskRef;

use crate::qemu::DiskFormat;
use crate::vm::Vm;
use crate::AgentError;

/// One writable disk being snapshotted.
#[derive(Debug, Clone)]
pub(super) struct SnapDisk {
    /// Its node in the VM's configuration (`root0`, `disk0`, ...).
    pub config_node: String,
    /// QEMU's node at the top of its chain now (the one frozen).
    pub qemu_node: String,
    /// The file the VM writes to now.
    pub current: PathBuf,
    /// The top of its frozen chain, in the snapshot's frozen-disk directory.
    pub frozen: PathBuf,
    /// The overlay the VM writes to after the pause.
    pub overlay: PathBuf,
    /// The overlay's node, once QEMU opened it.
    pub overlay_node: Option<String>,
}

/// Where the chain of the `k`-th writable disk (0-based) is frozen.
pub(crate) fn frozen_dir(disks_dir: &Path, k: usize, config_node: &str) -> PathBuf {
    if k == 0 {
        disks_dir.to_path_buf()
    } else {
        disks_dir.join(config_node)
    }
}

/// The name of the overlay that follows `current` for the `k`-th disk.
fn overlay_name(k: usize, config_node: &str, stamp: u64) -> String {
    if k == 0 {
        format!("data-{stamp}.qcow2")
    } else {
        format!("{config_node}-{stamp}.qcow2")
    }
}

/// Freezes the chains and creates the overlays of every writable disk of
/// `vm` (outside the pause). On failure nothing it made is left.
pub(super) fn prepare(
    vm: &mut Vm,
    qemu_img: &Path,
    disks_dir: &Path,
    stamp: u64,
) -> Result<Vec<SnapDisk>, AgentError> {
    let name = vm.name.clone();
    let fail = |detail: String| AgentError::Snapshot {
        vm: name.clone(),
        detail,
    };
    let writable: Vec<_> = vm
        .config
        .disks
        .iter()
        .filter(|d| !d.read_only)
        .cloned()
        .collect();
    if writable.is_empty() {
        return Err(fail("the VM has no writable disk to freeze".into()));
    }
    if let Some(d) = writable.iter().find(|d| d.format != DiskFormat::Qcow2) {
        return Err(fail(format!(
            "disk {} ({}) is {}: a snapshot freezes qcow2 disks only (by putting an overlay on top); nothing was paused",
            d.node,
            d.path.display(),
            d.format.driver()
        )));
    }
    let blocks = block_chains(vm)?;
    let mut out: Vec<SnapDisk> = Vec::new();
    for (k, d) in writable.iter().enumerate() {
        let made = qemu_top(&blocks, &d.path)
            .ok_or_else(|| {
                fail(format!(
                    "disk {} ({}) is not among QEMU's block devices ({}); nothing was paused",
                    d.node,
                    d.path.display(),
                    describe_chains(&blocks)
                ))
            })
            .and_then(|(qemu_node, current)| {
                let dir = frozen_dir(disks_dir, k, &d.node);
                std::fs::create_dir_all(&dir).map_err(AgentError::io("creating", &dir))?;
                let overlay = current
                    .parent()
                    .unwrap_or(Path::new("."))
                    .join(overlay_name(k, &d.node, stamp));
                let chain = crate::disk_chain::chain(qemu_img, &current)?;
                let frozen = crate::disk_chain::freeze(&chain, &dir)?;
                crate::disk_chain::create_overlay(
                    qemu_img,
                    &current,
                    chain.virtual_size,
                    &overlay,
                )?;
                Ok(SnapDisk {
                    config_node: d.node.clone(),
                    qemu_node,
                    current,
                    frozen,
                    overlay,
                    overlay_node: None,
                })
            });
        match made {
            Ok(s) => out.push(s),
            Err(e) => {
                remove_overlays(&out);
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// Each block device's node at the top and its chain of files, top first.
fn block_chains(vm: &mut Vm) -> Result<Vec<(String, Vec<PathBuf>)>, AgentError> {
    Ok(crate::block_chains::device_chains(vm)?
        .into_iter()
        .map(|c| (c.top_node, c.files))
        .collect())
}

/// QEMU's block devices for an error: each node, its top file and the
/// length of its chain.
fn describe_chains(blocks: &[(String, Vec<PathBuf>)]) -> String {
    let each: Vec<String> = blocks
        .iter()
        .map(|(node, chain)| match chain.first() {
            Some(top) => format!("{node}: {} over {} more", top.display(), chain.len() - 1),
            None => format!("{node}: no medium"),
        })
        .collect();
    if each.is_empty() {
        "none".into()
    } else {
        each.join("; ")
    }
}

/// The top node and file of the block device whose chain holds `path` (the
/// recorded file, or one below the top if a snapshot an agent died in put
/// an overlay on it since: `Member::refresh_disk`).
fn qemu_top(blocks: &[(String, Vec<PathBuf>)], path: &Path) -> Option<(String, PathBuf)> {
    let same = |f: &PathBuf| {
        f == path || matches!((f.canonicalize(), path.canonicalize()), (Ok(a), Ok(b)) if a == b)
    };
    blocks
        .iter()
        .find(|(_, chain)| chain.iter().any(same))
        .and_then(|(node, chain)| Some((node.clone(), chain.first()?.clone())))
}

/// Removes the overlays of disks the pause did not freeze.
pub(super) fn remove_overlays(disks: &[SnapDisk]) {
    for d in disks {
        let _ = std::fs::remove_file(&d.overlay);
    }
}

/// Before the pause: QEMU opens each overlay as a node of its own (no
/// backing yet), so that the pause only puts them on top.
pub(super) fn add_overlays(
    vm: &mut Vm,
    disks: &mut [SnapDisk],
    stamp: u64,
) -> Result<(), AgentError> {
    for (k, d) in disks.iter_mut().enumerate() {
        let node = format!("ov{stamp}-{k}");
        vm.execute(
            "blockdev-add",
            json!({
                "driver": "qcow2",
                "node-name": node,
                "file": { "driver": "file", "filename": d.overlay },
                "backing": null,
            }),
        )?;
        d.overlay_node = Some(node);
    }
    Ok(())
}

/// The transaction that freezes every disk at once: each overlay goes on
/// top of the node its disk writes to (its header already names that
/// file as its backing, relative: `disk_chain`).
pub(super) fn transaction(disks: &[SnapDisk]) -> Value {
    let actions: Vec<Value> = disks
        .iter()
        .map(|d| {
            json!({
                "type": "blockdev-snapshot",
                "data": {
                    "node": d.qemu_node,
                    "overlay": d.overlay_node.as_deref().unwrap_or_default(),
                }
            })
        })
        .collect();
    json!({ "actions": actions })
}

/// After a failure before the disks were frozen: the overlay nodes QEMU
/// opened go.
pub(super) fn release_overlay_nodes(vm: &mut Vm, disks: &mut [SnapDisk]) {
    for d in disks {
        if let Some(node) = d.overlay_node.take() {
            if let Err(e) = vm.execute("blockdev-del", json!({ "node-name": node })) {
                crate::log(format!(
                    "VM {}: removing the unused overlay node {node}: {e}",
                    vm.name
                ));
            }
        }
    }
}

/// The manifest's `disks`: one per disk, in the VM's disk order.
pub(super) fn manifest_refs(disks: &[SnapDisk]) -> Vec<DiskRef> {
    disks
        .iter()
        .map(|d| {
            let mut extra = BTreeMap::new();
            extra.insert(
                crate::disk_set::CONFIG_NODE.to_string(),
                json!(d.config_node),
            );
            extra.insert("overlay".to_string(), json!(d.overlay));
            extra.insert("original_path".to_string(), json!(d.current));
            DiskRef {
                node: d.qemu_node.clone(),
                path: d.frozen.display().to_string(),
                format: "qcow2".into(),
                extra,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_disk_keeps_its_place_and_the_others_get_their_own() {
        let d = Path::new("/s/.disks/x");
        assert_eq!(frozen_dir(d, 0, "root0"), d);
        assert_eq!(frozen_dir(d, 1, "disk0"), d.join("disk0"));
        assert_eq!(overlay_name(0, "root0", 7), "data-7.qcow2");
        assert_eq!(overlay_name(1, "disk0", 7), "disk0-7.qcow2");
    }

    #[test]
    fn a_disk_is_found_by_any_file_of_its_chain() {
        let blocks = vec![
            (
                "ov1-0".to_string(),
                vec![
                    PathBuf::from("/v/data-1.qcow2"),
                    PathBuf::from("/v/root.qcow2"),
                ],
            ),
            (
                "disk0".to_string(),
                vec![
                    PathBuf::from("/v/disk0.qcow2"),
                    PathBuf::from("/p/payload.img"),
                ],
            ),
        ];
        assert_eq!(
            qemu_top(&blocks, Path::new("/v/root.qcow2")),
            Some(("ov1-0".into(), PathBuf::from("/v/data-1.qcow2")))
        );
        assert_eq!(
            qemu_top(&blocks, Path::new("/v/disk0.qcow2")),
            Some(("disk0".into(), PathBuf::from("/v/disk0.qcow2")))
        );
        assert_eq!(qemu_top(&blocks, Path::new("/v/other.qcow2")), None);
    }

    #[test]
    fn one_transaction_freezes_every_disk() {
        let disk = |n: &str, q: &str| SnapDisk {
            config_node: n.into(),
            qemu_node: q.into(),
            current: "/c".into(),
            frozen: "/f".into(),
            overlay: "/o".into(),
            overlay_node: Some(format!("ov-{n}")),
        };
        let t = transaction(&[disk("root0", "root0"), disk("disk0", "disk0")]);
        let actions = t["actions"].as_array().unwrap();
        assert_eq!(actions.len(), 2);
        assert_eq!(actions[1]["data"]["node"], "disk0");
        assert_eq!(actions[1]["data"]["overlay"], "ov-disk0");
    }
}
