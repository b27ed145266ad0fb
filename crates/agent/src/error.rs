//! Errors of the agent.

use std::path::PathBuf;

use thiserror::Error;

/// Everything the agent can fail at. Messages say what to do.
#[derive(Debug, Error)]
pub enum AgentError {
    /// The spec is invalid.
    #[error("{path}: {source}")]
    Spec {
        /// The spec file.
        path: PathBuf,
        /// What is wrong.
        source: vmcsnap_spec::SpecError,
    },
    /// A required program is missing.
    #[error(
        "{program} not found: install the Debian package {package} (apt-get install {package})"
    )]
    MissingProgram {
        /// The program.
        program: String,
        /// The Debian package providing it.
        package: &'static str,
    },
    /// KVM was requested but cannot be used.
    #[error("accel = \"kvm\" but {0}; use accel = \"tcg\" or \"auto\"")]
    KvmUnusable(String),
    /// Another agent holds the run directory's lock (`crate::agent_lock`).
    #[error("another agent{} already serves this run directory on {}: talk to it, or stop it with `vmcsnap agent stop` first", pid.map(|p| format!(" (pid {p})")).unwrap_or_default(), socket.display())]
    AnotherAgent {
        /// Its pid, as it wrote it in the lock file.
        pid: Option<u32>,
        /// Its control socket.
        socket: PathBuf,
    },
    /// A cluster is already up.
    #[error("cluster {0:?} is already up in this run directory; run `vmcsnap down` first")]
    AlreadyUp(String),
    /// No cluster is up.
    #[error("no cluster is up; start one with `vmcsnap up SPEC`")]
    NoCluster,
    /// No VM of that name.
    #[error("no VM named {0:?} in the running cluster (see `vmcsnap status`)")]
    NoSuchVm(String),
    /// The agent's record of its VMs cannot be read.
    #[error("{}: the agent's record of its VMs is unreadable ({detail}); its VMs may still run: find them with `pgrep -af {}` before removing the file", path.display(), path.parent().map(|p| p.display().to_string()).unwrap_or_default())]
    BadRecord {
        /// The record file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// QEMU processes of an earlier cluster still use its directory.
    #[error("QEMU processes still use {} (pids {pids:?}), but no agent knows them; stop them (kill PID) or adopt them with the record of the agent that started them", dir.display())]
    StrayQemu {
        /// The cluster directory.
        dir: PathBuf,
        /// Their pids.
        pids: Vec<u32>,
    },
    /// QEMU failed to start or died during boot.
    #[error("VM {vm:?}: QEMU exited during boot ({status}); its output:\n{output}")]
    QemuExited {
        /// The VM.
        vm: String,
        /// Exit status text.
        status: String,
        /// Tail of QEMU's stderr and the console.
        output: String,
    },
    /// The guest never printed its ready marker.
    #[error(
        "VM {vm:?} did not reach its ready marker within {secs} s; last console lines:\n{console}"
    )]
    BootTimeout {
        /// The VM.
        vm: String,
        /// The timeout.
        secs: u64,
        /// Tail of its console.
        console: String,
    },
    /// Building or finding the guest assets failed.
    #[error("guest assets: {0}")]
    Guest(#[from] vmcsnap_guest::GuestError),
    /// The switch failed.
    #[error("switch: {0}")]
    Switch(#[from] vmcsnap_switch::SwitchError),
    /// A VM's image is missing or is not a disk image.
    #[error("image {}: {why}", path.display())]
    BadImage {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The VMs an operation is about to start do not fit on this host
    /// (memory, /dev/shm or disk: see [`crate::capacity`]); checked before
    /// anything is created.
    #[error("not enough {resource} to {to}: {need_mib} MiB needed ({need_detail}), {have_mib} MiB {have_detail}; {advice}")]
    Capacity {
        /// What is short.
        resource: crate::capacity::Resource,
        /// What the operation does, e.g. "start 2 VMs".
        to: String,
        /// What it needs, MiB (rounded up).
        need_mib: u64,
        /// How the need is made up.
        need_detail: String,
        /// What there is, MiB (rounded down).
        have_mib: u64,
        /// Where that figure comes from.
        have_detail: String,
        /// What to do.
        advice: &'static str,
    },
    /// Building or finding an image failed.
    #[error(transparent)]
    Image(#[from] vmcsnap_guest::image::ImageError),
    /// The QEMU binary's version (for the VM's CPU model) is unknown.
    #[error(transparent)]
    CpuModel(#[from] crate::cpu_model::CpuModelError),
    /// The cloud-init seed could not be made.
    #[error("cloud-init seed: {0}")]
    CloudInit(#[from] crate::cloud_init::CloudInitError),
    /// The host's interface on the cluster network failed.
    #[error("host access: {0}")]
    HostNet(#[from] vmcsnap_hostnet::HostNetError),
    /// QMP failed.
    #[error("VM {vm:?}: {source}")]
    Qmp {
        /// The VM.
        vm: String,
        /// The QMP error.
        source: vmcsnap_qmp::QmpError,
    },
    /// The VM's QEMU is a version vmcsnap does not speak.
    #[error("VM {vm:?}: {source}")]
    UnsupportedQemu {
        /// The VM.
        vm: String,
        /// The version QEMU reported, and what to do.
        source: vmcsnap_migstream::UnsupportedQemu,
    },
    /// A request that makes no sense.
    #[error("{0}")]
    BadRequest(String),
    /// A restart onto another QEMU release that cannot work, or a release
    /// vmcsnap does not know.
    #[error(transparent)]
    Crossing(#[from] crate::qemu_crossing::CrossingError),
    /// The metrics endpoint could not be served.
    #[error(transparent)]
    Metrics(#[from] crate::metrics_endpoint::MetricsError),
    /// A migration (state save or load) failed.
    #[error("VM {vm:?}: {what} failed: {detail}")]
    Migration {
        /// The VM.
        vm: String,
        /// Saving or loading.
        what: String,
        /// QEMU's description.
        detail: String,
    },
    /// Neither the new nor the previous QEMU could take over a VM.
    #[error("VM {vm:?} could not be restarted: new QEMU: {first}; kept copy of the previous QEMU: {second}. What it needs to start again is kept in {state}: `vmcsnap rejuvenate --vm {vm} --resume` starts it (with VMCSNAP_QEMU or the installed QEMU, then the kept copy), `--rollback` on the kept copy only")]
    RestartFailed {
        /// The VM.
        vm: String,
        /// Error of the new binary.
        first: String,
        /// Error of the previous binary.
        second: String,
        /// The kept state file.
        state: PathBuf,
    },
    /// No QEMU could start a VM again from what a failed restart kept.
    #[error("VM {vm:?} could not be started again ({tried}); what it needs is still kept: fix the QEMU (VMCSNAP_QEMU names another binary) and run `vmcsnap rejuvenate --vm {vm} --resume` again")]
    StartAgainFailed {
        /// The VM.
        vm: String,
        /// Each binary tried and its error.
        tried: String,
    },
    /// A restore failed (the new QEMU was stopped).
    #[error("restore of VM {vm:?} failed: {detail}")]
    Restore {
        /// The VM.
        vm: String,
        /// What went wrong.
        detail: String,
    },
    /// A VM of a cluster restore never started: the restore was abandoned
    /// because of another VM (whose error says why).
    #[error("restore of VM {vm:?} abandoned {during}, before its start, because the cluster restore failed")]
    Abandoned {
        /// The VM.
        vm: String,
        /// Where it was, e.g. "while paused, loaded and waiting for START".
        during: &'static str,
    },

    /// A cluster snapshot failed or was abandoned.
    #[error("cluster snapshot failed: {0}; every VM was left running and no snapshot was kept")]
    ClusterSnapshot(String),

    #[error("snapshot of VM {vm:?} failed: {detail}")]
    Snapshot {
        /// The VM.
        vm: String,
        /// What went wrong.
        detail: String,
    },
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl AgentError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> AgentError {
        let path = path.into();
        move |source| AgentError::Io { what, path, source }
    }
}
