//! Deleting the parent of incremental snapshots: each child is rewritten
//! first so that it no longer reads from it.
//!
//! A child's pages "in parent" that the deleted parent held itself are
//! copied into the child; those the parent in turn had from its own parent
//! stay references, now to that grandparent, which becomes the child's
//! parent (or the child becomes full). The rewrite keeps the child's image
//! id and creation time, so its own children stay valid and prune keeps
//! its order; it is committed by an atomic exchange with the old child
//! ([`ImageWriter::create_replacing`]): at every moment the child restores,
//! from the old or the new image. The chain under the child is one shorter
//! then: its depth and that of every snapshot incremental to it, however
//! far down, are recomputed ([`super::depth`]).

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;

use vmcsnap_capture::{ParentInfo, WriterOptions};
use vmcsnap_image::{
    list_snapshots, Block, Codec, FileKind, Image, ImageMeta, ImageWriter, PageKey, PageState,
    ReadError,
};

use super::RemovalError;
use crate::log;

/// The committed snapshots under `root` whose manifest names `name` (with
/// its current image id) as their parent.
pub(crate) fn children_of(root: &Path, name: &str) -> Vec<String> {
    let Ok(parent) = vmcsnap_image::check_committed(&root.join(name)) else {
        return Vec::new();
    };
    let Ok(entries) = list_snapshots(root) else {
        return Vec::new();
    };
    entries
        .into_iter()
        .filter(|e| {
            e.status.as_ref().is_ok_and(|m| {
                m.parent
                    .as_ref()
                    .is_some_and(|p| p.name == name && p.image_id == parent.image_id)
            })
        })
        .map(|e| e.name)
        .collect()
}

/// Rewrites snapshot `child` of `root` without its parent (see the module
/// docs).
pub(crate) fn merge_parent_into(root: &Path, child: &str) -> Result<(), RemovalError> {
    let dir = root.join(child);
    let fail = |detail: String| RemovalError::Merge {
        child: child.into(),
        detail,
    };
    let read = |e: ReadError| fail(e.to_string());
    // With its frozen disks: pages the removed parent keeps on its disk
    // (which goes with it) are copied in as bytes.
    let img = crate::frozen_disks::open_image(&dir).map_err(read)?;
    let m = img.manifest().clone();
    let parent = img
        .parent()
        .ok_or_else(|| fail("it has no parent to merge".into()))?;
    let parent_name = m
        .parent
        .as_ref()
        .map(|p| p.name.clone())
        .unwrap_or_default();
    let new_parent = match (parent.manifest().parent.clone(), parent.parent()) {
        (Some(reference), Some(gp)) => Some(ParentInfo {
            reference,
            ram_blocks: gp.manifest().ram_blocks.clone(),
            hashes: gp
                .page_hashes()
                .map_err(read)?
                .ok_or_else(|| fail("its grandparent has no page hashes".into()))?,
        }),
        _ => None,
    };
    let id = m
        .image_id_bytes()
        .ok_or_else(|| fail("its image id is malformed".into()))?;
    let meta = ImageMeta {
        vm: m.vm.clone(),
        qemu: m.qemu.clone(),
        page_size: m.page_size,
        ram_blocks: m.ram_blocks.clone(),
        disks: m.disks.clone(),
        device_state_format: m.device_state_format.clone(),
        labels: m.labels.clone(),
    };
    let codec = m
        .storage
        .as_ref()
        .and_then(|s| s.codec.parse::<Codec>().ok())
        .unwrap_or_default();
    let opts = WriterOptions {
        pages_per_block: m.pages_per_block,
        codec,
        ..Default::default()
    };
    let werr = |e: vmcsnap_image::WriteError| fail(e.to_string());
    let mut w = ImageWriter::create_replacing(&dir, meta, opts, id).map_err(werr)?;
    w.set_created_unix_ms(m.created_unix_ms);
    if let Some(p) = new_parent {
        w.set_parent(p).map_err(werr)?;
    }
    *w.metrics_mut() = m.metrics.clone();
    let hashes = img.page_hashes().map_err(read)?;
    let hot: HashSet<u32> = img
        .blocks()
        .iter()
        .enumerate()
        .filter(|(_, b)| b.is_hot())
        .map(|(i, _)| i as u32)
        .collect();
    let mut cache = BlockCache::default();
    let mut page = vec![0u8; img.page_size()];
    for r in 0..m.ram_blocks.len() as u32 {
        for p in 0..img.ram_block_pages(r) {
            let key = PageKey::new(r, p);
            match img.locate(key).map_err(read)? {
                PageState::Zero => w.add_zero_page(r, p).map_err(werr)?,
                PageState::Absent => {}
                PageState::OnDisk { disk, offset, crc } => {
                    let hash = hashes.as_ref().map_or(0, |h| h[r as usize][p as usize]);
                    let at = (offset / u64::from(m.page_size)) as u32;
                    w.add_disk_page(key, disk, at, crc, hash).map_err(werr)?
                }
                own @ (PageState::Stored(_) | PageState::InParent { .. }) => {
                    cache.page(&img, key, &mut page).map_err(read)?;
                    match own {
                        PageState::Stored(loc) if hot.contains(&loc.block) => {
                            w.add_hot_page(r, p, &page).map_err(werr)?
                        }
                        _ => w.add_page(r, p, &page).map_err(werr)?,
                    }
                }
            }
        }
    }
    for s in img.trace_sections() {
        w.add_trace_section(&s.name, s.entries.clone())
            .map_err(werr)?;
    }
    w.set_device_state(&img.device_state().map_err(read)?)
        .map_err(werr)?;
    // What else the snapshot directory holds (learned restore records)
    // moves with it: everything the manifest does not name.
    let image_files: Vec<String> = std::iter::once(FileKind::Manifest.default_name().to_string())
        .chain(m.files.all().into_iter().map(|(_, f)| f.name.clone()))
        .collect();
    let tmp = w.temp_path().to_path_buf();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        if !image_files.iter().any(|f| name == f.as_str()) {
            std::fs::rename(e.path(), tmp.join(&name))
                .map_err(|err| fail(format!("moving {}: {err}", e.path().display())))?;
        }
    }
    drop(img);
    w.commit().map_err(werr)?;
    log(format!(
        "merged snapshot {parent_name} into its child {child}"
    ));
    super::depth::recompute_from(root, child);
    Ok(())
}

/// Decompressed blocks of the images of a chain, most recent last.
#[derive(Default)]
struct BlockCache(VecDeque<(usize, Arc<Block>)>);

impl BlockCache {
    /// Reads page `key` of `img` (through its chain) into `out`.
    fn page(&mut self, img: &Image, key: PageKey, out: &mut [u8]) -> Result<(), ReadError> {
        let (holder, st) = img.resolve(key)?;
        let PageState::Stored(loc) = st else {
            img.read_page(key, out)?;
            return Ok(());
        };
        let id = holder as *const Image as usize;
        let blk = match self
            .0
            .iter()
            .find(|(h, b)| *h == id && b.index == loc.block)
        {
            Some((_, b)) => b.clone(),
            None => {
                let b = Arc::new(holder.read_block(loc.block)?);
                if self.0.len() >= 16 {
                    self.0.pop_front();
                }
                self.0.push_back((id, b.clone()));
                b
            }
        };
        out.copy_from_slice(blk.page(usize::from(loc.slot)));
        Ok(())
    }
}
