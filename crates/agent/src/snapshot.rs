//! Snapshotting a running VM into vmcsnap's own image format.
//!
//! Memory and disk are frozen in one pause; see `docs/snapshot.md`.
//!
//! - **hot** (HotSnap): `stop`; `transaction` with `blockdev-snapshot-sync`
//!   (the current qcow2 becomes the frozen disk, the VM continues on a new
//!   overlay); `migrate` with `background-snapshot` to a unix socket the
//!   agent listens on. QEMU saves device state, turns on userfaultfd write
//!   protection and resumes the guest by itself; pages stream out while the
//!   guest runs, a page the guest writes is sent first (copy on write).
//! - **stop-copy**: `stop`, disk snapshot, plain `migrate` of the paused VM,
//!   `cont` once QEMU reports it completed. Downtime = the whole copy.
//! - **precopy**: live `migrate` with `pause-before-switchover`: QEMU stops
//!   the VM for the switch-over and waits in `pre-switchover`; the disk is
//!   snapshotted then, in that same pause, `migrate-continue` sends the
//!   last dirty pages and device state, then `cont`.
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

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use vmcsnap_capture::{capture, CaptureMode, CaptureOptions, Captured, DiskRef, Phase};

use crate::cluster::Member;
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// How long a snapshot's migration may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How long QEMU gets to connect to the capture socket.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);
/// A pre-copy that has not converged after this long gets a larger
/// downtime limit (the guest dirties memory faster than it is sent).
const PRECOPY_RELAX_AFTER: Duration = Duration::from_secs(20);
/// Migration bandwidth during a snapshot (bytes/s): the socket is local.
const SNAPSHOT_BANDWIDTH: u64 = 64 << 30;
/// QMP reply timeout while a snapshot runs.
const SNAPSHOT_QMP_TIMEOUT: Duration = Duration::from_secs(120);

/// How a snapshot is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Background snapshot: a pause of milliseconds, copy-on-write after.
    Hot,
    /// The VM stays paused while all of its memory is copied.
    StopCopy,
    /// Live pre-copy; the VM pauses for the last round and the disk.
    Precopy,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hot" => Ok(Mode::Hot),
            "stop-copy" => Ok(Mode::StopCopy),
            "precopy" => Ok(Mode::Precopy),
            _ => Err(format!("unknown snapshot mode {s:?}: use hot, stop-copy or precopy")),
        }
    }
}

impl Mode {
    fn capture_mode(self) -> CaptureMode {
        match self {
            Mode::Hot => CaptureMode::BackgroundSnapshot,
            Mode::StopCopy => CaptureMode::StopCopy,
            Mode::Precopy => CaptureMode::Precopy,
        }
    }
}

/// What the request asks for.
#[derive(Debug, Clone)]
pub struct Options {
    /// The mode.
    pub mode: Mode,
    /// The snapshot's name (default `<vm>-<unix time>`).
    pub name: Option<String>,
    /// Debug: copy the guest RAM file here while the VM is paused for the
    /// snapshot (before the memory copy starts), to check the image against.
    pub reference: Option<PathBuf>,
    /// The VM's spec entry, for the manifest.
    pub vm_config: Value,
    /// Where the snapshot goes; `None`: `<run>/snapshots/<name>`, frozen
    /// disks in `<run>/snapshots/.disks/<name>`.
    pub target: Option<Target>,
}

/// Where a snapshot goes when it is part of something larger (a VM's
/// snapshot inside a cluster snapshot).
#[derive(Debug, Clone)]
pub struct Target {
    /// The directory the snapshot directory `<name>` is created in.
    pub root: PathBuf,
    /// The directory the frozen disk chain is hard-linked into.
    pub disks_dir: PathBuf,
}

