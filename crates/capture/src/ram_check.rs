//! Pre-copy: the staged pages checked against the guest's RAM at the
//! switch-over, before the image is written.
//!
//! A pre-copy image is only right if QEMU re-sent every page the guest
//! wrote after its first copy, and that rests on QEMU's dirty tracking.
//! Under TCG, QEMU 7.2 can miss a write (a vCPU's store that lands after the
//! migration thread cleared the page's dirty bit and read the page, through
//! a TLB entry that no longer traps writes; see `docs/snapshot.md`): the
//! stream then ends with an older copy of that page, and nothing in it says
//! so. So a caller that can read the guest's RAM while the VM is paused for
//! the switch-over (a `memory-backend-file`, `share=on`) gives the capture
//! a [`FinalRamSource`]: once the stream has ended, and before the staged
//! pages go into the image, the capture compares a hash of every staged
//! page of that RAM block with the hash of the same page of RAM
//! ([`FinalRam::hashes`], taken while the guest was paused), replaces each
//! page that differs with the RAM's bytes, and reports it
//! ([`RamCheckReport`]). The guest must stay paused until
//! [`FinalRamSource::checked`] has been called.
//!
//! A page read for the replacement whose hash is not the one taken before
//! means the RAM changed while the guest was supposed to be paused: the
//! capture fails ([`CaptureError::RamChanged`]) rather than write an image
//! that matches nothing.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use vmcsnap_image::hashes::page_hash;

use crate::error::CaptureError;

/// The guest's RAM as it is while the VM is paused for the switch-over.
#[derive(Debug)]
pub struct FinalRam {
    /// The RAM block it holds (its name in the stream, e.g. `mem`).
    pub block: String,
    /// The file that holds the block's bytes.
    pub file: File,
    /// Where the block starts in `file`.
    pub file_offset: u64,
    /// [`page_hash`] of each page of the block, in order, taken while the
    /// guest was paused ([`hash_pages`]).
    pub hashes: Vec<u128>,
}

/// What the check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RamCheckReport {
    /// Pages of the block compared.
    pub pages_checked: u64,
    /// Pages whose staged copy differed from RAM and were replaced by
    /// RAM's bytes: writes QEMU's stream missed.
    pub pages_patched: u64,
    /// The first few replaced pages (page numbers in the block).
    pub first_patched: Vec<u64>,
}

/// Where a pre-copy capture gets the final RAM, and whom it tells that the
/// check is over (the guest may run again then).
pub trait FinalRamSource: Send + Sync {
    /// Blocks until the guest's RAM, paused for the switch-over, has been
    /// hashed; an error (the RAM cannot be read, the snapshot was given up
    /// on) fails the capture.
    fn final_ram(&self) -> Result<FinalRam, String>;
    /// The check is over: the staged pages equal the RAM (`Ok`), or the
    /// capture fails with this error.
    fn checked(&self, outcome: Result<&RamCheckReport, &CaptureError>);
}

/// A [`FinalRamSource`] for [`CaptureOptions::final_ram`](crate::CaptureOptions::final_ram).
#[derive(Clone)]
pub struct FinalRamCheck(pub Arc<dyn FinalRamSource>);

impl std::fmt::Debug for FinalRamCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FinalRamCheck")
    }
}

/// Bytes read at a time by [`hash_pages`].
const READ_CHUNK: usize = 1 << 20;

/// [`page_hash`] of each `page_size` page of `len` bytes of `file` from
/// `offset`, read by `threads` threads (each a contiguous share). `len`
/// must be a multiple of `page_size`.
pub fn hash_pages(
    file: &File,
    offset: u64,
    len: u64,
    page_size: usize,
    threads: usize,
) -> io::Result<Vec<u128>> {
    let ps = page_size as u64;
    if ps == 0 || len % ps != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{len} bytes are not a whole number of {page_size}-byte pages"),
        ));
    }
    let pages = (len / ps) as usize;
    let mut hashes = vec![0u128; pages];
    let per = pages.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let jobs: Vec<_> = hashes
            .chunks_mut(per)
            .enumerate()
            .map(|(i, out)| {
                let start = offset + (i * per) as u64 * ps;
                s.spawn(move || hash_range(file, start, out, page_size))
            })
            .collect();
        jobs.into_iter().try_for_each(|j| {
            j.join()
                .unwrap_or_else(|_| Err(io::Error::other("panicked")))
        })
    })?;
    Ok(hashes)
}

/// Hashes `out.len()` pages of `file` from `start` into `out`.
fn hash_range(file: &File, start: u64, out: &mut [u128], page_size: usize) -> io::Result<()> {
    let per_read = (READ_CHUNK / page_size).max(1);
    let mut buf = vec![0u8; per_read * page_size];
    for (n, hashes) in out.chunks_mut(per_read).enumerate() {
        let bytes = &mut buf[..hashes.len() * page_size];
        file.read_exact_at(bytes, start + (n * per_read * page_size) as u64)?;
        for (h, page) in hashes.iter_mut().zip(bytes.chunks_exact(page_size)) {
            *h = page_hash(page);
        }
    }
    Ok(())
}

/// Reads page `page` of `ram` and checks it against its hash.
pub(crate) fn read_page(ram: &FinalRam, page: u64, buf: &mut [u8]) -> Result<(), CaptureError> {
    let at = ram.file_offset + page * buf.len() as u64;
    ram.file
        .read_exact_at(buf, at)
        .map_err(|e| CaptureError::RamCheck {
            detail: format!("reading page {page} of RAM block {:?}: {e}", ram.block),
        })?;
    if page_hash(buf) != ram.hashes[page as usize] {
        return Err(CaptureError::RamChanged {
            block: ram.block.clone(),
            page,
        });
    }
    Ok(())
}
