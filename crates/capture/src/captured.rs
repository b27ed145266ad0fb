//! A capture whose image is complete but not committed: [`Captured`].
//!
//! The stream has ended and every page and the device state are in the
//! writer's temporary directory; the caller adds what only it knows (the
//! downtime and disk-snapshot time QEMU and the disk layer report once the
//! migration is `completed`) and then commits. Dropping a `Captured`, or
//! [`Captured::abort`], removes the temporary directory.

use std::path::{Path, PathBuf};

use vmcsnap_image::{ImageWriter, Manifest, Metrics};

use crate::error::CaptureError;
use crate::progress::CaptureStats;

/// Manifest metric keys (in `metrics`, next to the v1 ones) that a capture
/// sets.
pub mod metric {
    /// Bytes of QEMU's migration stream.
    pub const STREAM_BYTES: &str = "stream_bytes";
    /// Milliseconds from the stream's first byte to its end.
    pub const CAPTURE_STREAM_MS: &str = "capture_stream_ms";
    /// Milliseconds from the start of the capture to the image being
    /// complete (before commit).
    pub const CAPTURE_MS: &str = "capture_ms";
    /// Page records of pages already sent (precopy rounds after the first).
    pub const PAGES_RESENT: &str = "pages_resent";
    /// Pre-copy with [`CaptureOptions::final_ram`](crate::CaptureOptions::final_ram):
    /// pages of the RAM block compared with the paused guest's RAM.
    pub const PRECOPY_PAGES_CHECKED: &str = "precopy_pages_checked";
    /// Pre-copy: pages whose last copy in the stream differed from the
    /// paused guest's RAM and were replaced by its bytes (writes QEMU's
    /// dirty tracking missed).
    pub const PRECOPY_PAGES_PATCHED: &str = "precopy_pages_patched";
}

/// A complete, uncommitted snapshot image; see the module docs.
#[derive(Debug)]
pub struct Captured {
    pub(crate) writer: ImageWriter,
    pub(crate) stats: CaptureStats,
}

/// A committed snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct CommittedInfo {
    /// The snapshot directory.
    pub path: PathBuf,
    /// Its manifest, as written.
    pub manifest: Manifest,
    /// The capture's counts and timings.
    pub stats: CaptureStats,
}

impl Captured {
    /// The capture's counts and timings.
    pub fn stats(&self) -> &CaptureStats {
        &self.stats
    }

    /// The metrics that go into the manifest. The capture has set
    /// `pages_guest_written` and the keys of [`metric`]; the writer sets
    /// `bytes_written`, `pages_total` and `pages_zero` at commit. Set
    /// `downtime_ms`, `disk_snapshot_ms` and `duration_ms` here.
    pub fn metrics_mut(&mut self) -> &mut Metrics {
        self.writer.metrics_mut()
    }

    /// The temporary directory holding the image until commit.
    pub fn temp_path(&self) -> &Path {
        self.writer.temp_path()
    }

    /// Makes the snapshot durable and visible under its final name (fsync
    /// of every file, manifest last, rename; see the image format's commit
    /// protocol).
    pub fn commit(self) -> Result<CommittedInfo, CaptureError> {
        self.commit_unless(&std::sync::atomic::AtomicBool::new(false))
    }

    /// [`commit`](Self::commit) unless `cancelled` is set before the
    /// snapshot is renamed into place (see
    /// [`ImageWriter::commit_unless`](vmcsnap_image::ImageWriter::commit_unless)).
    pub fn commit_unless(
        self,
        cancelled: &std::sync::atomic::AtomicBool,
    ) -> Result<CommittedInfo, CaptureError> {
        let Captured { writer, stats } = self;
        let committed = writer.commit_unless(cancelled)?;
        Ok(CommittedInfo {
            path: committed.path,
            manifest: committed.manifest,
            stats,
        })
    }

    /// Discards the image (as dropping does): e.g. when QEMU reports the
    /// migration `failed` although the stream looked complete.
    pub fn abort(self) {}
}
