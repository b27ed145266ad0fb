//! On-disk constants, limits and the fixed binary headers.
//!
//! Everything is little-endian. Every binary file starts with a
//! [`FileHeader`] (64 bytes in v1); each memory-image block starts with a
//! [`BlockHeader`] (32 bytes). The byte-by-byte layout is in
//! `docs/image-format.md`; this module is its executable form.

use std::path::Path;

use crate::error::{ReadError, Version};

/// The major format version this build writes (by default) and reads.
/// Version 2 added compressed blocks, duplicate pages and locality flags;
/// see `docs/image-format.md`.
pub const FORMAT_MAJOR: u16 = 2;
/// The oldest major version this build reads (and can still write, see
/// `WriterOptions::format`).
pub const OLDEST_MAJOR: u16 = 1;
/// The minor format version this build writes (it reads every minor of
/// every major from [`OLDEST_MAJOR`] to [`FORMAT_MAJOR`]).
pub const FORMAT_MINOR: u16 = 0;
/// [`FORMAT_MAJOR`].[`FORMAT_MINOR`].
pub const FORMAT_VERSION: Version = Version {
    major: FORMAT_MAJOR,
    minor: FORMAT_MINOR,
};
/// Version 1.0, which this build still writes on request.
pub const FORMAT_V1: Version = Version { major: 1, minor: 0 };

/// Whether this build reads files of major version `major`.
pub fn reads_major(major: u16) -> bool {
    (OLDEST_MAJOR..=FORMAT_MAJOR).contains(&major)
}

/// Length of a v1 [`FileHeader`]. Later minors may write longer headers
/// (the length is in the header); readers skip what they do not know.
pub const FILE_HEADER_LEN: usize = 64;
/// Largest header length a reader accepts.
pub const MAX_FILE_HEADER_LEN: u32 = 4096;
/// Length of a [`BlockHeader`].
pub const BLOCK_HEADER_LEN: usize = 32;
/// Length of one entry of a block's page list.
pub const BLOCK_ENTRY_LEN: usize = 12;
/// Magic of every memory-image block.
pub const BLOCK_MAGIC: [u8; 4] = *b"MBLK";

/// Default number of pages per memory-image block (256 KiB of 4 KiB pages).
pub const DEFAULT_PAGES_PER_BLOCK: u16 = 64;
/// Most pages a block may hold.
pub const MAX_PAGES_PER_BLOCK: u16 = 4096;
/// Largest uncompressed block payload (pages per block × page size).
pub const MAX_BLOCK_PAYLOAD: u64 = 16 << 20;
/// Smallest page size.
pub const MIN_PAGE_SIZE: u32 = 4096;
/// Largest page size.
pub const MAX_PAGE_SIZE: u32 = 65536;
/// Most RAM blocks an image may describe.
pub const MAX_RAM_BLOCKS: usize = 4096;
/// Longest RAM block, trace section or disk name, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Largest manifest body.
pub const MAX_MANIFEST_LEN: u64 = 16 << 20;
/// Largest device-state blob.
pub const MAX_DEVICE_STATE_LEN: u64 = 1 << 30;
/// Most trace sections.
pub const MAX_TRACE_SECTIONS: u32 = 256;

/// Compression codec numbers stored in block headers and the block table.
/// v1 writes only [`COMPRESSION_NONE`].
pub const COMPRESSION_NONE: u8 = 0;
/// LZ4 block format (no frame), v2.
pub const COMPRESSION_LZ4: u8 = 1;
/// Zstandard (one frame per block), v2.
pub const COMPRESSION_ZSTD: u8 = 2;

/// Block flag (v2): the block holds pages the guest wrote while the
/// snapshot ran, in the order it first wrote them (a locality block of the
/// working set); blocks without it hold pages in guest-physical order.
pub const BLOCK_FLAG_HOT: u8 = 1;
/// Block flags a v2 reader knows.
pub const BLOCK_FLAGS_KNOWN: u8 = BLOCK_FLAG_HOT;

