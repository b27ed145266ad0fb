//! What an image reads from outside itself (format 2): the parent of an
//! incremental snapshot, and pages stored as references to the frozen
//! disks.
//!
//! A parent is a sibling directory named in the manifest (`parent.name`)
//! with the image id the manifest records; it is opened and checked with
//! the child, recursively, up to [`MAX_CHAIN_DEPTH`] images, and must have
//! the same page size and RAM blocks. A missing parent, another snapshot
//! under the parent's name, or a chain that loops is an error naming it.
//! Pages read through the chain are checked against the child's CRC.

use std::io;
use std::path::Path;
use std::sync::Arc;

use super::{Image, PageState};
use crate::error::ReadError;
use crate::fileio::read_body;
use crate::format::{PageKey, MAX_CHAIN_DEPTH};
use crate::hashes::decode_hashes;
use crate::manifest::{DiskRef, Manifest, ParentRef};

/// Reads guest pages from a snapshot's frozen disks (the bytes the guest
/// sees at a byte offset of the disk; for qcow2 chains the reader follows
/// the backing files).
pub trait DiskPages: Send + Sync + std::fmt::Debug {
    /// Fills `out` with the disk's bytes at `offset`.
    fn read(&self, disk: &DiskRef, offset: u64, out: &mut [u8]) -> io::Result<()>;
}

type OpenFn = fn(&Path, Option<Arc<dyn DiskPages>>, u32) -> Result<Image, ReadError>;

/// Opens the parent `p` of the image in `dir`.
pub(super) fn open_parent(
    dir: &Path,
    child: &Manifest,
    p: &ParentRef,
    disks: Option<Arc<dyn DiskPages>>,
    depth: u32,
    open: OpenFn,
) -> Result<Image, ReadError> {
    let bad = |what: String| ReadError::corrupt(dir, what);
    if depth + 1 > MAX_CHAIN_DEPTH {
        return Err(bad(format!(
            "the chain of parent snapshots is longer than {MAX_CHAIN_DEPTH} (a loop?)"
        )));
    }
    let pdir = dir
        .parent()
        .map(|d| d.join(&p.name))
        .ok_or_else(|| bad("has no parent directory to find its parent snapshot in".into()))?;
    if !pdir.is_dir() {
        return Err(ReadError::NotFound(format!(
            "{}: its parent snapshot {:?} is missing ({} does not exist); this incremental \
             snapshot cannot be read without it (use `vmcsnap snapshots delete`, which merges \
             a parent into its children, rather than removing snapshots by hand)",
            dir.display(),
            p.name,
            pdir.display()
        )));
    }
    let parent = open(&pdir, disks, depth + 1)?;
    let pm = parent.manifest();
    if pm.image_id != p.image_id {
        return Err(bad(format!(
            "its parent {:?} is another snapshot now (image id {}, expected {})",
            p.name, pm.image_id, p.image_id
        )));
    }
    if pm.page_size != child.page_size || pm.ram_blocks != child.ram_blocks {
        return Err(bad(format!(
            "its parent {:?} has another page size or other RAM blocks",
            p.name
        )));
    }
    Ok(parent)
}

impl Image {
    /// The parent snapshot, if this one is incremental.
    pub fn parent(&self) -> Option<&Image> {
        self.parent.as_deref()
    }

    /// Where the bytes of page `key` are: the image of the chain that holds
    /// them (this one or a parent) and the page's state there (never
    /// [`PageState::InParent`]).
    pub fn resolve(&self, key: PageKey) -> Result<(&Image, PageState), ReadError> {
        let mut img = self;
        loop {
            match img.locate(key)? {
                PageState::InParent { .. } => {
                    img = img.parent.as_deref().ok_or_else(|| {
                        ReadError::corrupt(
                            img.dir(),
                            "a page is in the parent, but no parent is open",
                        )
                    })?;
                }
                st => return Ok((img, st)),
            }
        }
    }

    pub(super) fn read_parent_page(
        &self,
        key: PageKey,
        crc: u32,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let parent = self.parent.as_deref().ok_or_else(|| {
            ReadError::corrupt(self.dir(), "a page is in the parent, but no parent is open")
        })?;
        parent.read_page(key, out)?;
        if crc32c::crc32c(out) != crc {
            return Err(ReadError::BadCrc {
                file: parent.dir().into(),
                what: format!(
                    "page {}:{} read from the parent snapshot",
                    key.ram_block, key.page
                ),
                block: None,
                offset: 0,
            });
        }
        Ok(())
    }

    pub(super) fn read_disk_page(
        &self,
        disk: u16,
        offset: u64,
        crc: u32,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let d = &self.manifest().disks[usize::from(disk)];
        let reader = self.disk_pages.as_ref().ok_or_else(|| {
            ReadError::InvalidArgument(format!(
                "a page is stored as a reference to frozen disk {} ({}); open the image with a disk reader",
                d.node, d.path
            ))
        })?;
        reader
            .read(d, offset, out)
            .map_err(|e| ReadError::io(Path::new(&d.path), e))?;
        if crc32c::crc32c(out) != crc {
            return Err(ReadError::BadCrc {
                file: d.path.clone().into(),
                what: "page read from the frozen disk".into(),
                block: None,
                offset,
            });
        }
        Ok(())
    }

    /// Every page's content hash (format 2 images that have `hashes.bin`;
    /// `None` for others), read and CRC-checked now.
    pub fn page_hashes(&self) -> Result<Option<Vec<Vec<u128>>>, ReadError> {
        let Some((path, file, header)) = &self.hashes_file else {
            return Ok(None);
        };
        let body = read_body(file, path, header)?;
        let ram_pages: Vec<u32> = (0..self.ram_blocks().len() as u32)
            .map(|r| self.ram_block_pages(r))
            .collect();
        decode_hashes(path, &ram_pages, &body).map(Some)
    }
}
