//! Creating an [`ImageWriter`]: options and metadata checked, per-page
//! tables allocated (failing cleanly, not by aborting), the temporary
//! directory and the memory image's placeholder header written.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::pipeline::{self, Pool};
use super::{ImageMeta, ImageWriter, OpenBlock, WriteError, WriterOptions, TEMP_SEQ};
use crate::codec::Codec;
use crate::fileio::new_image_id;
use crate::format::{
    pages_for, valid_page_size, FileKind, FILE_HEADER_LEN, MAX_BLOCK_PAYLOAD, MAX_NAME_LEN,
    MAX_PAGES_PER_BLOCK, MAX_RAM_BLOCKS,
};
use crate::index::{IndexEntry, ZeroBitmap};
use crate::list::TEMP_MARKER;
use crate::manifest::{is_plain_name, Metrics};

impl ImageWriter {
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
}
