//! The error every reading operation returns ([`ReadError`]).
//!
//! Each variant names the file (its full path) and, where it applies, the
//! memory-image block and the byte offset, and its message says what an
//! operator can do about it. No reading path panics on bad input: every
//! problem a damaged, truncated or foreign file can cause ends up here.

use std::fmt;
use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// A format version: `major.minor`.
///
/// Readers accept every minor version of their own major version and reject
/// every other major version (see the compatibility policy in
/// `docs/image-format.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Incompatible changes bump this.
    pub major: u16,
    /// Compatible additions bump this.
    pub minor: u16,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Why opening, reading or verifying an image failed.
#[derive(Debug, Error)]
pub enum ReadError {
    /// A file (or the snapshot directory) does not exist.
    #[error(
        "{file}: missing; an interrupted snapshot has no manifest and is not a snapshot \
         (`vmcsnap gc` removes it), otherwise the snapshot directory is incomplete"
    )]
    Missing {
        /// The path that does not exist.
        file: PathBuf,
    },
    /// An I/O error other than "not found".
    #[error("{file}: I/O error: {source}")]
    Io {
        /// The file being read.
        file: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The file does not start with the magic of the file it should be.
    #[error(
        "{file}: bad magic: this is not a vmcsnap {expected} file (a foreign or overwritten file); \
         check the path, or restore from another snapshot"
    )]
    BadMagic {
        /// The file.
        file: PathBuf,
        /// What the file should have been (e.g. "memory image").
        expected: &'static str,
    },
    /// The file's major format version is not the one this build reads.
    #[error(
        "{file}: format version {found} is not supported: this build reads major versions \
         1 to {} (it writes {supported}); use a vmcsnap release that reads major version {}",
        supported.major, found.major
    )]
    UnsupportedVersion {
        /// The file.
        file: PathBuf,
        /// The version found in the file.
        found: Version,
        /// The version this build writes (it reads every minor of its major).
        supported: Version,
    },
    /// A CRC32C did not match: the bytes changed after they were written.
    #[error(
        "{file}: CRC mismatch in {what}{} at byte offset {offset}: the data is corrupt; \
         restore from another snapshot (or re-copy this one from its source)",
        block.map(|b| format!(" (memory-image block {b})")).unwrap_or_default()
    )]
    BadCrc {
        /// The file.
        file: PathBuf,
        /// The structure whose CRC failed (e.g. "block", "page", "body").
        what: String,
        /// The memory-image block, for block and page CRCs.
        block: Option<u32>,
        /// Byte offset in the file of the structure whose CRC failed.
        offset: u64,
    },
    /// The file is shorter than its header or the manifest says it must be.
    #[error(
        "{file}: truncated: expected {expected} bytes, found {found}; the file was cut short \
         (partial copy, full disk); re-copy it or restore from another snapshot"
    )]
    Truncated {
        /// The file.
        file: PathBuf,
        /// The size it must have (or at least have).
        expected: u64,
        /// The size it has.
        found: u64,
    },
    /// A structure passed its CRC but is inconsistent (or has no CRC).
    #[error("{file}: corrupt: {what}; restore from another snapshot")]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A block uses a compression codec this build does not know.
    #[error(
        "{file}: block {block} uses compression codec {codec}, which this build does not know; \
         use a newer vmcsnap to read it"
    )]
    UnsupportedCompression {
        /// The memory image.
        file: PathBuf,
        /// The block.
        block: u32,
        /// The codec number.
        codec: u8,
    },
    /// A caller asked for something the image does not have.
    #[error("{0}")]
    NotFound(String),
    /// A caller passed an invalid argument (e.g. a buffer of the wrong size).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl ReadError {
    /// Wraps an I/O error, turning "not found" into [`ReadError::Missing`].
    pub(crate) fn io(file: impl Into<PathBuf>, source: io::Error) -> Self {
        let file = file.into();
        if source.kind() == io::ErrorKind::NotFound {
            ReadError::Missing { file }
        } else if source.kind() == io::ErrorKind::UnexpectedEof {
            // A read past the end: the file shrank after it was opened.
            ReadError::Corrupt {
                file,
                what: "the file ended early (it shrank while open)".into(),
            }
        } else {
            ReadError::Io { file, source }
        }
    }

    /// Shorthand for [`ReadError::Corrupt`].
    pub(crate) fn corrupt(file: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        ReadError::Corrupt {
            file: file.into(),
            what: what.into(),
        }
    }

    /// The memory-image block this error is about, if any.
    pub fn block(&self) -> Option<u32> {
        match self {
            ReadError::BadCrc { block, .. } => *block,
            ReadError::UnsupportedCompression { block, .. } => Some(*block),
            _ => None,
        }
    }
}
