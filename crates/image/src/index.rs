//! The page index (`pages.idx`) and the zero-page bitmaps (`zero.bmp`).
//!
//! `pages.idx` body:
//!
//! ```text
//! block table: blocks × 16 bytes
//!   0 8 offset       file offset of the block header in memory.img
//!   8 4 stored_len   header + page list + stored payload
//!  12 2 page_count
//!  14 1 compression  0 none, 1 lz4, 2 zstd (v2)
//!  15 1 flags        bit 0 hot (v2); 0 in v1
//! then for each RAM block, in manifest order:
//!   section header, 16 bytes: ram_block u32, pages u32, reserved u64 (0)
//!   pages × 12-byte entries:
//!     0 4 block      memory-image block, or 0xffffffff if not stored
//!     4 2 slot       position of the page in the block
//!     6 2 flags      bit 0 duplicate (v2: block/slot is another page's
//!                    slot holding the same bytes); 0 in v1
//!     8 4 crc        CRC32C of the page's (uncompressed) bytes
//! ```
//!
//! `zero.bmp` body, for each RAM block in manifest order: a 16-byte
//! section header (ram_block u32, pages u32, zero_count u64) and
//! `ceil(pages / 8)` bitmap bytes padded with zero bytes to a multiple of 8.
//! Bit `p % 8` (least significant first) of byte `p / 8` set = page `p` is
//! all zeros.

use std::path::Path;

use crate::error::ReadError;
use crate::format::{
    get_u16, get_u32, get_u64, pad8, BLOCK_ENTRY_LEN, BLOCK_FLAGS_KNOWN, BLOCK_HEADER_LEN,
    COMPRESSION_NONE, ENTRY_FLAGS_KNOWN, ENTRY_FLAG_DISK, ENTRY_FLAG_DUP, ENTRY_FLAG_PARENT,
    MAX_BLOCK_PAYLOAD, NO_BLOCK,
};

/// Bytes per block-table entry.
pub const BLOCK_TABLE_ENTRY_LEN: u64 = 16;
/// Bytes per page-index entry.
pub const INDEX_ENTRY_LEN: u64 = 12;
/// Bytes per section header (index and bitmap).
pub const SECTION_HEADER_LEN: u64 = 16;

/// Where a stored page is: memory-image block, slot, and its CRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// Block number, or [`NO_BLOCK`].
    pub block: u32,
    /// Slot within the block.
    pub slot: u16,
    /// Flags (0 in v1).
    pub flags: u16,
    /// CRC32C of the page bytes.
    pub crc: u32,
}

impl IndexEntry {
    /// The entry of a page that is not stored.
    pub const NONE: IndexEntry = IndexEntry {
        block: NO_BLOCK,
        slot: 0,
        flags: 0,
        crc: 0,
    };

    /// True if the page is in the memory image (its own slot or, for a
    /// duplicate, another page's).
    pub fn is_stored(&self) -> bool {
        self.block != NO_BLOCK && self.flags & ENTRY_FLAG_DISK == 0
    }

    /// For a page on a frozen disk: (disk number, byte offset in pages).
    pub fn on_disk(&self) -> Option<(u16, u32)> {
        (self.flags & ENTRY_FLAG_DISK != 0).then_some((self.slot, self.block))
    }

    /// True if the page is read from the parent snapshot.
    pub fn in_parent(&self) -> bool {
        self.flags & ENTRY_FLAG_PARENT != 0
    }

    pub(crate) fn encode(&self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[0..4].copy_from_slice(&self.block.to_le_bytes());
        b[4..6].copy_from_slice(&self.slot.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.crc.to_le_bytes());
        b
    }
}

/// One memory-image block, as the block table describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    /// File offset of the block header.
    pub offset: u64,
    /// Header + page list + stored payload.
    pub stored_len: u32,
    /// Pages in the block.
    pub page_count: u16,
    /// Compression codec.
    pub compression: u8,
    /// Flags (0 in v1).
    pub flags: u8,
}

impl BlockInfo {
    /// File offset of the payload.
    pub fn payload_offset(&self) -> u64 {
        self.offset + (BLOCK_HEADER_LEN + usize::from(self.page_count) * BLOCK_ENTRY_LEN) as u64
    }

    /// Whether the block holds pages the guest wrote during the snapshot,
    /// in first-write order (v2 locality block).
    pub fn is_hot(&self) -> bool {
        self.flags & crate::format::BLOCK_FLAG_HOT != 0
    }

