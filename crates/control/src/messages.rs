//! Requests, replies and the typed results of each request.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vmcsnap_switch::SwitchStats;

use crate::{ClusterRestoreMode, RejuvenateMode, Response, RestoreMode, SnapshotMode};

/// What the CLI asks of the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// Is the agent alive? Result: [`Response::Ping`].
    Ping,
    /// Boot a cluster. Result: [`UpResult`].
    Up {
        /// Absolute path of the spec (for messages and relative paths).
        spec_path: PathBuf,
        /// The spec's text, as read by the CLI.
        spec_toml: String,
    },
    /// State of the cluster. Result: [`StatusResult`].
    Status,
    /// A VM's serial console output. Result: [`ConsoleResult`].
    Console {
        /// The VM.
        vm: String,
        /// Return at most this many bytes from the end (0 = everything).
        tail_bytes: u64,
    },
    /// Restart the QEMU of one VM or of all (in parallel). Result:
    /// [`Response::Rejuvenate`], or with `recover` [`Response::Recover`].
    Rejuvenate {
        /// The VM, or `None` for every VM.
        vm: Option<String>,
        /// How.
        mode: RejuvenateMode,
        /// The QEMU binary to restart on (the CLI's `VMCSNAP_QEMU`, as an
        /// absolute path); `None`: the agent's own (`VMCSNAP_QEMU` of the
        /// agent, else `qemu-system-x86_64` on its PATH).
        #[serde(default)]
        qemu: Option<PathBuf>,
        /// Instead of a restart: start again VMs whose restart failed, from
        /// what it kept.
        #[serde(default)]
        recover: Option<Recover>,
    },
    /// Take a snapshot of one VM (memory and disk in one pause) into
    /// `<run-dir>/snapshots/<name>`. Result: [`Response::Snapshot`].
    Snapshot {
        /// The VM.
        vm: String,
        /// How.
        mode: SnapshotMode,
        /// Snapshot name; default `<vm>-<unix time>`.
        #[serde(default)]
        name: Option<String>,
        /// Debug: copy guest RAM here while the VM is paused for the
        /// snapshot, to compare the image with.
        #[serde(default)]
        reference: Option<PathBuf>,
        /// How the memory image is stored (`--storage`; on the wire as
        /// on the command line, e.g. `"lz4,no-disk"`); `None`: the default.
        #[serde(default)]
        storage: Option<crate::ImageStorage>,
        /// Store every page: no parent, even if the VM has snapshots.
        #[serde(default)]
        full: bool,
        /// Pages per memory-image block (locality block); `None`: 64.
        #[serde(default)]
        block_pages: Option<u16>,
        /// Seconds after the snapshot point to record the pages the guest
        /// accesses (host DAMON only); 0: off; `None`: the agent's default.
        #[serde(default)]
        access_window_s: Option<u64>,
    },
    /// Measure the floor of a hot snapshot's pause on this host: QEMU's own
    /// background snapshot of the VM into `/dev/null`, with nothing else done
    /// and nothing kept. Result:
    /// [`Response::PauseLimit`].
    PauseLimit {
        /// The VM.
        vm: String,
    },
    /// Take a consistent snapshot of every VM of the cluster at once
    /// (HotSnap's coordinated protocol, with the switch's packet mediator)
    /// into `<run-dir>/snapshots/<name>`. Result:
    /// [`Response::ClusterSnapshot`].
    ClusterSnapshot {
        /// How.
        mode: SnapshotMode,
        /// Snapshot name; default `<cluster>-<unix time>`.
        #[serde(default)]
        name: Option<String>,
        /// Cut each VM after its socket drained only, without the cut
        /// probes that make sure its QEMU handed the guest every frame
        /// (to measure what they change).
        #[serde(default)]
        no_cut_probes: bool,
    },
    /// Restore every VM of a cluster snapshot into a new cluster (HotRestore:
    /// restore dependency graph, revised working sets, restore line).
    /// Result: [`Response::ClusterRestore`] (with `wait`) or
    /// [`Response::ClusterRunning`].
    ClusterRestore {
        /// The cluster snapshot's name or path.
        snapshot: String,
        /// How.
        mode: ClusterRestoreMode,
        /// Leave every thread's CPU priority alone (see docs/restore.md).
        #[serde(default)]
        no_priorities: bool,
        /// After each guest starts, serve only the pages it faults on for
        /// this many ms (then load the rest in the background); `None`: the
        /// agent's default for a cluster restore (docs/restore.md).
        #[serde(default)]
        start_quiet_ms: Option<u64>,
        /// Answer once every page is loaded (the full report); otherwise
        /// once every guest runs, while the rest loads in the background.
        #[serde(default)]
        wait: bool,
    },
    /// Restore a VM from a snapshot (joining the running cluster, or a
    /// cluster of its own). Result: [`Response::Restore`] (with `wait`) or
    /// [`Response::RestoreRunning`].
    Restore {
        /// The snapshot's name.
        snapshot: String,
        /// How.
        mode: RestoreMode,
        /// Working-set size in pages; `None` = HotRestore's hybrid size.
        #[serde(default)]
        wss: Option<u64>,
        /// Keep the guest paused once its state is loaded.
        #[serde(default)]
        paused: bool,
        /// Record this restore as a first-access trace for `analyze-ws`.
        #[serde(default)]
        trace: bool,
        /// Send only demanded pages for the first 10 s.
        #[serde(default)]
        no_background: bool,
        /// Leave every thread's CPU priority alone (see docs/restore.md).
        #[serde(default)]
        no_priorities: bool,
        /// After the guest starts, serve only the pages it faults on for
        /// this many ms (then load the rest in the background); `None`: 0.
        #[serde(default)]
        start_quiet_ms: Option<u64>,
        /// Locality blocks read ahead after a demand fault's own block;
        /// `None`: 1.
        #[serde(default)]
        prefetch_blocks: Option<u32>,
        /// Send the pages the guest faults on over QEMU's postcopy-preempt
        /// channel (QEMU 10.0 only; see docs/restore.md).
        #[serde(default)]
        preempt: bool,
        /// Answer once every page is loaded (the full report); otherwise
        /// once the guest runs, while the rest loads in the background.
        #[serde(default)]
        wait: bool,
    },
    /// Stop one VM of the cluster (its QEMU, RAM and port go; the rest
    /// runs on). Result: [`Response::Stop`].
    Stop {
        /// The VM.
        vm: String,
    },
    /// Tear the cluster down. Result: [`Response::Down`].
    Down,
    /// Remove what dead operations left in the snapshot directory.
    /// Result: [`GcResult`].
    Gc,
    /// Delete committed snapshots (per-VM or cluster) by name, with the
    /// frozen disks no running VM or other snapshot reads from. Result:
    /// [`SnapshotsDeleteResult`].
    SnapshotsDelete {
        /// Snapshot names, as `vmcsnap snapshots` lists them.
        names: Vec<String>,
    },
    /// Delete all but the `keep` newest committed snapshots of each VM (and
    /// of each cluster, for cluster snapshots). Result:
    /// [`SnapshotsDeleteResult`].
    SnapshotsPrune {
        /// How many to keep per VM (per cluster); 0 only with `vm`.
        keep: u32,
        /// Only this VM's snapshots (cluster snapshots are left alone).
        #[serde(default)]
        vm: Option<String>,
        /// Say what would go; remove nothing.
        #[serde(default)]
        dry_run: bool,
    },
    /// Restart the agent in place (exec of its executable, VMs untouched).
    /// Result: [`Response::RestartAgent`]: the image that answered.
    RestartAgent,
    /// Stop the agent (refused while a cluster is up). Result:
    /// [`Response::Shutdown`].
    Shutdown,
}

