//! The streaming writer ([`ImageWriter`]).
//!
//! Non-zero pages are grouped into blocks of up to `pages_per_block` pages;
//! all-zero pages only set a bit. Format v2 (the default) keeps two open
//! blocks, so that blocks have locality (Halite): pages the guest wrote
//! while the snapshot ran ([`ImageWriter::add_hot_page`]) fill *hot*
//! blocks in the order the guest first wrote them, every other page fills
//! *cold* blocks in arrival order (guest-physical order for every stream
//! QEMU sends). Full blocks are compressed by the worker pool of
//! [`pipeline`](self) and appended in submission order with one `writev`
//! each; a page whose bytes equal an earlier page's is stored once (the
//! index points both at one slot). Format v1 ([`WriterOptions::v1`]) keeps
//! one block in arrival order, uncompressed, without duplicates.
//!
//! Memory use is bounded: the open blocks, the blocks in flight in the
//! pool, the index (12 bytes per guest page), the zero bitmaps and the
//! pages-given bitmap (1 bit per guest page each), the duplicate table (16
//! bytes of hash + 8 of key per stored page, v2) and the traces (8 bytes
//! per entry); the index, bitmaps and traces go to disk at
//! [`ImageWriter::commit`].
//!
//! Everything is written under a temporary directory next to the final
//! one (`<name>.tmp-<pid>-<n>`); `commit` fsyncs every file, writes the
//! manifest last, fsyncs the directory, renames it to its final name and
//! fsyncs the parent. A snapshot that was not committed has no final name,
//! and dropping an uncommitted writer removes its temporary directory.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use thiserror::Error;

mod commit;
pub mod pipeline;

use crate::codec::Codec;
use crate::error::Version;
use crate::fileio::{new_image_id, write_all_vectored, write_body_file};
use crate::format::{
    is_zero, pages_for, valid_page_size, BlockHeader, FileHeader, FileKind, PageKey,
    BLOCK_ENTRY_LEN, BLOCK_FLAG_HOT, BLOCK_HEADER_LEN, DEFAULT_PAGES_PER_BLOCK, ENTRY_FLAG_DISK,
    ENTRY_FLAG_DUP, ENTRY_FLAG_PARENT, FILE_HEADER_LEN, FORMAT_V1, FORMAT_VERSION,
    MAX_BLOCK_PAYLOAD, MAX_DEVICE_STATE_LEN, MAX_NAME_LEN, MAX_PAGES_PER_BLOCK, MAX_RAM_BLOCKS,
    MAX_TRACE_SECTIONS,
};
use crate::index::{BlockInfo, IndexEntry, ZeroBitmap};
use crate::list::TEMP_MARKER;
use crate::manifest::{is_plain_name, DiskRef, Manifest, Metrics, QemuInfo, RamBlock, VmInfo};
use crate::trace::{valid_section_name, TraceSection, TRACE_FAFL};
use pipeline::{Done, Pool, WorkerInit};

