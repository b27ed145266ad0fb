//! The page path of [`ImageWriter`]: each page given is checked, then
//! recorded as zero, in the parent, on a frozen disk or a duplicate, or
//! put in an open block; full blocks go through the compression pool and
//! are appended to the memory image in order.

use std::io;

use super::pipeline::Done;
use super::{ImageWriter, WriteError};
use crate::codec::Codec;
use crate::fileio::write_all_vectored;
use crate::format::{
    is_zero, BlockHeader, FileKind, PageKey, BLOCK_ENTRY_LEN, BLOCK_FLAG_HOT, BLOCK_HEADER_LEN,
    ENTRY_FLAG_DISK, ENTRY_FLAG_DUP, ENTRY_FLAG_PARENT,
};
use crate::index::{BlockInfo, IndexEntry};

impl ImageWriter {
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

    pub(super) fn check_key(&self, key: PageKey) -> Result<(), WriteError> {
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

    pub(super) fn is_given(&self, key: PageKey) -> bool {
        let p = key.page as usize;
        self.given[key.ram_block as usize][p / 64] & (1 << (p % 64)) != 0
    }

    pub(super) fn set_given(&mut self, key: PageKey) {
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

    pub(super) fn add(&mut self, key: PageKey, data: &[u8], hot: bool) -> Result<(), WriteError> {
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
    pub(super) fn submit(&mut self, which: usize) -> Result<(), WriteError> {
        let open = std::mem::take(&mut self.open[which]);
        let ready = self.pool.submit(which == 1, open.keys, open.payload);
        self.append_all(ready)
    }

    pub(super) fn append_all(&mut self, ready: Vec<Done>) -> Result<(), WriteError> {
        for d in ready {
            self.append(&d)?;
            self.pool.recycle(d.job.raw);
        }
        Ok(())
    }

    /// Waits for the pool and appends every block still in flight.
    pub(super) fn drain_pool(&mut self) -> Result<(), WriteError> {
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
    pub(super) fn append(&mut self, d: &Done) -> Result<(), WriteError> {
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
    pub(super) fn resolve_dups(&mut self) {
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
}
