//! The channel-state file of a cluster snapshot (`channel-state.bin`): the
//! Ethernet frames vmcsnap's switch logged at the cut.
//!
//! A frame is logged when it crosses the cut: sent by a VM before that VM's
//! cut and delivered to another VM after the receiver's cut. Restoring the
//! cluster replays these frames; `docs/cluster-snapshot.md` explains how
//! they are used (and the per-pair counts W(i,j) the cluster manifest keeps).
//!
//! ```text
//! channel-state.bin
//! +------------------------+----------------------------------+-----+------------------+
//! | header (24)            | record 0                         | ... | trailer (28)     |
//! |  "VMCSCHAN"            |  "CHFR"                          |     |  "VMCSCEND"      |
//! |  major u16, minor u16  |  sender: len u8 + 1..=64 bytes   |     |  records u64     |
//! |  header_len u32 = 24   |  receiver: len u8 + 1..=64 bytes |     |  frame_bytes u64 |
//! |  flags u32 = 0         |  received_unix_us u64            |     |  CRC32C of bytes |
//! |  CRC32C of bytes 0..20 |  delivered_unix_us u64           |     |   0..24          |
//! |                        |  reason u8: 1 held-at-cut,       |     |                  |
//! |                        |            2 in-flight           |     |                  |
//! |                        |  frame_len u32, frame bytes      |     |                  |
//! |                        |  CRC32C of the record up to here |     |                  |
//! +------------------------+----------------------------------+-----+------------------+
//! ```
//!
//! Header (24 bytes in v1.0):
//!
//! ```text
//! off len field
//!   0   8 magic        "VMCSCHAN"
//!   8   2 major        1
//!  10   2 minor        0
//!  12   4 header_len   24; a later minor may write a longer header (readers accept
//!                      24..=4096 and skip what they do not know)
//!  16   4 flags        0; readers ignore bits they do not know
//!  20   4 header_crc   CRC32C of bytes 0..header_len-4 (always the header's last 4 bytes)
//! ```
//!
//! Record (31 bytes + names + frame):
//!
//! ```text
//! off      len field
//!   0        4 magic              "CHFR"
//!   4        1 s = sender_len     1..=64
//!   5        s sender             UTF-8 VM name (see [`is_vm_name`])
//!   5+s      1 r = receiver_len   1..=64
//!   6+s      r receiver           UTF-8 VM name
//!   6+s+r    8 received_unix_us   when the switch received the frame from the sender
//!  14+s+r    8 delivered_unix_us  when the switch delivered it to the receiver
//!  22+s+r    1 reason             1 = held-at-cut, 2 = in-flight
//!  23+s+r    4 n = frame_len      0..=1 MiB
//!  27+s+r    n frame              the Ethernet frame as the switch forwarded it
//!  27+s+r+n  4 crc                CRC32C of bytes 0..27+s+r+n of the record
//! ```
//!
//! Trailer (28 bytes):
//!
//! ```text
//! off len field
//!   0   8 magic        "VMCSCEND"
//!   8   8 records      number of records
//!  16   8 frame_bytes  sum of frame_len over all records
//!  24   4 crc          CRC32C of bytes 0..24 of the trailer
//! ```
//!
//! Integers are little-endian. A reader tells a record from the trailer by
//! its first four bytes (`CHFR` or `VMCS`). The file ends right after the
//! trailer; a file without a trailer is truncated. Every byte is under a
//! CRC32C; every length is checked against a fixed limit and against the
//! bytes that remain before anything is allocated, so
//! [`parse_channel_log`] never panics and allocates at most about what its
//! input holds.
//!
//! [`is_vm_name`]: crate::cluster::is_vm_name

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::cluster::{is_vm_name, CHANNEL_LOG, MAX_VM_NAME_LEN};
use crate::error::Version;
use crate::fileio::sync_dir;