/// Why writing a snapshot failed.
#[derive(Debug, Error)]
pub enum WriteError {
    /// A file system operation failed; the snapshot is not committed.
    #[error("{path}: {source}; the snapshot was not committed (check free space and permissions)")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The metadata or options are unusable.
    #[error("invalid snapshot metadata: {0}")]
    InvalidMeta(String),
    /// The final directory already exists.
    #[error("{0} already exists; choose another snapshot name or remove the old snapshot")]
    Exists(PathBuf),
    /// A page names a RAM block the metadata does not list.
    #[error("RAM block {0} is not in the snapshot metadata")]
    UnknownRamBlock(u32),
    /// A page number is past the end of its RAM block.
    #[error("page {page} is past the end of RAM block {ram_block} ({pages} pages)")]
    PageOutOfRange {
        /// RAM block.
        ram_block: u32,
        /// Page.
        page: u32,
        /// Pages in the RAM block.
        pages: u32,
    },
    /// Page data of the wrong length.
    #[error("page data is {found} bytes, the page size is {expected}")]
    PageSize {
        /// The page size.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// A page was given twice (each page must arrive exactly once).
    #[error("page {}:{} was given twice; each page must be written exactly once", .0.ram_block, .0.page)]
    DuplicatePage(PageKey),
    /// `commit` with pages that were never given.
    #[error("{missing} guest pages were never written (first: {}:{}); the stream was incomplete", first.ram_block, first.page)]
    Incomplete {
        /// How many pages are missing.
        missing: u64,
        /// The first missing page.
        first: PageKey,
    },
    /// `commit` before `set_device_state`.
    #[error("no device state was set; a snapshot needs one")]
    MissingDeviceState,
    /// A bad device state or second call.
    #[error("device state: {0}")]
    DeviceState(String),
    /// A bad trace section or entry.
    #[error("trace: {0}")]
    Trace(String),
    /// An earlier I/O error left the writer unusable.
    #[error("an earlier write failed; this snapshot cannot be committed (drop the writer)")]
    Poisoned,
    /// [`ImageWriter::commit_unless`] was cancelled before the rename.
    #[error("the commit was cancelled before the snapshot was renamed into place; nothing was committed")]
    Cancelled,
}

/// What a snapshot is of; goes into the manifest.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ImageMeta {
    /// The VM.
    pub vm: VmInfo,
    /// The QEMU that produced the state.
    pub qemu: QemuInfo,
    /// Guest page size (4096 for x86).
    pub page_size: u32,
    /// Guest RAM blocks; page keys refer to them by position.
    pub ram_blocks: Vec<RamBlock>,
    /// Disks frozen with the snapshot.
    pub disks: Vec<DiskRef>,
    /// What the device-state blob is.
    pub device_state_format: String,
    /// Free-form labels.
    pub labels: BTreeMap<String, String>,
}

/// Writer tuning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterOptions {
    /// Most pages per memory-image block (default 64).
    pub pages_per_block: u16,
    /// Refuse to commit unless every guest page was given (default true).
    pub require_complete: bool,
    /// Major format version to write: 2 (default) or 1 (uncompressed, one
    /// block stream, no duplicates: readable by older vmcsnap builds).
    pub format_major: u16,
    /// Block compression (v2; default Zstandard).
    pub codec: Codec,
    /// Store pages with equal bytes once (v2; default true).
    pub dedup: bool,
    /// Compression worker threads; 0 (default) = one fewer than the CPUs,
    /// 1 to 4.
    pub compress_threads: usize,
    /// Benchmark control (Halite's "no locality"): 0 (default) = off; N =
    /// every page that is not hot goes to one of N open blocks chosen at
    /// random, so a block holds pages from all over a window of N blocks.
    pub scatter_blocks: u16,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            pages_per_block: DEFAULT_PAGES_PER_BLOCK,
            require_complete: true,
            format_major: FORMAT_VERSION.major,
            codec: Codec::default(),
            dedup: true,
            compress_threads: 0,
            scatter_blocks: 0,
        }
    }
}

impl WriterOptions {
    /// Options that write format 1.0 (what vmcsnap wrote before v2).
    pub fn v1() -> Self {
        WriterOptions {
            format_major: 1,
            codec: Codec::None,
            dedup: false,
            ..Default::default()
        }
    }

    fn version(&self) -> Version {
        if self.format_major == 1 {
            FORMAT_V1
        } else {
            FORMAT_VERSION
        }
    }
}

/// The parent of an incremental snapshot, as the writer needs it.
#[derive(Debug, Clone)]
pub struct ParentInfo {
    /// Its manifest reference (name, image id, chain depth of the child).
    pub reference: crate::manifest::ParentRef,
    /// Its RAM blocks (must equal the child's).
    pub ram_blocks: Vec<RamBlock>,
    /// Its page hashes ([`crate::Image::page_hashes`]).
    pub hashes: Vec<Vec<u128>>,
}

/// Finds a page's bytes on one of the snapshot's frozen disks (the
/// detection layer: pages of the guest's page cache). `find` must compare
/// the bytes themselves, not only the hash, before answering.
pub trait DiskMatcher: Send {
    /// `(disk, offset in pages)` of a disk block holding exactly `data`.
    fn find(&mut self, hash: u128, data: &[u8]) -> Option<(u16, u32)>;
}

/// A block being filled.
#[derive(Debug, Default)]
struct OpenBlock {
    keys: Vec<(PageKey, u32)>,
    payload: Vec<u8>,
}

/// A committed snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    /// Its directory.
    pub path: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Writes one snapshot; see the module documentation.
