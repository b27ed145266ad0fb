//! The reader ([`Image`]).
//!
//! [`Image::open`] checks the manifest (magic, version, CRC), that every
//! data file exists with the size the manifest names, every file header
//! (magic, version, CRC, image id), and reads and CRC-checks the page
//! index, the zero bitmaps and the traces, cross-checking them against
//! each other. Every length or count taken from disk is checked against
//! the file size or a fixed limit before anything is allocated. Block and
//! page CRCs are checked when blocks and pages are read, and all of them
//! by [`Image::verify`].
//!
//! All reads are positioned (`pread`), so an `Image` can be shared between
//! threads.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{ReadError, Version};
use crate::fileio::{open_file, read_at, read_body, read_header};
use crate::format::{
    get_u16, reads_major, FileHeader, FileKind, PageKey, COMPRESSION_NONE, ENTRY_FLAG_DUP,
    FORMAT_VERSION, MAX_DEVICE_STATE_LEN,
};
use crate::hashes::hashes_body_len;
use crate::index::{
    bitmap_body_len, decode_bitmaps, decode_index, index_body_len, BlockInfo, IndexContext,
    IndexEntry, ZeroBitmap,
};
use crate::manifest::{Manifest, RamBlock};
use crate::trace::{decode_trace, TraceSection, TRACE_FAFL};

mod blocks;
mod chain;
pub use blocks::Block;
pub use chain::DiskPages;

/// Largest trace file body a reader loads.
pub const MAX_TRACE_LEN: u64 = 1 << 30;

/// Where a page is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageState {
    /// In the memory image.
    Stored(PageLocation),
    /// A zero page (in the zero bitmap).
    Zero,
    /// Neither stored nor zero (not in this image).
    Absent,
    /// On a frozen disk of the snapshot (v2): disk number in the
    /// manifest's `disks`, byte offset on the disk, CRC32C of the page.
    OnDisk {
        /// Index into the manifest's `disks`.
        disk: u16,
        /// Byte offset of the page on the disk (as the guest sees it).
        offset: u64,
        /// CRC32C of the page's bytes.
        crc: u32,
    },
    /// The same page of the parent snapshot (v2 incremental).
    InParent {
        /// CRC32C of the page's bytes.
        crc: u32,
    },
}

/// Where a stored page is in the memory image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLocation {
    /// Memory-image block.
    pub block: u32,
    /// Slot within the block.
    pub slot: u16,
    /// File offset of the page's bytes; `None` if the block is compressed.
    pub offset: Option<u64>,
    /// CRC32C of the page's bytes.
    pub crc: u32,
}

/// Sizes and counts of an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImageStats {
    /// Guest pages of all RAM blocks.
    pub pages_total: u64,
    /// Pages in the memory image.
    pub pages_stored: u64,
    /// Zero pages.
    pub pages_zero: u64,
    /// Pages stored once for several pages of equal bytes (v2), not
    /// counting the page that owns the slot.
    pub pages_duplicate: u64,
    /// Pages read from the parent snapshot (v2 incremental).
    pub pages_in_parent: u64,
    /// Pages stored as references to a frozen disk (v2).
    pub pages_on_disk: u64,
    /// Pages neither stored nor zero.
    pub pages_absent: u64,
    /// Blocks of pages the guest wrote during the snapshot (v2).
    pub blocks_hot: u32,
    /// Blocks stored compressed (v2).
    pub blocks_compressed: u32,
    /// Bytes of the stored pages before compression.
    pub payload_raw_bytes: u64,
    /// Bytes of the stored pages as stored (after compression).
    pub payload_stored_bytes: u64,
    /// Memory-image blocks.
    pub blocks: u32,
    /// Size of the memory image.
    pub memory_bytes: u64,
    /// Size of every file, the manifest included.
    pub total_bytes: u64,
    /// Size of the device state.
    pub device_state_bytes: u64,
}

/// An open, checked snapshot image.
#[derive(Debug)]
pub struct Image {
    dir: PathBuf,
    version: Version,
    manifest: Manifest,
    manifest_len: u64,
    pub(crate) mem: File,
    pub(crate) mem_path: PathBuf,
    device: File,
    device_path: PathBuf,
    device_header: FileHeader,
    pub(crate) blocks: Vec<BlockInfo>,
    pub(crate) index: Vec<Vec<IndexEntry>>,
    zero: Vec<ZeroBitmap>,
    traces: Vec<TraceSection>,
    /// The parent snapshot, opened and checked (incremental snapshots).
    pub(crate) parent: Option<Box<Image>>,
    /// Reads pages stored as disk references.
    pub(crate) disk_pages: Option<Arc<dyn DiskPages>>,
    /// `hashes.bin`, checked at open, read by [`Image::page_hashes`].
    pub(crate) hashes_file: Option<(PathBuf, File, FileHeader)>,
}