/// Magic at the start of a channel-state file.
pub const CHANNEL_MAGIC: [u8; 8] = *b"VMCSCHAN";
/// Magic at the start of every record.
pub const RECORD_MAGIC: [u8; 4] = *b"CHFR";
/// Magic at the start of the trailer.
pub const TRAILER_MAGIC: [u8; 8] = *b"VMCSCEND";
/// The major version of the channel-state file this build writes and reads.
pub const CHANNEL_LOG_MAJOR: u16 = 1;
/// The minor version this build writes (it reads every minor of
/// [`CHANNEL_LOG_MAJOR`]).
pub const CHANNEL_LOG_MINOR: u16 = 0;
/// [`CHANNEL_LOG_MAJOR`].[`CHANNEL_LOG_MINOR`].
pub const CHANNEL_LOG_VERSION: Version = Version {
    major: CHANNEL_LOG_MAJOR,
    minor: CHANNEL_LOG_MINOR,
};
/// Length of the v1.0 header.
pub const CHANNEL_HEADER_LEN: usize = 24;
/// Largest header length a reader accepts.
pub const MAX_CHANNEL_HEADER_LEN: usize = 4096;
/// Length of the trailer.
pub const CHANNEL_TRAILER_LEN: usize = 28;
/// Bytes of a record besides its names and frame.
pub const RECORD_OVERHEAD: usize = 4 + 1 + 1 + 8 + 8 + 1 + 4 + 4;
/// Largest frame a record may hold (1 MiB; the switch forwards at most
/// 69632 bytes, QEMU's `NET_BUFSIZE`).
pub const MAX_FRAME_LEN: usize = 1 << 20;
/// Size of a channel-state file holding no frames.
pub const EMPTY_CHANNEL_LOG_LEN: u64 = (CHANNEL_HEADER_LEN + CHANNEL_TRAILER_LEN) as u64;

/// Why a frame was logged at the cut. Stored as one byte; JSON uses the
/// kebab-case names (`"held-at-cut"`, `"in-flight"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum FrameReason {
    /// The receiver's port was held for its cut: the switch queued the
    /// frame and delivered it when the port was released.
    HeldAtCut = 1,
    /// The frame was in transit across the cut: sent before the sender's
    /// cut, delivered after the receiver's.
    InFlight = 2,
}

impl FrameReason {
    /// The byte stored in a record.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The reason stored as `code`, if this build knows it.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(FrameReason::HeldAtCut),
            2 => Some(FrameReason::InFlight),
            _ => None,
        }
    }

    /// The kebab-case name (as in JSON).
    pub fn name(self) -> &'static str {
        match self {
            FrameReason::HeldAtCut => "held-at-cut",
            FrameReason::InFlight => "in-flight",
        }
    }
}

impl fmt::Display for FrameReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One frame logged at the cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelFrame {
    /// The VM that sent the frame.
    pub sender: String,
    /// The VM the switch delivered it to.
    pub receiver: String,
    /// When the switch received it from the sender (Unix time, µs).
    pub received_unix_us: u64,
    /// When the switch delivered it to the receiver (Unix time, µs).
    pub delivered_unix_us: u64,
    /// Why it was logged.
    pub reason: FrameReason,
    /// The Ethernet frame.
    pub data: Vec<u8>,
}

/// What [`write_channel_log`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChannelLogSummary {
    /// Number of frames (records).
    pub frames: u64,
    /// Sum of the frames' lengths.
    pub bytes: u64,
    /// Size of the file.
    pub file_size: u64,
}