/// Index entry flag (v2): the page's bytes equal another page's, stored
/// once; `block`/`slot` name the slot that page owns (the block's page
/// list names the owner), and the entry's CRC equals the slot's.
pub const ENTRY_FLAG_DUP: u16 = 1;
/// Index entry flag (v2): the page's bytes are on a frozen disk of the
/// snapshot (a page of the guest's page cache): disk `slot` (its position
/// in the manifest's `disks`), byte offset `block × page_size` of the
/// disk as the guest sees it. Nothing of it is in `memory.img`.
pub const ENTRY_FLAG_DISK: u16 = 2;
/// Index entry flag (v2): the page's bytes equal the same page of the
/// parent snapshot (the manifest's `parent`), where they are read;
/// `block` is 0xFFFFFFFF and `slot` 0.
pub const ENTRY_FLAG_PARENT: u16 = 4;
/// Index entry flags a v2 reader knows.
pub const ENTRY_FLAGS_KNOWN: u16 = ENTRY_FLAG_DUP | ENTRY_FLAG_DISK | ENTRY_FLAG_PARENT;
/// Longest chain of parents a reader follows (a writer starts a full
/// snapshot well before: see `WriterOptions`).
pub const MAX_CHAIN_DEPTH: u32 = 64;

/// Index entry `block` value of a page that is not in the memory image.
pub const NO_BLOCK: u32 = u32::MAX;

/// A guest page: RAM block number (its position in the manifest's
/// `ram_blocks`) and page number within that RAM block (byte offset / page
/// size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageKey {
    /// Index into the manifest's RAM block list.
    pub ram_block: u32,
    /// Page number within the RAM block.
    pub page: u32,
}

impl PageKey {
    /// A page key.
    pub fn new(ram_block: u32, page: u32) -> Self {
        PageKey { ram_block, page }
    }
}

/// The kinds of file a snapshot directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileKind {
    /// `manifest`: header line + JSON.
    Manifest,
    /// `memory.img`: the blocks of non-zero pages.
    Memory,
    /// `pages.idx`: block table and page index.
    Index,
    /// `zero.bmp`: zero-page bitmaps.
    Zero,
    /// `device.bin`: the device-state blob.
    Device,
    /// `trace.bin`: page-access traces (the FAFL queue).
    Trace,
    /// `hashes.bin` (v2, optional): a 128-bit content hash per page, for
    /// incremental snapshots of the same VM.
    Hashes,
}

impl FileKind {
    /// The 8-byte magic of a binary file (the manifest has a text magic).
    pub fn magic(self) -> [u8; 8] {
        match self {
            FileKind::Manifest => *b"VMCSNAP-",
            FileKind::Memory => *b"VMCSNMEM",
            FileKind::Index => *b"VMCSNIDX",
            FileKind::Zero => *b"VMCSNZBM",
            FileKind::Device => *b"VMCSNDEV",
            FileKind::Trace => *b"VMCSNTRC",
            FileKind::Hashes => *b"VMCSNHSH",
        }
    }

    /// The file name v1 writers use.
    pub fn default_name(self) -> &'static str {
        match self {
            FileKind::Manifest => "manifest",
            FileKind::Memory => "memory.img",
            FileKind::Index => "pages.idx",
            FileKind::Zero => "zero.bmp",
            FileKind::Device => "device.bin",
            FileKind::Trace => "trace.bin",
            FileKind::Hashes => "hashes.bin",
        }
    }

    /// Human name, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            FileKind::Manifest => "manifest",
            FileKind::Memory => "memory image",
            FileKind::Index => "page index",
            FileKind::Zero => "zero-page bitmap",
            FileKind::Device => "device state",
            FileKind::Trace => "trace",
            FileKind::Hashes => "page hashes",
        }
    }
}

/// The common header of every binary file.
///
/// ```text
/// off len field
///   0   8 magic            per file kind
///   8   2 major            format major version
///  10   2 minor            format minor version
///  12   4 header_len       64 in v1; the CRC is its last 4 bytes
///  16  16 image_id         same in every file of one snapshot
///  32   8 body_len         bytes after the header
///  40   4 count            file-specific (blocks, RAM blocks, sections)
///  44   4 page_size        memory image and index; 0 elsewhere
///  48   4 flags            0 in v1; readers ignore unknown bits
///  52   4 body_crc         CRC32C of the body; 0 for the memory image
///  56   4 reserved         0
///  60   4 header_crc       CRC32C of bytes 0..header_len-4
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    /// The file's version.
    pub version: Version,
    /// Header length in bytes.
    pub header_len: u32,
    /// The snapshot's id.
    pub image_id: [u8; 16],
    /// Length of the body (everything after the header).
    pub body_len: u64,
    /// File-specific count.
    pub count: u32,
    /// Page size (memory image, index) or 0.
    pub page_size: u32,
    /// Flags (0 in v1).
    pub flags: u32,
    /// CRC32C of the body (0 for the memory image).
    pub body_crc: u32,
}

