//! The precopy page stage: where a live migration's pages wait until the
//! stream has ended, so that the image gets the **last** copy of each page.
//!
//! A pre-copy stream sends every page once in its first round and then
//! again every page the guest dirtied, round after round, until the final
//! pause; the image writer accepts each page only once. The stage is a
//! scratch file with one page-sized slot per guest page (global page
//! number × page size, blocks in stream order), created sparse inside the
//! image writer's temporary directory, and one state byte per guest page
//! in memory (not seen, zero, data). A page record overwrites its slot and
//! state, so the last copy wins; a zero record only changes the state. When
//! the stream has ended, `PageStage::drain_into` reads the slots in page
//! order (large sequential reads) and gives every page to the writer once,
//! then deletes the scratch file.
//!
//! Consecutive page records (the common case: a round is a linear scan)
//! are gathered into one write of up to [`RUN_PAGES`] pages. Costs: disk
//! space for the guest's RAM (less its zero and never-sent pages, the file
//! is sparse) until the image is written, one byte of memory per guest
//! page, and writing the stream's pages twice. If the capture fails, the
//! scratch file goes with the writer's temporary directory.
//!
//! Each slot's content hash is kept too (16 bytes per guest page), so that
//! the staged pages can be checked against the guest's RAM at the
//! switch-over in one pass over memory ([`PageStage::check_against`]; see
//! [`crate::ram_check`]).

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use vmcsnap_image::hashes::page_hash;
use vmcsnap_image::ImageWriter;

use crate::error::CaptureError;
use crate::ram_check::{read_page, FinalRam, RamCheckReport};

/// Name of the scratch file inside the writer's temporary directory.
pub const SCRATCH_NAME: &str = "precopy-pages.scratch";

/// Most pages gathered into one scratch write or read (1 MiB of 4 KiB pages).
pub const RUN_PAGES: usize = 256;

/// Per-page state.
const UNSEEN: u8 = 0;
const ZERO: u8 = 1;
const DATA: u8 = 2;

/// Pages of a precopy stream, last copy wins; see the module docs.
pub(crate) struct PageStage {
    path: PathBuf,
    file: File,
    page_size: usize,
    /// Global page number of each RAM block's first page, then the total.
    block_starts: Vec<u64>,
    state: Vec<u8>,
    /// [`page_hash`] of each page's staged copy (of a zero page for ZERO,
    /// 0 while UNSEEN).
    hashes: Vec<u128>,
    /// [`page_hash`] of a zero page.
    zero_hash: u128,
    /// Global page number of `run[0]` (meaningful while `run` is not empty).
    run_start: u64,
    /// Consecutive pages not yet written to the file.
    run: Vec<u8>,
}

impl PageStage {
    /// Creates the scratch file in `dir` for RAM blocks of `block_pages`
    /// pages each.
    pub(crate) fn create(
        dir: &Path,
        page_size: usize,
        block_pages: &[u32],
    ) -> Result<Self, CaptureError> {
        let path = dir.join(SCRATCH_NAME);
        let mut block_starts = vec![0u64];
        for &n in block_pages {
            block_starts.push(block_starts[block_starts.len() - 1] + u64::from(n));
        }
        let total = block_starts[block_starts.len() - 1];
        let scratch = |source| CaptureError::Scratch {
            path: path.clone(),
            source,
        };
        let mut state = Vec::new();
        let pages =
            usize::try_from(total).map_err(|_| scratch(io::ErrorKind::OutOfMemory.into()))?;
        state
            .try_reserve_exact(pages)
            .map_err(|_| scratch(io::ErrorKind::OutOfMemory.into()))?;
        state.resize(pages, UNSEEN);
        let mut hashes = Vec::new();
        hashes
            .try_reserve_exact(pages)
            .map_err(|_| scratch(io::ErrorKind::OutOfMemory.into()))?;
        hashes.resize(pages, 0);
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(scratch)?;
        file.set_len(total * page_size as u64).map_err(scratch)?;
        Ok(PageStage {
            file,
            page_size,
            block_starts,
            state,
            hashes,
            zero_hash: page_hash(&vec![0u8; page_size]),
            run_start: 0,
            run: Vec::with_capacity(RUN_PAGES * page_size),
            path,
        })
    }

    fn scratch_err(&self, source: io::Error) -> CaptureError {
        CaptureError::Scratch {
            path: self.path.clone(),
            source,
        }
    }

    fn global(&self, block: u32, page: u32) -> u64 {
        self.block_starts[block as usize] + u64::from(page)
    }