/// Calls a snapshot makes around the VM's pause, so that a cluster snapshot
/// can cut the VM's network exactly (see `cluster_snapshot`). Errors from
/// the hooks fail the snapshot (and the VM is resumed).
pub trait Hooks {
    /// Everything that can be done before the snapshot proper is done (disk
    /// overlay made, capture listening, migration settings in place); the
    /// next step pauses the VM (hot, stop-copy) or starts the pre-copy. A
    /// cluster snapshot waits here until every VM is this far, so that the
    /// pauses start together. An error abandons the snapshot.
    fn ready(&mut self) -> Result<(), AgentError> {
        Ok(())
    }
    /// Hot and stop-copy: just before the VM is paused.
    fn before_pause(&mut self) -> Result<(), AgentError> {
        Ok(())
    }
    /// Right after the VM was paused (all modes; for pre-copy, QEMU paused
    /// it for the switch-over and `before_pause` was not called).
    fn paused(&mut self) -> Result<(), AgentError> {
        Ok(())
    }
    /// The VM runs again after its transient snapshot (hot: QEMU resumed it
    /// once write protection was on; stop-copy and pre-copy: after `cont`).
    fn running(&mut self) {}
    /// Whether the snapshot should be abandoned (polled while it runs).
    fn cancelled(&self) -> Option<String> {
        None
    }
}

/// No hooks: a snapshot of one VM.
pub struct NoHooks;
impl Hooks for NoHooks {}

/// What one snapshot measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The VM.
    pub vm: String,
    /// The snapshot's name.
    pub name: String,
    /// Its directory.
    pub path: PathBuf,
    /// The mode.
    pub mode: Mode,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Guest not running: QMP STOP to RESUME event timestamps.
    pub downtime_ms: f64,
    /// The disk snapshot (QMP transaction) alone.
    pub disk_snapshot_ms: f64,
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
    /// Stream throughput.
    pub stream_mb_per_s: f64,
    /// The frozen disk image (a hard link of the qcow2 the VM ran on).
    pub frozen_disk: PathBuf,
    /// The overlay the VM runs on from now on.
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
}

