//! [`DiskError`]: why a disk image cannot be read.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Why a disk image (or its backing chain) cannot be opened or read.
#[derive(Debug, Error)]
pub enum DiskError {
    /// A file could not be opened or read.
    #[error("{path}: {source} (check that the disk image exists and is readable)")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The file is not a valid image: a header field or table is out of
    /// range or points outside the file.
    #[error("{path}: {what}; the disk image is damaged (`qemu-img check` tells more)")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The image uses a qcow2 feature this reader does not implement.
    #[error(
        "{path} uses {feature}, which vmcsnap's disk reader does not support; \
         convert the image with `qemu-img convert -O qcow2` (no -c, no encryption, \
         no extended_l2, no data_file) to use it"
    )]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The feature.
        feature: String,
    },
    /// A backing file named in a header cannot be used.
    #[error("{path}: its backing file {backing:?} {why}; restore the backing file or rebase the image (`qemu-img rebase`)")]
    Backing {
        /// The image naming the backing file.
        path: PathBuf,
        /// The name as the header gives it.
        backing: String,
        /// What is wrong with it.
        why: String,
    },
    /// The backing chain is longer than the reader follows (a loop?).
    #[error("{path}: the backing chain is longer than {max} files (a loop?); flatten it with `qemu-img convert`")]
    ChainTooLong {
        /// The top image.
        path: PathBuf,
        /// The limit.
        max: usize,
    },
    /// A read past the end of the virtual disk.
    #[error("read of {len} bytes at {offset} is past the end of the {size}-byte disk {path}")]
    OutOfRange {
        /// The top image.
        path: PathBuf,
        /// Byte offset asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// Virtual size.
        size: u64,
    },
}

impl DiskError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> DiskError {
        let path = path.into();
        move |source| DiskError::Io { path, source }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, what: impl Into<String>) -> DiskError {
        DiskError::Corrupt {
            path: path.into(),
            what: what.into(),
        }
    }

    pub(crate) fn unsupported(path: impl Into<PathBuf>, feature: impl Into<String>) -> DiskError {
        DiskError::Unsupported {
            path: path.into(),
            feature: feature.into(),
        }
    }
}
