//! Snapshotting a running VM into vmcsnap's own image format.
//!
//! Memory and disk are frozen in one pause; see `docs/snapshot.md`.
//!
//! - **hot** (HotSnap): `stop`; `transaction` with `blockdev-snapshot` of
//!   an overlay opened beforehand (the current qcow2 becomes the frozen
//!   disk, the VM continues on the overlay); `migrate` with
//!   `background-snapshot` into the stream relay's pipe (`relay`), sent
//!   together when nothing runs between them (`pause`). QEMU saves device state, turns on userfaultfd write
//!   protection and resumes the guest by itself (QEMU 7.2; 10.0 leaves it
//!   paused and the agent sends `cont` as soon as QEMU counts its first
//!   page, see `hot_resume`); pages stream out while the
//!   guest runs, a page the guest writes is sent first (copy on write).
//! - **stop-copy**: `stop`, disk snapshot, plain `migrate` of the paused VM,
//!   `cont` once QEMU reports it completed. Downtime = the whole copy.
//! - **precopy**: live `migrate` with `pause-before-switchover`: QEMU stops
//!   the VM for the switch-over and waits in `pre-switchover`; the disk is
//!   snapshotted then, in that same pause, `migrate-continue` sends the
//!   last dirty pages and device state; the captured pages are checked
//!   against the paused guest's RAM (`final_ram`: QEMU 7.2 under TCG can
//!   miss a write), then `cont`.
//!
//! The agent accepts QEMU's connection in a thread and runs
//! [`vmcsnap_capture::capture`] on it; the image is committed only once
//! QEMU reports the migration `completed`. Whatever fails, the migration
//! capabilities and parameters are put back and a VM left paused is
//! resumed: a failed snapshot never harms the running VM (it may be left
//! running on the new overlay, which holds the same data).

use std::io::ErrorKind;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::{json, Value};
use vmcsnap_capture::{capture, CaptureOptions, Captured, Phase};

pub mod access;
mod capture_thread;
mod commit_watch;
pub(crate) mod disk_match;
mod disks;
mod final_ram;
pub mod limit;
mod modes;
pub mod parent;
mod pause;
mod prepare;
mod qemu_steps;
mod request;
mod settle;

use capture_thread::CaptureThread;
use qemu_steps::*;
pub(crate) use request::background_priority;
pub use request::{set_block_pages, writer_options, Hooks, Mode, NoHooks, Options, Report, Target};

use crate::member::Member;
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// How long a snapshot's migration may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the capture may make no progress while QEMU is expected to
/// send (or while it writes the image) before it is stopped and the
/// snapshot fails: a hung disk under the image (see `capture_thread`).
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long QEMU gets to connect to the capture socket.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);
/// A pre-copy that has not converged after this long gets a larger
/// downtime limit (the guest dirties memory faster than it is sent).
const PRECOPY_RELAX_AFTER: Duration = Duration::from_secs(20);
/// Migration bandwidth during a snapshot (bytes/s): the socket is local.
const SNAPSHOT_BANDWIDTH: u64 = 64 << 30;
/// The nice value of a QEMU whose guest is paused for a hot snapshot
/// (where permitted: root or CAP_SYS_NICE).
const PAUSE_NICE: i32 = -10;
/// QMP reply timeout while a snapshot runs.
const SNAPSHOT_QMP_TIMEOUT: Duration = Duration::from_secs(120);

