//! Full verification ([`Image::verify`]): everything a restore checks.
//!
//! [`Image::open`] already checked the manifest CRC, every file header CRC,
//! the index, bitmap and trace CRCs and their consistency, and opened the
//! chain of parents. `verify` reads the rest, as a restore would read it:
//!
//! - every memory-image block (header, block CRC, page list against the
//!   index, every page CRC) and the device state;
//! - every page through the chain ([`pages`]): a page "in the parent" is
//!   read where it is (the block of the parent that holds it, a frozen
//!   disk) and checked against *this* image's CRC; a page on a frozen disk
//!   is read through the disk reader and checked against its CRC; an
//!   absent page (neither stored, zero, on a disk nor in a parent) is a
//!   failure, since no restore can send it;
//! - `hashes.bin` (format 2): its CRC, and each page's hash against the
//!   XXH3-128 of the page's bytes, since a later snapshot of the VM trusts
//!   these hashes to leave pages out as "in parent".
//!
//! It does not stop at the first problem: the report names every bad
//! block, by image, number and file offset, and the first
//! [`MAX_LISTED`] bad pages (with their total).

mod pages;

use std::path::PathBuf;

use crate::error::ReadError;
use crate::fileio::read_at;
use crate::format::PageKey;
use crate::hashes::page_hash;
use crate::reader::Image;

/// Bad pages listed in a report (the rest are counted).
pub const MAX_LISTED: usize = 20;

/// A block that failed verification.
#[derive(Debug)]
pub struct BadBlock {
    /// The snapshot directory of the image holding the block (this one,
    /// or a parent whose block this image reads pages from).
    pub image: PathBuf,
    /// Block number.
    pub index: u32,
    /// File offset of its header in the memory image.
    pub offset: u64,
    /// What is wrong.
    pub error: ReadError,
}

/// A page that failed verification (outside a bad block).
#[derive(Debug)]
pub struct BadPage {
    /// The page.
    pub key: PageKey,
    /// What is wrong.
    pub error: ReadError,
}

/// The outcome of [`Image::verify`].
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Blocks read (this image's and those of parents it reads from).
    pub blocks_checked: u32,
    /// Pages whose CRC was checked.
    pub pages_checked: u64,
    /// Of those, pages read from a parent snapshot.
    pub parent_pages_checked: u64,
    /// Of those, pages read from a frozen disk.
    pub disk_pages_checked: u64,
    /// Page hashes of `hashes.bin` compared with the pages' bytes.
    pub hashes_checked: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Blocks that failed, this image's in file order, then the parents'.
    pub bad_blocks: Vec<BadBlock>,
    /// The first [`MAX_LISTED`] pages that failed.
    pub bad_pages: Vec<BadPage>,
    /// Pages that failed, in all.
    pub bad_pages_total: u64,
    /// Other failures (device state, `hashes.bin`).
    pub other: Vec<ReadError>,
}

impl VerifyReport {
    /// True if nothing failed.
    pub fn is_ok(&self) -> bool {
        self.bad_blocks.is_empty() && self.bad_pages_total == 0 && self.other.is_empty()
    }

    /// The first problem, as one line (`None` if there is none).
    pub fn first_problem(&self) -> Option<String> {
        self.bad_blocks
            .first()
            .map(|b| b.to_string())
            .or_else(|| self.bad_pages.first().map(|p| p.to_string()))
            .or_else(|| self.other.first().map(|e| e.to_string()))
    }

    pub(crate) fn bad_page(&mut self, key: PageKey, error: ReadError) {
        self.bad_pages_total += 1;
        if self.bad_pages.len() < MAX_LISTED {
            self.bad_pages.push(BadPage { key, error });
        }
    }
}

impl std::fmt::Display for BadBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "block {} at offset {} of {}: {}",
            self.index,
            self.offset,
            self.image.display(),
            self.error
        )
    }
}

impl std::fmt::Display for BadPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "page {}:{}: {}",
            self.key.ram_block, self.key.page, self.error
        )
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} blocks, {} pages ({} from parents, {} from frozen disks), {} hashes, {} bytes checked: ",
            self.blocks_checked,
            self.pages_checked,
            self.parent_pages_checked,
            self.disk_pages_checked,
            self.hashes_checked,
            self.bytes_read
        )?;
        if self.is_ok() {
            return write!(f, "OK");
        }
        write!(
            f,
            "{} bad blocks, {} bad pages, {} other problems",
            self.bad_blocks.len(),
            self.bad_pages_total,
            self.other.len()
        )?;
        for b in &self.bad_blocks {
            write!(f, "\n  {b}")?;
        }
        for p in &self.bad_pages {
            write!(f, "\n  {p}")?;
        }
        if self.bad_pages_total > self.bad_pages.len() as u64 {
            write!(
                f,
                "\n  ... and {} more bad pages",
                self.bad_pages_total - self.bad_pages.len() as u64
            )?;
        }
        for e in &self.other {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

impl Image {
    /// Checks everything a restore of this image checks (see the module
    /// docs) and returns a report naming each problem. Read errors are
    /// reported too; this never panics and never stops early.
    pub fn verify(&self) -> VerifyReport {
        let mut report = VerifyReport::default();
        let hashes = match self.page_hashes() {
            Ok(h) => h,
            Err(e) => {
                report.other.push(e);
                None
            }
        };
        let slot_hashes = self.verify_own_blocks(&mut report, hashes.is_some());
        self.verify_pages(&mut report, hashes.as_deref(), &slot_hashes);
        match self.device_state() {
            Ok(d) => report.bytes_read += d.len() as u64,
            Err(e) => report.other.push(e),
        }
        report
    }

    /// Reads and checks every block of this image; returns, per block, the
    /// hash of each slot's bytes (if `hash`; `None` for a bad block).
    fn verify_own_blocks(&self, report: &mut VerifyReport, hash: bool) -> Vec<Option<Vec<u128>>> {
        let mut buf = Vec::new();
        let mut out = Vec::with_capacity(self.blocks.len());
        for (i, info) in self.blocks.iter().enumerate() {
            let i = i as u32;
            buf.resize(info.stored_len as usize, 0);
            let r = read_at(&self.mem, &self.mem_path, &mut buf, info.offset)
                .and_then(|()| self.check_block(i, info, std::mem::take(&mut buf)));
            report.blocks_checked += 1;
            report.bytes_read += u64::from(info.stored_len);
            match r {
                Ok(block) => {
                    report.pages_checked += block.pages.len() as u64;
                    out.push(hash.then(|| block.iter().map(|(_, d)| page_hash(d)).collect()));
                    buf = block.data;
                }
                Err(error) => {
                    out.push(None);
                    report.bad_blocks.push(BadBlock {
                        image: self.dir().into(),
                        index: i,
                        offset: info.offset,
                        error,
                    })
                }
            }
        }
        out
    }
}
