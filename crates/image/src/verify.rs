//! Full verification ([`Image::verify`]).
//!
//! [`Image::open`] already checked the manifest CRC, every file header CRC,
//! the index, bitmap and trace CRCs and their consistency. `verify` reads
//! the rest: every memory-image block (header, block CRC, page list against
//! the index, every page CRC) and the device state. It does not stop at the
//! first bad block: the report names every one, by number and file offset.

use crate::error::ReadError;
use crate::fileio::read_at;
use crate::reader::Image;

/// A block that failed verification.
#[derive(Debug)]
pub struct BadBlock {
    /// Block number.
    pub index: u32,
    /// File offset of its header in the memory image.
    pub offset: u64,
    /// What is wrong.
    pub error: ReadError,
}

/// The outcome of [`Image::verify`].
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Blocks read.
    pub blocks_checked: u32,
    /// Pages whose CRC was checked.
    pub pages_checked: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Blocks that failed, in file order.
    pub bad_blocks: Vec<BadBlock>,
    /// Other failures (device state).
    pub other: Vec<ReadError>,
}

impl VerifyReport {
    /// True if nothing failed.
    pub fn is_ok(&self) -> bool {
        self.bad_blocks.is_empty() && self.other.is_empty()
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} blocks, {} pages, {} bytes checked: ",
            self.blocks_checked, self.pages_checked, self.bytes_read
        )?;
        if self.is_ok() {
            return write!(f, "OK");
        }
        write!(
            f,
            "{} bad blocks, {} other problems",
            self.bad_blocks.len(),
            self.other.len()
        )?;
        for b in &self.bad_blocks {
            write!(
                f,
                "\n  block {} at offset {}: {}",
                b.index, b.offset, b.error
            )?;
        }
        for e in &self.other {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

impl Image {
    /// Checks every CRC of the image and returns a report naming each bad
    /// block. Read errors are reported per block too; this never panics and
    /// never stops early.
    pub fn verify(&self) -> VerifyReport {
        let mut report = VerifyReport::default();
        let mut buf = Vec::new();
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
                    buf = block.data;
                }
                Err(error) => report.bad_blocks.push(BadBlock {
                    index: i,
                    offset: info.offset,
                    error,
                }),
            }
        }
        match self.device_state() {
            Ok(d) => report.bytes_read += d.len() as u64,
            Err(e) => report.other.push(e),
        }
        report
    }
}
