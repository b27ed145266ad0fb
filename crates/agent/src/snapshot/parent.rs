//! Incremental snapshots: which earlier snapshot a new one of the same VM
//! is taken against, or why it is full.
//!
//! The parent is the newest committed snapshot of the same VM in the same
//! directory (per-VM snapshots only, not the VMs of cluster snapshots)
//! that is format 2 with page hashes and whose chain is shorter than
//! [`MAX_DEPTH`]: a snapshot past that depth is full again, so that a
//! restore never reads through more than `MAX_DEPTH` images. The new
//! snapshot stores only the pages whose bytes differ from the parent's
//! same page (compared by 128-bit hash, no parent page is read); the
//! others are "in parent". A parent whose RAM layout differs (the VM's
//! memory was resized) gives a full snapshot (the capture says so).
//!
//! A snapshot that is full when it could have been incremental says why
//! ([`NoParent`]): in the manifest's `metrics.parent` (`"none: <why>"`, or
//! `"<name> (depth <d>)"` for an incremental one), in the command's report
//! and progress, and in the agent's log. A parent whose `hashes.bin` is
//! damaged is never silently skipped.

use std::path::{Path, PathBuf};

use thiserror::Error;
use vmcsnap_capture::{ParentInfo, ParentRef};
use vmcsnap_image::{list_snapshots, Image};

use super::Options;

/// Longest chain of parents behind a snapshot.
pub const MAX_DEPTH: u32 = 8;

/// Why a snapshot is full rather than incremental.
#[derive(Debug, Error)]
pub enum NoParent {
    /// Asked for.
    #[error("--full")]
    Full,
    /// A cluster snapshot's VMs are each full (each restores alone).
    #[error("a cluster snapshot's VM snapshots stand alone")]
    Cluster,
    /// Format 1 has no incremental snapshots.
    #[error("format 1 (--storage v1) has no incremental snapshots")]
    Format1,
    /// The snapshot directory could not be listed.
    #[error("listing {}: {detail}", root.display())]
    List {
        /// The snapshot directory.
        root: PathBuf,
        /// Why.
        detail: String,
    },
    /// The VM's first snapshot (of format 2).
    #[error("no earlier snapshot of {vm} with page hashes (format 2)")]
    NoEarlier {
        /// The VM.
        vm: String,
    },
    /// The newest snapshot does not open.
    #[error("its newest snapshot {name} cannot be read ({detail}); `vmcsnap inspect {name} --verify` says what is wrong")]
    Unreadable {
        /// The snapshot.
        name: String,
        /// Why.
        detail: String,
    },
    /// The chain is as deep as it may be.
    #[error("the chain behind {name} is {MAX_DEPTH} snapshots deep already, the most a restore reads through")]
    TooDeep {
        /// The newest snapshot.
        name: String,
    },
    /// The newest snapshot's page hashes do not read.
    #[error("the page hashes of {name} (hashes.bin) cannot be used ({detail}); `vmcsnap inspect {name} --verify` checks that snapshot")]
    Hashes {
        /// The snapshot.
        name: String,
        /// Why.
        detail: String,
    },
}

impl NoParent {
    /// Whether the operator should hear of it (a damaged snapshot), rather
    /// than it being the expected case.
    pub fn is_problem(&self) -> bool {
        matches!(
            self,
            NoParent::List { .. } | NoParent::Unreadable { .. } | NoParent::Hashes { .. }
        )
    }

    /// The value of the `parent` metric.
    pub fn metric(&self) -> String {
        format!("none: {self}")
    }
}

/// The value of the `parent` metric of an incremental snapshot.
pub fn metric_of(p: &ParentInfo) -> String {
    format!("{} (depth {})", p.reference.name, p.reference.depth)
}

/// The parent of a new snapshot of `vm` in `root` under `opts`, or why it
/// is full; says so in the progress and, for a damaged parent, the log.
pub fn decide(
    root: &Path,
    vm: &str,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<ParentInfo, NoParent> {
    let r = if opts.target.is_some() {
        Err(NoParent::Cluster)
    } else if opts.full {
        Err(NoParent::Full)
    } else if opts.writer.format_major < 2 {
        Err(NoParent::Format1)
    } else {
        choose(root, vm)
    };
    match &r {
        Ok(p) => progress(&format!(
            "incremental to {} (chain depth {})",
            p.reference.name, p.reference.depth
        )),
        Err(e) if e.is_problem() => {
            tracing::warn!(vm, why = %e, "snapshot is full: its parent cannot be used");
            progress(&format!("a full snapshot: {e}"));
        }
        Err(e) => tracing::info!(vm, why = %e, "full snapshot"),
    }
    r
}

/// The parent for a new snapshot of `vm` in `root`, or why none fits.
pub fn choose(root: &Path, vm: &str) -> Result<ParentInfo, NoParent> {
    let entries = list_snapshots(root).map_err(|e| NoParent::List {
        root: root.into(),
        detail: e.to_string(),
    })?;
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
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    let Some((_, name, path)) = newest else {
        return Err(NoParent::NoEarlier { vm: vm.into() });
    };
    let img = Image::open(&path).map_err(|e| NoParent::Unreadable {
        name: name.clone(),
        detail: e.to_string(),
    })?;
    // The chain as it is (opened with the image), not the depth its
    // manifest recorded: a merge shortens chains.
    let depth = chain_len(&img) + 1;
    if depth > MAX_DEPTH {
        return Err(NoParent::TooDeep { name });
    }
    let hashes = match img.page_hashes() {
        Ok(Some(h)) => h,
        Ok(None) => {
            return Err(NoParent::Hashes {
                name,
                detail: "the image has none".into(),
            })
        }
        Err(e) => {
            return Err(NoParent::Hashes {
                name,
                detail: e.to_string(),
            })
        }
    };
    Ok(ParentInfo {
        reference: ParentRef {
            name,
            image_id: img.manifest().image_id.clone(),
            depth,
        },
        ram_blocks: img.manifest().ram_blocks.clone(),
        hashes,
    })
}

/// Parents behind `img`.
pub fn chain_len(img: &Image) -> u32 {
    std::iter::successors(img.parent(), |p| p.parent()).count() as u32
}

#[cfg(test)]
#[path = "parent_tests.rs"]
mod tests;