impl Reply {
    /// [`Reply::Done`] with `result`.
    pub fn done(result: Response) -> Reply {
        Reply::Done {
            result: Box::new(result),
        }
    }
}

/// How to start again a VM whose restart failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recover {
    /// The named (or installed) QEMU, then the kept copy of the previous one.
    Resume,
    /// The kept copy of the previous QEMU only.
    Rollback,
}

/// One line the agent sends back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Reply {
    /// A human progress line of a long operation.
    Progress {
        /// The line.
        message: String,
    },
    /// The request succeeded.
    Done {
        /// The request's result.
        result: Box<Response>,
    },
    /// The request failed; the message says what to do.
    Failed {
        /// The whole cause chain, one line.
        error: String,
    },
    /// The agent was exiting (idle) when this connection reached it and
    /// did not read the request: the client starts a new agent and sends
    /// it again.
    Exiting,
    /// The agent's answer to a client's hello: its protocol version
    /// (`crate::PROTOCOL_VERSION`), the first line of every conversation.
    Hello {
        /// The agent's version.
        version: u32,
    },
}

/// One VM after `up`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmUp {
    /// VM name.
    pub name: String,
    /// QEMU's process id.
    pub pid: u32,
    /// QEMU start to the guest's ready marker, in milliseconds.
    pub boot_ms: u64,
    /// The accelerator in use (`kvm` or `tcg`).
    pub accel: String,
    /// The VM's address, `A.B.C.D/NN`.
    pub ip: String,
    /// The VM's MAC address.
    pub mac: String,
}

