//! The manifest: a one-line text header followed by a JSON body.
//!
//! ```text
//! VMCSNAP-MANIFEST 1.0 len=1234 crc32c=1a2b3c4d\n
//! { ...pretty JSON, exactly len bytes, CRC32C crc32c... }
//! ```
//!
//! The header line is frozen for all versions: magic, `major.minor`, body
//! length in decimal and the body's CRC32C in 8 lowercase hex digits,
//! separated by single spaces. `tail -n +2 manifest | jq .` shows the body.
//! Readers ignore JSON fields they do not know; fields added in later minor
//! versions are optional.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ReadError, Version};
use crate::fileio::{open_file, read_at, read_vec_at};
use crate::format::{
    pages_for, reads_major, valid_page_size, FileKind, FORMAT_VERSION, MAX_BLOCK_PAYLOAD,
    MAX_CHAIN_DEPTH, MAX_MANIFEST_LEN, MAX_NAME_LEN, MAX_PAGES_PER_BLOCK, MAX_RAM_BLOCKS,
};

/// The text magic at the start of a manifest (followed by a space).
pub const MANIFEST_MAGIC: &str = "VMCSNAP-MANIFEST";
/// Longest manifest header line a reader looks at, newline included.
pub const MAX_MANIFEST_HEADER: usize = 96;

/// Everything about a snapshot except the bulk data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// 32 hex digits; the same id is in the header of every binary file.
    pub image_id: String,
    /// When the snapshot was committed (Unix time, milliseconds).
    pub created_unix_ms: u64,
    /// The VM.
    pub vm: VmInfo,
    /// The QEMU that produced the state.
    pub qemu: QemuInfo,
    /// Guest page size in bytes.
    pub page_size: u32,
    /// Most pages per memory-image block the writer used.
    pub pages_per_block: u16,
    /// Number of memory-image blocks.
    pub blocks: u32,
    /// Guest RAM blocks, in the order page keys refer to them.
    pub ram_blocks: Vec<RamBlock>,
    /// Disks frozen with the snapshot.
    #[serde(default)]
    pub disks: Vec<DiskRef>,
    /// What the device-state blob is (e.g. `"qemu-migration-stream"`).
    #[serde(default)]
    pub device_state_format: String,
    /// The data files, by role.
    pub files: Files,
    /// Measurements of the snapshot.
    #[serde(default)]
    pub metrics: Metrics,
    /// Free-form labels (e.g. cluster snapshot id).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// How the memory image is stored (v2; absent in v1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<Storage>,
    /// The snapshot this one is incremental to (v2): pages flagged "in
    /// parent" are read there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentRef>,
}

/// The parent of an incremental snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentRef {
    /// The parent's directory name, a sibling of this snapshot's
    /// directory (relative: the pair can move together).
    pub name: String,
    /// The parent's image id: a different snapshot under that name is
    /// refused, never read.
    pub image_id: String,
    /// How many parents lie behind this snapshot (1: the parent is full).
    pub depth: u32,
}

/// How a v2 memory image is stored: codec, locality and savings. Written by
/// the writer, informational (the block table is what readers trust).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Storage {
    /// Compression asked for (`none`, `lz4`, `zstd`); each block names
    /// the codec it actually used.
    pub codec: String,
    /// Blocks of pages the guest wrote during the snapshot.
    #[serde(default)]
    pub blocks_hot: u32,
    /// Blocks stored compressed.
    #[serde(default)]
    pub blocks_compressed: u32,
    /// Blocks stored raw because every compression worker was busy (the
    /// capture never waits for compression).
    #[serde(default)]
    pub blocks_raw_fallback: u32,
    /// Pages whose bytes equal another page's, stored once.
    #[serde(default)]
    pub pages_duplicate: u64,
    /// Pages equal to the parent snapshot's (incremental snapshots).
    #[serde(default)]
    pub pages_in_parent: u64,
    /// Pages found on a frozen disk (the guest's page cache).
    #[serde(default)]
    pub pages_on_disk: u64,
    /// Bytes of the stored pages before compression.
    #[serde(default)]
    pub payload_raw_bytes: u64,
    /// Bytes of the stored pages as stored.
    #[serde(default)]
    pub payload_stored_bytes: u64,
}

/// The VM a snapshot is of.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct VmInfo {
    /// VM name.
    pub name: String,
    /// The VM's configuration, opaque to this crate (the cluster spec's VM).
    #[serde(default)]
    pub config: Value,
}

/// The QEMU that produced the device state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct QemuInfo {
    /// QEMU version, e.g. `"8.2.2"`.
    pub version: String,
    /// Machine type, e.g. `"microvm"` or `"pc-q35-8.2"`.
    pub machine: String,
}