/// Why reading or writing a channel-state file failed. Every variant that
/// is about the file's content names the file and the byte offset.
/// ([`parse_channel_log`] names the file `channel-state.bin`.)
#[derive(Debug, Error)]
pub enum ChannelLogError {
    /// The file does not exist.
    #[error(
        "{file}: missing; a cluster snapshot without its channel-state file is incomplete: \
         restore from another snapshot"
    )]
    Missing {
        /// The file.
        file: PathBuf,
    },
    /// An I/O error other than "not found".
    #[error("{file}: I/O error: {source}")]
    Io {
        /// The file (or, for a write, the temporary file or directory).
        file: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A magic number is wrong: a foreign file, or damage.
    #[error(
        "{file}: bad magic at byte offset {offset}: expected {expected}; this is not a vmcsnap \
         channel-state file or it is damaged: check the path, or restore from another snapshot"
    )]
    BadMagic {
        /// The file.
        file: PathBuf,
        /// What should have started there (e.g. "the file header", "record 3 or the trailer").
        expected: String,
        /// Byte offset of the bad magic.
        offset: u64,
    },
    /// The file's major version is not the one this build reads.
    #[error(
        "{file}: channel-state format version {found} is not supported: this build reads \
         version {supported} and every {}.x; use a vmcsnap release that reads major version {}",
        supported.major, found.major
    )]
    UnsupportedVersion {
        /// The file.
        file: PathBuf,
        /// The version in the file.
        found: Version,
        /// The version this build writes (it reads every minor of its major).
        supported: Version,
    },
    /// A CRC32C did not match.
    #[error(
        "{file}: CRC mismatch in {what} at byte offset {offset}: the data is corrupt; \
         restore from another snapshot (or re-copy this one from its source)"
    )]
    BadCrc {
        /// The file.
        file: PathBuf,
        /// "the file header", "record N" or "the trailer".
        what: String,
        /// The record index, for a record.
        record: Option<u64>,
        /// Byte offset of the structure whose CRC failed.
        offset: u64,
    },
    /// The file ends before a structure it must hold.
    #[error(
        "{file}: truncated: {what} at byte offset {offset} needs the file to be at least \
         {needed} bytes, it has {len}; the file was cut short (interrupted copy, full disk): \
         re-copy it or restore from another snapshot"
    )]
    Truncated {
        /// The file.
        file: PathBuf,
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// Bytes the file needs.
        needed: u64,
        /// Bytes it has.
        len: u64,
    },
    /// Bytes follow the trailer.
    #[error(
        "{file}: {extra} bytes after the trailer (at byte offset {offset}): the file was \
         appended to or overwritten; restore from another snapshot"
    )]
    TrailingBytes {
        /// The file.
        file: PathBuf,
        /// Where the extra bytes start.
        offset: u64,
        /// How many there are.
        extra: u64,
    },
    /// The trailer's totals disagree with the records.
    #[error(
        "{file}: the trailer says {trailer} {what}, the records hold {found}: records were \
         lost or added; restore from another snapshot"
    )]
    CountMismatch {
        /// The file.
        file: PathBuf,
        /// "records" or "frame bytes".
        what: &'static str,
        /// What the trailer says.
        trailer: u64,
        /// What the records hold.
        found: u64,
    },
    /// A record's reason byte is not one this build knows.
    #[error(
        "{file}: record {record} at byte offset {offset} has reason {reason}, which this build \
         does not know (1 = held-at-cut, 2 = in-flight); the file was written by a newer \
         vmcsnap: use that release to read it"
    )]
    UnknownReason {
        /// The file.
        file: PathBuf,
        /// The record index.
        record: u64,
        /// Byte offset of the record.
        offset: u64,
        /// The reason byte.
        reason: u8,
    },
    /// A length field is larger than its limit.
    #[error(
        "{file}: {what} at byte offset {offset} is {len} bytes, more than the limit of {max}: \
         the file is corrupt; restore from another snapshot"
    )]
    TooLarge {
        /// The file.
        file: PathBuf,
        /// What is too large (e.g. "record 2's frame").
        what: String,
        /// Byte offset of the length field.
        offset: u64,
        /// The length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A record's sender or receiver is not a valid VM name.
    #[error(
        "{file}: record {record} at byte offset {offset}: {which} {name:?} is not a valid VM \
         name (1..=64 bytes of UTF-8, a plain file name); the file is corrupt: restore from \
         another snapshot"
    )]
    BadName {
        /// The file.
        file: PathBuf,
        /// The record index.
        record: u64,
        /// Byte offset of the record.
        offset: u64,
        /// "sender" or "receiver".
        which: &'static str,
        /// The name (lossily decoded).
        name: String,
    },
    /// Some other inconsistency (e.g. a header length out of range).
    #[error("{file}: corrupt at byte offset {offset}: {what}; restore from another snapshot")]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// Byte offset.
        offset: u64,
        /// What is wrong.
        what: String,
    },
    /// A frame given to the writer cannot be stored.
    #[error("cannot write frame {index} to the channel-state file: {what}")]
    InvalidFrame {
        /// Position of the frame in the slice given to the writer.
        index: usize,
        /// What is wrong (and what to do).
        what: String,
    },
}

