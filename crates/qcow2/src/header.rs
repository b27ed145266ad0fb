//! The qcow2 header (versions 2 and 3) and its extensions, checked against
//! the file's length. All qcow2 integers are big-endian.
//!
//! Layout (docs/interop/qcow2.txt in QEMU's source): magic `QFI\xfb`,
//! version, backing file offset and length, cluster bits, virtual size,
//! encryption method, L1 size and offset, refcount table, snapshots; v3
//! adds feature bit masks, the refcount order, the header length and the
//! compression type. Header extensions follow the header inside cluster 0.

use std::path::Path;

use crate::error::DiskError;

/// The magic at offset 0.
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// Smallest and largest cluster size QEMU accepts (512 B .. 2 MiB).
const CLUSTER_BITS: std::ops::RangeInclusive<u32> = 9..=21;
/// QEMU's limit on the L1 table (32 MiB).
const MAX_L1_BYTES: u64 = 32 << 20;
/// QEMU's limit on a backing file name.
const MAX_BACKING_NAME: u32 = 1023;
/// v2 header length.
const V2_LEN: usize = 72;
/// v3 header length without the compression type.
const V3_MIN_LEN: usize = 104;

/// Incompatible feature bits (v3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;

/// Header extension types.
const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xE279_2ACA;

/// What the reader needs from a qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    /// Virtual size in bytes.
    pub size: u64,
    pub l1_entries: u32,
    pub l1_offset: u64,
    /// 0 = zlib (deflate), 1 = zstd: for compressed clusters.
    pub compression_type: u8,
    pub backing_file: Option<String>,
    /// The backing format extension (`qcow2`, `raw`), if present.
    pub backing_format: Option<String>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(x)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

impl Header {
    /// Parses `head` (the first cluster of the file, or the whole file if
    /// shorter) of a file of `file_len` bytes.
    pub fn parse(path: &Path, head: &[u8], file_len: u64) -> Result<Header, DiskError> {
        let bad = |what: String| Err(DiskError::corrupt(path, what));
        if head.len() < V2_LEN {
            return bad(format!(
                "{} bytes is too short for a qcow2 header",
                head.len()
            ));
        }
        if head[..4] != MAGIC {
            return bad("no qcow2 magic".into());
        }
        let version = be32(head, 4);
        if !(2..=3).contains(&version) {
            return Err(DiskError::unsupported(
                path,
                format!("qcow2 version {version} (only 2 and 3 exist)"),
            ));
        }
        let backing_offset = be64(head, 8);
        let backing_len = be32(head, 16);
        let cluster_bits = be32(head, 20);
        let size = be64(head, 24);
        let crypt = be32(head, 32);
        let l1_entries = be32(head, 36);
        let l1_offset = be64(head, 40);
        if !CLUSTER_BITS.contains(&cluster_bits) {
            return bad(format!("cluster bits {cluster_bits} (QEMU uses 9 to 21)"));
        }
        let cluster = 1u64 << cluster_bits;
        if crypt != 0 {
            return Err(DiskError::unsupported(
                path,
                format!("encryption (method {crypt})"),
            ));
        }
        let (mut ext_at, mut compression_type) = (V2_LEN, 0u8);
        if version == 3 {
            if head.len() < V3_MIN_LEN {
                return bad("too short for a qcow2 version 3 header".into());
            }
            let incompat = be64(head, 72);
            let header_len = be32(head, 100) as usize;
            if header_len < V3_MIN_LEN || header_len as u64 > cluster || header_len > head.len() {
                return bad(format!("header length {header_len} is out of range"));
            }
            if incompat & INCOMPAT_CORRUPT != 0 {
                return bad(
                    "QEMU marked the image corrupt (repair it with `qemu-img check -r all`)".into(),
                );
            }
            if incompat & INCOMPAT_DATA_FILE != 0 {
                return Err(DiskError::unsupported(path, "an external data file"));
            }
            if incompat & INCOMPAT_EXTL2 != 0 {
                return Err(DiskError::unsupported(
                    path,
                    "extended L2 entries (subclusters)",
                ));
            }
            let known = INCOMPAT_DIRTY
                | INCOMPAT_CORRUPT
                | INCOMPAT_DATA_FILE
                | INCOMPAT_COMPRESSION
                | INCOMPAT_EXTL2;
            if incompat & !known != 0 {
                return Err(DiskError::unsupported(
                    path,
                    format!("unknown incompatible features {:#x}", incompat & !known),
                ));
            }
            if incompat & INCOMPAT_COMPRESSION != 0 {
                if header_len <= V3_MIN_LEN {
                    return bad(
                        "the compression type bit is set but the header has no compression type"
                            .into(),
                    );
                }
                compression_type = head[V3_MIN_LEN];
            }
            ext_at = header_len;
        }
        // The L1 table covers the virtual size and lies inside the file.
        let l2_entries = cluster / 8;
        let per_l1 = cluster * l2_entries;
        let needed = size.div_ceil(per_l1);
        let l1_bytes = u64::from(l1_entries) * 8;
        if u64::from(l1_entries) < needed {
            return bad(format!(
                "L1 table of {l1_entries} entries is too small for {size} bytes"
            ));
        }
        if l1_bytes > MAX_L1_BYTES {
            return bad(format!(
                "L1 table of {l1_entries} entries is larger than QEMU allows"
            ));
        }
        if l1_entries > 0
            && (l1_offset % cluster != 0
                || l1_offset
                    .checked_add(l1_bytes)
                    .is_none_or(|end| end > file_len))
        {
            return bad(format!(
                "L1 table at {l1_offset} ({l1_bytes} bytes) is misaligned or past the end of the file ({file_len} bytes)"
            ));
        }
        let backing_file = if backing_offset != 0 {
            if backing_len == 0 || backing_len > MAX_BACKING_NAME {
                return bad(format!("backing file name length {backing_len}"));
            }
            let end = backing_offset.checked_add(u64::from(backing_len));
            match end {
                Some(end) if end <= head.len() as u64 => {}
                _ => return bad("backing file name is outside the first cluster".into()),
            }
            let raw = &head[backing_offset as usize..end.unwrap_or(0) as usize];
            match std::str::from_utf8(raw) {
                Ok(s) => Some(s.to_string()),
                Err(_) => return bad("backing file name is not UTF-8".into()),
            }
        } else {
            None
        };
        let backing_format = parse_extensions(path, head, ext_at)?;
        Ok(Header {
            version,
            cluster_bits,
            size,
            l1_entries,
            l1_offset,
            compression_type,
            backing_file,
            backing_format,
        })
    }
}

/// Walks the header extensions from `at`; returns the backing format.
fn parse_extensions(path: &Path, head: &[u8], mut at: usize) -> Result<Option<String>, DiskError> {
    let mut backing_format = None;
    // Every extension takes at least 8 bytes: the walk is bounded by the
    // first cluster.
    while at + 8 <= head.len() {
        let kind = be32(head, at);
        let len = be32(head, at + 4) as usize;
        if kind == EXT_END {
            break;
        }
        let data = at + 8;
        if len > head.len() - data {
            return Err(DiskError::corrupt(
                path,
                format!("header extension {kind:#x} at {at} runs past the first cluster"),
            ));
        }
        if kind == EXT_BACKING_FORMAT {
            let s = String::from_utf8_lossy(&head[data..data + len]).into_owned();
            backing_format = Some(s);
        }
        at = data + len.div_ceil(8) * 8;
    }
    Ok(backing_format)
}
