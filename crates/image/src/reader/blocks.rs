//! Reading and checking whole memory-image blocks.

use super::Image;
use crate::codec::{decompress, Codec};
use crate::error::ReadError;
use crate::fileio::read_vec_at;
use crate::format::{get_u32, BlockHeader, PageKey, BLOCK_ENTRY_LEN, BLOCK_HEADER_LEN};
use crate::index::BlockInfo;

/// A memory-image block, read and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Block number.
    pub index: u32,
    /// File offset of the block header.
    pub offset: u64,
    /// The pages, in slot order.
    pub pages: Vec<PageKey>,
    /// Uncompressed payload: the pages' bytes, in slot order.
    pub data: Vec<u8>,
    page_size: usize,
}

impl Block {
    /// The bytes of the page in `slot` (panics if `slot` is out of range,
    /// like slice indexing).
    pub fn page(&self, slot: usize) -> &[u8] {
        &self.data[slot * self.page_size..(slot + 1) * self.page_size]
    }

    /// `(page, bytes)` in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (PageKey, &[u8])> + '_ {
        self.pages
            .iter()
            .copied()
            .zip(self.data.chunks_exact(self.page_size))
    }
}

impl Image {
    pub(crate) fn page_crc_error(&self, block: u32, offset: u64) -> ReadError {
        ReadError::BadCrc {
            file: self.mem_path.clone(),
            what: "page".into(),
            block: Some(block),
            offset,
        }
    }

    /// Reads block `i` whole and checks its header, CRC, page list (against
    /// the index) and page CRCs.
    pub fn read_block(&self, i: u32) -> Result<Block, ReadError> {
        let info = *self.blocks.get(i as usize).ok_or_else(|| {
            ReadError::NotFound(format!(
                "block {i} does not exist ({} blocks)",
                self.blocks.len()
            ))
        })?;
        let raw = read_vec_at(
            &self.mem,
            &self.mem_path,
            u64::from(info.stored_len),
            info.offset,
        )?;
        self.check_block(i, &info, raw)
    }

    /// Reads every page of RAM block `ram_block` into `out` (its pages ×
    /// page size bytes), each memory-image block once (decompressed and
    /// checked), zero pages as zeros. Returns (pages stored, zero pages);
    /// [`ReadError::NotFound`] if a page is in neither (an incomplete image).
    pub fn read_ram_block(&self, ram_block: u32, out: &mut [u8]) -> Result<(u64, u64), ReadError> {
        let ps = self.page_size();
        let pages = self.ram_block_pages(ram_block) as usize;
        if out.len() != pages * ps {
            return Err(ReadError::InvalidArgument(format!(
                "buffer is {} bytes, RAM block {ram_block} is {} bytes",
                out.len(),
                pages * ps
            )));
        }
        // An incremental snapshot: the parent's RAM first, then this
        // image's own pages over it.
        let in_parent = match self.parent() {
            Some(parent) => {
                parent.read_ram_block(ram_block, out)?;
                true
            }
            None => false,
        };
        let mut wanted: Vec<(u32, u16, usize)> = Vec::with_capacity(pages);
        let mut zero = 0;
        for p in 0..pages {
            match self.locate(PageKey::new(ram_block, p as u32))? {
                crate::PageState::Stored(loc) => wanted.push((loc.block, loc.slot, p)),
                crate::PageState::Zero => {
                    out[p * ps..(p + 1) * ps].fill(0);
                    zero += 1;
                }
                crate::PageState::Absent => {
                    return Err(ReadError::NotFound(format!(
                        "page {ram_block}:{p} is not in this image"
                    )))
                }
                crate::PageState::InParent { crc } => {
                    if !in_parent || crc32c::crc32c(&out[p * ps..(p + 1) * ps]) != crc {
                        self.read_page(
                            PageKey::new(ram_block, p as u32),
                            &mut out[p * ps..(p + 1) * ps],
                        )?;
                    }
                }
                crate::PageState::OnDisk { .. } => {
                    self.read_page(
                        PageKey::new(ram_block, p as u32),
                        &mut out[p * ps..(p + 1) * ps],
                    )?;
                }
            }
        }
        wanted.sort_unstable();
        let mut current: Option<Block> = None;
        for &(b, slot, p) in &wanted {
            if current.as_ref().map(|c| c.index) != Some(b) {
                current = Some(self.read_block(b)?);
            }
            if let Some(c) = &current {
                out[p * ps..(p + 1) * ps].copy_from_slice(c.page(usize::from(slot)));
            }
        }
        Ok((wanted.len() as u64, zero))
    }

