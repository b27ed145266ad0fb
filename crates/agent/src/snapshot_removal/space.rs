//! How much disk space removing directory trees frees.
//!
//! Frozen disks are hard links: of the VM's own disk while it runs, and of
//! the same base files in every later snapshot's `.disks/<name>/`. Removing
//! a link frees nothing while another link remains, so a file counts only
//! if every one of its links is inside the trees being removed; its
//! allocated size (`st_blocks`, not the apparent length of a sparse qcow2)
//! is what comes back.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// One inode seen while walking the trees.
struct Seen {
    /// The first tree (owner index) it was found in.
    owner: usize,
    /// How many of its links are inside the trees.
    links_inside: u64,
    /// Its link count.
    nlink: u64,
    /// Allocated bytes.
    bytes: u64,
    /// A directory: it goes with its tree (its link count counts its
    /// subdirectories' `..`, not other names).
    dir: bool,
}

/// The bytes removing every tree of `trees` together would free, summed
/// per owner (`trees[i].0`, less than `owners`): a file shared by two trees
/// counts once, for the owner of the first tree it is found in. A tree
/// that cannot be read counts what could be.
pub(crate) fn bytes_freed(trees: &[(usize, &Path)], owners: usize) -> Vec<u64> {
    let mut seen: BTreeMap<(u64, u64), Seen> = BTreeMap::new();
    for &(owner, root) in trees {
        walk(root, &mut |md| {
            let e = seen.entry((md.dev(), md.ino())).or_insert(Seen {
                owner,
                links_inside: 0,
                nlink: md.nlink(),
                bytes: md.blocks() * 512,
                dir: md.is_dir(),
            });
            e.links_inside += 1;
        });
    }
    let mut out = vec![0; owners];
    for s in seen.values() {
        if s.dir || s.links_inside >= s.nlink {
            if let Some(o) = out.get_mut(s.owner) {
                *o += s.bytes;
            }
        }
    }
    out
}

/// Calls `f` with the metadata of `root` and of everything under it,
/// without following symbolic links.
fn walk(root: &Path, f: &mut dyn FnMut(&std::fs::Metadata)) {
    let Ok(md) = std::fs::symlink_metadata(root) else {
        return;
    };
    f(&md);
    if !md.is_dir() {
        return;
    }
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    for ent in rd.flatten() {
        walk(&ent.path(), f);
    }
}