pub struct ImageWriter {
    final_dir: PathBuf,
    tmp_dir: PathBuf,
    meta: ImageMeta,
    opts: WriterOptions,
    image_id: [u8; 16],
    page_size: usize,
    ram_pages: Vec<u32>,
    mem: Option<File>,
    mem_len: u64,
    /// Open blocks: cold, hot, then the scattered ones
    /// ([`WriterOptions::scatter_blocks`]).
    open: Vec<OpenBlock>,
    /// State of the scatter control's random choice.
    scatter_rng: u64,
    pool: Pool,
    list_buf: Vec<u8>,
    blocks: Vec<BlockInfo>,
    index: Vec<Vec<IndexEntry>>,
    zero: Vec<ZeroBitmap>,
    /// One bit per guest page: given (stored, zero or duplicate).
    given: Vec<Vec<u64>>,
    /// Content hash → the page that stores those bytes (v2 dedup).
    by_content: HashMap<u128, PageKey>,
    /// Pages stored as a reference to an equal page: (page, owner, crc).
    dups: Vec<(PageKey, PageKey, u32)>,
    /// Content hash of every page given (v2; 0 for zero pages).
    hashes: Vec<Vec<u128>>,
    parent: Option<ParentInfo>,
    disk_matcher: Option<Box<dyn DiskMatcher>>,
    pages_in_parent: u64,
    pages_on_disk: u64,
    traces: Vec<TraceSection>,
    device_len: Option<u64>,
    metrics: Metrics,
    pages_stored: u64,
    raw_bytes: u64,
    blocks_hot: u32,
    blocks_compressed: u32,
    poisoned: bool,
    committed: bool,
    /// Commit by exchanging with the existing `final_dir` (a rewrite).
    replace: bool,
    /// The manifest's creation time, if not the commit's (a rewrite).
    created_unix_ms: Option<u64>,
}

impl std::fmt::Debug for ImageWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageWriter")
            .field("final_dir", &self.final_dir)
            .field("tmp_dir", &self.tmp_dir)
            .field("opts", &self.opts)
            .field("pages_stored", &self.pages_stored)
            .field("blocks", &self.blocks.len())
            .finish_non_exhaustive()
    }
}

impl ImageWriter {
    /// Starts a snapshot that [`commit`](Self::commit) will make `final_dir`.
    pub fn create(final_dir: &Path, meta: ImageMeta) -> Result<Self, WriteError> {
        Self::create_with(final_dir, meta, WriterOptions::default())
    }