/// An open data file and its checked header.
pub(crate) struct Opened {
    path: PathBuf,
    file: File,
    len: u64,
    header: FileHeader,
}

impl Image {
    /// Opens and checks the snapshot in `dir` (see the module docs), and
    /// its parents if it is incremental. Pages stored as disk references
    /// cannot be read (use [`Image::open_with`]).
    pub fn open(dir: &Path) -> Result<Image, ReadError> {
        Self::open_with(dir, None)
    }

    /// [`open`](Self::open), reading disk-reference pages with `disks`.
    pub fn open_with(dir: &Path, disks: Option<Arc<dyn DiskPages>>) -> Result<Image, ReadError> {
        Self::open_at(dir, disks, 0)
    }

    fn open_at(
        dir: &Path,
        disks: Option<Arc<dyn DiskPages>>,
        depth: u32,
    ) -> Result<Image, ReadError> {
        match fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(ReadError::corrupt(dir, "not a directory")),
            Err(e) => return Err(ReadError::io(dir, e)),
        }
        let mpath = dir.join(FileKind::Manifest.default_name());
        let (version, manifest) = Manifest::load(&mpath)?;
        let manifest_len = fs::metadata(&mpath)
            .map_err(|e| ReadError::io(&mpath, e))?
            .len();
        let id = manifest.image_id_bytes().unwrap_or_default();
        let open_ref = |kind: FileKind,
                        fr: &crate::manifest::FileRef|
         -> Result<Opened, ReadError> {
            let path = dir.join(&fr.name);
            let (file, len) = open_file(&path)?;
            // A foreign file, or one of another major version, says so
            // before its size is compared.
            let mut pre = [0u8; 12];
            let n = len.min(12) as usize;
            read_at(&file, &path, &mut pre[..n], 0)?;
            if !kind.magic().starts_with(&pre[..n.min(8)]) {
                return Err(ReadError::BadMagic {
                    file: path,
                    expected: kind.describe(),
                });
            }
            if n == 12 && get_u16(&pre, 8) != version.major {
                let found = Version {
                    major: get_u16(&pre, 8),
                    minor: get_u16(&pre, 10),
                };
                if reads_major(found.major) {
                    return Err(ReadError::corrupt(
                        path,
                        format!(
                            "format version {found}, the manifest's is {version}: files of two snapshots mixed"
                        ),
                    ));
                }
                return Err(ReadError::UnsupportedVersion {
                    file: path,
                    found,
                    supported: FORMAT_VERSION,
                });
            }
            if len < fr.size {
                return Err(ReadError::Truncated {
                    file: path,
                    expected: fr.size,
                    found: len,
                });
            }
            if len > fr.size {
                return Err(ReadError::corrupt(
                    path,
                    format!("{len} bytes, the manifest says {}", fr.size),
                ));
            }
            let header = read_header(&file, &path, kind, len)?;
            if header.image_id != id {
                return Err(ReadError::corrupt(
                    path,
                    "the file belongs to a different snapshot (image id differs)",
                ));
            }
            Ok(Opened {
                path,
                file,
                len,
                header,
            })
        };
        let open = |kind: FileKind| {
            let fr = match kind {
                FileKind::Memory => &manifest.files.memory,
                FileKind::Index => &manifest.files.index,
                FileKind::Zero => &manifest.files.zero,
                FileKind::Device => &manifest.files.device,
                _ => &manifest.files.trace,
            };
            open_ref(kind, fr)
        };
        let mem = open(FileKind::Memory)?;
        let idx = open(FileKind::Index)?;
        let zero = open(FileKind::Zero)?;
        let device = open(FileKind::Device)?;
        let trace = open(FileKind::Trace)?;

        let ram_pages: Vec<u32> = (0..manifest.ram_blocks.len())
            .map(|i| manifest.ram_block_pages(i))
            .collect();
        for o in [&mem, &idx] {
            if o.header.page_size != manifest.page_size || o.header.count != manifest.blocks {
                return Err(ReadError::corrupt(
                    &o.path,
                    format!(
                        "header says {} blocks of {}-byte pages, the manifest {} of {}",
                        o.header.count, o.header.page_size, manifest.blocks, manifest.page_size
                    ),
                ));
            }
        }
        let expected = index_body_len(manifest.blocks, &ram_pages);
        if idx.header.body_len != expected {
            return Err(ReadError::corrupt(
                &idx.path,
                format!(
                    "body is {} bytes, the manifest implies {expected}",
                    idx.header.body_len
                ),
            ));
        }
        let body = read_body(&idx.file, &idx.path, &idx.header)?;
        let cx = IndexContext {
            file: &idx.path,
            blocks: manifest.blocks,
            ram_pages: &ram_pages,
            page_size: manifest.page_size,
            pages_per_block: manifest.pages_per_block,
            first_block: u64::from(mem.header.header_len),
            memory_len: mem.len,
            major: version.major,
            disks: manifest.disks.len(),
            has_parent: manifest.parent.is_some(),
        };
        let (blocks, index) = decode_index(&cx, &body)?;
        drop(body);

