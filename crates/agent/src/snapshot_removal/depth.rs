//! The recorded chain depth (`parent.depth` in the manifest: parents
//! behind a snapshot) after a merge shortened a chain.
//!
//! Merging a deleted parent into its child makes the child's chain one
//! shorter, and with it the chain of every snapshot incremental to the
//! child, however far down. Each of those manifests is rewritten with its
//! depth counted along the chain as it now is (the manifest only: written
//! beside it, fsynced, renamed over it; the image id stays, so the
//! snapshots that name it as their parent stay valid). Choosing a parent
//! counts the chain itself ([`crate::snapshot::parent::chain_len`]), so a
//! depth left stale by a crash here costs nothing but a wrong figure in
//! `inspect`.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::path::Path;

use vmcsnap_image::{FileKind, Manifest};

use super::merge::children_of;
use crate::log;

/// Most parents followed (a reader refuses longer chains).
const MAX_WALK: u32 = 64;

/// Rewrites the depth of `name` and of every snapshot below it whose
/// recorded depth is not its chain's; failures are logged (see the module
/// docs).
pub(crate) fn recompute_from(root: &Path, name: &str) {
    let mut queue = VecDeque::from([(name.to_string(), chain_depth(root, name))]);
    let mut seen = 0;
    while let Some((n, depth)) = queue.pop_front() {
        seen += 1;
        if seen > 4096 {
            break;
        }
        if let Some(depth) = depth {
            match set_depth(&root.join(&n), depth) {
                Ok(true) => log(format!("snapshot {n}: chain depth is {depth} now")),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(snapshot = %n, error = %e, "could not record the new chain depth")
                }
            }
        }
        for c in children_of(root, &n) {
            queue.push_back((c, depth.map(|d| d + 1)));
        }
    }
}

/// Parents behind snapshot `name`, following the manifests' parent names
/// (`None` if a manifest does not read or the chain does not end).
pub(crate) fn chain_depth(root: &Path, name: &str) -> Option<u32> {
    let mut m = vmcsnap_image::check_committed(&root.join(name)).ok()?;
    let mut depth = 0;
    while let Some(p) = m.parent {
        depth += 1;
        if depth > MAX_WALK {
            return None;
        }
        m = vmcsnap_image::check_committed(&root.join(&p.name)).ok()?;
        if m.image_id != p.image_id {
            return None;
        }
    }
    Some(depth)
}

/// Records `depth` in the manifest of the snapshot in `dir`; false if it
/// was there already (or the snapshot is full).
fn set_depth(dir: &Path, depth: u32) -> io::Result<bool> {
    let path = dir.join(FileKind::Manifest.default_name());
    let (version, mut m) = Manifest::load(&path).map_err(io::Error::other)?;
    let Some(p) = m.parent.as_mut() else {
        return Ok(false);
    };
    if p.depth == depth {
        return Ok(false);
    }
    p.depth = depth;
    let tmp = dir.join(format!(
        "{}.tmp-{}",
        FileKind::Manifest.default_name(),
        std::process::id()
    ));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&m.encode_as(version))?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(true)
}