/// One guest RAM block, as named in the QEMU migration stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamBlock {
    /// The block's id string (e.g. `"pc.ram"`, `"mem"`).
    pub name: String,
    /// Used length in bytes.
    pub used_length: u64,
}

/// A disk frozen with the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DiskRef {
    /// Device or block node name (e.g. `"disk0"`).
    pub node: String,
    /// Path of the image holding the disk as of the snapshot.
    pub path: String,
    /// Image format (e.g. `"qcow2"`).
    #[serde(default)]
    pub format: String,
    /// Anything else later versions record.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// A data file of the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRef {
    /// Plain file name inside the snapshot directory.
    pub name: String,
    /// Exact size in bytes.
    pub size: u64,
}

/// The data files, by role. Later minors may add roles (ignored by older
/// readers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Files {
    /// The memory image.
    pub memory: FileRef,
    /// The page index.
    pub index: FileRef,
    /// The zero-page bitmaps.
    pub zero: FileRef,
    /// The device state.
    pub device: FileRef,
    /// The traces.
    pub trace: FileRef,
    /// The page hashes (v2, optional: a parent for incremental snapshots
    /// needs them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hashes: Option<FileRef>,
}

impl Files {
    /// `(kind, file)` for every role present.
    pub fn all(&self) -> Vec<(FileKind, &FileRef)> {
        let mut v = vec![
            (FileKind::Memory, &self.memory),
            (FileKind::Index, &self.index),
            (FileKind::Zero, &self.zero),
            (FileKind::Device, &self.device),
            (FileKind::Trace, &self.trace),
        ];
        v.extend(self.hashes.as_ref().map(|h| (FileKind::Hashes, h)));
        v
    }
}

/// Per-snapshot measurements. Every field is optional; unknown ones are
/// kept in `other`, so later work adds metrics without a format change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Metrics {
    /// How long the guest was paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_ms: Option<u64>,
    /// Snapshot start to commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Bytes of the data files (everything but the manifest). Set by the writer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_written: Option<u64>,
    /// Guest pages covered (stored + zero). Set by the writer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_total: Option<u64>,
    /// Zero pages. Set by the writer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_zero: Option<u64>,
    /// Pages the guest wrote during the snapshot (defaults to the FAFL trace length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_guest_written: Option<u64>,
    /// How long the disk snapshot took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_snapshot_ms: Option<u64>,
    /// The pause broken into its parts (absent in older snapshots; readers
    /// that predate it keep it in `other`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<PauseBreakdown>,
    /// Any other metric (e.g. a sampled working-set size).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// A snapshot's pause, from QEMU's `STOP` event to its `RESUME` event,
/// broken into consecutive parts measured on QEMU's event clock and the
/// agent's (both the host's wall clock). The parts add up to `total_us`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PauseBreakdown {
    /// The measured pause, µs.
    pub total_us: u64,
    /// Its parts, in the order they happened.
    pub parts: Vec<PausePart>,
}

/// One part of a pause. Names are documented in docs/snapshot.md ("Where
/// the pause goes"); a reader shows names it does not know as they are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausePart {
    /// What happened in it, e.g. `disk_snapshot`.
    pub name: String,
    /// How long, µs.
    pub us: u64,
}

impl PauseBreakdown {
    /// The sum of the parts, µs.
    pub fn parts_us(&self) -> u64 {
        self.parts.iter().map(|p| p.us).sum()
    }

    /// The part named `name`, µs (0 if absent).
    pub fn part_us(&self, name: &str) -> u64 {
        self.parts
            .iter()
            .filter(|p| p.name == name)
            .map(|p| p.us)
            .sum()
    }
}

/// A plain file name: no separators, not `.`/`..`, not empty, not too long.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
}