impl FileHeader {
    /// A v1 header.
    pub fn new(image_id: [u8; 16]) -> Self {
        FileHeader {
            version: FORMAT_VERSION,
            header_len: FILE_HEADER_LEN as u32,
            image_id,
            body_len: 0,
            count: 0,
            page_size: 0,
            flags: 0,
            body_crc: 0,
        }
    }

    /// Encodes a v1 (64-byte) header for `kind`.
    pub fn encode(&self, kind: FileKind) -> [u8; FILE_HEADER_LEN] {
        let mut b = [0u8; FILE_HEADER_LEN];
        b[0..8].copy_from_slice(&kind.magic());
        put_u16(&mut b, 8, self.version.major);
        put_u16(&mut b, 10, self.version.minor);
        put_u32(&mut b, 12, FILE_HEADER_LEN as u32);
        b[16..32].copy_from_slice(&self.image_id);
        put_u64(&mut b, 32, self.body_len);
        put_u32(&mut b, 40, self.count);
        put_u32(&mut b, 44, self.page_size);
        put_u32(&mut b, 48, self.flags);
        put_u32(&mut b, 52, self.body_crc);
        let crc = crc32c::crc32c(&b[..FILE_HEADER_LEN - 4]);
        put_u32(&mut b, FILE_HEADER_LEN - 4, crc);
        b
    }