impl ChannelLogError {
    /// The record this error is about, if any.
    pub fn record(&self) -> Option<u64> {
        match self {
            ChannelLogError::BadCrc { record, .. } => *record,
            ChannelLogError::UnknownReason { record, .. }
            | ChannelLogError::BadName { record, .. } => Some(*record),
            _ => None,
        }
    }
}

/// Checks a frame the writer is given.
fn check_frame(index: usize, f: &ChannelFrame) -> Result<(), ChannelLogError> {
    let invalid = |what: String| Err(ChannelLogError::InvalidFrame { index, what });
    for (which, name) in [("sender", &f.sender), ("receiver", &f.receiver)] {
        if !is_vm_name(name) {
            return invalid(format!(
                "{which} {name:?} is not a valid VM name (1..={MAX_VM_NAME_LEN} bytes, a plain \
                 file name, not hidden, without \".tmp-\"); give the VM's name from the cluster spec"
            ));
        }
    }
    if f.data.len() > MAX_FRAME_LEN {
        return invalid(format!(
            "the frame is {} bytes, more than the limit of {MAX_FRAME_LEN}; the switch never \
             forwards frames this large, so the caller has a bug",
            f.data.len()
        ));
    }
    Ok(())
}

/// The header this build writes.
fn encode_header() -> [u8; CHANNEL_HEADER_LEN] {
    let mut h = [0u8; CHANNEL_HEADER_LEN];
    h[0..8].copy_from_slice(&CHANNEL_MAGIC);
    h[8..10].copy_from_slice(&CHANNEL_LOG_MAJOR.to_le_bytes());
    h[10..12].copy_from_slice(&CHANNEL_LOG_MINOR.to_le_bytes());
    h[12..16].copy_from_slice(&(CHANNEL_HEADER_LEN as u32).to_le_bytes());
    // 16..20: flags, 0.
    let crc = crc32c::crc32c(&h[..CHANNEL_HEADER_LEN - 4]);
    h[CHANNEL_HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Writes the whole file to `out`; returns the frame count, frame bytes and
/// bytes written.
fn encode_into(frames: &[ChannelFrame], out: &mut dyn Write) -> Result<ChannelLogSummary, Wrap> {
    for (i, f) in frames.iter().enumerate() {
        check_frame(i, f).map_err(Wrap::Log)?;
    }
    out.write_all(&encode_header()).map_err(Wrap::Io)?;
    let mut size = CHANNEL_HEADER_LEN as u64;
    let mut bytes = 0u64;
    let mut head = Vec::with_capacity(RECORD_OVERHEAD + 2 * MAX_VM_NAME_LEN);
    for f in frames {
        head.clear();
        head.extend_from_slice(&RECORD_MAGIC);
        for name in [&f.sender, &f.receiver] {
            head.push(name.len() as u8);
            head.extend_from_slice(name.as_bytes());
        }
        head.extend_from_slice(&f.received_unix_us.to_le_bytes());
        head.extend_from_slice(&f.delivered_unix_us.to_le_bytes());
        head.push(f.reason.code());
        head.extend_from_slice(&(f.data.len() as u32).to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&head), &f.data);
        out.write_all(&head).map_err(Wrap::Io)?;
        out.write_all(&f.data).map_err(Wrap::Io)?;
        out.write_all(&crc.to_le_bytes()).map_err(Wrap::Io)?;
        size += (head.len() + f.data.len() + 4) as u64;
        bytes += f.data.len() as u64;
    }
    let mut t = [0u8; CHANNEL_TRAILER_LEN];
    t[0..8].copy_from_slice(&TRAILER_MAGIC);
    t[8..16].copy_from_slice(&(frames.len() as u64).to_le_bytes());
    t[16..24].copy_from_slice(&bytes.to_le_bytes());
    let crc = crc32c::crc32c(&t[..24]);
    t[24..].copy_from_slice(&crc.to_le_bytes());
    out.write_all(&t).map_err(Wrap::Io)?;
    Ok(ChannelLogSummary {
        frames: frames.len() as u64,
        bytes,
        file_size: size + CHANNEL_TRAILER_LEN as u64,
    })
}

/// An encoding error before a path is known.
enum Wrap {
    Log(ChannelLogError),
    Io(io::Error),
}

/// Encodes `frames` as a channel-state file (header, one record per frame
/// in order, trailer).
pub fn encode_channel_log(frames: &[ChannelFrame]) -> Result<Vec<u8>, ChannelLogError> {
    let mut out = Vec::new();
    match encode_into(frames, &mut out) {
        Ok(_) => Ok(out),
        Err(Wrap::Log(e)) => Err(e),
        // Writing to a Vec does not fail.
        Err(Wrap::Io(e)) => Err(ChannelLogError::Io {
            file: PathBuf::from(CHANNEL_LOG),
            source: e,
        }),
    }
}

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Writes `frames` to `path` atomically: a temporary file next to it
/// (`.<name>.tmp-<pid>-<n>`), fsync, rename over `path`, fsync of the
/// directory. A crash leaves either the old file (or none) or the new one,
/// never a partial one. Returns what was written (for the cluster
/// manifest's `channel_state`).
pub fn write_channel_log(
    path: &Path,
    frames: &[ChannelFrame],
) -> Result<ChannelLogSummary, ChannelLogError> {
    for (i, f) in frames.iter().enumerate() {
        check_frame(i, f)?;
    }
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Err(ChannelLogError::Io {
            file: path.into(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "not a file path"),
        });
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{name}{}{}-{}",
        crate::list::TEMP_MARKER,
        std::process::id(),
        TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let io_err = |file: &Path| {
        let file = file.to_path_buf();
        move |source| ChannelLogError::Io { file, source }
    };
    let result = (|| {
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        let mut w = io::BufWriter::with_capacity(1 << 20, &file);
        let summary = match encode_into(frames, &mut w) {
            Ok(s) => s,
            Err(Wrap::Log(e)) => return Err(e),
            Err(Wrap::Io(e)) => return Err(io_err(&tmp)(e)),
        };
        w.flush().map_err(io_err(&tmp))?;
        drop(w);
        file.sync_all().map_err(io_err(&tmp))?;
        Ok(summary)
    })();
    let summary = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(path)(e));
    }
    sync_dir(&dir).map_err(io_err(&dir))?;
    Ok(summary)
}