/// Takes a snapshot of `member`.
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
    let vm_name = vm.name.clone();
    let fail = |detail: String| AgentError::Snapshot { vm: vm_name.clone(), detail };
    let root = opts.target.as_ref().map_or_else(|| run.snapshots_dir(), |t| t.root.clone());
    let name = opts.name.clone().unwrap_or_else(|| default_name(&root, &vm.name));
    if !vmcsnap_image::manifest::is_plain_name(&name) || name.starts_with('.') || name.contains(".tmp-") {
        return Err(AgentError::BadRequest(format!(
            "bad snapshot name {name:?}: use a plain file name (no '/', not starting with '.')"
        )));
    }
    std::fs::create_dir_all(&root).map_err(AgentError::io("creating", &root))?;
    let final_dir = root.join(&name);
    if final_dir.exists() {
        return Err(AgentError::BadRequest(format!(
            "snapshot {name:?} already exists ({}); choose another --name",
            final_dir.display()
        )));
    }
    if let Err(e) = vmcsnap_image::cleanup_stale(&root) {
        log(format!("snapshot: cleaning stale temporary directories: {e}"));
    }

    // Outside the pause: the frozen disk (hard links of the chain the VM
    // runs on now, whose top becomes read-only backing once the overlay is
    // on top; see `disk_chain`), the overlay, the capture socket.
    let vm_dir = vm.config.console_log.parent().expect("console log is in the VM dir").to_path_buf();
    let disks_dir = opts.target.as_ref().map_or_else(|| root.join(".disks").join(&name), |t| t.disks_dir.clone());
    let _ = std::fs::remove_dir_all(&disks_dir);
    std::fs::create_dir_all(&disks_dir).map_err(AgentError::io("creating", &disks_dir))?;
    let current_disk = vm.config.disk.clone();
    let qemu_img = crate::qemu::find_qemu_img()?;
    let stamp = unix_ms();
    let overlay = vm_dir.join(format!("data-{stamp}.qcow2"));
    let prepared = crate::disk_chain::chain(&qemu_img, &current_disk).and_then(|chain| {
        let frozen = crate::disk_chain::freeze(&chain, &disks_dir)?;
        crate::disk_chain::create_overlay(&qemu_img, &current_disk, chain.virtual_size, &overlay)?;
        Ok(frozen)
    });
    let frozen = match prepared {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&disks_dir);
            let _ = std::fs::remove_file(&overlay);
            return Err(e);
        }
    };
    let sock = vm_dir.join("snapshot.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(AgentError::io("binding", &sock))?;

    let node = top_node(vm);
    let v = vm.qmp()?.version();
    let mut copts = CaptureOptions::new(opts.mode.capture_mode(), vm.name.clone());
    copts.qemu_version = format!("{}.{}.{}", v.major, v.minor, v.micro);
    copts.vm_config = opts.vm_config.clone();
    copts.progress_interval_bytes = 32 << 20;
    let mut extra = std::collections::BTreeMap::new();
    extra.insert("overlay".to_string(), json!(overlay));
    extra.insert("original_path".to_string(), json!(current_disk));
    copts.disks = vec![DiskRef {
        node: node.clone(),
        path: frozen.display().to_string(),
        format: "qcow2".into(),
        extra,
    }];
    copts.labels.insert("snapshot_mode".into(), mode_name(opts.mode));

    let saved_params = vm.execute("query-migrate-parameters", Value::Null)?;
    // A stop-copy snapshot completes with QEMU's main loop locked: QMP
    // answers only once the whole RAM is written (7 s for a busy 1 GiB
    // guest under TCG in the benchmark), so wait longer than usual.
    vm.qmp()?.set_timeout(SNAPSHOT_QMP_TIMEOUT);
    let mut cap = CaptureThread::start(listener, final_dir.clone(), copts);
    let mut ctx = Ctx {
        t: Timings::default(),
        disk_done: false,
        migrating: false,
        node,
        overlay: overlay.clone(),
        reference: opts.reference.clone(),
    };
    let result = run_mode(vm, opts.mode, &sock, &mut cap, &mut ctx, hooks, progress);
    // Whatever happened: the VM must run on, with rejuvenation's settings
    // back to what they were.
    let mut cap = Some(cap);
    if result.is_err() && ctx.migrating {
        if opts.mode == Mode::Hot {
            // QEMU 7.2 removes the write protection of guest RAM only when a
            // background snapshot completes: one that fails or is cancelled
            // leaves RAM protected with nobody serving the faults, and the
            // guest hangs at its next write. So never cancel it: stop
            // capturing (the relay then discards the rest of the stream) and
            // let QEMU finish.
            if let Some(c) = cap.take() {
                c.abort();
            }
            finish_background_snapshot(vm);
        } else {
            let _ = vm.execute("migrate_cancel", Value::Null);
        }
    }
    restore_settings(vm, &saved_params);
    if let Ok(q) = vm.qmp() {
        q.set_timeout(Duration::from_secs(10));
    }
    let resumed = ensure_running(vm);
    if ctx.disk_done {
        // The VM writes to the overlay from now on; a restarted QEMU must too.
        vm.config.disk = overlay.clone();
    }
    let _ = std::fs::remove_file(&sock);
    let captured = match (result.and(resumed), cap.take()) {
        (Ok(()), Some(cap)) => cap.join().map_err(&fail),
        (Ok(()), None) => Err(fail("the capture was stopped".into())),
        (Err(e), cap) => {
            if let Some(c) = cap {
                c.abort();
            }
            Err(e)
        }
    };
    let mut captured = match captured {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&disks_dir);
            if !ctx.disk_done {
                let _ = std::fs::remove_file(&overlay);
            }
            log(format!("snapshot {name} of {} failed: {e}", vm.name));
            return Err(e);
        }
    };
    let t = ctx.t;
    let stats = captured.stats().clone();
    let duration_ms = t_req.elapsed().as_secs_f64() * 1000.0;
    {
        let m = captured.metrics_mut();
        m.downtime_ms = Some(t.downtime_ms.round() as u64);
        m.disk_snapshot_ms = Some(t.disk_snapshot_ms.round() as u64);
        m.duration_ms = Some(duration_ms.round() as u64);
        m.other.insert("downtime_us".into(), json!((t.downtime_ms * 1000.0).round() as u64));
        // HotRestore's WSS_sample: the sampler's mean over the last minutes.
        let samples = crate::sampler::load(&vm_dir);
        if let Some(p) = crate::sampler::mean_pages(&samples) {
            m.other.insert("wss_sample_pages".into(), json!(p));
            m.other.insert("wss_samples".into(), json!(samples.len()));
        }
    }
    let committed = match captured.commit() {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&disks_dir);
            return Err(fail(format!("commit: {e}")));
        }
    };
    let report = Report {
        vm: vm.name.clone(),
        name,
        path: committed.path.clone(),
        mode: opts.mode,
        memory_mib: vm.config.memory_mib,
        downtime_ms: t.downtime_ms,
        disk_snapshot_ms: t.disk_snapshot_ms,
        duration_ms,
        stream_bytes: stats.stream_bytes,
        pages_stored: stats.pages_stored,
        pages_zero: stats.pages_zero,
        pages_guest_written: stats.pages_guest_written,
        stream_mb_per_s: stats.stream_mb_per_s(),
        frozen_disk: frozen,
        overlay,
        reference: opts.reference,
        start_unix_us,
        pause_start_unix_us: t.stop_us,
        pause_end_unix_us: t.resume_us,
        transient_done_unix_us: t.transient_done_us,
        complete_unix_us: unix_us(),
    };
    progress(&format!(
        "{}: snapshot {} committed: downtime {:.1} ms, disk {:.1} ms, total {:.1} ms",
        report.vm, report.name, report.downtime_ms, report.disk_snapshot_ms, report.duration_ms
    ));
    log(format!(
        "snapshot {} of {} ({:?}): downtime {:.1} ms, disk snapshot {:.1} ms, duration {:.1} ms, {} stream bytes",
        report.name, report.vm, report.mode, report.downtime_ms, report.disk_snapshot_ms, report.duration_ms, report.stream_bytes
    ));
    Ok(report)
}