    /// [`create`](Self::create) with options.
    pub fn create_with(
        final_dir: &Path,
        meta: ImageMeta,
        opts: WriterOptions,
    ) -> Result<Self, WriteError> {
        let invalid = |m: String| Err(WriteError::InvalidMeta(m));
        let name = final_dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !is_plain_name(name) || name.starts_with('.') || name.contains(TEMP_MARKER) {
            return invalid(format!("snapshot directory name {name:?} must be a plain name, not hidden, without {TEMP_MARKER:?}"));
        }
        if !valid_page_size(meta.page_size) {
            return invalid(format!(
                "page size {} is not a power of two in 4096..=65536",
                meta.page_size
            ));
        }
        if !(1..=2).contains(&opts.format_major)
            || (opts.format_major == 1 && (opts.codec != Codec::None || opts.dedup))
        {
            return invalid(format!(
                "format {} with compression {} and dedup {} cannot be written (v1 has neither)",
                opts.format_major, opts.codec, opts.dedup
            ));
        }
        if opts.scatter_blocks > 1024 || (opts.format_major == 1 && opts.scatter_blocks > 0) {
            return invalid(format!(
                "scatter_blocks {} is out of range (format 2, at most 1024)",
                opts.scatter_blocks
            ));
        }
        let ppb = opts.pages_per_block;
        if ppb == 0
            || ppb > MAX_PAGES_PER_BLOCK
            || u64::from(ppb) * u64::from(meta.page_size) > MAX_BLOCK_PAYLOAD
        {
            return invalid(format!("pages_per_block {ppb} is out of range"));
        }
        if meta.ram_blocks.len() > MAX_RAM_BLOCKS {
            return invalid(format!(
                "{} RAM blocks (at most {MAX_RAM_BLOCKS})",
                meta.ram_blocks.len()
            ));
        }
        let mut ram_pages = Vec::with_capacity(meta.ram_blocks.len());
        for (i, rb) in meta.ram_blocks.iter().enumerate() {
            if rb.name.is_empty()
                || rb.name.len() > MAX_NAME_LEN
                || meta.ram_blocks[..i].iter().any(|o| o.name == rb.name)
            {
                return invalid(format!(
                    "RAM block name {:?} is empty, too long or repeated",
                    rb.name
                ));
            }
            match pages_for(rb.used_length, meta.page_size) {
                Some(p) => ram_pages.push(p),
                None => return invalid(format!("RAM block {:?} is too large", rb.name)),
            }
        }
        // The index and bitmaps are the writer's only per-page memory: 12
        // bytes and 1 bit per guest page. Fail cleanly, not by aborting.
        let mut index = Vec::new();
        let mut zero = Vec::new();
        let mut given = Vec::new();
        for &p in &ram_pages {
            let mut v = Vec::new();
            if v.try_reserve_exact(p as usize).is_err() {
                return invalid(format!("cannot allocate the page index for {p} pages"));
            }
            v.resize(p as usize, IndexEntry::NONE);
            index.push(v);
            zero.push(ZeroBitmap::new(p));
            given.push(vec![0u64; (p as usize).div_ceil(64)]);
        }
        let hashes = if opts.format_major >= 2 {
            ram_pages.iter().map(|&p| vec![0u128; p as usize]).collect()
        } else {
            Vec::new()
        };
        let page_size = meta.page_size as usize;
        let threads = match opts.compress_threads {
            0 => pipeline::auto_threads(),
            n => n,
        };
        if final_dir.exists() {
            return Err(WriteError::Exists(final_dir.into()));
        }
        let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp_dir =
            final_dir.with_file_name(format!("{name}{TEMP_MARKER}{}-{seq}", std::process::id()));
        fs::create_dir(&tmp_dir).map_err(|e| WriteError::Io {
            path: tmp_dir.clone(),
            source: e,
        })?;
        let mut w = ImageWriter {
            final_dir: final_dir.into(),
            tmp_dir,
            image_id: new_image_id(),
            page_size,
            index,
            zero,
            ram_pages,
            meta,
            opts,
            mem: None,
            mem_len: 0,
            open: (0..2 + usize::from(opts.scatter_blocks))
                .map(|_| OpenBlock::default())
                .collect(),
            scatter_rng: 0x9e37_79b9_7f4a_7c15,
            pool: Pool::new(
                opts.codec,
                threads,
                usize::from(opts.pages_per_block) * page_size,
            ),
            list_buf: Vec::new(),
            blocks: Vec::new(),
            given,
            by_content: HashMap::new(),
            dups: Vec::new(),
            hashes,
            parent: None,
            disk_matcher: None,
            pages_in_parent: 0,
            pages_on_disk: 0,
            traces: Vec::new(),
            device_len: None,
            metrics: Metrics::default(),
            pages_stored: 0,
            raw_bytes: 0,
            blocks_hot: 0,
            blocks_compressed: 0,
            poisoned: false,
            committed: false,
            replace: false,
            created_unix_ms: None,
        };
        let path = w.file_path(FileKind::Memory);
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| WriteError::Io { path, source: e })?;
        let mut mem = file;
        w.io(FileKind::Memory, |_| mem.write_all(&[0u8; FILE_HEADER_LEN]))?;
        w.mem = Some(mem);
        w.mem_len = FILE_HEADER_LEN as u64;
        Ok(w)
    }

    /// Rewrites the existing snapshot `final_dir` (e.g. to merge its parent
    /// into it): the new image keeps `image_id`, so snapshots that name it
    /// as their parent stay valid, and [`commit`](Self::commit) swaps it
    /// with the old one atomically (`renameat2(RENAME_EXCHANGE)`), then
    /// removes the old one. Until then the old snapshot is untouched; a
    /// crash leaves it and a temporary directory that `cleanup_stale`
    /// removes.
    pub fn create_replacing(
        final_dir: &Path,
        meta: ImageMeta,
        opts: WriterOptions,
        image_id: [u8; 16],
    ) -> Result<Self, WriteError> {
        if !final_dir.is_dir() {
            return Err(WriteError::InvalidMeta(format!(
                "{} does not exist: nothing to rewrite",
                final_dir.display()
            )));
        }
        // `create_with` refuses an existing final directory: create next to
        // it under a scratch name, then aim the commit at the real one.
        let scratch = final_dir.with_file_name(format!(
            "{}.rewrite",
            final_dir.file_name().and_then(|n| n.to_str()).unwrap_or("")
        ));
        let mut w = Self::create_with(&scratch, meta, opts)?;
        w.final_dir = final_dir.into();
        w.image_id = image_id;
        w.replace = true;
        Ok(w)
    }

    /// Records `ms` as the snapshot's creation time (Unix ms) instead of
    /// the commit's: a rewritten snapshot keeps its place among the VM's
    /// snapshots.
    pub fn set_created_unix_ms(&mut self, ms: u64) {
        self.created_unix_ms = Some(ms);
    }

    /// Records a page whose bytes are on frozen disk `disk` at
    /// `offset_pages × page_size` (v2), with its CRC and content hash (as an
    /// image being rewritten has them).
    pub fn add_disk_page(
        &mut self,
        key: PageKey,
        disk: u16,
        offset_pages: u32,
        crc: u32,
        hash: u128,
    ) -> Result<(), WriteError> {
        if self.poisoned {
            return Err(WriteError::Poisoned);
        }
        if self.opts.format_major < 2 || usize::from(disk) >= self.meta.disks.len() {
            return Err(WriteError::InvalidMeta(format!(
                "page {}:{} on disk {disk}: no such disk in format {}",
                key.ram_block, key.page, self.opts.format_major
            )));
        }
        self.check_key(key)?;
        self.set_given(key);
        let (r, p) = (key.ram_block as usize, key.page as usize);
        self.hashes[r][p] = hash;
        self.index[r][p] = IndexEntry {
            block: offset_pages,
            slot: disk,
            flags: ENTRY_FLAG_DISK,
            crc,
        };
        self.pages_on_disk += 1;
        Ok(())
    }

    /// The temporary directory being written.
    pub fn temp_path(&self) -> &Path {
        &self.tmp_dir
    }

    /// The RAM block number of `name`.
    pub fn ram_block_id(&self, name: &str) -> Option<u32> {
        self.meta
            .ram_blocks
            .iter()
            .position(|rb| rb.name == name)
            .map(|i| i as u32)
    }

    /// Pages stored in the memory image so far.
    pub fn pages_stored(&self) -> u64 {
        self.pages_stored
    }

    /// Zero pages recorded so far.
    pub fn pages_zero(&self) -> u64 {
        self.zero.iter().map(ZeroBitmap::count).sum()
    }

    /// Bytes appended to the memory image so far.
    pub fn memory_bytes(&self) -> u64 {
        self.mem_len
    }

    /// The metrics that go into the manifest.
    pub fn metrics_mut(&mut self) -> &mut Metrics {
        &mut self.metrics
    }

    fn file_path(&self, kind: FileKind) -> PathBuf {
        self.tmp_dir.join(kind.default_name())
    }

    /// Runs a file operation; an error poisons the writer.
    fn io<T>(
        &mut self,
        kind: FileKind,
        f: impl FnOnce(&mut Self) -> io::Result<T>,
    ) -> Result<T, WriteError> {
        f(self).map_err(|source| {
            self.poisoned = true;
            WriteError::Io {
                path: self.file_path(kind),
                source,
            }
        })
    }

    /// Runs `f` in each compression worker thread as it starts (e.g. to
    /// lower its scheduling priority). Call before the first page.
    pub fn on_worker_start(&mut self, f: WorkerInit) {
        self.pool.set_init(f);
    }

    /// Makes this an incremental snapshot of `parent` (v2): a page whose
    /// bytes equal the parent's same page is stored as "in parent". Call
    /// before the first page.
    pub fn set_parent(&mut self, parent: ParentInfo) -> Result<(), WriteError> {
        if self.opts.format_major < 2 {
            return Err(WriteError::InvalidMeta(
                "format 1 has no incremental snapshots".into(),
            ));
        }
        let same_layout = parent.ram_blocks == self.meta.ram_blocks
            && parent.hashes.len() == self.ram_pages.len()
            && parent
                .hashes
                .iter()
                .zip(&self.ram_pages)
                .all(|(h, &p)| h.len() == p as usize);
        if !same_layout {
            return Err(WriteError::InvalidMeta(format!(
                "parent {:?} has other RAM blocks than this snapshot; take a full snapshot",
                parent.reference.name
            )));
        }
        self.parent = Some(parent);
        Ok(())
    }

    /// Looks pages up on the frozen disks before storing them (v2).
    pub fn set_disk_matcher(&mut self, m: Box<dyn DiskMatcher>) {
        if self.opts.format_major >= 2 {
            self.disk_matcher = Some(m);
        }
    }

    /// The header every binary file of this snapshot starts from.
    pub(crate) fn file_header(&self) -> FileHeader {
        let mut h = FileHeader::new(self.image_id);
        h.version = self.opts.version();
        h
    }

    fn check_key(&self, key: PageKey) -> Result<(), WriteError> {
        let pages = *self
            .ram_pages
            .get(key.ram_block as usize)
            .ok_or(WriteError::UnknownRamBlock(key.ram_block))?;
        if key.page >= pages {
            return Err(WriteError::PageOutOfRange {
                ram_block: key.ram_block,
                page: key.page,
                pages,
            });
        }
        if self.is_given(key) {
            return Err(WriteError::DuplicatePage(key));
        }
        Ok(())
    }

    fn is_given(&self, key: PageKey) -> bool {
        let p = key.page as usize;
        self.given[key.ram_block as usize][p / 64] & (1 << (p % 64)) != 0
    }

    fn set_given(&mut self, key: PageKey) {
        let p = key.page as usize;
        self.given[key.ram_block as usize][p / 64] |= 1 << (p % 64);
    }

    /// Adds a page. An all-zero page only sets its bit in the zero bitmap;
    /// any other page goes to a cold block (or, v2, is recorded as a
    /// duplicate of an equal page already given). Each page may be given
    /// once ([`WriteError::DuplicatePage`] otherwise).
    pub fn add_page(&mut self, ram_block: u32, page: u32, data: &[u8]) -> Result<(), WriteError> {
        self.add(PageKey { ram_block, page }, data, false)
    }

    /// [`add_page`](Self::add_page) for a page the guest wrote while the
    /// snapshot ran: v2 puts it in a hot block, in the order given (the
    /// guest's first-access order); v1 treats it like any page.
    pub fn add_hot_page(
        &mut self,
        ram_block: u32,
        page: u32,
        data: &[u8],
    ) -> Result<(), WriteError> {
        self.add(PageKey { ram_block, page }, data, true)
    }

    fn add(&mut self, key: PageKey, data: &[u8], hot: bool) -> Result<(), WriteError> {
        if self.poisoned {
            return Err(WriteError::Poisoned);
        }
        if data.len() != self.page_size {
            return Err(WriteError::PageSize {
                expected: self.page_size,
                found: data.len(),
            });
        }
        self.check_key(key)?;
        self.set_given(key);
        if is_zero(data) {
            self.zero[key.ram_block as usize].set(key.page);
            return Ok(());
        }
        let crc = crc32c::crc32c(data);
        let (r, p) = (key.ram_block as usize, key.page as usize);
        let h = if self.opts.format_major >= 2 {
            let h = crate::hashes::page_hash(data);
            self.hashes[r][p] = h;
            Some(h)
        } else {
            None
        };
        if let (Some(h), Some(parent)) = (h, &self.parent) {
            if parent.hashes[r][p] == h {
                self.index[r][p] = IndexEntry {
                    block: crate::format::NO_BLOCK,
                    slot: 0,
                    flags: ENTRY_FLAG_PARENT,
                    crc,
                };
                self.pages_in_parent += 1;
                return Ok(());
            }
        }
        if let (Some(h), Some(m)) = (h, self.disk_matcher.as_mut()) {
            if let Some((disk, at)) = m.find(h, data) {
                self.index[r][p] = IndexEntry {
                    block: at,
                    slot: disk,
                    flags: ENTRY_FLAG_DISK,
                    crc,
                };
                self.pages_on_disk += 1;
                return Ok(());
            }
        }
        if let (true, Some(h)) = (self.opts.dedup, h) {
            match self.by_content.get(&h) {
                Some(&owner) => {
                    self.dups.push((key, owner, crc));
                    return Ok(());
                }
                None => {
                    self.by_content.insert(h, key);
                }
            }
        }
        let mut which = usize::from(hot && self.opts.format_major >= 2);
        if which == 0 && self.opts.scatter_blocks > 0 {
            let x = &mut self.scatter_rng;
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            which = 2 + (*x % u64::from(self.opts.scatter_blocks)) as usize;
        }
        let ppb = usize::from(self.opts.pages_per_block);
        let open = &mut self.open[which];
        if open.payload.capacity() == 0 {
            open.payload = self.pool.buffer();
            open.payload.reserve(ppb * self.page_size);
        }
        open.keys.push((key, crc));
        open.payload.extend_from_slice(data);
        self.pages_stored += 1;
        if open.keys.len() >= ppb {
            self.submit(which)?;
        }
        Ok(())
    }

    /// Records a zero page (QEMU's stream marks them without data).
    pub fn add_zero_page(&mut self, ram_block: u32, page: u32) -> Result<(), WriteError> {
        if self.poisoned {
            return Err(WriteError::Poisoned);
        }
        let key = PageKey { ram_block, page };
        self.check_key(key)?;
        self.set_given(key);
        self.zero[ram_block as usize].set(page);
        Ok(())
    }

    /// Ends the open blocks early (the next pages start new ones), so a
    /// caller can keep pages that belong together in one block.
    pub fn flush_block(&mut self) -> Result<(), WriteError> {
        if self.poisoned {
            return Err(WriteError::Poisoned);
        }
        for which in std::iter::once(1).chain(0..1).chain(2..self.open.len()) {
            if !self.open[which].keys.is_empty() {
                self.submit(which)?;
            }
        }
        Ok(())
    }

    /// Hands open block `which` to the pool; appends what is ready.
    fn submit(&mut self, which: usize) -> Result<(), WriteError> {
        let open = std::mem::take(&mut self.open[which]);
        let ready = self.pool.submit(which == 1, open.keys, open.payload);
        self.append_all(ready)
    }

    fn append_all(&mut self, ready: Vec<Done>) -> Result<(), WriteError> {
        for d in ready {
            self.append(&d)?;
            self.pool.recycle(d.job.raw);
        }
        Ok(())
    }

    /// Waits for the pool and appends every block still in flight.
    fn drain_pool(&mut self) -> Result<(), WriteError> {
        self.flush_block()?;
        match self.pool.finish() {
            Some(ready) => self.append_all(ready),
            None => {
                self.poisoned = true;
                Err(WriteError::InvalidMeta(
                    "a compression worker stopped with a block; the snapshot was not committed"
                        .into(),
                ))
            }
        }
    }

    /// Appends one finished block to the memory image and indexes its pages.
    fn append(&mut self, d: &Done) -> Result<(), WriteError> {
        let page_count = d.job.keys.len() as u16;
        let seq = self.blocks.len() as u32;
        self.list_buf.clear();
        for (k, crc) in &d.job.keys {
            self.list_buf.extend_from_slice(&k.ram_block.to_le_bytes());
            self.list_buf.extend_from_slice(&k.page.to_le_bytes());
            self.list_buf.extend_from_slice(&crc.to_le_bytes());
        }
        let payload = d.payload();
        let flags = if d.job.hot { BLOCK_FLAG_HOT } else { 0 };
        let mut h = BlockHeader {
            seq,
            page_count,
            compression: d.codec.id(),
            flags,
            payload_len: payload.len() as u32,
            raw_len: d.job.raw.len() as u32,
            crc: 0,
        };
        let enc = h.encode();
        let mut crc = crc32c::crc32c(&enc[..BLOCK_HEADER_LEN - 4]);
        crc = crc32c::crc32c_append(crc, &self.list_buf);
        h.crc = crc32c::crc32c_append(crc, payload);
        let stored_len = (BLOCK_HEADER_LEN + self.list_buf.len() + payload.len()) as u32;
        debug_assert_eq!(
            self.list_buf.len(),
            usize::from(page_count) * BLOCK_ENTRY_LEN
        );
        // One writev per block: no copy into a user-space buffer.
        let list = std::mem::take(&mut self.list_buf);
        let written = self.io(FileKind::Memory, |w| {
            let mem = w
                .mem
                .as_mut()
                .ok_or_else(|| io::Error::other("memory image closed"))?;
            write_all_vectored(mem, &[&h.encode(), &list, payload])
        });
        self.list_buf = list;
        written?;
        for (slot, (k, crc)) in d.job.keys.iter().enumerate() {
            self.index[k.ram_block as usize][k.page as usize] = IndexEntry {
                block: seq,
                slot: slot as u16,
                flags: 0,
                crc: *crc,
            };
        }
        self.blocks.push(BlockInfo {
            offset: self.mem_len,
            stored_len,
            page_count,
            compression: d.codec.id(),
            flags,
        });
        self.mem_len += u64::from(stored_len);
        self.raw_bytes += d.job.raw.len() as u64;
        self.blocks_hot += u32::from(d.job.hot);
        self.blocks_compressed += u32::from(d.codec != Codec::None);
        Ok(())
    }

    /// Points every duplicate page at its owner's slot (once every block
    /// is appended).
    fn resolve_dups(&mut self) {
        for &(key, owner, crc) in &self.dups {
            let o = self.index[owner.ram_block as usize][owner.page as usize];
            debug_assert!(o.is_stored() && o.crc == crc);
            self.index[key.ram_block as usize][key.page as usize] = IndexEntry {
                block: o.block,
                slot: o.slot,
                flags: ENTRY_FLAG_DUP,
                crc,
            };
        }
    }

    /// Writes the device-state blob (once).
    pub fn set_device_state(&mut self, data: &[u8]) -> Result<(), WriteError> {
        if self.poisoned {
            return Err(WriteError::Poisoned);
        }
        if self.device_len.is_some() {
            return Err(WriteError::DeviceState("set twice".into()));
        }
        if data.len() as u64 > MAX_DEVICE_STATE_LEN {
            return Err(WriteError::DeviceState(format!(
                "{} bytes is more than the {MAX_DEVICE_STATE_LEN} limit",
                data.len()
            )));
        }
        let path = self.file_path(FileKind::Device);
        let header = self.file_header();
        let len = self.io(FileKind::Device, |_| {
            write_body_file(&path, FileKind::Device, header, |w| w.write_all(data))
        })?;
        self.device_len = Some(len);
        Ok(())
    }

    fn check_trace_key(&self, key: PageKey) -> Result<(), WriteError> {
        match self.ram_pages.get(key.ram_block as usize) {
            Some(&pages) if key.page < pages => Ok(()),
            _ => Err(WriteError::Trace(format!(
                "page {}:{} does not exist",
                key.ram_block, key.page
            ))),
        }
    }

    /// Appends a page to the FAFL trace (pages the guest wrote during the
    /// snapshot, in order).
    pub fn trace_push(&mut self, key: PageKey) -> Result<(), WriteError> {
        self.check_trace_key(key)?;
        if let Some(s) = self.traces.iter_mut().find(|s| s.name == TRACE_FAFL) {
            s.entries.push(key);
        } else {
            self.add_trace_section(TRACE_FAFL, vec![key])?;
        }
        Ok(())
    }

    /// Adds a whole named trace section.
    pub fn add_trace_section(
        &mut self,
        name: &str,
        entries: Vec<PageKey>,
    ) -> Result<(), WriteError> {
        if !valid_section_name(name) {
            return Err(WriteError::Trace(format!("bad section name {name:?}")));
        }
        if self.traces.iter().any(|s| s.name == name) {
            return Err(WriteError::Trace(format!(
                "section {name:?} already exists"
            )));
        }
        if self.traces.len() >= MAX_TRACE_SECTIONS as usize {
            return Err(WriteError::Trace(format!(
                "at most {MAX_TRACE_SECTIONS} sections"
            )));
        }
        for &k in &entries {
            self.check_trace_key(k)?;
        }
        self.traces.push(TraceSection {
            name: name.into(),
            entries,
        });
        Ok(())
    }

    /// Discards the snapshot (same as dropping the writer).
    pub fn abort(self) {}
}

impl Drop for ImageWriter {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: a crash leaves the directory behind, and
            // `cleanup_stale` removes it later.
            let _ = fs::remove_dir_all(&self.tmp_dir);
        }
    }
}
