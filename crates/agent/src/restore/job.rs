//! What a restore is asked and what it works with, shared by its steps
//! (`run`, `early`, `feed`, `finish`, `page_source`, `pages`, `adopt`): the
//! request's options, the events it reports, the report, the prepared job
//! and its plan, and the constants and clocks every step uses. The steps
//! import this file, never each other's drivers.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use vmcsnap_image::Image;
use vmcsnap_spec::{ClusterSection, VmAddress, VmSpec};
use vmcsnap_workingset::{self as ws, Mode};

use super::ws_inputs;
use crate::qemu::QemuConfig;
use crate::AgentError;

/// With `--no-background`, how long only demand-faulted pages are sent
/// before the rest is pushed (every page must arrive before the stream
/// ends).
pub const TRACE_WINDOW: Duration = Duration::from_secs(10);
/// How long after a guest's start only its demand faults are served in a
/// cluster restore, unless `--start-quiet` says otherwise (a restore of one
/// VM pushes in the background at once unless asked). A guest that has just started needs the CPU: under
/// TCG it retranslates its code, and its peers' TCP expects answers within
/// a tail-loss-probe timeout (2 RTT + 8 ms with several segments out).
/// Background loading during that time (the sender, and QEMU placing each
/// page) took enough CPU from the guests of a cluster restore to make their
/// peers retransmit; holding it for 1 s cut the retransmissions from 109 to
/// 33 in 32 restores (docs/restore.md, "A quiet start").
pub const CLUSTER_START_QUIET: Duration = Duration::from_millis(1000);

/// The section id of "ram" in the stream we send (what QEMU itself uses).
pub(super) const RAM_SECTION_ID: u32 = 2;

/// How many pages go before the guest starts (`workingset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WssChoice {
    /// HotRestore's hybrid size from the snapshot's sample and trace.
    Auto,
    /// This many pages.
    Pages(u64),
}

/// What the request asks for.
#[derive(Debug, Clone)]
pub struct Options {
    /// The snapshot's name.
    pub snapshot: String,
    /// The restore mode.
    pub mode: Mode,
    /// Working-set size.
    pub wss: WssChoice,
    /// Keep the guest paused once its state is loaded.
    pub paused: bool,
    /// Record the restore as a trace for `analyze-ws`.
    pub trace: bool,
    /// Send only demanded pages for [`TRACE_WINDOW`] after the start.
    pub no_background: bool,
    /// Raise the fault path's CPU priority and lower background loading's,
    /// where this process may ([`super::priority`]).
    pub priorities: bool,
    /// After the guest starts, serve only the pages it faults on for this
    /// long, then push the rest in the background (0 for one VM by default,
    /// [`CLUSTER_START_QUIET`] in a cluster restore).
    pub start_quiet: Duration,
    /// Locality blocks read ahead after a demand fault's own block.
    pub prefetch_blocks: usize,
    /// Requested pages over QEMU's postcopy-preempt channel (QEMU 10.0).
    pub preempt: bool,
    /// A cluster restore: the snapshot's directory (instead of a name under
    /// the snapshots root), the gate that holds the start, and where to
    /// report progress. `None` for a restore of one VM.
    pub cluster: Option<InCluster>,
    /// Told what a cluster restore's `events` are (a restore of one VM that
    /// answers once its guest runs watches its load with it).
    pub observer: Option<mpsc::Sender<RestoreEvent>>,
}

/// How a restore takes part in a cluster restore (HotRestore's Cohort).
#[derive(Debug, Clone)]
pub struct InCluster {
    /// The VM's snapshot directory (`<cluster snapshot>/vms/<vm>`).
    pub dir: PathBuf,
    /// Held until the Coordinator's START: the guest's QEMU runs with -S,
    /// loads the device state and waits; pages keep loading meanwhile.
    pub gate: super::StartGate,
    /// Told when the working set is loaded, when the guest started, and
    /// when every page is loaded.
    pub events: mpsc::Sender<RestoreEvent>,
    /// Testing (`crate::fault`): the page source pushes no page in the
    /// background while this file does not exist.
    pub hold_background_until: Option<PathBuf>,
}

/// What a restore taking part in a cluster restore reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreEvent {
    /// The VM's switch port exists (its QEMU is about to start).
    PortReady(vmcsnap_switch::PortId),
    /// The pages planned before the start and the device state are loaded
    /// (LOAD_FIN), by the QEMU of this pid.
    Loaded { qemu_pid: u32 },
    /// The guest started (QEMU's RESUME event), unix µs.
    Started(u64),
    /// `sent` of the VM's `total` pages are loaded (before and after the
    /// start).
    Loading { sent: u64, total: u64 },
    /// Every page is loaded.
    AllLoaded,
}

pub use vmcsnap_control::{Quality, RestoreReport as Report, Spread};

pub(super) fn fail(vm: &str, detail: impl std::fmt::Display) -> AgentError {
    AgentError::Restore {
        vm: vm.to_string(),
        detail: detail.to_string(),
    }
}

/// What the snapshot says about the VM it was taken of.
#[derive(Debug, Clone)]
pub struct Saved {
    /// Its QEMU configuration.
    pub qemu: QemuConfig,
    /// Its spec entry.
    pub spec: VmSpec,
    /// The cluster section of the spec it ran in.
    pub cluster: ClusterSection,
    /// Its address and MAC.
    pub address: VmAddress,
}

/// Faults later than this after the start are not learned from: the next
/// restore's working set is what the guest touches in its first seconds.
pub const LEARN_WINDOW: Duration = Duration::from_secs(10);

/// The plan and the numbers behind it.
pub(super) struct Planned {
    pub(super) plan: ws::Plan,
    /// The queue the working set is the head of (learned from by the next
    /// restore).
    pub(super) queue: Vec<vmcsnap_image::PageKey>,
    pub(super) wss: u64,
    /// HotRestore's hybrid size (the learning's cap without a measurement).
    pub(super) hybrid: u64,
    pub(super) wss_sample: Option<u64>,
    pub(super) wss_snapshot: u64,
    pub(super) learned: bool,
    pub(super) access: ws_inputs::AccessData,
}

/// Everything checked and prepared before a QEMU starts.
pub(super) struct Job<'a> {
    pub(super) opts: &'a Options,
    pub(super) img: &'a Image,
    pub(super) snap_dir: &'a Path,
    pub(super) saved: Saved,
    pub(super) qemu_bin: PathBuf,
    /// The release of `qemu_bin` (what the postcopy source speaks to it).
    pub(super) dialect: vmcsnap_migstream::Dialect,
    pub(super) qemu_img: PathBuf,
    pub(super) frozen: Vec<crate::disk_set::Frozen>,
    pub(super) assets: vmcsnap_guest::GuestAssets,
    pub(super) planned: Planned,
    /// When the request arrived (monotonic and wall clock).
    pub(super) t0: Instant,
    pub(super) t0_wall: SystemTime,
}

/// Pages per window of the locality fill (a 256 KiB locality block).
pub const LOCALITY_WINDOW: u32 = 64;

pub(super) fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