    /// Reads the header length from the first 16 bytes, checking magic and
    /// major version first. Returns the version and the header length.
    pub fn preamble(
        file: &Path,
        kind: FileKind,
        b: &[u8],
        file_len: u64,
    ) -> Result<(Version, u32), ReadError> {
        let magic = kind.magic();
        if b.len() < 16 && magic.starts_with(&b[..b.len().min(8)]) {
            // Too short even for magic + version, and what is there is (a
            // prefix of) our magic: a truncated file.
            return Err(ReadError::Truncated {
                file: file.into(),
                expected: FILE_HEADER_LEN as u64,
                found: file_len,
            });
        }
        if b.len() < 8 || b[..8] != magic {
            return Err(ReadError::BadMagic {
                file: file.into(),
                expected: kind.describe(),
            });
        }
        let version = Version {
            major: get_u16(b, 8),
            minor: get_u16(b, 10),
        };
        if !reads_major(version.major) {
            return Err(ReadError::UnsupportedVersion {
                file: file.into(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let header_len = get_u32(b, 12);
        if header_len < FILE_HEADER_LEN as u32 || header_len > MAX_FILE_HEADER_LEN {
            return Err(ReadError::corrupt(
                file,
                format!("header length {header_len} is not sane"),
            ));
        }
        if u64::from(header_len) > file_len {
            return Err(ReadError::Truncated {
                file: file.into(),
                expected: u64::from(header_len),
                found: file_len,
            });
        }
        Ok((version, header_len))
    }

    /// Decodes a whole header (`b` is exactly `header_len` bytes, as
    /// returned by [`FileHeader::preamble`]).
    pub fn decode(file: &Path, kind: FileKind, b: &[u8], file_len: u64) -> Result<Self, ReadError> {
        let (version, header_len) = Self::preamble(file, kind, b, file_len)?;
        if b.len() != header_len as usize {
            return Err(ReadError::corrupt(
                file,
                "header length changed while reading",
            ));
        }
        let crc_at = b.len() - 4;
        let stored = get_u32(b, crc_at);
        if crc32c::crc32c(&b[..crc_at]) != stored {
            return Err(ReadError::BadCrc {
                file: file.into(),
                what: "file header".into(),
                block: None,
                offset: 0,
            });
        }
        let mut image_id = [0u8; 16];
        image_id.copy_from_slice(&b[16..32]);
        Ok(FileHeader {
            version,
            header_len,
            image_id,
            body_len: get_u64(b, 32),
            count: get_u32(b, 40),
            page_size: get_u32(b, 44),
            flags: get_u32(b, 48),
            body_crc: get_u32(b, 52),
        })
    }
}

/// The header of one memory-image block.
///
/// ```text
/// off len field
///   0   4 magic            "MBLK"
///   4   4 seq              block number, 0-based
///   8   2 page_count       1..=pages_per_block
///  10   1 compression      0 = none
///  11   1 flags            0 in v1
///  12   4 payload_len      stored payload bytes
///  16   4 raw_len          uncompressed payload bytes = page_count * page_size
///  20   8 reserved         0
///  28   4 crc              CRC32C of bytes 0..28, the page list and the payload
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// Block number.
    pub seq: u32,
    /// Pages in the block.
    pub page_count: u16,
    /// Compression codec.
    pub compression: u8,
    /// Flags (0 in v1).
    pub flags: u8,
    /// Stored payload length.
    pub payload_len: u32,
    /// Uncompressed payload length.
    pub raw_len: u32,
    /// The block CRC.
    pub crc: u32,
}

impl BlockHeader {
    /// Encodes the header; `crc` is written as given.
    pub fn encode(&self) -> [u8; BLOCK_HEADER_LEN] {
        let mut b = [0u8; BLOCK_HEADER_LEN];
        b[0..4].copy_from_slice(&BLOCK_MAGIC);
        put_u32(&mut b, 4, self.seq);
        put_u16(&mut b, 8, self.page_count);
        b[10] = self.compression;
        b[11] = self.flags;
        put_u32(&mut b, 12, self.payload_len);
        put_u32(&mut b, 16, self.raw_len);
        put_u32(&mut b, 28, self.crc);
        b
    }

    /// Decodes a header; `None` if the magic is wrong.
    pub fn decode(b: &[u8; BLOCK_HEADER_LEN]) -> Option<Self> {
        if b[0..4] != BLOCK_MAGIC {
            return None;
        }
        Some(BlockHeader {
            seq: get_u32(b, 4),
            page_count: get_u16(b, 8),
            compression: b[10],
            flags: b[11],
            payload_len: get_u32(b, 12),
            raw_len: get_u32(b, 16),
            crc: get_u32(b, 28),
        })
    }
}

/// Checks a page size: a power of two in [`MIN_PAGE_SIZE`]..=[`MAX_PAGE_SIZE`].
pub fn valid_page_size(page_size: u32) -> bool {
    page_size.is_power_of_two() && (MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size)
}

/// Pages needed to hold `len` bytes, or `None` if more than `u32::MAX`.
pub fn pages_for(len: u64, page_size: u32) -> Option<u32> {
    let ps = u64::from(page_size);
    u32::try_from(len.checked_add(ps - 1)? / ps).ok()
}

/// Rounds `n` up to a multiple of 8.
pub fn pad8(n: u64) -> u64 {
    (n + 7) & !7
}

/// True if every byte of `data` is zero (vectorises well).
pub fn is_zero(data: &[u8]) -> bool {
    let mut chunks = data.chunks_exact(32);
    let all = chunks.by_ref().all(|c| {
        let mut acc = 0u64;
        for w in c.chunks_exact(8) {
            acc |= u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        }
        acc == 0
    });
    all && chunks.remainder().iter().all(|&b| b == 0)
}

pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
/// Callers guarantee `at + 2 <= b.len()`.
pub(crate) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
/// Callers guarantee `at + 4 <= b.len()`.
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
/// Callers guarantee `at + 8 <= b.len()`.
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_crc() {
        let mut h = FileHeader::new([7; 16]);
        h.body_len = 123;
        h.count = 4;
        h.page_size = 4096;
        h.body_crc = 0xdead_beef;
        let b = h.encode(FileKind::Index);
        let p = Path::new("x");
        assert_eq!(FileHeader::decode(p, FileKind::Index, &b, 1000).unwrap(), h);
        assert!(matches!(
            FileHeader::decode(p, FileKind::Memory, &b, 1000),
            Err(ReadError::BadMagic { .. })
        ));
        let mut bad = b;
        bad[33] ^= 1;
        assert!(matches!(
            FileHeader::decode(p, FileKind::Index, &bad, 1000),
            Err(ReadError::BadCrc { .. })
        ));
        let mut v3 = b;
        v3[8] = 3;
        assert!(matches!(
            FileHeader::decode(p, FileKind::Index, &v3, 1000),
            Err(ReadError::UnsupportedVersion { .. })
        ));
    }

    #[test]
    fn zero_detection() {
        let mut p = vec![0u8; 4096];
        assert!(is_zero(&p));
        p[4095] = 1;
        assert!(!is_zero(&p));
        p[4095] = 0;
        p[0] = 1;
        assert!(!is_zero(&p));
        assert!(is_zero(&[0u8; 5]));
        assert!(!is_zero(&[0, 0, 0, 0, 9]));
    }

    #[test]
    fn page_math() {
        assert_eq!(pages_for(0, 4096), Some(0));
        assert_eq!(pages_for(1, 4096), Some(1));
        assert_eq!(pages_for(8192, 4096), Some(2));
        assert_eq!(pages_for(u64::MAX, 4096), None);
        assert_eq!(pad8(9), 16);
        assert!(valid_page_size(4096) && !valid_page_size(4095) && !valid_page_size(1 << 20));
    }
}
