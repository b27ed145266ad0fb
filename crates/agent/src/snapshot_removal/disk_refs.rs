//! Which frozen-disk files are still needed: those a running VM reads
//! (gc's [`crate::gc::disk_files_in_use`]) and those the frozen disk
//! chains of the snapshots that stay read.
//!
//! A snapshot's frozen disk can read from another snapshot's frozen-disk
//! directory: a VM restored from snapshot `s` runs on an overlay whose
//! backing file is `.disks/s/<top>`, named by absolute path; a snapshot of
//! that VM hard-links the overlay into its own `.disks/<name>/`, but the
//! overlay still names `.disks/s/<top>` as its backing file. Deleting `s`'s
//! disks would leave that snapshot listed but unable to restore, so they
//! stay as long as such a chain reads from them.
//!
//! The chains are read from the qcow2 headers (the backing file name), not
//! with `qemu-img`, so that a delete costs no process per snapshot.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use vmcsnap_image::{check_committed, list_cluster_snapshots, list_snapshots};

use crate::cluster::Cluster;

/// The first bytes of every qcow2 file.
const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";
/// The longest backing file name the qcow2 specification allows.
const MAX_BACKING_NAME: u32 = 1023;
/// The longest chain followed (a loop or a damaged file stops earlier).
const MAX_CHAIN: usize = 256;

/// The paths still read, each as named and, where it resolves, canonical
/// (a run directory reached through a symbolic link names the same file
/// two ways).
#[derive(Debug, Default)]
pub(crate) struct InUse {
    files: BTreeSet<PathBuf>,
}

impl InUse {
    /// Every disk file a running VM of `cluster` reads, and every file of
    /// the frozen disk chains of the committed snapshots under `root`
    /// except those named in `leaving`.
    pub(crate) fn gather(
        root: &Path,
        cluster: &mut Option<Cluster>,
        leaving: &BTreeSet<String>,
    ) -> InUse {
        let mut u = InUse::default();
        u.add_all(crate::gc::disk_files_in_use(cluster));
        u.add_all(snapshot_chain_files(root, leaving));
        u
    }

    fn add_all(&mut self, files: impl IntoIterator<Item = PathBuf>) {
        for f in files {
            if let Ok(c) = f.canonicalize() {
                self.files.insert(c);
            }
            self.files.insert(f);
        }
    }

    /// The files in use.
    pub(crate) fn files(&self) -> &BTreeSet<PathBuf> {
        &self.files
    }

    /// Whether any file in use is `dir` or under it.
    pub(crate) fn reads_from(&self, dir: &Path) -> bool {
        let canonical = dir.canonicalize().ok();
        self.files
            .iter()
            .any(|f| f.starts_with(dir) || canonical.as_ref().is_some_and(|c| f.starts_with(c)))
    }
}

/// Every file of the frozen disk chains of the committed snapshots under
/// `root` (per-VM snapshots, and each VM of a cluster snapshot), except
/// the snapshots named in `leaving`. A snapshot whose manifest cannot be
/// read is skipped: it does not restore anyway.
pub(crate) fn snapshot_chain_files(root: &Path, leaving: &BTreeSet<String>) -> Vec<PathBuf> {
    let mut tops = Vec::new();
    for e in list_snapshots(root).into_iter().flatten() {
        if let (false, Ok(m)) = (leaving.contains(&e.name), &e.status) {
            tops.extend(m.disks.iter().map(|d| PathBuf::from(&d.path)));
        }
    }
    for e in list_cluster_snapshots(root).into_iter().flatten() {
        let (false, Ok(m)) = (leaving.contains(&e.name), &e.status) else {
            continue;
        };
        for vm in &m.vms {
            let dir = e.path.join(&vm.snapshot);
            if let Ok(vm_m) = check_committed(&dir) {
                tops.extend(vm_m.disks.iter().map(|d| PathBuf::from(&d.path)));
            }
        }
    }
    tops.iter().flat_map(|t| chain_files(t)).collect()
}

/// The files of the disk chain whose top is `top`, top first, as QEMU
/// resolves them: a relative backing name is relative to the directory of
/// the file naming it. Stops at a file that is not qcow2 or cannot be read.
pub(crate) fn chain_files(top: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut cur = top.to_path_buf();
    while out.len() < MAX_CHAIN && !out.contains(&cur) {
        out.push(cur.clone());
        match backing_of(&cur) {
            Some(b) => cur = b,
            None => break,
        }
    }
    out
}

/// The backing file `file` names in its qcow2 header, if any.
fn backing_of(file: &Path) -> Option<PathBuf> {
    let f = File::open(file).ok()?;
    // magic (4) | version (4) | backing_file_offset (8) | backing_file_size (4), big-endian
    let mut h = [0u8; 20];
    f.read_exact_at(&mut h, 0).ok()?;
    if h[..4] != QCOW2_MAGIC {
        return None;
    }
    let offset = u64::from_be_bytes(h[8..16].try_into().ok()?);
    let len = u32::from_be_bytes(h[16..20].try_into().ok()?);
    if offset == 0 || len == 0 || len > MAX_BACKING_NAME {
        return None;
    }
    let mut name = vec![0u8; len as usize];
    f.read_exact_at(&mut name, offset).ok()?;
    let name = String::from_utf8(name).ok()?;
    let p = crate::block_chains::plain_filename(&name);
    Some(if p.is_absolute() {
        p
    } else {
        file.parent().unwrap_or(Path::new(".")).join(p)
    })
}