    /// Stored payload length.
    pub fn payload_len(&self) -> u32 {
        self.stored_len - (BLOCK_HEADER_LEN + usize::from(self.page_count) * BLOCK_ENTRY_LEN) as u32
    }

    pub(crate) fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.stored_len.to_le_bytes());
        b[12..14].copy_from_slice(&self.page_count.to_le_bytes());
        b[14] = self.compression;
        b[15] = self.flags;
        b
    }
}

/// Body length of `pages.idx` for `blocks` blocks and these RAM block sizes.
pub fn index_body_len(blocks: u32, ram_pages: &[u32]) -> u64 {
    u64::from(blocks) * BLOCK_TABLE_ENTRY_LEN
        + ram_pages
            .iter()
            .map(|&p| SECTION_HEADER_LEN + u64::from(p) * INDEX_ENTRY_LEN)
            .sum::<u64>()
}

/// Body length of `zero.bmp` for these RAM block sizes.
pub fn bitmap_body_len(ram_pages: &[u32]) -> u64 {
    ram_pages
        .iter()
        .map(|&p| SECTION_HEADER_LEN + pad8(u64::from(p).div_ceil(8)))
        .sum()
}

/// What the index decoder needs to know about the memory image.
pub(crate) struct IndexContext<'a> {
    pub file: &'a Path,
    pub blocks: u32,
    pub ram_pages: &'a [u32],
    pub page_size: u32,
    pub pages_per_block: u16,
    /// Offset of the first block (the memory image's header length).
    pub first_block: u64,
    /// Size of the memory image.
    pub memory_len: u64,
    /// Major format version (v1: no flags, no compression).
    pub major: u16,
    /// Frozen disks the manifest lists (disk references index them).
    pub disks: usize,
    /// Whether the manifest names a parent snapshot.
    pub has_parent: bool,
}