#[derive(Debug, Clone, Copy, Default)]
struct Timings {
    downtime_ms: f64,
    disk_snapshot_ms: f64,
    stop_us: u64,
    resume_us: u64,
    transient_done_us: u64,
}

struct Ctx {
    t: Timings,
    disk_done: bool,
    migrating: bool,
    node: String,
    overlay: PathBuf,
    reference: Option<PathBuf>,
}

fn run_mode(
    vm: &mut Vm,
    mode: Mode,
    sock: &Path,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    if mode == Mode::Hot && !vm.ram_populated {
        populate_ram(vm, hooks, progress)?;
    }
    vm.execute("migrate-set-parameters", json!({ "max-bandwidth": SNAPSHOT_BANDWIDTH }))?;
    set_caps(vm, mode == Mode::Hot, mode == Mode::Precopy)?;
    take_events(vm)?;
    // QEMU writes to a relay it owns, not to our socket: see `relay`.
    let exe = std::env::current_exe().map_err(AgentError::io("finding the vmcsnap executable", "/proc/self/exe"))?;
    let uri = json!({ "uri": crate::relay::exec_uri(&exe, sock) });
    hooks.ready()?;
    match mode {
        Mode::Hot | Mode::StopCopy => {
            progress(&format!("{}: pausing for the {} snapshot", vm.name, if mode == Mode::Hot { "hot" } else { "stop-copy" }));
            hooks.before_pause()?;
            vm.execute("stop", Value::Null)?;
            ctx.t.stop_us = event_ts(vm, "STOP")?;
            hooks.paused()?;
            copy_reference(vm, ctx)?;
            disk_snapshot(vm, ctx)?;
            ctx.migrating = true;
            vm.execute("migrate", uri)?;
            if mode == Mode::Hot {
                // QEMU resumes the guest by itself once write protection is on.
                ctx.t.resume_us = wait_resume(vm)?;
                ctx.t.transient_done_us = unix_us();
                hooks.running();
            }
            wait_migration(vm, &["completed"], cap, hooks, progress)?;
            if mode == Mode::StopCopy {
                vm.execute("cont", Value::Null)?;
                ctx.t.resume_us = event_ts(vm, "RESUME")?;
                ctx.t.transient_done_us = unix_us();
                hooks.running();
            }
        }
        Mode::Precopy => {
            progress(&format!("{}: live pre-copy", vm.name));
            ctx.migrating = true;
            vm.execute("migrate", uri)?;
            wait_migration(vm, &["pre-switchover"], cap, hooks, progress)?;
            ctx.t.stop_us = event_ts(vm, "STOP")?;
            hooks.paused()?;
            copy_reference(vm, ctx)?;
            disk_snapshot(vm, ctx)?;
            vm.execute("migrate-continue", json!({ "state": "pre-switchover" }))?;
            wait_migration(vm, &["completed"], cap, hooks, progress)?;
            vm.execute("cont", Value::Null)?;
            ctx.t.resume_us = event_ts(vm, "RESUME")?;
            ctx.t.transient_done_us = unix_us();
            hooks.running();
        }
    }
    ctx.migrating = false;
    ctx.t.downtime_ms = ctx.t.resume_us.saturating_sub(ctx.t.stop_us) as f64 / 1000.0;
    Ok(())
}

