//! The detection layer of a snapshot: guest pages whose bytes lie on the
//! VM's frozen disk (its page cache, mostly) are stored in the image as
//! references to a disk block instead of as bytes (see
//! `docs/image-format.md`, "Detection layer").
//!
//! The index maps a page hash ([`page_hash`], the writer's XXH3-128, kept
//! as its low 64 bits) to a 4 KiB block of the disk as the guest sees it.
//! It is built per file of the frozen chain, from the blocks that file
//! holds data for ([`Disk::allocated_blocks`]), and each file's index is
//! cached on disk under `<run>/disk-index/`, keyed by the file's device,
//! inode, length and modification time: frozen files never change, and
//! every snapshot's `.disks/<name>/` hard-links the same inodes, so a
//! later snapshot indexes only the overlay written since the previous one.
//!
//! Nothing of it runs in the pause or in QEMU's way. A thread at nice +10
//! ([`start`]) indexes the lower files of the chain (already read-only)
//! while the snapshot prepares, waits for the disk snapshot to freeze the
//! top file, indexes that, and only then publishes the index; the
//! writer's matcher answers "not on disk" until it is published. A match
//! is confirmed by reading the block through the frozen chain and
//! comparing bytes, so an index that is stale or colliding only loses
//! matches.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::json;
use thiserror::Error;
use vmcsnap_capture::{DiskMatcher, DiskMatcherInit};
use vmcsnap_image::hashes::page_hash;
use vmcsnap_qcow2::{Disk, DiskError, FileIdentity, BLOCK};

/// Most blocks one chain's index holds (16 GiB of disk data, about
/// 400 MiB of memory); the rest of a larger disk is not matched.
const MAX_BLOCKS: usize = 4 << 20;
/// Cached file indexes kept; the least recently used go first.
const MAX_CACHED: usize = 64;
/// Cache file magic (version 1).
const MAGIC: &[u8; 8] = b"VMCSDIX1";
/// Bytes per cached entry: hash (u64) and block (u32), little-endian.
const ENTRY: usize = 12;