/// Decodes and cross-checks a `pages.idx` body (its CRC already checked).
pub(crate) fn decode_index(
    cx: &IndexContext<'_>,
    body: &[u8],
) -> Result<(Vec<BlockInfo>, Vec<Vec<IndexEntry>>), ReadError> {
    let bad = |what: String| ReadError::corrupt(cx.file, what);
    if body.len() as u64 != index_body_len(cx.blocks, cx.ram_pages) {
        return Err(bad(format!(
            "body is {} bytes, the manifest implies {}",
            body.len(),
            index_body_len(cx.blocks, cx.ram_pages)
        )));
    }
    let mut blocks = Vec::with_capacity(cx.blocks as usize);
    let mut next = cx.first_block;
    let mut slot_base = Vec::with_capacity(cx.blocks as usize + 1);
    let mut total_slots: u64 = 0;
    for i in 0..cx.blocks as usize {
        let b = &body[i * 16..i * 16 + 16];
        let info = BlockInfo {
            offset: get_u64(b, 0),
            stored_len: get_u32(b, 8),
            page_count: get_u16(b, 12),
            compression: b[14],
            flags: b[15],
        };
        if info.offset != next {
            return Err(bad(format!(
                "block {i} is at offset {}, expected {next}",
                info.offset
            )));
        }
        let flags_ok = match cx.major {
            1 => info.flags == 0 && info.compression == COMPRESSION_NONE,
            _ => info.flags & !BLOCK_FLAGS_KNOWN == 0,
        };
        if !flags_ok {
            return Err(bad(format!(
                "block {i} has flags {:#x} and compression {}, which format {}.x does not have",
                info.flags, info.compression, cx.major
            )));
        }
        if info.page_count == 0 || info.page_count > cx.pages_per_block {
            return Err(bad(format!("block {i} has {} pages", info.page_count)));
        }
        let meta = (BLOCK_HEADER_LEN + usize::from(info.page_count) * BLOCK_ENTRY_LEN) as u64;
        let raw = u64::from(info.page_count) * u64::from(cx.page_size);
        let payload = u64::from(info.stored_len).checked_sub(meta);
        let ok = match payload {
            None => false,
            Some(p) if info.compression == COMPRESSION_NONE => p == raw,
            Some(p) => p <= 2 * MAX_BLOCK_PAYLOAD,
        };
        if !ok {
            return Err(bad(format!(
                "block {i} has stored length {}",
                info.stored_len
            )));
        }
        next = info.offset + u64::from(info.stored_len);
        if next > cx.memory_len {
            return Err(bad(format!(
                "block {i} ends at {next}, past the memory image ({})",
                cx.memory_len
            )));
        }
        slot_base.push(total_slots);
        total_slots += u64::from(info.page_count);
        blocks.push(info);
    }
    if next != cx.memory_len {
        return Err(bad(format!(
            "blocks end at {next} but the memory image is {} bytes",
            cx.memory_len
        )));
    }
    // Every (block, slot) must be claimed by exactly one page (its owner);
    // v2 duplicates point at a claimed slot with the same CRC.
    let mut claimed = vec![0u64; total_slots.div_ceil(64) as usize];
    let mut slot_crc = vec![0u32; total_slots as usize];
    let mut dups = Vec::new();
    let mut stored: u64 = 0;
    let mut pos = cx.blocks as usize * 16;
    let mut ram = Vec::with_capacity(cx.ram_pages.len());
    for (r, &pages) in cx.ram_pages.iter().enumerate() {
        let s = &body[pos..pos + 16];
        if get_u32(s, 0) as usize != r || get_u32(s, 4) != pages {
            return Err(bad(format!(
                "section {r} header does not match RAM block {r} ({pages} pages)"
            )));
        }
        pos += 16;
        let mut entries = Vec::with_capacity(pages as usize);
        for p in 0..pages {
            let e = &body[pos..pos + 12];
            pos += 12;
            let entry = IndexEntry {
                block: get_u32(e, 0),
                slot: get_u16(e, 4),
                flags: get_u16(e, 6),
                crc: get_u32(e, 8),
            };
            let known = match cx.major {
                1 => 0,
                _ => ENTRY_FLAGS_KNOWN,
            };
            if entry.flags & !known != 0
                || (!entry.is_stored() && entry.flags & ENTRY_FLAG_DUP != 0)
            {
                return Err(bad(format!(
                    "page {r}:{p} has flags {:#x}, which format {}.x does not have here",
                    entry.flags, cx.major
                )));
            }
            if entry.flags & ENTRY_FLAG_DISK != 0 {
                if entry.flags != ENTRY_FLAG_DISK
                    || usize::from(entry.slot) >= cx.disks
                    || entry.block == NO_BLOCK
                {
                    return Err(bad(format!(
                        "page {r}:{p} refers to disk {} of {} (flags {:#x}): no such frozen disk",
                        entry.slot, cx.disks, entry.flags
                    )));
                }
                entries.push(entry);
                continue;
            }
            if entry.in_parent() {
                if entry.flags != ENTRY_FLAG_PARENT || entry.block != NO_BLOCK || entry.slot != 0 {
                    return Err(bad(format!(
                        "page {r}:{p} is in the parent but also names block {} slot {} (flags {:#x})",
                        entry.block, entry.slot, entry.flags
                    )));
                }
                if !cx.has_parent {
                    return Err(bad(format!(
                        "page {r}:{p} is in the parent snapshot, but the manifest names no parent"
                    )));
                }
                entries.push(entry);
                continue;
            }
            if entry.is_stored() {
                let Some(info) = blocks.get(entry.block as usize) else {
                    return Err(bad(format!(
                        "page {r}:{p} points at block {} of {}",
                        entry.block, cx.blocks
                    )));
                };
                if entry.slot >= info.page_count {
                    return Err(bad(format!(
                        "page {r}:{p} points at slot {} of block {}",
                        entry.slot, entry.block
                    )));
                }
                let bit = slot_base[entry.block as usize] + u64::from(entry.slot);
                if entry.flags & ENTRY_FLAG_DUP != 0 {
                    dups.push((r, p, bit, entry.crc));
                    entries.push(entry);
                    continue;
                }
                slot_crc[bit as usize] = entry.crc;
                let (w, m) = ((bit / 64) as usize, 1u64 << (bit % 64));
                if claimed[w] & m != 0 {
                    return Err(bad(format!(
                        "block {} slot {} is claimed twice",
                        entry.block, entry.slot
                    )));
                }
                claimed[w] |= m;
                stored += 1;
            }
            entries.push(entry);
        }
        ram.push(entries);
    }
    if stored != total_slots {
        return Err(bad(format!(
            "{stored} pages are indexed but the blocks hold {total_slots}"
        )));
    }
    // Every slot is claimed now, so a duplicate's slot has an owner.
    for (r, p, bit, crc) in dups {
        if slot_crc[bit as usize] != crc {
            return Err(bad(format!(
                "duplicate page {r}:{p} names a slot whose page has another CRC"
            )));
        }
    }
    Ok((blocks, ram))
}