/// Reads and parses the channel-state file at `path` (see
/// [`parse_channel_log`]).
pub fn read_channel_log(path: &Path) -> Result<Vec<ChannelFrame>, ChannelLogError> {
    let data = fs::read(path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            ChannelLogError::Missing { file: path.into() }
        } else {
            ChannelLogError::Io {
                file: path.into(),
                source: e,
            }
        }
    })?;
    parse_in(path, &data)
}

/// Parses a whole channel-state file. Checks everything (magic numbers,
/// version, every CRC, every length, names, reasons, the trailer's totals,
/// no trailing bytes); never panics, whatever `bytes` holds. Errors name
/// the file `channel-state.bin`.
pub fn parse_channel_log(bytes: &[u8]) -> Result<Vec<ChannelFrame>, ChannelLogError> {
    parse_in(Path::new(CHANNEL_LOG), bytes)
}

/// A read position in the file's bytes.
struct Cursor<'a> {
    file: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Checks that `n` bytes starting at `start` are in the file, for
    /// `what` (starting at `at`).
    fn need(
        &self,
        start: usize,
        n: usize,
        what: &dyn Fn() -> String,
        at: usize,
    ) -> Result<(), ChannelLogError> {
        let end = start.checked_add(n);
        match end {
            Some(end) if end <= self.bytes.len() => Ok(()),
            _ => Err(ChannelLogError::Truncated {
                file: self.file.into(),
                what: what(),
                offset: at as u64,
                needed: (start as u64).saturating_add(n as u64),
                len: self.len(),
            }),
        }
    }

    fn u8_at(&self, off: usize) -> u8 {
        self.bytes[off]
    }

    fn u16_at(&self, off: usize) -> u16 {
        u16::from_le_bytes([self.bytes[off], self.bytes[off + 1]])
    }

    fn u32_at(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.bytes[off..off + 4]);
        u32::from_le_bytes(b)
    }

    fn u64_at(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.bytes[off..off + 8]);
        u64::from_le_bytes(b)
    }
}

