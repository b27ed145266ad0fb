//! Incremental snapshots: which earlier snapshot a new one of the same VM
//! is taken against.
//!
//! The parent is the newest committed snapshot of the same VM in the same
//! directory (per-VM snapshots only, not the VMs of cluster snapshots)
//! that is format 2 with page hashes and whose chain is shorter than
//! [`MAX_DEPTH`]: a snapshot past that depth is full again, so that a
//! restore never reads through more than `MAX_DEPTH` images. The new
//! snapshot stores only the pages whose bytes differ from the parent's
//! same page (compared by 128-bit hash, no parent page is read); the
//! others are "in parent". A parent whose RAM layout differs (the VM's
//! memory was resized) gives a full snapshot.

use std::path::Path;

use vmcsnap_capture::{ParentInfo, ParentRef};
use vmcsnap_image::{list_snapshots, Image};

use crate::log;

/// Longest chain of parents behind a snapshot.
pub const MAX_DEPTH: u32 = 8;

/// The parent for a new snapshot of `vm` in `root`, if one fits.
pub fn choose(root: &Path, vm: &str) -> Option<ParentInfo> {
    let entries = list_snapshots(root).ok()?;
    let newest = entries
        .into_iter()
        .filter_map(|e| {
            let m = e.status.ok()?;
            (m.vm.name == vm && m.files.hashes.is_some()).then_some((
                m.created_unix_ms,
                e.name,
                e.path,
            ))
        })
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)))?;
    let (_, name, path) = newest;
    let img = match Image::open(&path) {
        Ok(i) => i,
        Err(e) => {
            log(format!(
                "snapshot {name} cannot be a parent ({e}); taking a full snapshot"
            ));
            return None;
        }
    };
    let depth = img.manifest().parent.as_ref().map_or(0, |p| p.depth) + 1;
    if depth > MAX_DEPTH {
        return None;
    }
    let hashes = match img.page_hashes() {
        Ok(Some(h)) => h,
        _ => return None,
    };
    Some(ParentInfo {
        reference: ParentRef {
            name,
            image_id: img.manifest().image_id.clone(),
            depth,
        },
        ram_blocks: img.manifest().ram_blocks.clone(),
        hashes,
    })
}