/// The zero-page bitmap of one RAM block.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ZeroBitmap {
    pages: u32,
    bits: Vec<u8>,
    count: u64,
}

impl ZeroBitmap {
    /// An empty bitmap for `pages` pages.
    pub fn new(pages: u32) -> Self {
        ZeroBitmap {
            pages,
            bits: vec![0; (pages as usize).div_ceil(8)],
            count: 0,
        }
    }

    /// Pages the bitmap covers.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// True if page `p` is a zero page (false past the end).
    pub fn is_zero(&self, p: u32) -> bool {
        p < self.pages && self.bits[(p / 8) as usize] & (1 << (p % 8)) != 0
    }

    /// Marks page `p` (which must be in range) as zero.
    pub(crate) fn set(&mut self, p: u32) {
        let byte = &mut self.bits[(p / 8) as usize];
        if *byte & (1 << (p % 8)) == 0 {
            *byte |= 1 << (p % 8);
            self.count += 1;
        }
    }

    /// Number of zero pages.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The raw bitmap: bit `p % 8` of byte `p / 8`, least significant first.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bits
    }

    /// The zero pages, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.bits.iter().enumerate().flat_map(|(i, &b)| {
            (0..8u32)
                .filter(move |k| b & (1 << k) != 0)
                .map(move |k| i as u32 * 8 + k)
        })
    }
}

/// Decodes and checks a `zero.bmp` body (its CRC already checked).
pub(crate) fn decode_bitmaps(
    file: &Path,
    ram_pages: &[u32],
    body: &[u8],
) -> Result<Vec<ZeroBitmap>, ReadError> {
    let bad = |what: String| ReadError::corrupt(file, what);
    if body.len() as u64 != bitmap_body_len(ram_pages) {
        return Err(bad(format!(
            "body is {} bytes, the manifest implies {}",
            body.len(),
            bitmap_body_len(ram_pages)
        )));
    }
    let mut pos = 0usize;
    let mut out = Vec::with_capacity(ram_pages.len());
    for (r, &pages) in ram_pages.iter().enumerate() {
        let s = &body[pos..pos + 16];
        if get_u32(s, 0) as usize != r || get_u32(s, 4) != pages {
            return Err(bad(format!(
                "section {r} header does not match RAM block {r} ({pages} pages)"
            )));
        }
        let declared = get_u64(s, 8);
        pos += 16;
        let n = (pages as usize).div_ceil(8);
        let padded = pad8(n as u64) as usize;
        let bits = body[pos..pos + n].to_vec();
        if body[pos + n..pos + padded].iter().any(|&b| b != 0) {
            return Err(bad(format!("section {r} has non-zero padding")));
        }
        pos += padded;
        if pages % 8 != 0 && bits[n - 1] >> (pages % 8) != 0 {
            return Err(bad(format!(
                "section {r} marks pages past the end of the RAM block"
            )));
        }
        let count: u64 = bits.iter().map(|b| u64::from(b.count_ones())).sum();
        if count != declared {
            return Err(bad(format!(
                "section {r} declares {declared} zero pages but marks {count}"
            )));
        }
        out.push(ZeroBitmap { pages, bits, count });
    }
    Ok(out)
}

/// Encodes the bitmaps as a `zero.bmp` body.
pub(crate) fn encode_bitmaps(
    maps: &[ZeroBitmap],
    w: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    for (r, m) in maps.iter().enumerate() {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&(r as u32).to_le_bytes());
        h[4..8].copy_from_slice(&m.pages.to_le_bytes());
        h[8..16].copy_from_slice(&m.count.to_le_bytes());
        w.write_all(&h)?;
        w.write_all(&m.bits)?;
        let pad = pad8(m.bits.len() as u64) as usize - m.bits.len();
        w.write_all(&[0u8; 8][..pad])?;
    }
    Ok(())
}

/// Encodes the block table and page index as a `pages.idx` body.
pub(crate) fn encode_index(
    blocks: &[BlockInfo],
    ram: &[Vec<IndexEntry>],
    w: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    for b in blocks {
        w.write_all(&b.encode())?;
    }
    for (r, entries) in ram.iter().enumerate() {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&(r as u32).to_le_bytes());
        h[4..8].copy_from_slice(&(entries.len() as u32).to_le_bytes());
        w.write_all(&h)?;
        for e in entries {
            w.write_all(&e.encode())?;
        }
    }
    Ok(())
}