fn parse_in(file: &Path, bytes: &[u8]) -> Result<Vec<ChannelFrame>, ChannelLogError> {
    let mut c = Cursor {
        file,
        bytes,
        pos: 0,
    };
    parse_header(&mut c)?;
    let mut frames = Vec::new();
    let mut frame_bytes = 0u64;
    loop {
        let index = frames.len() as u64;
        let start = c.pos;
        let what = || format!("record {index} or the trailer");
        c.need(start, 4, &what, start)?;
        let tag = &bytes[start..start + 4];
        if tag == RECORD_MAGIC {
            let f = parse_record(&mut c, index)?;
            frame_bytes += f.data.len() as u64;
            frames.push(f);
        } else if *tag == TRAILER_MAGIC[..4] {
            break;
        } else {
            return Err(ChannelLogError::BadMagic {
                file: file.into(),
                expected: format!("record {index} (\"CHFR\") or the trailer (\"VMCSCEND\")"),
                offset: start as u64,
            });
        }
    }
    parse_trailer(&mut c, frames.len() as u64, frame_bytes)?;
    Ok(frames)
}

fn parse_header(c: &mut Cursor<'_>) -> Result<(), ChannelLogError> {
    let bytes = c.bytes;
    let what = || "the file header".to_string();
    let n = bytes.len().min(CHANNEL_MAGIC.len());
    if bytes[..n] != CHANNEL_MAGIC[..n] {
        return Err(ChannelLogError::BadMagic {
            file: c.file.into(),
            expected: "the file header (\"VMCSCHAN\")".into(),
            offset: 0,
        });
    }
    c.need(0, 16, &what, 0)?;
    let found = Version {
        major: c.u16_at(8),
        minor: c.u16_at(10),
    };
    if found.major != CHANNEL_LOG_MAJOR {
        return Err(ChannelLogError::UnsupportedVersion {
            file: c.file.into(),
            found,
            supported: CHANNEL_LOG_VERSION,
        });
    }
    let header_len = c.u32_at(12) as usize;
    if !(CHANNEL_HEADER_LEN..=MAX_CHANNEL_HEADER_LEN).contains(&header_len) {
        return Err(ChannelLogError::Corrupt {
            file: c.file.into(),
            offset: 12,
            what: format!(
                "header length {header_len} is not in {CHANNEL_HEADER_LEN}..={MAX_CHANNEL_HEADER_LEN}"
            ),
        });
    }
    c.need(0, header_len, &what, 0)?;
    let crc = c.u32_at(header_len - 4);
    if crc32c::crc32c(&bytes[..header_len - 4]) != crc {
        return Err(ChannelLogError::BadCrc {
            file: c.file.into(),
            what: "the file header".into(),
            record: None,
            offset: 0,
        });
    }
    c.pos = header_len;
    Ok(())
}