    /// Iterates over every block in file order (each read and checked).
    pub fn iter_blocks(&self) -> impl Iterator<Item = Result<Block, ReadError>> + '_ {
        (0..self.blocks.len() as u32).map(move |i| self.read_block(i))
    }

    /// Checks the bytes of block `i` (`raw` = header + list + payload).
    pub(crate) fn check_block(
        &self,
        i: u32,
        info: &BlockInfo,
        mut raw: Vec<u8>,
    ) -> Result<Block, ReadError> {
        let corrupt = |what: String| {
            ReadError::corrupt(
                &self.mem_path,
                format!("block {i} at offset {}: {what}", info.offset),
            )
        };
        let mut hb = [0u8; BLOCK_HEADER_LEN];
        hb.copy_from_slice(&raw[..BLOCK_HEADER_LEN]);
        let h = BlockHeader::decode(&hb).ok_or_else(|| corrupt("bad block magic".into()))?;
        let list_len = usize::from(info.page_count) * BLOCK_ENTRY_LEN;
        let crc = crc32c::crc32c_append(
            crc32c::crc32c(&raw[..BLOCK_HEADER_LEN - 4]),
            &raw[BLOCK_HEADER_LEN..],
        );
        if crc != h.crc {
            return Err(ReadError::BadCrc {
                file: self.mem_path.clone(),
                what: "block".into(),
                block: Some(i),
                offset: info.offset,
            });
        }
        if h.seq != i
            || h.page_count != info.page_count
            || h.compression != info.compression
            || h.flags != info.flags
            || h.payload_len != info.payload_len()
            || u64::from(h.raw_len) != u64::from(h.page_count) * self.manifest.page_size as u64
        {
            return Err(corrupt(format!(
                "header {h:?} does not match the block table {info:?}"
            )));
        }
        let mut pages = Vec::with_capacity(usize::from(info.page_count));
        let mut crcs = Vec::with_capacity(usize::from(info.page_count));
        for (slot, e) in raw[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + list_len]
            .chunks_exact(BLOCK_ENTRY_LEN)
            .enumerate()
        {
            let key = PageKey {
                ram_block: get_u32(e, 0),
                page: get_u32(e, 4),
            };
            let crc = get_u32(e, 8);
            let entry = self
                .index
                .get(key.ram_block as usize)
                .and_then(|v| v.get(key.page as usize));
            match entry {
                Some(x) if x.block == i && usize::from(x.slot) == slot && x.crc == crc => {}
                _ => {
                    return Err(corrupt(format!(
                        "slot {slot} holds page {}:{}, which the index places elsewhere",
                        key.ram_block, key.page
                    )))
                }
            }
            pages.push(key);
            crcs.push(crc);
        }
        let ps = self.page_size();
        let start = BLOCK_HEADER_LEN + list_len;
        let codec =
            Codec::from_id(info.compression).map_err(|_| ReadError::UnsupportedCompression {
                file: self.mem_path.clone(),
                block: i,
                codec: info.compression,
            })?;
        if codec != Codec::None {
            // Bounded: raw_len = page_count × page_size, checked above.
            let mut out = vec![0u8; h.raw_len as usize];
            decompress(codec, &raw[start..], &mut out)
                .map_err(|e| corrupt(format!("the compressed payload is damaged ({e})")))?;
            raw.truncate(start);
            raw.extend_from_slice(&out);
        }
        for (slot, page) in raw[start..].chunks_exact(ps).enumerate() {
            if crc32c::crc32c(page) != crcs[slot] {
                // In a compressed block the offset is the block's: the
                // page has no offset of its own in the file.
                let at = if codec == Codec::None {
                    info.offset + (start + slot * ps) as u64
                } else {
                    info.offset
                };
                return Err(self.page_crc_error(i, at));
            }
        }
        raw.drain(..start);
        Ok(Block {
            index: i,
            offset: info.offset,
            pages,
            data: raw,
            page_size: ps,
        })
    }
}