/// Why a disk index could not be built; the snapshot then stores every
/// page's bytes (it does not fail).
#[derive(Debug, Error)]
pub enum IndexError {
    /// The frozen disk cannot be read.
    #[error("reading the frozen disk: {0}")]
    Disk(#[from] DiskError),
    /// The snapshot ended before the disk was frozen.
    #[error("the snapshot ended before its disk was frozen")]
    NotFrozen,
    /// The index cache cannot be written (the index is still used).
    #[error("{path}: {source} (check free space and permissions of the run directory)")]
    Cache {
        /// The cache file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The index of one file of the chain: page hash → block.
#[derive(Debug, Default, PartialEq)]
struct FileIndex {
    map: HashMap<u64, u32>,
}

/// The published index: the frozen chain (opened after the freeze) and
/// the index of each of its files, top first.
#[derive(Debug)]
struct ChainIndex {
    disk: Disk,
    files: Vec<FileIndex>,
}

/// What building the index measured (manifest `metrics`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct IndexStats {
    /// Thread start to the index published (ms).
    pub total_ms: f64,
    /// Time spent on the top file after the freeze (ms).
    pub top_ms: f64,
    /// Thread start to the lower files indexed (ms).
    pub lower_ms: f64,
    started: Option<Instant>,
    /// Blocks indexed, all files.
    pub blocks: u64,
    /// Files of the chain.
    pub files: usize,
    /// Files whose index came from the cache.
    pub files_cached: usize,
    /// Why there is no index, if there is none.
    pub error: Option<String>,
}

#[derive(Debug, Default)]
struct Shared {
    index: OnceLock<ChainIndex>,
    stats: Mutex<IndexStats>,
    /// Set once the lower files are indexed (or indexing ended).
    lower_done: (Mutex<bool>, Condvar),
}

impl Shared {
    fn set_lower_done(&self) {
        *self.lower_done.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.lower_done.1.notify_all();
    }
}

/// The detection layer of one snapshot (see the module documentation).
pub(super) struct DiskLayer {
    shared: Arc<Shared>,
    frozen: Option<mpsc::Sender<()>>,
}

/// Starts indexing the frozen chain whose top is `top` (disk slot 0 of
/// the manifest), with the index cache in `cache_dir`.
pub(super) fn start(top: &Path, cache_dir: &Path) -> DiskLayer {
    let shared = Arc::new(Shared::default());
    let (tx, rx) = mpsc::channel();
    let (sh, top, cache) = (shared.clone(), top.to_path_buf(), cache_dir.to_path_buf());
    std::thread::spawn(move || {
        super::background_priority();
        let t = Instant::now();
        let mut stats = IndexStats {
            started: Some(t),
            ..Default::default()
        };
        let r = build(&top, &cache, &rx, &mut stats, &sh);
        sh.set_lower_done();
        match r {
            Ok(index) => {
                stats.total_ms = t.elapsed().as_secs_f64() * 1000.0;
                *sh.stats.lock().unwrap_or_else(|p| p.into_inner()) = stats;
                let _ = sh.index.set(index);
            }
            Err(e) => {
                if !matches!(e, IndexError::NotFrozen) {
                    crate::log(format!("disk index of {}: {e}", top.display()));
                }
                stats.error = Some(e.to_string());
                *sh.stats.lock().unwrap_or_else(|p| p.into_inner()) = stats;
            }
        }
    });
    DiskLayer {
        shared,
        frozen: Some(tx),
    }
}

impl DiskLayer {
    /// The matcher factory for the capture.
    pub fn matcher(&self) -> DiskMatcherInit {
        let shared = self.shared.clone();
        DiskMatcherInit(Arc::new(move || {
            Box::new(Matcher {
                shared: shared.clone(),
                buf: vec![0u8; BLOCK as usize],
            }) as Box<dyn DiskMatcher>
        }))
    }

    /// Waits (at most `limit`) until the lower files of the chain are
    /// indexed: called before the pause, so that indexing them (from the
    /// cache after the first snapshot) never competes with the pause for
    /// the CPU, and matching can start as soon as the top file is indexed.
    pub fn wait_lower(&self, limit: Duration) {
        let (done, cv) = &self.shared.lower_done;
        let guard = done.lock().unwrap_or_else(|p| p.into_inner());
        let _ = cv.wait_timeout_while(guard, limit, |d| !*d);
    }

    /// What to call once the top file is frozen (the disk snapshot
    /// succeeded); dropping it without calling ends the indexing.
    pub fn frozen_signal(&mut self) -> Option<Box<dyn FnOnce() + Send>> {
        let tx = self.frozen.take()?;
        Some(Box::new(move || {
            let _ = tx.send(());
        }))
    }

    /// Adds what indexing measured to the manifest metrics.
    pub fn record(&self, m: &mut vmcsnap_capture::Metrics) {
        let s = self.shared.stats.lock().unwrap_or_else(|p| p.into_inner());
        let ready = self.shared.index.get().is_some();
        m.other.insert(
            "disk_index".into(),
            json!({
                "ready": ready,
                "total_ms": (s.total_ms * 10.0).round() / 10.0,
                "top_ms": (s.top_ms * 10.0).round() / 10.0,
                "lower_ms": (s.lower_ms * 10.0).round() / 10.0,
                "blocks": s.blocks,
                "files": s.files,
                "files_cached": s.files_cached,
                "error": s.error,
            }),
        );
    }
}

/// The writer's matcher: answers once the index is published.
struct Matcher {
    shared: Arc<Shared>,
    buf: Vec<u8>,
}

impl DiskMatcher for Matcher {
    fn find(&mut self, hash: u128, data: &[u8]) -> Option<(u16, u32)> {
        if data.len() != BLOCK as usize {
            return None;
        }
        let index = self.shared.index.get()?;
        for f in &index.files {
            let Some(&block) = f.map.get(&(hash as u64)) else {
                continue;
            };
            let read = index.disk.read_at(u64::from(block) * BLOCK, &mut self.buf);
            if read.is_ok() && self.buf == data {
                return Some((0, block));
            }
        }
        None
    }
}

fn stats_ms(s: &IndexStats) -> f64 {
    s.started
        .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1000.0)
}

fn build(
    top: &Path,
    cache: &Path,
    frozen: &mpsc::Receiver<()>,
    stats: &mut IndexStats,
    shared: &Shared,
) -> Result<ChainIndex, IndexError> {
    // The lower files are read-only backing files already: index them now.
    let before = Disk::open(top)?;
    let layers = before.layers();
    drop(before);
    stats.files = layers.len();
    let mut budget = MAX_BLOCKS;
    let mut lower = Vec::new();
    for l in layers.iter().skip(1) {
        let d = Disk::open_as(&l.path, Some(l.format))?;
        lower.push(file_index(&d, 0, cache, &mut budget, stats)?);
    }
    stats.lower_ms = stats_ms(stats);
    shared.set_lower_done();
    // The top file only once QEMU has moved to the new overlay; opened
    // again so that no table read before the freeze is used.
    frozen.recv().map_err(|_| IndexError::NotFrozen)?;
    let t = Instant::now();
    let disk = Disk::open(top)?;
    let mut files = vec![file_index(&disk, 0, cache, &mut budget, stats)?];
    files.extend(lower);
    stats.top_ms = t.elapsed().as_secs_f64() * 1000.0;
    Ok(ChainIndex { disk, files })
}

/// The index of file `layer` of `disk`: from the cache, or built and
/// cached.
fn file_index(
    disk: &Disk,
    layer: usize,
    cache: &Path,
    budget: &mut usize,
    stats: &mut IndexStats,
) -> Result<FileIndex, IndexError> {
    let id = disk.identity(layer)?;
    let path = cache_path(cache, &id);
    if let Some(idx) = load(&path) {
        stats.files_cached += 1;
        stats.blocks += idx.map.len() as u64;
        *budget = budget.saturating_sub(idx.map.len());
        // Mark it used, for the pruning in `save`.
        if let Ok(f) = std::fs::File::options().append(true).open(&path) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        return Ok(idx);
    }
    let mut idx = FileIndex::default();
    for r in disk.allocated_blocks(layer)? {
        if idx.map.len() >= *budget {
            break;
        }
        let (block, data) = r?;
        let Ok(block) = u32::try_from(block) else {
            break;
        };
        idx.map.entry(page_hash(&data) as u64).or_insert(block);
    }
    *budget -= idx.map.len();
    stats.blocks += idx.map.len() as u64;
    if let Err(e) = save(cache, &path, &idx) {
        crate::log(format!("disk index: {e}"));
    }
    Ok(idx)
}

fn cache_path(cache: &Path, id: &FileIdentity) -> PathBuf {
    cache.join(cache_name(id))
}

/// The name of the cached index of the file `id` in `<run>/disk-index/`.
pub(crate) fn cache_name(id: &FileIdentity) -> String {
    format!(
        "{:x}-{:x}-{:x}-{:x}.idx",
        id.dev, id.ino, id.len, id.mtime_ns
    )
}

fn encode(idx: &FileIndex) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + idx.map.len() * ENTRY + 4);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&(idx.map.len() as u64).to_le_bytes());
    for (h, blk) in &idx.map {
        b.extend_from_slice(&h.to_le_bytes());
        b.extend_from_slice(&blk.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// A cached index, if there is a whole and intact one.
fn decode(b: &[u8]) -> Option<FileIndex> {
    let body = b.get(..b.len().checked_sub(4)?)?;
    let crc = u32::from_le_bytes(b[body.len()..].try_into().ok()?);
    if body.get(..8)? != MAGIC || crc32c::crc32c(body) != crc {
        return None;
    }
    let n = u64::from_le_bytes(body.get(8..16)?.try_into().ok()?);
    let entries = body.get(16..)?;
    if entries.len() as u64 != n.checked_mul(ENTRY as u64)? {
        return None;
    }
    let mut map = HashMap::with_capacity(entries.len() / ENTRY);
    for e in entries.chunks_exact(ENTRY) {
        let h = u64::from_le_bytes(e[..8].try_into().ok()?);
        let blk = u32::from_le_bytes(e[8..].try_into().ok()?);
        map.insert(h, blk);
    }
    Some(FileIndex { map })
}

fn load(path: &Path) -> Option<FileIndex> {
    decode(&std::fs::read(path).ok()?)
}

/// Writes `idx` to `path` (temporary file, then rename) and prunes the
/// cache to [`MAX_CACHED`] files.
fn save(cache: &Path, path: &Path, idx: &FileIndex) -> Result<(), IndexError> {
    let err = |p: &Path| {
        let p = p.to_path_buf();
        move |source| IndexError::Cache { path: p, source }
    };
    std::fs::create_dir_all(cache).map_err(err(cache))?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(err(&tmp))?;
    f.write_all(&encode(idx)).map_err(err(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(err(path))?;
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(cache)
        .map_err(err(cache))?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "idx"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if files.len() > MAX_CACHED {
        files.sort();
        for (_, p) in &files[..files.len() - MAX_CACHED] {
            let _ = std::fs::remove_file(p);
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "disk_match_tests.rs"]
mod tests;