fn parse_record(c: &mut Cursor<'_>, index: u64) -> Result<ChannelFrame, ChannelLogError> {
    let start = c.pos;
    let what = || format!("record {index}");
    // Find the record's extent from its length fields (each checked before
    // it is used), then check the CRC, then interpret the fields.
    let mut p = start + 4;
    let mut names = [(0usize, 0usize); 2];
    for (slot, which) in names.iter_mut().zip(["sender", "receiver"]) {
        c.need(p, 1, &what, start)?;
        let len = usize::from(c.u8_at(p));
        if len > MAX_VM_NAME_LEN {
            return Err(ChannelLogError::TooLarge {
                file: c.file.into(),
                what: format!("record {index}'s {which} name"),
                offset: p as u64,
                len: len as u64,
                max: MAX_VM_NAME_LEN as u64,
            });
        }
        c.need(p + 1, len, &what, start)?;
        *slot = (p + 1, len);
        p += 1 + len;
    }
    c.need(p, 8 + 8 + 1 + 4, &what, start)?;
    let received_unix_us = c.u64_at(p);
    let delivered_unix_us = c.u64_at(p + 8);
    let reason = c.u8_at(p + 16);
    let len_off = p + 17;
    let frame_len = c.u32_at(len_off) as usize;
    if frame_len > MAX_FRAME_LEN {
        return Err(ChannelLogError::TooLarge {
            file: c.file.into(),
            what: format!("record {index}'s frame"),
            offset: len_off as u64,
            len: frame_len as u64,
            max: MAX_FRAME_LEN as u64,
        });
    }
    let data_off = len_off + 4;
    // Frame and CRC must be in the file before anything is allocated.
    c.need(data_off, frame_len + 4, &what, start)?;
    let crc_off = data_off + frame_len;
    if crc32c::crc32c(&c.bytes[start..crc_off]) != c.u32_at(crc_off) {
        return Err(ChannelLogError::BadCrc {
            file: c.file.into(),
            what: format!("record {index}"),
            record: Some(index),
            offset: start as u64,
        });
    }
    let mut decoded = [String::new(), String::new()];
    for ((out, (off, len)), which) in decoded.iter_mut().zip(names).zip(["sender", "receiver"]) {
        let raw = &c.bytes[off..off + len];
        match std::str::from_utf8(raw) {
            Ok(s) if is_vm_name(s) => *out = s.to_string(),
            _ => {
                return Err(ChannelLogError::BadName {
                    file: c.file.into(),
                    record: index,
                    offset: start as u64,
                    which,
                    name: String::from_utf8_lossy(raw).into_owned(),
                })
            }
        }
    }
    let Some(reason) = FrameReason::from_code(reason) else {
        return Err(ChannelLogError::UnknownReason {
            file: c.file.into(),
            record: index,
            offset: start as u64,
            reason,
        });
    };
    let [sender, receiver] = decoded;
    c.pos = crc_off + 4;
    Ok(ChannelFrame {
        sender,
        receiver,
        received_unix_us,
        delivered_unix_us,
        reason,
        data: c.bytes[data_off..crc_off].to_vec(),
    })
}

fn parse_trailer(
    c: &mut Cursor<'_>,
    records: u64,
    frame_bytes: u64,
) -> Result<(), ChannelLogError> {
    let start = c.pos;
    let what = || "the trailer".to_string();
    c.need(start, TRAILER_MAGIC.len(), &what, start)?;
    if c.bytes[start..start + 8] != TRAILER_MAGIC {
        return Err(ChannelLogError::BadMagic {
            file: c.file.into(),
            expected: format!("record {records} (\"CHFR\") or the trailer (\"VMCSCEND\")"),
            offset: start as u64,
        });
    }
    c.need(start, CHANNEL_TRAILER_LEN, &what, start)?;
    if crc32c::crc32c(&c.bytes[start..start + 24]) != c.u32_at(start + 24) {
        return Err(ChannelLogError::BadCrc {
            file: c.file.into(),
            what: "the trailer".into(),
            record: None,
            offset: start as u64,
        });
    }
    let end = start + CHANNEL_TRAILER_LEN;
    if end < c.bytes.len() {
        return Err(ChannelLogError::TrailingBytes {
            file: c.file.into(),
            offset: end as u64,
            extra: (c.bytes.len() - end) as u64,
        });
    }
    for (what, trailer, found) in [
        ("records", c.u64_at(start + 8), records),
        ("frame bytes", c.u64_at(start + 16), frame_bytes),
    ] {
        if trailer != found {
            return Err(ChannelLogError::CountMismatch {
                file: c.file.into(),
                what,
                trailer,
                found,
            });
        }
    }
    c.pos = end;
    Ok(())
}

/// The exact size of the channel-state file [`encode_channel_log`] writes
/// for `frames` (which must be valid).
pub fn encoded_len(frames: &[ChannelFrame]) -> u64 {
    EMPTY_CHANNEL_LOG_LEN
        + frames
            .iter()
            .map(|f| (RECORD_OVERHEAD + f.sender.len() + f.receiver.len() + f.data.len()) as u64)
            .sum::<u64>()
}

#[cfg(test)]
mod tests;
