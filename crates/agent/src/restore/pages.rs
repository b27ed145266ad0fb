//! Page contents for the postcopy source, read from the snapshot image.
//!
//! Pages that go before the guest starts are read with the image's read
//! plan: sorted by file offset and merged into large sequential reads
//! (HotRestore §5.2), one extent in memory at a time. In a format-2 image
//! every other page is read with its whole block (decompressed once, kept
//! in a small cache): a demand fault then sends the rest of its locality
//! block and prefetches the next block of the same kind (`--prefetch-blocks`) ([`companions`]),
//! as Halite does. A format-1 image keeps positioned reads of one page and
//! the source's 4-page address window. Every page's CRC32C is checked: a
//! corrupt page is never delivered to the guest, the restore fails
//! instead.
//!
//! [`companions`]: PageSource::companions

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmcsnap_image::plan::ReadPlan;
use vmcsnap_image::{Block, Image, PageKey, PageState};
use vmcsnap_migstream::postcopy::{BackgroundHold, DestBlock, PageId, PageSource, SourceConfig};

/// Gaps up to this many bytes are read through rather than seeked over.
const MAX_GAP: u64 = 64 << 10;
/// Longest single read.
const MAX_EXTENT: u64 = 8 << 20;
/// Decompressed blocks kept (16 MiB of 256 KiB blocks).
const CACHE_BLOCKS: usize = 64;
/// Blocks prefetched after a demand fault's own block, by default. Deeper
/// prefetch (`--prefetch-blocks`) was measured without a clear winner
/// (docs/restore.md, "Locality").
pub const PREFETCH_BLOCKS: usize = 1;
/// The most a restore may ask for.
pub const MAX_PREFETCH_BLOCKS: u32 = 64;

/// The image as a [`PageSource`].
pub struct ImagePages<'a> {
    img: &'a Image,
    plan: ReadPlan,
    /// Page → (extent, offset within it), for the planned pages.
    planned: HashMap<PageKey, (usize, usize)>,
    loaded: Option<usize>,
    buf: Vec<u8>,
    /// Format 2: read whole blocks and offer their pages as companions.
    blockwise: bool,
    /// Most recently used last; keyed by the image of the chain that holds
    /// the block (its address) and the block number.
    cache: VecDeque<(usize, Arc<Block>)>,
    /// Bytes read from the memory image so far.
    pub bytes_read: Arc<AtomicU64>,
    /// Pages handed out so far (each page once: the source sends a page
    /// only once).
    pub pages_read: Arc<AtomicU64>,
    /// Blocks read whole (format 2).
    pub blocks_read: Arc<AtomicU64>,
    /// Decompression ahead of the pages sent before the guest starts.
    prefetch: Option<super::prefetch::Prefetch>,
    /// Blocks read ahead after a demand fault's own block.
    prefetch_blocks: usize,
}

impl<'a> ImagePages<'a> {
    /// A page source that reads `sequential` (the pages sent before the
    /// guest starts) with merged reads.
    pub fn new(
        img: &'a Image,
        sequential: &[PageKey],
        prefetch_blocks: usize,
    ) -> Result<Self, vmcsnap_image::ReadError> {
        let plan = img.plan_reads(sequential, MAX_GAP, MAX_EXTENT)?;
        let mut planned = HashMap::with_capacity(sequential.len());
        for (i, e) in plan.extents.iter().enumerate() {
            for &(k, off, _) in &e.pages {
                planned.insert(k, (i, off as usize));
            }
        }
        Ok(ImagePages {
            img,
            plan,
            planned,
            loaded: None,
            buf: Vec::new(),
            blockwise: img.version().major >= 2,
            cache: VecDeque::with_capacity(CACHE_BLOCKS),
            bytes_read: Arc::default(),
            pages_read: Arc::default(),
            blocks_read: Arc::default(),
            prefetch: super::prefetch::Prefetch::start(img, sequential, prefetch_threads()),
            prefetch_blocks,
        })
    }