impl Manifest {
    /// The image id as bytes.
    pub fn image_id_bytes(&self) -> Option<[u8; 16]> {
        let s = self.image_id.as_bytes();
        if s.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, o) in out.iter_mut().enumerate() {
            let hex = std::str::from_utf8(&s[2 * i..2 * i + 2]).ok()?;
            *o = u8::from_str_radix(hex, 16).ok()?;
        }
        Some(out)
    }

    /// Pages of RAM block `i` (its used length rounded up to pages).
    pub fn ram_block_pages(&self, i: usize) -> u32 {
        self.ram_blocks
            .get(i)
            .and_then(|rb| pages_for(rb.used_length, self.page_size))
            .unwrap_or(0)
    }

    /// Checks everything the rest of the reader relies on.
    pub fn validate(&self, file: &Path) -> Result<(), ReadError> {
        let bad = |what: String| Err(ReadError::corrupt(file, what));
        if self.image_id_bytes().is_none() {
            return bad(format!("image_id {:?} is not 32 hex digits", self.image_id));
        }
        if !valid_page_size(self.page_size) {
            return bad(format!(
                "page_size {} is not a power of two in 4096..=65536",
                self.page_size
            ));
        }
        if self.pages_per_block == 0
            || self.pages_per_block > MAX_PAGES_PER_BLOCK
            || u64::from(self.pages_per_block) * u64::from(self.page_size) > MAX_BLOCK_PAYLOAD
        {
            return bad(format!(
                "pages_per_block {} is out of range",
                self.pages_per_block
            ));
        }
        if self.ram_blocks.len() > MAX_RAM_BLOCKS {
            return bad(format!(
                "{} RAM blocks (at most {MAX_RAM_BLOCKS})",
                self.ram_blocks.len()
            ));
        }
        for (i, rb) in self.ram_blocks.iter().enumerate() {
            if rb.name.is_empty() || rb.name.len() > MAX_NAME_LEN {
                return bad(format!("RAM block {i} has an empty or overlong name"));
            }
            if pages_for(rb.used_length, self.page_size).is_none() {
                return bad(format!(
                    "RAM block {:?} is too large ({} bytes)",
                    rb.name, rb.used_length
                ));
            }
            if self.ram_blocks[..i].iter().any(|o| o.name == rb.name) {
                return bad(format!("RAM block name {:?} appears twice", rb.name));
            }
        }
        if let Some(p) = &self.parent {
            if !is_plain_name(&p.name) || p.name.starts_with('.') {
                return bad(format!("parent name {:?} is not a plain name", p.name));
            }
            if p.depth == 0 || p.depth > MAX_CHAIN_DEPTH {
                return bad(format!("parent chain depth {} is out of range", p.depth));
            }
        }
        for (kind, f) in self.files.all() {
            if !is_plain_name(&f.name) || f.name == FileKind::Manifest.default_name() {
                return bad(format!(
                    "{} file name {:?} is not a plain file name",
                    kind.describe(),
                    f.name
                ));
            }
        }
        Ok(())
    }

    /// Encodes header line + JSON body, as version [`FORMAT_VERSION`].
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(FORMAT_VERSION)
    }

    /// Encodes header line + JSON body with `version` in the header line.
    pub fn encode_as(&self, version: Version) -> Vec<u8> {
        // Serialising plain data to JSON cannot fail (string keys only).
        let mut body = serde_json::to_vec_pretty(self).unwrap_or_default();
        body.push(b'\n');
        let crc = crc32c::crc32c(&body);
        let mut out = format!(
            "{MANIFEST_MAGIC} {}.{} len={} crc32c={crc:08x}\n",
            version.major,
            version.minor,
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(&body);
        out
    }

    /// Parses the header line from the first bytes of the file. Returns
    /// the version, header length, body length and body CRC.
    pub fn decode_header(
        file: &Path,
        head: &[u8],
        file_len: u64,
    ) -> Result<(Version, usize, u64, u32), ReadError> {
        let magic = format!("{MANIFEST_MAGIC} ");
        let n = head.len().min(magic.len());
        if head[..n] != magic.as_bytes()[..n] {
            return Err(ReadError::BadMagic {
                file: file.into(),
                expected: "manifest",
            });
        }
        let Some(nl) = head.iter().position(|&c| c == b'\n') else {
            if head.len() < MAX_MANIFEST_HEADER && (head.len() as u64) == file_len {
                return Err(ReadError::Truncated {
                    file: file.into(),
                    expected: file_len + 1,
                    found: file_len,
                });
            }
            return Err(ReadError::corrupt(
                file,
                "manifest header line is not terminated",
            ));
        };
        let line = std::str::from_utf8(&head[magic.len()..nl])
            .map_err(|_| ReadError::corrupt(file, "manifest header line is not text"))?;
        let bad =
            || ReadError::corrupt(file, format!("manifest header line {line:?} is malformed"));
        let mut parts = line.split(' ');
        let ver = parts.next().ok_or_else(bad)?;
        let (maj, min) = ver.split_once('.').ok_or_else(bad)?;
        let version = Version {
            major: maj.parse().map_err(|_| bad())?,
            minor: min.parse().map_err(|_| bad())?,
        };
        if !reads_major(version.major) {
            return Err(ReadError::UnsupportedVersion {
                file: file.into(),
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let len: u64 = parts
            .next()
            .and_then(|p| p.strip_prefix("len="))
            .and_then(|p| p.parse().ok())
            .ok_or_else(bad)?;
        let crc = parts
            .next()
            .and_then(|p| p.strip_prefix("crc32c="))
            .filter(|p| p.len() == 8)
            .and_then(|p| u32::from_str_radix(p, 16).ok())
            .ok_or_else(bad)?;
        if len > MAX_MANIFEST_LEN {
            return Err(ReadError::corrupt(
                file,
                format!("manifest body length {len} is not sane"),
            ));
        }
        Ok((version, nl + 1, len, crc))
    }

    /// Reads, decodes and validates the manifest file at `path`, reading
    /// no more than its header line declares (bounded by the file size).
    pub fn load(path: &Path) -> Result<(Version, Manifest), ReadError> {
        let (file, len) = open_file(path)?;
        let mut head = vec![0u8; len.min(MAX_MANIFEST_HEADER as u64) as usize];
        read_at(&file, path, &mut head, 0)?;
        let (_, hlen, body_len, _) = Self::decode_header(path, &head, len)?;
        let expected = hlen as u64 + body_len;
        if len < expected {
            return Err(ReadError::Truncated {
                file: path.into(),
                expected,
                found: len,
            });
        }
        if len > expected {
            return Err(ReadError::corrupt(
                path,
                format!("{} bytes after the manifest body", len - expected),
            ));
        }
        let data = read_vec_at(&file, path, len, 0)?;
        Self::decode(path, &data)
    }

    /// Decodes and validates a whole manifest file.
    pub fn decode(file: &Path, data: &[u8]) -> Result<(Version, Manifest), ReadError> {
        let head = &data[..data.len().min(MAX_MANIFEST_HEADER)];
        let (version, hlen, len, crc) = Self::decode_header(file, head, data.len() as u64)?;
        let expected = hlen as u64 + len;
        let found = data.len() as u64;
        if found < expected {
            return Err(ReadError::Truncated {
                file: file.into(),
                expected,
                found,
            });
        }
        if found > expected {
            return Err(ReadError::corrupt(
                file,
                format!("{} bytes after the manifest body", found - expected),
            ));
        }
        let body = &data[hlen..];
        if crc32c::crc32c(body) != crc {
            return Err(ReadError::BadCrc {
                file: file.into(),
                what: "manifest body".into(),
                block: None,
                offset: hlen as u64,
            });
        }
        let m: Manifest = serde_json::from_slice(body)
            .map_err(|e| ReadError::corrupt(file, format!("manifest JSON: {e}")))?;
        m.validate(file)?;
        Ok((version, m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_keep_unknown_fields() {
        let j = r#"{"downtime_ms": 3, "wss_sampled_pages": 1234, "ratio": 0.5}"#;
        let m: Metrics = serde_json::from_str(j).unwrap();
        assert_eq!(m.downtime_ms, Some(3));
        assert_eq!(m.other["wss_sampled_pages"], 1234);
        let back = serde_json::to_value(&m).unwrap();
        assert_eq!(back["ratio"], 0.5);
        assert!(back.get("duration_ms").is_none());
    }

    #[test]
    fn header_line_parsing() {
        let p = Path::new("m");
        let ok = b"VMCSNAP-MANIFEST 1.7 len=12 crc32c=0000abcd\n";
        let (v, hl, len, crc) = Manifest::decode_header(p, ok, 100).unwrap();
        assert_eq!(
            (v.major, v.minor, hl, len, crc),
            (1, 7, ok.len(), 12, 0xabcd)
        );
        let v2 = b"VMCSNAP-MANIFEST 2.3 len=12 crc32c=0000abcd\n";
        assert_eq!(Manifest::decode_header(p, v2, 100).unwrap().0.major, 2);
        let v3 = b"VMCSNAP-MANIFEST 3.0 len=12 crc32c=0000abcd\n";
        assert!(matches!(
            Manifest::decode_header(p, v3, 100),
            Err(ReadError::UnsupportedVersion { .. })
        ));
        assert!(matches!(
            Manifest::decode_header(p, b"{\"json\": 1}\n", 100),
            Err(ReadError::BadMagic { .. })
        ));
        assert!(matches!(
            Manifest::decode_header(p, b"VMCSNAP-MANIFEST 1.0 len=", 25),
            Err(ReadError::Truncated { .. })
        ));
        assert!(matches!(
            Manifest::decode_header(p, b"VMCSNAP-MANIFEST 1.0 len=x crc32c=1\n", 100),
            Err(ReadError::Corrupt { .. })
        ));
    }
}
