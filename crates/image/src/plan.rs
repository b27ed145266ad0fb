//! Read planning for restores: turn a set of pages (e.g. the first pages
//! of the FAFL queue) into few large sequential reads.
//!
//! [`Image::plan_reads`] sorts the stored pages by file offset and merges
//! pages whose gap is at most `max_gap` bytes into one [`ReadExtent`] (a
//! gap that small is cheaper to read through than to seek over), capped at
//! `max_extent` bytes. [`Image::read_extent`] performs one extent as a
//! single positioned read and checks every page's CRC.

use crate::error::ReadError;
use crate::fileio::read_at;
use crate::format::PageKey;
use crate::reader::{Image, PageState};

/// One sequential read of the memory image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadExtent {
    /// File offset of the first byte.
    pub offset: u64,
    /// Bytes to read.
    pub len: u64,
    /// The wanted pages in it: key, offset within the extent, CRC.
    pub pages: Vec<(PageKey, u64, u32)>,
}

/// A read plan for a set of pages.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadPlan {
    /// Sequential reads, in file order.
    pub extents: Vec<ReadExtent>,
    /// Blocks to read whole with [`Image::read_block`] (pages in
    /// compressed blocks; never in v1), ascending.
    pub whole_blocks: Vec<u32>,
    /// Wanted pages that are zero pages.
    pub zero: Vec<PageKey>,
    /// Wanted pages the image does not hold.
    pub absent: Vec<PageKey>,
    /// Wanted pages held elsewhere (the parent snapshot, a frozen disk):
    /// read one by one with [`Image::read_page`].
    pub elsewhere: Vec<PageKey>,
}

impl ReadPlan {
    /// Bytes the extents read.
    pub fn bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }
}

impl Image {
    /// The blocks holding any of `keys`, in file order, without repeats.
    pub fn blocks_for(&self, keys: &[PageKey]) -> Result<Vec<u32>, ReadError> {
        let mut out = Vec::new();
        for &k in keys {
            if let PageState::Stored(loc) = self.locate(k)? {
                out.push(loc.block);
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// Plans reads of `keys` (repeats are read once); see the module docs.
    pub fn plan_reads(
        &self,
        keys: &[PageKey],
        max_gap: u64,
        max_extent: u64,
    ) -> Result<ReadPlan, ReadError> {
        let ps = self.page_size() as u64;
        let mut plan = ReadPlan::default();
        let mut located = Vec::with_capacity(keys.len());
        for &k in keys {
            match self.locate(k)? {
                PageState::Stored(loc) => match loc.offset {
                    Some(off) => located.push((off, k, loc.crc)),
                    None => plan.whole_blocks.push(loc.block),
                },
                PageState::Zero => plan.zero.push(k),
                PageState::Absent => plan.absent.push(k),
                PageState::OnDisk { .. } | PageState::InParent { .. } => plan.elsewhere.push(k),
            }
        }
        plan.whole_blocks.sort_unstable();
        plan.whole_blocks.dedup();
        // A page asked for twice is read once; two pages sharing one slot
        // (v2 duplicates) share its bytes in the extent.
        located.sort_unstable();
        located.dedup();
        let max_extent = max_extent.max(ps);
        let mut cur: Option<ReadExtent> = None;
        for (off, key, crc) in located {
            if let Some(e) = cur.as_mut() {
                let end = e.offset + e.len;
                if off + ps <= end {
                    e.pages.push((key, off - e.offset, crc));
                    continue;
                }
                if off >= end && off - end <= max_gap && off + ps - e.offset <= max_extent {
                    e.len = off + ps - e.offset;
                    e.pages.push((key, off - e.offset, crc));
                    continue;
                }
                plan.extents.extend(cur.take());
            }
            cur = Some(ReadExtent {
                offset: off,
                len: ps,
                pages: vec![(key, 0, crc)],
            });
        }
        plan.extents.extend(cur);
        Ok(plan)
    }

    /// Reads one extent into `buf` (resized to its length) and checks the
    /// CRC of every wanted page in it. Page `(key, at, _)` is then
    /// `buf[at..at + page_size]`.
    pub fn read_extent(&self, extent: &ReadExtent, buf: &mut Vec<u8>) -> Result<(), ReadError> {
        let ps = self.page_size();
        let len = usize::try_from(extent.len)
            .map_err(|_| ReadError::InvalidArgument("extent too long".into()))?;
        let in_file = extent
            .offset
            .checked_add(extent.len)
            .is_some_and(|end| end <= self.manifest().files.memory.size);
        if !in_file
            || extent
                .pages
                .iter()
                .any(|&(_, at, _)| at + ps as u64 > extent.len)
        {
            return Err(ReadError::InvalidArgument(
                "extent does not fit the memory image".into(),
            ));
        }
        buf.resize(len, 0);
        read_at(&self.mem, &self.mem_path, buf, extent.offset)?;
        for &(key, at, crc) in &extent.pages {
            let at = at as usize;
            if crc32c::crc32c(&buf[at..at + ps]) != crc {
                let block = match self.locate(key)? {
                    PageState::Stored(loc) => loc.block,
                    _ => u32::MAX,
                };
                return Err(self.page_crc_error(block, extent.offset + at as u64));
            }
        }
        Ok(())
    }
}