    /// Stores a page's data (replacing any earlier copy).
    pub(crate) fn page(&mut self, block: u32, page: u32, data: &[u8]) -> Result<(), CaptureError> {
        debug_assert_eq!(data.len(), self.page_size);
        let g = self.global(block, page);
        let run_pages = (self.run.len() / self.page_size) as u64;
        if !self.run.is_empty()
            && (g != self.run_start + run_pages || run_pages as usize >= RUN_PAGES)
        {
            self.flush()?;
        }
        if self.run.is_empty() {
            self.run_start = g;
        }
        self.run.extend_from_slice(data);
        self.state[g as usize] = DATA;
        self.hashes[g as usize] = page_hash(data);
        Ok(())
    }

    /// Records a zero page (replacing any earlier copy).
    pub(crate) fn zero(&mut self, block: u32, page: u32) {
        let g = self.global(block, page);
        // A zero record for a page still in the pending run must not be
        // overwritten by the run later: the state says ZERO, and the slot's
        // content is then never read.
        self.state[g as usize] = ZERO;
        self.hashes[g as usize] = self.zero_hash;
    }

    /// Compares every staged page of RAM block `block` with `ram` by hash
    /// and replaces each one that differs with RAM's bytes (see
    /// [`crate::ram_check`]).
    pub(crate) fn check_against(
        &mut self,
        block: u32,
        ram: &FinalRam,
    ) -> Result<RamCheckReport, CaptureError> {
        let start = self.block_starts[block as usize];
        let pages = self.block_starts[block as usize + 1] - start;
        if ram.hashes.len() as u64 != pages {
            return Err(CaptureError::RamCheck {
                detail: format!(
                    "RAM block {:?} has {pages} pages in the stream but {} in the RAM given to \
                     check it against",
                    ram.block,
                    ram.hashes.len()
                ),
            });
        }
        self.flush()?;
        let mut report = RamCheckReport {
            pages_checked: pages,
            ..RamCheckReport::default()
        };
        let mut buf = vec![0u8; self.page_size];
        for (p, &want) in ram.hashes.iter().enumerate() {
            let g = start + p as u64;
            if self.state[g as usize] != UNSEEN && self.hashes[g as usize] == want {
                continue;
            }
            read_page(ram, p as u64, &mut buf)?;
            self.file
                .write_all_at(&buf, g * self.page_size as u64)
                .map_err(|e| self.scratch_err(e))?;
            self.state[g as usize] = DATA;
            self.hashes[g as usize] = want;
            report.pages_patched += 1;
            if report.first_patched.len() < 16 {
                report.first_patched.push(p as u64);
            }
        }
        Ok(report)
    }

    /// Writes the pending run to the file.
    fn flush(&mut self) -> Result<(), CaptureError> {
        if self.run.is_empty() {
            return Ok(());
        }
        let at = self.run_start * self.page_size as u64;
        self.file
            .write_all_at(&self.run, at)
            .map_err(|e| self.scratch_err(e))?;
        self.run.clear();
        Ok(())
    }

    /// Gives every page to `writer` once, in page order (RAM blocks in
    /// stream order), then deletes the scratch file. `progress` sees the
    /// writer about every `interval` bytes of pages.
    pub(crate) fn drain_into(
        mut self,
        writer: &mut ImageWriter,
        interval: u64,
        progress: &mut dyn FnMut(&ImageWriter),
    ) -> Result<(), CaptureError> {
        self.flush()?;
        let ps = self.page_size;
        let mut buf = vec![0u8; RUN_PAGES * ps];
        let mut done = 0u64;
        let mut next_report = interval;
        for block in 0..self.block_starts.len() - 1 {
            let (start, end) = (self.block_starts[block], self.block_starts[block + 1]);
            let mut g = start;
            while g < end {
                match self.state[g as usize] {
                    DATA => {
                        // The longest run of data pages from g, up to RUN_PAGES.
                        let mut n = 1;
                        while n < RUN_PAGES as u64
                            && g + n < end
                            && self.state[(g + n) as usize] == DATA
                        {
                            n += 1;
                        }
                        let bytes = &mut buf[..n as usize * ps];
                        self.file
                            .read_exact_at(bytes, g * ps as u64)
                            .map_err(|e| self.scratch_err(e))?;
                        for (i, data) in bytes.chunks_exact(ps).enumerate() {
                            writer.add_page(block as u32, (g - start) as u32 + i as u32, data)?;
                        }
                        g += n;
                        done += n * ps as u64;
                    }
                    ZERO => {
                        writer.add_zero_page(block as u32, (g - start) as u32)?;
                        g += 1;
                        done += ps as u64;
                    }
                    // Never sent: left absent; the writer refuses to commit
                    // an incomplete image (and the stream reader already
                    // refuses a stream with unsent pages).
                    _ => g += 1,
                }
                if interval > 0 && done >= next_report {
                    progress(writer);
                    next_report = done + interval;
                }
            }
        }
        drop(self.file);
        fs::remove_file(&self.path).map_err(|source| CaptureError::Scratch {
            path: self.path.clone(),
            source,
        })?;
        Ok(())
    }
}
