//! The disks of a restored VM: each writable disk runs on a new overlay of
//! its own frozen copy in the snapshot (`crate::disk_set::frozen_for`),
//! never on a file of the VM that was snapshotted.
//!
//! Each frozen chain is hard-linked into the restored VM's disk directory
//! (`cluster/<vm>/disk-<stamp>/`: the first disk's there, each other's in
//! a subdirectory named by its node) and the overlay put next to it names
//! its backing file by name only: the VM's disk chains are then
//! self-contained, and so is the frozen disk of every later snapshot of it
//! (which links the whole chain again), whatever becomes of the snapshot
//! restored here.

use std::path::{Path, PathBuf};

use crate::disk_set::Frozen;
use crate::AgentError;

/// Creates the overlay of every frozen disk under `disk_dir`; returns each
/// disk's node and overlay, in order. On failure nothing it made is left.
pub(super) fn prepare(
    qemu_img: &Path,
    frozen: &[Frozen],
    disk_dir: &Path,
    stamp: u64,
) -> Result<Vec<(String, PathBuf)>, AgentError> {
    let mut made: Vec<(String, PathBuf)> = Vec::new();
    for (k, f) in frozen.iter().enumerate() {
        let dir = if k == 0 {
            disk_dir.to_path_buf()
        } else {
            disk_dir.join(&f.node)
        };
        let overlay = dir.join(format!("data-{stamp}.qcow2"));
        let done = std::fs::create_dir_all(&dir)
            .map_err(AgentError::io("creating", &dir))
            .and_then(|()| crate::disk_chain::chain(qemu_img, &f.path))
            .and_then(|chain| {
                let top = crate::disk_chain::freeze(&chain, &dir)?;
                crate::disk_chain::create_overlay(qemu_img, &top, chain.virtual_size, &overlay)
            })
            .map_err(|e| {
                AgentError::BadRequest(format!(
                    "preparing disk {} from {}: {e}",
                    f.node,
                    f.path.display()
                ))
            });
        if let Err(e) = done {
            for (_, o) in &made {
                let _ = std::fs::remove_file(o);
            }
            return Err(e);
        }
        made.push((f.node.clone(), overlay));
    }
    Ok(made)
}