        let expected = bitmap_body_len(&ram_pages);
        if zero.header.count as usize != ram_pages.len() || zero.header.body_len != expected {
            return Err(ReadError::corrupt(
                &zero.path,
                "bitmap sizes do not match the manifest's RAM blocks",
            ));
        }
        let body = read_body(&zero.file, &zero.path, &zero.header)?;
        let bitmaps = decode_bitmaps(&zero.path, &ram_pages, &body)?;
        for (r, (entries, map)) in index.iter().zip(&bitmaps).enumerate() {
            if let Some(p) = map
                .iter()
                .find(|&p| entries[p as usize] != IndexEntry::NONE)
            {
                return Err(ReadError::corrupt(
                    &zero.path,
                    format!("page {r}:{p} is both zero and stored (or referenced)"),
                ));
            }
        }

        if trace.header.body_len > MAX_TRACE_LEN {
            return Err(ReadError::corrupt(
                &trace.path,
                "trace is larger than 1 GiB",
            ));
        }
        let body = read_body(&trace.file, &trace.path, &trace.header)?;
        let traces = decode_trace(&trace.path, trace.header.count, &ram_pages, &body)?;
        let hashes_file = match &manifest.files.hashes {
            Some(fr) => {
                let o = open_ref(FileKind::Hashes, fr)?;
                if o.header.body_len != hashes_body_len(&ram_pages) {
                    return Err(ReadError::corrupt(
                        &o.path,
                        "body length does not match the RAM blocks",
                    ));
                }
                Some((o.path, o.file, o.header))
            }
            None => None,
        };
        let parent = match &manifest.parent {
            Some(p) => Some(Box::new(chain::open_parent(
                dir,
                &manifest,
                p,
                disks.clone(),
                depth,
                Image::open_at,
            )?)),
            None => None,
        };

