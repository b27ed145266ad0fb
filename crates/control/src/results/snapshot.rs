//! Results of `snapshot` and `pause-limit`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vmcsnap_image::PauseBreakdown;

use crate::SnapshotMode;

/// What one snapshot measured (`vmcsnap snapshot VM`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReport {
    /// The VM.
    pub vm: String,
    /// The snapshot's name.
    pub name: String,
    /// Its directory.
    pub path: PathBuf,
    /// The mode.
    pub mode: SnapshotMode,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Guest not running: QMP STOP to RESUME event timestamps.
    pub downtime_ms: f64,
    /// The disk snapshot (QMP transaction) alone.
    pub disk_snapshot_ms: f64,
    /// Where the pause went (absent for a VM that was already paused).
    pub pause: Option<PauseBreakdown>,
    /// Request to commit.
    pub duration_ms: f64,
    /// Bytes of QEMU's stream.
    pub stream_bytes: u64,
    /// Pages stored in the image.
    pub pages_stored: u64,
    /// Zero pages.
    pub pages_zero: u64,
    /// Pages the guest wrote during a hot snapshot (FAFL trace length).
    pub pages_guest_written: u64,
    /// The parent this snapshot is incremental to, `"<name> (depth <d>)"`,
    /// or why it is full, `"none: <why>"` (manifest `metrics.parent`).
    pub parent: String,
    /// Stream throughput.
    pub stream_mb_per_s: f64,
    /// The frozen disk image (a hard link of the qcow2 the VM ran on) of
    /// its first disk.
    pub frozen_disk: PathBuf,
    /// The frozen disk of every writable disk, in the VM's disk order.
    #[serde(default)]
    pub frozen_disks: Vec<PathBuf>,
    /// The overlay its first disk runs on from now on.
    pub overlay: PathBuf,
    /// Where the debug reference copy of RAM went, if asked.
    pub reference: Option<PathBuf>,
    /// Unix µs: the snapshot began.
    pub start_unix_us: u64,
    /// Unix µs of QEMU's STOP event.
    pub pause_start_unix_us: u64,
    /// Unix µs of QEMU's RESUME event.
    pub pause_end_unix_us: u64,
    /// Unix µs: the VM's transient snapshot was over (running again, hooks told).
    pub transient_done_unix_us: u64,
    /// Unix µs: the image was committed.
    pub complete_unix_us: u64,
    /// Hot: how much of guest RAM QEMU had mapped before the pause, and
    /// whether the agent had it read first (QEMU populates what is not
    /// mapped inside the pause, `qemu_setup`).
    #[serde(default)]
    pub ram: Option<RamResidency>,
}

/// Guest RAM as QEMU had it mapped (its page tables) around a hot
/// snapshot's "read guest RAM once" step, in 4 KiB pages. QEMU reads every
/// page before write-protecting RAM; a page that is not mapped then costs
/// a page fault inside the pause.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RamResidency {
    /// Guest RAM.
    pub ram_pages: u64,
    /// Mapped when the snapshot began.
    pub resident_before: u64,
    /// Mapped just before the VM was ready to pause (after any read).
    pub resident_at_pause: u64,
    /// Whether the agent had QEMU read guest RAM for this snapshot.
    pub read: bool,
    /// How long those reads took, ms.
    pub read_ms: f64,
}

impl SnapshotReport {
    /// What `parent` says: `Ok(parent)` for an incremental snapshot,
    /// `Err(why)` for a full one.
    pub fn incremental_to(&self) -> Result<&str, &str> {
        match self.parent.strip_prefix("none: ") {
            Some(why) => Err(why),
            None => Ok(&self.parent),
        }
    }
}

/// What `pause-limit` measured: QEMU's own background snapshot of the VM
/// into `/dev/null`, with nothing else done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PauseLimitReport {
    /// The VM.
    pub vm: String,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// The pause: QEMU's STOP to RESUME event, ms.
    pub downtime_ms: f64,
    /// QEMU's migration setup, done while the guest still ran (MIGRATION
    /// `setup` to `active` event), ms.
    pub setup_while_running_ms: f64,
    /// From `migrate` to the stream's end (QMP `completed`), ms.
    pub duration_ms: f64,
}