/// Takes a snapshot of `member`: checks the VM, prepares the snapshot
/// outside the pause, pauses and streams (`modes`), puts the VM back and
/// joins the capture, then commits and reports (`settle`).
pub fn snapshot(
    member: &mut Member,
    run: &RunDir,
    opts: Options,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, AgentError> {
    let t_req = Instant::now();
    let start_unix_us = unix_us();
    let vm = &mut member.vm;
    // A QEMU version vmcsnap does not speak: refused before anything.
    let dialect = vm.dialect()?;
    let (opts, was_running) = prepare::as_it_is(vm, opts, progress);
    let ram = prepare::read_ram_first(vm, &opts, &*hooks, progress)?;
    let begun = prepare::Begun {
        t_req,
        start_unix_us,
        was_running,
        dialect,
        ram,
    };
    let mut job = prepare::prepare(vm, run, &opts, begun, progress)?;
    let result = pause_and_stream(vm, &mut job, hooks, progress);
    let captured = settle::settle(vm, &mut job, result, progress)?;
    settle::commit(vm, opts, job, captured, progress)
}

/// A snapshot under way, from its preparation to its report: what one
/// step hands to the next.
struct Job {
    /// When the request came.
    t_req: Instant,
    start_unix_us: u64,
    /// The snapshot's name.
    name: String,
    /// The VM's directory (its sampler's file).
    vm_dir: PathBuf,
    /// The frozen disks and the files the snapshot keeps.
    disks_dir: PathBuf,
    /// The capture socket.
    sock: PathBuf,
    /// The first disk's frozen file and overlay (the report names them).
    frozen: PathBuf,
    overlay: PathBuf,
    /// The parent decided on, or why the snapshot is full.
    parent_metric: String,
    disk_layer: Option<disk_match::DiskLayer>,
    /// QEMU's migration parameters before the snapshot.
    saved_params: Value,
    /// The capture thread, until it is joined or stopped.
    cap: Option<CaptureThread>,
    access: access::Collector,
    ctx: Ctx,
}

/// Marks the VM to be resumed by a next agent, and runs the mode's pause.
fn pause_and_stream(
    vm: &mut Vm,
    job: &mut Job,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    // Should this agent die while the VM is paused, the next one resumes it.
    if job.ctx.was_running {
        crate::intent::set(&vm.config, &crate::intent::Intent::Resume)?;
    }
    let cap = job
        .cap
        .as_mut()
        .expect("the capture runs until the pause is over");
    modes::run_mode(vm, &job.sock, cap, &mut job.ctx, hooks, progress)
}

#[derive(Debug, Clone, Default)]
struct Timings {
    /// The pause's boundaries as they happen.
    pause: pause::PauseClock,
    /// And its parts, once it is over.
    breakdown: Option<vmcsnap_image::PauseBreakdown>,
    downtime_ms: f64,
    disk_snapshot_ms: f64,
    stop_us: u64,
    resume_us: u64,
    transient_done_us: u64,
}

/// The state of a snapshot's pause, shared by its steps (`modes`,
/// `qemu_steps`).
struct Ctx {
    /// The snapshot's mode (stop-copy for a VM that was paused).
    mode: Mode,
    /// The VM ran when the snapshot began (else it stays paused).
    was_running: bool,
    /// The running QEMU's version.
    dialect: vmcsnap_migstream::Dialect,
    t: Timings,
    disk_done: bool,
    migrating: bool,
    /// Every writable disk, frozen together in the pause (`disks`).
    disks: Vec<disks::SnapDisk>,
    /// Names this snapshot's overlay nodes.
    stamp: u64,
    /// QEMU holds the relay's pipe (`prepare_relay`).
    relay_fd_added: bool,
    reference: Option<PathBuf>,
    /// Called once the disk snapshot froze the disk (the detection layer
    /// indexes its top file then).
    on_disk_frozen: Option<Box<dyn FnOnce() + Send>>,
    /// Pre-copy: the check of the captured pages against the paused
    /// guest's RAM (`final_ram`).
    ram_check: Option<final_ram::RamCheck>,
    /// Testing: the request's fault.
    fault: Option<crate::fault::Fault>,
    /// `precopy-untracked-write`: the page to put back before resuming.
    untracked_write: Option<final_ram::UntrackedWrite>,
    /// Hot: guest RAM as QEMU had it mapped (`ensure_ram_mapped`).
    ram: Option<vmcsnap_control::RamResidency>,
}

/// How `value` (a mode) is named in JSON and on the command line.
pub(crate) fn serde_name(value: impl Serialize) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn mode_name(mode: Mode) -> String {
    serde_name(mode)
}

/// Checks a new snapshot's name (default `<base>-<unix time>`, or with
/// `-2`, `-3`... if taken) under `root`, creates `root` and removes what
/// interrupted snapshots left there; returns the name and the directory
/// the snapshot will be committed to. Shared by VM and cluster snapshots.
pub(crate) fn new_snapshot_dir(
    root: &Path,
    name: Option<String>,
    base: &str,
) -> Result<(String, PathBuf), AgentError> {
    let name = name.unwrap_or_else(|| default_name(root, base));
    if !vmcsnap_image::manifest::is_plain_name(&name)
        || name.starts_with('.')
        || name.contains(vmcsnap_image::list::TEMP_MARKER)
    {
        return Err(AgentError::BadRequest(format!(
            "bad snapshot name {name:?}: use a plain file name (no '/', not starting with '.')"
        )));
    }
    std::fs::create_dir_all(root).map_err(AgentError::io("creating", root))?;
    let final_dir = root.join(&name);
    if final_dir.exists() {
        return Err(AgentError::BadRequest(format!(
            "snapshot {name:?} already exists ({}); choose another --name",
            final_dir.display()
        )));
    }
    if let Err(e) = vmcsnap_image::cleanup_stale(root) {
        log(format!(
            "snapshot: cleaning stale temporary directories in {}: {e}",
            root.display()
        ));
    }
    Ok((name, final_dir))
}

/// `<base>-<unix time>`, or with `-2`, `-3`... if taken within the second.
fn default_name(root: &Path, base: &str) -> String {
    let base = format!("{base}-{}", unix_ms() / 1000);
    let mut name = base.clone();
    let mut n = 2;
    while root.join(&name).exists() {
        name = format!("{base}-{n}");
        n += 1;
    }
    name
}

/// Microseconds since the Unix epoch.
pub(crate) fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!("hot".parse::<Mode>().unwrap(), Mode::Hot);
        assert_eq!("stop-copy".parse::<Mode>().unwrap(), Mode::StopCopy);
        assert_eq!("precopy".parse::<Mode>().unwrap(), Mode::Precopy);
        assert!("cold"
            .parse::<Mode>()
            .unwrap_err()
            .contains("hot, stop-copy or precopy"));
        assert_eq!(
            serde_json::to_value(Mode::StopCopy).unwrap(),
            json!("stop-copy")
        );
    }
}
