//! The one error type of a capture, [`CaptureError`].
//!
//! Whatever the error, nothing that looks like a snapshot is left behind:
//! the image writer's temporary directory (with the precopy scratch file in
//! it) is removed when the capture fails, and the final directory is only
//! created by [`Captured::commit`](crate::Captured::commit).

use std::io;
use std::path::PathBuf;

use thiserror::Error;
use vmcsnap_image::WriteError;
use vmcsnap_migstream::StreamError;

use crate::options::CaptureMode;

/// Why a capture (or its commit) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// The snapshot directory already exists.
    #[error("{0} already exists; choose another snapshot name or remove the old snapshot")]
    Exists(PathBuf),

    /// The snapshot directory cannot be created where it was asked for.
    #[error("cannot write a snapshot at {path}: {reason}")]
    Target {
        /// The requested snapshot directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// QEMU's migration stream could not be read: cut short (QEMU died,
    /// the migration was cancelled, the socket was shut down), malformed,
    /// or using a feature the reader does not support (its message says
    /// which QEMU setting to change).
    #[error("reading QEMU's migration stream failed, no snapshot was written: {0}")]
    Stream(#[from] StreamError),

    /// Writing the image failed (I/O, or the stream's contents do not fit
    /// the image format).
    #[error("writing the snapshot image failed: {0}")]
    Image(#[from] WriteError),

    /// A page came twice in a mode where each page must arrive once.
    #[error(
        "page {offset:#x} of RAM block {block:?} was sent twice in a {mode} capture: the VM \
         was running during a plain migration; stop the VM before migrating, or capture with \
         CaptureMode::Precopy (no snapshot was written)"
    )]
    PageResent {
        /// The RAM block's name.
        block: String,
        /// Byte offset of the page in the block.
        offset: u64,
        /// The capture's mode.
        mode: CaptureMode,
    },

    /// The stream ended without a RAM block list, or with an empty one.
    #[error(
        "the migration stream has no guest RAM (no RAM block list before the device state); \
         a snapshot needs RAM: is the source migrating with x-ignore-shared, or not a VM? \
         (no snapshot was written)"
    )]
    NoRam,

    /// No machine type was given and the stream does not name one.
    #[error(
        "the machine type is unknown: the stream has no configuration section \
         (send-configuration=off); set CaptureOptions::machine (no snapshot was written)"
    )]
    UnknownMachine,

    /// The precopy scratch file could not be written or read.
    #[error(
        "precopy scratch file {path}: {source}; no snapshot was written (a precopy capture needs \
         free space for the guest's RAM twice next to the snapshot)"
    )]
    Scratch {
        /// The scratch file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },

    /// Pre-copy: the staged pages could not be checked against the guest's
    /// RAM at the switch-over ([`crate::ram_check`]).
    #[error(
        "the pre-copy snapshot could not be checked against the paused guest's RAM: {detail}; \
         no snapshot was written (a pre-copy image is committed only once each of its pages \
         is known to equal the guest's memory at the pause; take a hot or stop-copy snapshot \
         instead if this persists)"
    )]
    RamCheck {
        /// What went wrong.
        detail: String,
    },

    /// Pre-copy: a page of guest RAM changed while the VM was supposed to
    /// be paused for the switch-over.
    #[error(
        "page {page} of RAM block {block:?} changed while the VM was paused for the pre-copy \
         switch-over (was it resumed by someone else, or is another process writing its RAM \
         file?); no snapshot was written"
    )]
    RamChanged {
        /// The RAM block's name.
        block: String,
        /// The page number in the block.
        page: u64,
    },
}