/// Makes this QEMU read every page of guest RAM once, while the guest runs.
///
/// A background snapshot populates QEMU's page tables for all of RAM before
/// write-protecting it (`ram_write_tracking_prepare`), and since vmcsnap
/// pauses the VM first (to freeze the disk in the same pause), that happens
/// inside the pause: 170-250 ms for a fresh 256 MiB guest under TCG instead
/// of 20-40 ms once populated (measured). QMP `pmemsave` of guest-physical
/// RAM to /dev/null, in chunks so that QEMU's main loop is never blocked
/// for long, reads every page without pausing the guest. Needed once per
/// QEMU process. (A pre-copy migration cancelled after its first pass does
/// the same but may complete on its own for an idle guest, which leaves the
/// disks inactive: QEMU 7.2 then aborts at the next migration.)
fn populate_ram(vm: &mut Vm, hooks: &dyn Hooks, progress: &mut dyn FnMut(&str)) -> Result<(), AgentError> {
    /// Bytes read per `pmemsave` (about 10 ms of QEMU's main loop under TCG).
    const CHUNK: u64 = 8 << 20;
    /// microvm maps RAM below 3 GiB, and the rest from 4 GiB.
    const LOW_RAM: u64 = 3 << 30;
    let t = Instant::now();
    progress(&format!("{}: first hot snapshot of this QEMU: reading guest RAM once so that the pause stays short", vm.name));
    let ram = vm.config.ram_kib() * 1024;
    let ranges = [(0, ram.min(LOW_RAM)), (4 << 30, ram.saturating_sub(LOW_RAM))];
    for (base, len) in ranges {
        let mut off = 0;
        while off < len {
            if let Some(why) = hooks.cancelled() {
                return Err(AgentError::Snapshot { vm: vm.name.clone(), detail: format!("cancelled: {why}") });
            }
            let n = CHUNK.min(len - off);
            vm.execute("pmemsave", json!({ "val": base + off, "size": n, "filename": "/dev/null" }))?;
            off += n;
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    vm.ram_populated = true;
    crate::log(format!("VM {}: guest RAM read once in {:.0} ms", vm.name, t.elapsed().as_secs_f64() * 1000.0));
    Ok(())
}

/// Waits (bounded) until a background snapshot whose stream is being
/// discarded has finished in QEMU, so that guest RAM is unprotected.
fn finish_background_snapshot(vm: &mut Vm) {
    let t = Instant::now();
    loop {
        let status = match vm.execute("query-migrate", Value::Null) {
            Ok(st) => st["status"].as_str().unwrap_or("").to_string(),
            Err(e) => {
                log(format!("VM {}: waiting for the abandoned background snapshot: {e}", vm.name));
                return;
            }
        };
        if !matches!(status.as_str(), "setup" | "active" | "device" | "wait-unplug") {
            log(format!(
                "VM {}: abandoned background snapshot ended ({status}) after {:.0} ms",
                vm.name,
                t.elapsed().as_secs_f64() * 1000.0
            ));
            return;
        }
        if t.elapsed() > MIGRATION_TIMEOUT {
            log(format!("VM {}: abandoned background snapshot still {status} after {MIGRATION_TIMEOUT:?}", vm.name));
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Hot mode: waits for QEMU to resume the guest after saving device state
/// and write-protecting RAM; returns the RESUME event's timestamp (µs).
fn wait_resume(vm: &mut Vm) -> Result<u64, AgentError> {
    let start = Instant::now();
    loop {
        let vm_name = vm.name.clone();
        match vm.qmp()?.wait_event("RESUME", Duration::from_millis(20)) {
            Ok(ev) => return Ok(ev.timestamp_us),
            Err(vmcsnap_qmp::QmpError::Timeout(..)) => {}
            Err(source) => return Err(AgentError::Qmp { vm: vm_name, source }),
        }
        let st = vm.execute("query-migrate", Value::Null)?;
        let status = st["status"].as_str().unwrap_or("");
        if status == "failed" || status == "cancelled" {
            let detail = st["error-desc"].as_str().unwrap_or("no detail from QEMU").to_string();
            return Err(AgentError::Migration { vm: vm.name.clone(), what: "snapshot".into(), detail });
        }
        if start.elapsed() > ACCEPT_TIMEOUT {
            return Err(AgentError::Snapshot {
                vm: vm.name.clone(),
                detail: format!("QEMU did not resume the guest within {ACCEPT_TIMEOUT:?} of starting the background snapshot"),
            });
        }
    }
}

fn set_caps(vm: &mut Vm, background: bool, pause_before_switchover: bool) -> Result<Value, AgentError> {
    vm.execute(
        "migrate-set-capabilities",
        json!({ "capabilities": [
            { "capability": "x-ignore-shared", "state": false },
            { "capability": "background-snapshot", "state": background },
            { "capability": "pause-before-switchover", "state": pause_before_switchover },
        ] }),
    )
}

/// Puts back what a snapshot changed: capabilities off (rejuvenation sets
/// the ones it needs), bandwidth and downtime limit as they were.
fn restore_settings(vm: &mut Vm, saved: &Value) {
    if let Err(e) = set_caps(vm, false, false) {
        log(format!("VM {}: resetting migration capabilities: {e}", vm.name));
    }
    let mut p = serde_json::Map::new();
    for k in ["max-bandwidth", "downtime-limit"] {
        if let Some(v) = saved.get(k) {
            p.insert(k.into(), v.clone());
        }
    }
    if let Err(e) = vm.execute("migrate-set-parameters", Value::Object(p)) {
        log(format!("VM {}: resetting migration parameters: {e}", vm.name));
    }
}

/// Resumes a VM a snapshot left paused (a failure mid-way).
fn ensure_running(vm: &mut Vm) -> Result<(), AgentError> {
    let st = vm.execute("query-status", Value::Null)?;
    let status = st["status"].as_str().unwrap_or("");
    if status != "running" {
        log(format!("VM {}: {status} after the snapshot; resuming it", vm.name));
        vm.execute("cont", Value::Null)?;
    }
    Ok(())
}

fn take_events(vm: &mut Vm) -> Result<(), AgentError> {
    let name = vm.name.clone();
    vm.qmp()?.take_events().map_err(|source| AgentError::Qmp { vm: name, source })?;
    Ok(())
}

/// The node name at the top of the VM's disk chain (`disk0` until a first
/// snapshot puts an overlay on it).
fn top_node(vm: &mut Vm) -> String {
    vm.execute("query-block", Value::Null)
        .ok()
        .and_then(|v| {
            v.as_array()?.iter().find_map(|d| d["inserted"]["node-name"].as_str().map(str::to_string))
        })
        .unwrap_or_else(|| crate::qemu::DISK_NODE.to_string())
}

fn disk_snapshot(vm: &mut Vm, ctx: &mut Ctx) -> Result<(), AgentError> {
    let t = Instant::now();
    let new_node = format!("ov{}", unix_ms());
    vm.execute(
        "transaction",
        json!({ "actions": [ {
            "type": "blockdev-snapshot-sync",
            "data": {
                "node-name": ctx.node,
                "snapshot-file": ctx.overlay,
                "snapshot-node-name": new_node,
                "format": "qcow2",
                // Made beforehand, with a relative backing name (`disk_chain`).
                "mode": "existing",
            }
        } ] }),
    )?;
    ctx.disk_done = true;
    ctx.t.disk_snapshot_ms = t.elapsed().as_secs_f64() * 1000.0;
    Ok(())
}

fn copy_reference(vm: &Vm, ctx: &Ctx) -> Result<(), AgentError> {
    if let Some(r) = &ctx.reference {
        std::fs::copy(&vm.config.ram_file, r).map_err(AgentError::io("copying guest RAM to", r))?;
    }
    Ok(())
}

/// Waits for the QMP event `name` and returns its timestamp (µs).
fn event_ts(vm: &mut Vm, name: &str) -> Result<u64, AgentError> {
    let vm_name = vm.name.clone();
    let ev = vm.qmp()?.wait_event(name, Duration::from_secs(10)).map_err(|source| AgentError::Qmp { vm: vm_name, source })?;
    Ok(ev.timestamp_us)
}

/// Polls `query-migrate` until its status is one of `until`; fails on
/// `failed`/`cancelled`, or when the capture thread ended in error.
fn wait_migration(
    vm: &mut Vm,
    until: &[&str],
    cap: &mut CaptureThread,
    hooks: &dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    let start = Instant::now();
    let mut relaxed = false;
    loop {
        if let Some(why) = hooks.cancelled() {
            return Err(AgentError::Snapshot { vm: vm.name.clone(), detail: format!("cancelled: {why}") });
        }
        for m in cap.progress.try_iter() {
            progress(&format!("{}: {m}", vm.name));
        }
        let st = vm.execute("query-migrate", Value::Null)?;
        let status = st["status"].as_str().unwrap_or("");
        if until.contains(&status) {
            return Ok(());
        }
        if status == "failed" || status == "cancelled" {
            let mut detail = st["error-desc"].as_str().unwrap_or("no detail from QEMU").to_string();
            if cap.finished() {
                if let Some(e) = cap.error() {
                    detail = format!("{detail}; capture: {e}");
                }
            }
            return Err(AgentError::Migration { vm: vm.name.clone(), what: "snapshot".into(), detail });
        }
        if cap.finished() {
            if let Some(e) = cap.error() {
                return Err(AgentError::Snapshot { vm: vm.name.clone(), detail: format!("capture: {e}") });
            }
        }
        if !relaxed && status == "active" && start.elapsed() > PRECOPY_RELAX_AFTER && until.contains(&"pre-switchover") {
            relaxed = true;
            log(format!("VM {}: pre-copy not converging; raising downtime-limit to 5 s", vm.name));
            progress(&format!("{}: pre-copy not converging, raising the downtime limit", vm.name));
            let _ = vm.execute("migrate-set-parameters", json!({ "downtime-limit": 5000 }));
        }
        if start.elapsed() > MIGRATION_TIMEOUT {
            return Err(AgentError::Migration {
                vm: vm.name.clone(),
                what: "snapshot".into(),
                detail: format!("not finished after {MIGRATION_TIMEOUT:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The thread that accepts QEMU's connection and captures the stream.
struct CaptureThread {
    handle: Option<JoinHandle<Result<Captured, String>>>,
    abort: Arc<AtomicBool>,
    conn: Arc<Mutex<Option<UnixStream>>>,
    progress: mpsc::Receiver<String>,
    result: Option<Result<Captured, String>>,
}

impl CaptureThread {
    fn start(listener: UnixListener, final_dir: PathBuf, opts: CaptureOptions) -> CaptureThread {
        let abort = Arc::new(AtomicBool::new(false));
        let conn: Arc<Mutex<Option<UnixStream>>> = Arc::new(Mutex::new(None));
        let (tx, rx) = mpsc::channel();
        let (abort2, conn2) = (abort.clone(), conn.clone());
        let handle = std::thread::spawn(move || -> Result<Captured, String> {
            listener.set_nonblocking(true).map_err(|e| e.to_string())?;
            let deadline = Instant::now() + ACCEPT_TIMEOUT;
            let stream = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if abort2.load(Ordering::SeqCst) {
                            return Err("aborted before QEMU connected".into());
                        }
                        if Instant::now() > deadline {
                            return Err(format!("QEMU did not connect within {ACCEPT_TIMEOUT:?}"));
                        }
                        std::thread::sleep(Duration::from_micros(500));
                    }
                    Err(e) => return Err(format!("accept: {e}")),
                }
            };
            stream.set_nonblocking(false).map_err(|e| e.to_string())?;
            if let Ok(c) = stream.try_clone() {
                *conn2.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
            }
            if abort2.load(Ordering::SeqCst) {
                return Err("aborted".into());
            }
            capture(std::io::BufReader::with_capacity(1 << 20, stream), &final_dir, opts, &mut |p| {
                let what = match p.phase {
                    Phase::Receiving => "receiving",
                    Phase::WritingImage => "writing image",
                    Phase::Done => "image complete",
                };
                let _ = tx.send(format!(
                    "{what}: {} MiB of stream, {} pages written, {:.1} s",
                    p.stream_bytes >> 20,
                    p.pages_written,
                    p.elapsed.as_secs_f64()
                ));
            })
            .map_err(|e| e.to_string())
        });
        CaptureThread { handle: Some(handle), abort, conn, progress: rx, result: None }
    }

    fn finished(&mut self) -> bool {
        if self.result.is_none() && self.handle.as_ref().is_some_and(|h| h.is_finished()) {
            let h = self.handle.take().expect("checked");
            self.result = Some(h.join().unwrap_or_else(|_| Err("capture thread panicked".into())));
        }
        self.result.is_some()
    }

    fn error(&self) -> Option<&str> {
        match &self.result {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// Waits for the capture to end (QEMU closes the stream at completion).
    fn join(mut self) -> Result<Captured, String> {
        if let Some(h) = self.handle.take() {
            self.result = Some(h.join().unwrap_or_else(|_| Err("capture thread panicked".into())));
        }
        self.result.take().expect("joined")
    }

    /// Stops the capture (its temporary directory is removed).
    fn abort(mut self) {
        self.abort.store(true, Ordering::SeqCst);
        if let Some(c) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn mode_name(mode: Mode) -> String {
    serde_json::to_value(mode).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// `<vm>-<unix time>`, or with `-2`, `-3`... if taken within the second.
fn default_name(root: &Path, vm: &str) -> String {
    let base = format!("{vm}-{}", unix_ms() / 1000);
    let mut name = base.clone();
    let mut n = 2;
    while root.join(&name).exists() {
        name = format!("{base}-{n}");
        n += 1;
    }
    name
}

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!("hot".parse::<Mode>().unwrap(), Mode::Hot);
        assert_eq!("stop-copy".parse::<Mode>().unwrap(), Mode::StopCopy);
        assert_eq!("precopy".parse::<Mode>().unwrap(), Mode::Precopy);
        assert!("cold".parse::<Mode>().unwrap_err().contains("hot, stop-copy or precopy"));
        assert_eq!(serde_json::to_value(Mode::StopCopy).unwrap(), json!("stop-copy"));
    }
}
