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
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use thiserror::Error;

mod commit;
mod create;
mod pages;
pub mod pipeline;

use crate::codec::Codec;
use crate::error::Version;
use crate::fileio::write_body_file;
use crate::format::{
    FileHeader, FileKind, PageKey, DEFAULT_PAGES_PER_BLOCK, FORMAT_V1, FORMAT_VERSION,
    MAX_DEVICE_STATE_LEN, MAX_TRACE_SECTIONS,
};
use crate::index::{BlockInfo, IndexEntry, ZeroBitmap};
use crate::manifest::{DiskRef, Manifest, Metrics, QemuInfo, RamBlock, VmInfo};
use crate::trace::{valid_section_name, TraceSection, TRACE_FAFL};
use pipeline::{Pool, WorkerInit};

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

    /// Records `ms` as the snapshot's creation time (Unix ms) instead of
    /// the commit's: a rewritten snapshot keeps its place among the VM's
    /// snapshots.
    pub fn set_created_unix_ms(&mut self, ms: u64) {
        self.created_unix_ms = Some(ms);
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
