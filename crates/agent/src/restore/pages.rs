//! Page contents for the postcopy source, read from the snapshot image.
//!
//! Pages that go before the guest starts are read with the image's read
//! plan: sorted by file offset and merged into large sequential reads
//! (HotRestore §5.2), one extent in memory at a time. Every other page is a
//! positioned read of one page. Both check each page's CRC32C: a corrupt
//! page is never delivered to the guest, the restore fails instead.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmcsnap_image::plan::ReadPlan;
use vmcsnap_image::{Image, PageKey, PageState};
use vmcsnap_migstream::postcopy::{PageId, PageSource};

/// Gaps up to this many bytes are read through rather than seeked over.
const MAX_GAP: u64 = 64 << 10;
/// Longest single read.
const MAX_EXTENT: u64 = 8 << 20;

/// The image as a [`PageSource`].
pub struct ImagePages<'a> {
    img: &'a Image,
    plan: ReadPlan,
    /// Page → (extent, offset within it), for the planned pages.
    planned: HashMap<PageKey, (usize, usize)>,
    loaded: Option<usize>,
    buf: Vec<u8>,
    /// Bytes read from the memory image so far.
    pub bytes_read: Arc<AtomicU64>,
    /// Pages handed out so far (each page once: the source sends a page
    /// only once).
    pub pages_read: Arc<AtomicU64>,
}

impl<'a> ImagePages<'a> {
    /// A page source that reads `sequential` (the pages sent before the
    /// guest starts) with merged reads.
    pub fn new(img: &'a Image, sequential: &[PageKey]) -> Result<Self, vmcsnap_image::ReadError> {
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
            bytes_read: Arc::default(),
            pages_read: Arc::default(),
        })
    }
}

fn to_io(e: vmcsnap_image::ReadError) -> io::Error {
    io::Error::other(e.to_string())
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
        match self.img.read_page(key, buf).map_err(to_io)? {
            PageState::Stored(_) => {
                self.bytes_read
                    .fetch_add(buf.len() as u64, Ordering::Relaxed);
                Ok(true)
            }
            PageState::Zero => Ok(false),
            PageState::Absent => Err(io::Error::other(format!(
                "page {} of RAM block {} is not in the image",
                id.page, id.block
            ))),
        }
    }
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