/// Result of `up`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpResult {
    /// Cluster name.
    pub cluster: String,
    /// Every VM, in spec order.
    pub vms: Vec<VmUp>,
}

/// One VM in `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmStatus {
    /// VM name.
    pub name: String,
    /// QEMU's process id.
    pub pid: u32,
    /// QEMU's run state (`running`, `paused`, ...) or `exited`.
    pub state: String,
    /// The VM's address.
    pub ip: String,
    /// The VM's MAC address.
    pub mac: String,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Seconds since QEMU started.
    pub uptime_s: f64,
    /// The switch port of its NIC.
    pub port: String,
    /// A restored VM whose pages still load in the background (the
    /// restore answered once its guest ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<VmLoad>,
}

/// How far a restored VM's background load is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmLoad {
    /// Pages in its guest's RAM now.
    pub pages_loaded: u64,
    /// Pages of its guest's RAM.
    pub pages_total: u64,
}

/// Result of `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusResult {
    /// Cluster name, or `None` when no cluster is up.
    pub cluster: Option<String>,
    /// Accelerator in use.
    pub accel: Option<String>,
    /// The agent's pid.
    pub agent_pid: u32,
    /// Every VM.
    pub vms: Vec<VmStatus>,
    /// Switch counters (`None` when no cluster is up or the switch did
    /// not answer).
    pub switch: Option<SwitchStats>,
    /// The operation running while this status was asked for, if any: the
    /// VM states are then those from before it began.
    #[serde(default)]
    pub busy: Option<Busy>,
}

/// Result of `gc`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcResult {
    /// What was removed.
    pub removed: Vec<PathBuf>,
    /// Leftover-looking directories kept because a VM's disk uses them.
    pub kept_in_use: Vec<PathBuf>,
    /// Disk files of VMs `vmcsnap stop` took out of the cluster: they stay
    /// until the VM runs again or `vmcsnap down`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_stopped: Vec<PathBuf>,
}

/// What a snapshot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// One VM's snapshot.
    Vm,
    /// A cluster snapshot (every VM, with the channel state).
    Cluster,
}

/// One snapshot removed by `snapshots delete` or `snapshots prune` (or
/// that a `prune --dry-run` would remove).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemovedSnapshot {
    /// Its name.
    pub name: String,
    /// Per-VM or cluster snapshot.
    pub kind: SnapshotKind,
    /// The VM (or, for a cluster snapshot, the cluster) it is of; `None`
    /// if its manifest could not be read (an invalid snapshot).
    pub of: Option<String>,
    /// When it was committed (Unix ms), if its manifest says.
    pub created_unix_ms: Option<u64>,
    /// Disk space its removal freed (allocated bytes of the files whose
    /// last link went), frozen disks included.
    pub bytes_freed: u64,
    /// Its frozen-disk directory, if it had one and it was removed.
    pub disks_removed: Option<PathBuf>,
}

/// Result of `snapshots delete` and `snapshots prune`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotsDeleteResult {
    /// The snapshot directory (`<run-dir>/snapshots`).
    pub root: PathBuf,
    /// `prune --dry-run`: nothing was removed; `removed` is what would go.
    pub dry_run: bool,
    /// The snapshots removed, in the order they went.
    pub removed: Vec<RemovedSnapshot>,
    /// `prune`: the committed snapshots kept, newest first per VM.
    pub kept: Vec<String>,
    /// Disk space freed in all (allocated bytes).
    pub bytes_freed: u64,
    /// Frozen-disk directories of removed snapshots kept because a running
    /// VM's disk or another snapshot's frozen disk reads from them (as for
    /// `gc`; `vmcsnap gc` removes them once nothing does).
    pub kept_in_use: Vec<PathBuf>,
    /// Incremental snapshots rewritten without a removed parent (they
    /// restore exactly as before).
    #[serde(default)]
    pub merged: Vec<String>,
}

/// An operation the agent is running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Busy {
    /// The request, as the CLI would name it (`snapshot srv`).
    pub request: String,
    /// Seconds since it began.
    pub for_s: f64,
}

/// Result of `console`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsoleResult {
    /// The VM.
    pub vm: String,
    /// Path of the full console log on the agent's host.
    pub path: PathBuf,
    /// The (tail of the) console text.
    pub text: String,
}
