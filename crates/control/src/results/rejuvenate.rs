//! Results of `rejuvenate` (a restart, or a recovery of a failed one).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{Recover, RejuvenateMode};

/// What one restart measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RejuvenateReport {
    /// The VM.
    pub vm: String,
    /// The mode.
    pub mode: RejuvenateMode,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Guest not running: pause to resume (QMP STOP/RESUME timestamps), or
    /// for cold, quit to the new guest's ready marker.
    pub downtime_ms: f64,
    /// Pause to state saved.
    pub save_ms: f64,
    /// State saved to the new QEMU answering QMP (old quit + new start).
    pub restart_ms: f64,
    /// State loaded into the new QEMU: `migrate-incoming` to `completed`
    /// (or, for cold, boot to ready).
    pub load_ms: f64,
    /// Part of `restart_ms` spent waiting for the old QEMU to quit.
    pub quit_ms: f64,
    /// Part of `restart_ms` from starting the new QEMU to its QMP socket
    /// answering.
    #[serde(default)]
    pub start_ms: f64,
    /// State loaded to the guest running again: waiting for the new QEMU to
    /// accept the switch's connection, then `cont` to its `RESUME` event.
    #[serde(default)]
    pub resume_ms: f64,
    /// Size of the state file.
    pub state_bytes: u64,
    /// Waiting for the old QEMU to read frames already sent and hand them
    /// to the guest (socket drain and cut probes, before the pause).
    pub drain_ms: f64,
    /// Whether that wait hit its bound before the socket drained.
    pub drain_bound_hit: bool,
    /// The socket drained but the old QEMU did not read both probes in
    /// time: it may have quit with frames the guest had not taken yet
    /// (TCP retransmits them).
    pub unsettled: bool,
    /// Frames the switch held for the VM while it was away.
    pub frames_held: u64,
    /// Old and new QEMU pids.
    pub old_pid: u32,
    /// New QEMU pid.
    pub new_pid: u32,
    /// Whether the old binary had to be used.
    pub fell_back_to_old_binary: bool,
    /// Why the new QEMU could not take over, when it fell back.
    #[serde(default)]
    pub fallback_reason: Option<String>,
    /// The binary the VM runs on now (what `/proc/PID/exe` names).
    #[serde(default)]
    pub qemu: Option<PathBuf>,
}

/// Result of `rejuvenate` (one line of `<run-dir>/rejuvenation.jsonl`,
/// which `vmcsnap availability` reads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RejuvenateResult {
    /// When it ended, unix ms.
    pub unix_ms: u64,
    /// The mode.
    pub mode: RejuvenateMode,
    /// How many VMs restarted.
    pub n: usize,
    /// Request to the last VM running again, ms.
    pub total_ms: f64,
    /// Per VM.
    pub reports: Vec<RejuvenateReport>,
}

/// What a recovery did for one VM (`vmcsnap rejuvenate --resume|--rollback`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recovered {
    /// The VM.
    pub vm: String,
    /// Resume or rollback.
    pub how: Recover,
    /// The unfinished work: `restart` (from saved state) or `boot`.
    pub intent: String,
    /// The binary that runs the VM now.
    pub qemu: PathBuf,
    /// Whether that is the kept copy of the previous QEMU.
    pub on_kept_copy: bool,
    /// The new QEMU's pid.
    pub pid: u32,
}

/// Result of `rejuvenate --resume|--rollback`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoverResult {
    /// Every VM started again.
    pub recovered: Vec<Recovered>,
}