        if device.header.body_len > MAX_DEVICE_STATE_LEN {
            return Err(ReadError::corrupt(
                &device.path,
                "device state is larger than 1 GiB",
            ));
        }
        Ok(Image {
            dir: dir.into(),
            version,
            manifest,
            manifest_len,
            mem: mem.file,
            mem_path: mem.path,
            device: device.file,
            device_path: device.path,
            device_header: device.header,
            blocks,
            index,
            zero: bitmaps,
            traces,
            parent,
            disk_pages: disks,
            hashes_file,
        })
    }

    /// The snapshot directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The format version of the manifest.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Guest page size.
    pub fn page_size(&self) -> usize {
        self.manifest.page_size as usize
    }

    /// The RAM blocks; a [`PageKey`]'s `ram_block` indexes this.
    pub fn ram_blocks(&self) -> &[RamBlock] {
        &self.manifest.ram_blocks
    }

    /// The RAM block number of `name`.
    pub fn ram_block_id(&self, name: &str) -> Option<u32> {
        self.manifest
            .ram_blocks
            .iter()
            .position(|rb| rb.name == name)
            .map(|i| i as u32)
    }

    /// Pages of RAM block `ram_block` (0 if there is no such block).
    pub fn ram_block_pages(&self, ram_block: u32) -> u32 {
        self.index
            .get(ram_block as usize)
            .map_or(0, |e| e.len() as u32)
    }

    /// The block table, in file order.
    pub fn blocks(&self) -> &[BlockInfo] {
        &self.blocks
    }

    /// The zero bitmap of a RAM block.
    pub fn zero_bitmap(&self, ram_block: u32) -> Option<&ZeroBitmap> {
        self.zero.get(ram_block as usize)
    }

    /// Every trace section.
    pub fn trace_sections(&self) -> &[TraceSection] {
        &self.traces
    }

    /// The trace section `name`.
    pub fn trace(&self, name: &str) -> Option<&[PageKey]> {
        self.traces
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.entries.as_slice())
    }

    /// The FAFL queue (empty if the snapshot recorded none).
    pub fn fafl(&self) -> &[PageKey] {
        self.trace(TRACE_FAFL).unwrap_or(&[])
    }

    /// Counts and sizes.
    pub fn stats(&self) -> ImageStats {
        let pages_total: u64 = self.index.iter().map(|e| e.len() as u64).sum();
        let pages_stored: u64 = self.blocks.iter().map(|b| u64::from(b.page_count)).sum();
        let pages_zero: u64 = self.zero.iter().map(ZeroBitmap::count).sum();
        let pages_duplicate: u64 = self
            .index
            .iter()
            .flatten()
            .filter(|e| e.is_stored() && e.flags & ENTRY_FLAG_DUP != 0)
            .count() as u64;
        let pages_in_parent = self
            .index
            .iter()
            .flatten()
            .filter(|e| e.in_parent())
            .count() as u64;
        let pages_on_disk = self
            .index
            .iter()
            .flatten()
            .filter(|e| e.on_disk().is_some())
            .count() as u64;
        let files: u64 = self.manifest.files.all().iter().map(|(_, f)| f.size).sum();
        let ps = self.manifest.page_size as u64;
        ImageStats {
            pages_total,
            pages_stored,
            pages_zero,
            pages_duplicate,
            pages_in_parent,
            pages_on_disk,
            pages_absent: pages_total
                - pages_stored
                - pages_duplicate
                - pages_in_parent
                - pages_on_disk
                - pages_zero,
            blocks_hot: self.blocks.iter().filter(|b| b.is_hot()).count() as u32,
            blocks_compressed: self
                .blocks
                .iter()
                .filter(|b| b.compression != COMPRESSION_NONE)
                .count() as u32,
            payload_raw_bytes: pages_stored * ps,
            payload_stored_bytes: self.blocks.iter().map(|b| u64::from(b.payload_len())).sum(),
            blocks: self.blocks.len() as u32,
            memory_bytes: self.manifest.files.memory.size,
            total_bytes: files + self.manifest_len,
            device_state_bytes: self.device_header.body_len,
        }
    }

    /// Where page `key` is; [`ReadError::NotFound`] if there is no such page.
    pub fn locate(&self, key: PageKey) -> Result<PageState, ReadError> {
        let entry = self
            .index
            .get(key.ram_block as usize)
            .and_then(|e| e.get(key.page as usize))
            .ok_or_else(|| {
                ReadError::NotFound(format!(
                    "page {}:{} is not in this image's RAM blocks",
                    key.ram_block, key.page
                ))
            })?;
        if entry.is_stored() {
            let info = &self.blocks[entry.block as usize];
            let offset = (info.compression == COMPRESSION_NONE).then(|| {
                info.payload_offset() + u64::from(entry.slot) * self.manifest.page_size as u64
            });
            Ok(PageState::Stored(PageLocation {
                block: entry.block,
                slot: entry.slot,
                offset,
                crc: entry.crc,
            }))
        } else if let Some((disk, at)) = entry.on_disk() {
            Ok(PageState::OnDisk {
                disk,
                offset: u64::from(at) * self.manifest.page_size as u64,
                crc: entry.crc,
            })
        } else if entry.in_parent() {
            Ok(PageState::InParent { crc: entry.crc })
        } else if self.zero[key.ram_block as usize].is_zero(key.page) {
            Ok(PageState::Zero)
        } else {
            Ok(PageState::Absent)
        }
    }

    /// Reads page `key` into `out` (one page long) and checks its CRC.
    /// A zero page fills `out` with zeros; an absent page leaves it alone.
    /// Returns where the page was.
    pub fn read_page(&self, key: PageKey, out: &mut [u8]) -> Result<PageState, ReadError> {
        if out.len() != self.page_size() {
            return Err(ReadError::InvalidArgument(format!(
                "buffer is {} bytes, pages are {}",
                out.len(),
                self.page_size()
            )));
        }
        let state = self.locate(key)?;
        match state {
            PageState::Stored(loc) => match loc.offset {
                Some(offset) => {
                    read_at(&self.mem, &self.mem_path, out, offset)?;
                    if crc32c::crc32c(out) != loc.crc {
                        return Err(self.page_crc_error(loc.block, offset));
                    }
                }
                None => {
                    let block = self.read_block(loc.block)?;
                    out.copy_from_slice(block.page(usize::from(loc.slot)));
                }
            },
            PageState::Zero => out.fill(0),
            PageState::Absent => {}
            PageState::OnDisk { disk, offset, crc } => {
                self.read_disk_page(disk, offset, crc, out)?
            }
            PageState::InParent { crc } => self.read_parent_page(key, crc, out)?,
        }
        Ok(state)
    }

    /// Reads the device-state blob and checks its CRC.
    pub fn device_state(&self) -> Result<Vec<u8>, ReadError> {
        read_body(&self.device, &self.device_path, &self.device_header)
    }
}