    /// Block `b` of `holder` (this image or one of its parents), from the
    /// cache or read (and decompressed) now.
    fn block(&mut self, holder: &Image, b: u32) -> io::Result<Arc<Block>> {
        let id = holder as *const Image as usize;
        if let Some(i) = self
            .cache
            .iter()
            .position(|(h, x)| *h == id && x.index == b)
        {
            let entry = self.cache.remove(i).unwrap_or_else(|| unreachable!());
            let blk = entry.1.clone();
            self.cache.push_back(entry);
            return Ok(blk);
        }
        let prefetched = match &mut self.prefetch {
            Some(p) if std::ptr::eq(holder, self.img) => p.get(b),
            _ => None,
        };
        let blk = match prefetched {
            Some(r) => r.map_err(io::Error::other)?,
            None => Arc::new(holder.read_block(b).map_err(to_io)?),
        };
        let stored = holder.blocks()[b as usize].stored_len;
        self.bytes_read
            .fetch_add(u64::from(stored), Ordering::Relaxed);
        self.blocks_read.fetch_add(1, Ordering::Relaxed);
        if self.cache.len() >= CACHE_BLOCKS {
            self.cache.pop_front();
        }
        self.cache.push_back((id, blk.clone()));
        Ok(blk)
    }
}

/// Decompression threads ahead of the pages sent before the guest starts:
/// every CPU (the guest is not running yet), at most 4.
fn prefetch_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
}

fn to_io(e: vmcsnap_image::ReadError) -> io::Error {
    io::Error::other(e.to_string())
}

/// What the postcopy source says of `img`'s VM (machine, RAM blocks,
/// device state), with no pages to send yet: the caller's plan fills in
/// `before_run`, `demand_cluster`, `background` and `background_after`.
pub fn source_config(img: &Image, device_state: Vec<u8>, hold: BackgroundHold) -> SourceConfig {
    SourceConfig {
        machine: img.manifest().qemu.machine.clone(),
        blocks: img
            .ram_blocks()
            .iter()
            .map(|b| DestBlock {
                name: b.name.clone(),
                used_length: b.used_length,
            })
            .collect(),
        page_size: img.page_size(),
        ram_section_id: super::job::RAM_SECTION_ID,
        device_state,
        before_run: vec![],
        demand_cluster: 0,
        background: vec![],
        background_after: None,
        hold,
        shut_timeout: std::time::Duration::from_secs(60),
    }
}

/// A page read from a parent snapshot is not the page the child recorded.
fn parent_crc_mismatch(id: PageId, holder: &Image) -> io::Error {
    io::Error::other(format!(
        "page {}:{} read from the parent snapshot {} has another CRC",
        id.block,
        id.page,
        holder.dir().display()
    ))
}

impl PageSource for ImagePages<'_> {
    fn read_page(&mut self, id: PageId, buf: &mut [u8]) -> io::Result<bool> {
        let key = PageKey::new(id.block, id.page);
        self.pages_read.fetch_add(1, Ordering::Relaxed);
        if let Some(&(extent, off)) = self.planned.get(&key) {
            if self.loaded != Some(extent) {
                let e = &self.plan.extents[extent];
                self.img.read_extent(e, &mut self.buf).map_err(to_io)?;
                self.bytes_read.fetch_add(e.len, Ordering::Relaxed);
                self.loaded = Some(extent);
            }
            buf.copy_from_slice(&self.buf[off..off + buf.len()]);
            return Ok(true);
        }
        if self.blockwise {
            let img = self.img;
            return match img.resolve(key).map_err(to_io)? {
                (holder, PageState::Stored(loc)) => {
                    let blk = self.block(holder, loc.block)?;
                    // `locate` checked the slot against the block table.
                    buf.copy_from_slice(blk.page(usize::from(loc.slot)));
                    // A page of a parent: the child's CRC says it is the
                    // same page (the parent could only differ if replaced,
                    // which opening the chain refuses).
                    if !std::ptr::eq(holder, img) {
                        if let PageState::InParent { crc } = img.locate(key).map_err(to_io)? {
                            if loc.crc != crc {
                                return Err(parent_crc_mismatch(id, holder));
                            }
                        }
                    }
                    Ok(true)
                }
                (holder, PageState::Zero) => {
                    // A parent's zero page must be what the child recorded.
                    if !std::ptr::eq(holder, img) {
                        if let PageState::InParent { crc } = img.locate(key).map_err(to_io)? {
                            buf.fill(0);
                            if crc32c::crc32c(buf) != crc {
                                return Err(parent_crc_mismatch(id, holder));
                            }
                        }
                    }
                    Ok(false)
                }
                (_, PageState::Absent) => Err(absent(id)),
                (_, PageState::OnDisk { .. } | PageState::InParent { .. }) => {
                    img.read_page(key, buf).map_err(to_io)?;
                    self.bytes_read
                        .fetch_add(buf.len() as u64, Ordering::Relaxed);
                    Ok(true)
                }
            };
        }
        match self.img.read_page(key, buf).map_err(to_io)? {
            PageState::Zero => Ok(false),
            PageState::Absent => Err(absent(id)),
            _ => {
                self.bytes_read
                    .fetch_add(buf.len() as u64, Ordering::Relaxed);
                Ok(true)
            }
        }
    }

    /// Format 2: the other pages of the requested page's block (the pages
    /// written with it: the guest's first-write order in a hot block,
    /// address order in a cold one), then those of the next block of the
    /// same kind, read now so that the source sends them from memory.
    fn companions(&mut self, id: PageId, out: &mut Vec<PageId>) -> bool {
        if !self.blockwise {
            return false;
        }
        let key = PageKey::new(id.block, id.page);
        let img = self.img;
        let Ok((holder, PageState::Stored(loc))) = img.resolve(key) else {
            return false;
        };
        let blocks = holder.blocks();
        let hot = blocks[loc.block as usize].is_hot();
        let next = (loc.block as usize + 1..blocks.len())
            .filter(|&b| blocks[b].is_hot() == hot)
            .take(self.prefetch_blocks);
        let own = std::ptr::eq(holder, img);
        for b in std::iter::once(loc.block as usize).chain(next) {
            // A block that fails to read is reported when its page is
            // requested; prefetch is best effort.
            let Ok(blk) = self.block(holder, b as u32) else {
                continue;
            };
            // A parent's block: only the pages the child still reads there
            // (the others changed since).
            out.extend(
                blk.pages
                    .iter()
                    .filter(|k| **k != key)
                    .filter(|k| own || img.resolve(**k).is_ok_and(|(h, _)| std::ptr::eq(h, holder)))
                    .map(|k| PageId {
                        block: k.ram_block,
                        page: k.page,
                    }),
            );
        }
        true
    }
}

fn absent(id: PageId) -> io::Error {
    io::Error::other(format!(
        "page {} of RAM block {} is not in the image",
        id.page, id.block
    ))
}

/// Every page of the image once, in image order: stored pages by their
/// place in the memory image, then zero pages (which cost no read) in
/// address order.
pub fn image_order(img: &Image) -> Result<Vec<PageKey>, vmcsnap_image::ReadError> {
    let mut stored = Vec::new();
    let mut zero = Vec::new();
    for b in 0..img.ram_blocks().len() as u32 {
        for p in 0..img.ram_block_pages(b) {
            let k = PageKey::new(b, p);
            match img.locate(k)? {
                PageState::Stored(loc) => stored.push(((loc.block, loc.slot), k)),
                _ => zero.push(k),
            }
        }
    }
    stored.sort_unstable_by_key(|&(r, _)| r);
    Ok(stored.into_iter().map(|(_, k)| k).chain(zero).collect())
}

#[cfg(test)]
#[path = "pages_tests.rs"]
mod tests;
