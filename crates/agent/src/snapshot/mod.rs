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
pub mod parent;
mod pause;
mod qemu_steps;
mod request;

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
    let fail = |detail: String| AgentError::Snapshot {
        vm: vm_name.clone(),
        detail,
    };
    // A QEMU version vmcsnap does not speak: refused before anything.
    let dialect = vm.dialect()?;
    // A VM the operator paused is taken as it is and stays paused: no
    // background snapshot (QEMU would resume the guest when it starts
    // one) and no `cont` after. Its "pause" costs the guest nothing.
    let was_running = vm.run_state() == "running";
    let mut opts = opts;
    if !was_running {
        progress(&format!(
            "{}: the VM is paused; copying it as it is (stop-copy), it stays paused",
            vm.name
        ));
        opts.mode = Mode::StopCopy;
    }
    // A first hot snapshot reads all of guest RAM once, while the guest
    // runs: before anything of the snapshot exists, and before the capture
    // starts waiting for QEMU's connection (a bounded wait), since the read
    // takes 20 s for a 4 GiB guest under TCG and longer on a busy host.
    // Checked again once the VM is ready to pause (`run_mode`).
    let mut ram = None;
    if opts.mode == Mode::Hot {
        let delay = crate::fault::ram_read_delay(opts.fault);
        ensure_ram_mapped(vm, &*hooks, progress, delay, &mut ram)?;
    }
    let root = opts
        .target
        .as_ref()
        .map_or_else(|| run.snapshots_dir(), |t| t.root.clone());
    let (name, final_dir) = new_snapshot_dir(&root, opts.name.clone(), &vm.name)?;

    // Outside the pause: the frozen disks (hard links of the chain each
    // writable disk runs on now, whose top becomes read-only backing once
    // its overlay is on top; see `disk_chain`, `disks`), the overlays, the
    // capture socket.
    let vm_dir = vm
        .config
        .console_log
        .parent()
        .expect("console log is in the VM dir")
        .to_path_buf();
    let disks_dir = opts
        .target
        .as_ref()
        .map_or_else(|| root.join(".disks").join(&name), |t| t.disks_dir.clone());
    let _ = std::fs::remove_dir_all(&disks_dir);
    std::fs::create_dir_all(&disks_dir).map_err(AgentError::io("creating", &disks_dir))?;
    let qemu_img = crate::qemu::find_qemu_img()?;
    let stamp = unix_ms();
    let snap_disks = match disks::prepare(vm, &qemu_img, &disks_dir, stamp) {
        Ok(d) => d,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&disks_dir);
            return Err(e);
        }
    };
    // The first disk's: the detection layer reads it, the report names it.
    let frozen = snap_disks[0].frozen.clone();
    let overlay = snap_disks[0].overlay.clone();
    let sock = vm_dir.join("snapshot.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(AgentError::io("binding", &sock))?;

    let v = vm.qmp()?.version();
    let mut copts = CaptureOptions::new(request::capture_mode(opts.mode), vm.name.clone());
    // The running QEMU's version: the manifest records it (a restore
    // refuses an image into an older QEMU) and the reader reads its stream.
    copts.qemu_version = format!("{}.{}.{}", v.major, v.minor, v.micro);
    copts.reader.dialect = dialect;
    // The same layout in both versions (FULL sections of stream version 3),
    // but only the version that wrote them can load them.
    copts.device_state_format = format!("qemu-{}-device-sections", dialect.release());
    let mut vm_config = opts.vm_config.clone();
    // An image VM's seed and workload files live in its directory, which
    // `down` or a restore replaces: the snapshot keeps its own copies.
    if let Err(e) = freeze_aux_files(&mut vm_config.qemu, &disks_dir) {
        let _ = std::fs::remove_dir_all(&disks_dir);
        disks::remove_overlays(&snap_disks);
        return Err(e);
    }
    copts.vm_config = vm_config.to_value();
    copts.progress_interval_bytes = 32 << 20;
    copts.writer = opts.writer;
    // An incremental snapshot of a single VM (not of a cluster snapshot's
    // VM: each cluster snapshot stands alone), or why it is full.
    let parent_metric = match parent::decide(&root, &vm.name, &opts, progress) {
        Ok(p) => {
            let metric = parent::metric_of(&p);
            copts.parent = Some(p);
            metric
        }
        Err(e) => e.metric(),
    };
    copts.compress_worker_init = Some(vmcsnap_capture::WorkerInit(std::sync::Arc::new(
        background_priority,
    )));
    copts.disks = disks::manifest_refs(&snap_disks);
    copts
        .labels
        .insert("snapshot_mode".into(), mode_name(opts.mode));
    let mut disk_layer = opts
        .disk_layer
        .then(|| disk_match::start(&frozen, &run.root().join("disk-index")));
    copts.disk_matcher = disk_layer.as_ref().map(disk_match::DiskLayer::matcher);
    // Pre-copy: the pages QEMU sent are checked against the paused guest's
    // RAM before the guest resumes (QEMU 7.2 under TCG can miss a write).
    let ram_check = (opts.mode == Mode::Precopy).then(|| {
        let (check, source) = final_ram::RamCheck::new();
        copts.final_ram = Some(source);
        check
    });

    let saved_params = vm.execute("query-migrate-parameters", Value::Null)?;
    // A stop-copy snapshot completes with QEMU's main loop locked: QMP
    // answers only once the whole RAM is written (7 s for a busy 1 GiB
    // guest under TCG in the benchmark), so wait longer than usual.
    vm.qmp()?.set_timeout(SNAPSHOT_QMP_TIMEOUT);
    let mut cap = CaptureThread::start(
        listener,
        final_dir.clone(),
        copts,
        opts.fault,
        crate::fault::short_capture_waits(opts.fault).unwrap_or(STALL_TIMEOUT),
        crate::fault::short_capture_waits(opts.fault).unwrap_or(ACCEPT_TIMEOUT),
    );
    let mut ctx = Ctx {
        t: Timings::default(),
        disk_done: false,
        migrating: false,
        disks: snap_disks,
        stamp,
        relay_fd_added: false,
        reference: opts.reference.clone(),
        on_disk_frozen: disk_layer
            .as_mut()
            .and_then(disk_match::DiskLayer::frozen_signal),
        ram_check,
        fault: opts.fault,
        untracked_write: None,
        ram,
    };
    if let Some(d) = &disk_layer {
        // Outside the pause: the backing files' index (cached after the
        // first snapshot of them).
        d.wait_lower(Duration::from_secs(10));
    }
    let access = access::Collector::start(
        &vm.name,
        vm.pid,
        &vm.config.ram_file,
        access::Config::new(opts.access_window, run.root()),
    );
    // Should this agent die while the VM is paused, the next one resumes it.
    let marked = if was_running {
        crate::intent::set(&vm.config, &crate::intent::Intent::Resume)
    } else {
        Ok(())
    };
    let result = marked.and_then(|()| {
        run_mode(
            vm,
            opts.mode,
            was_running,
            dialect,
            &sock,
            &mut cap,
            &mut ctx,
            hooks,
            progress,
        )
    });
    access.set_point_unix_us(ctx.t.resume_us);
    if result.is_err() {
        // A capture waiting for the paused guest's RAM stops waiting, and
        // a page an injected fault changed is put back before the guest
        // resumes.
        if let Some(check) = &ctx.ram_check {
            check.give_up("the snapshot failed");
        }
        if let Some(w) = ctx.untracked_write.take() {
            w.undo();
        }
    }
    // Whatever happened, no raised priority outlives the snapshot (the
    // pause's boost ends with `run_mode`; this finds one nobody ended).
    crate::thread_priority::undo_left(
        &crate::thread_priority::record_path(&vm.config),
        Some(vm.pid),
    );
    // Whatever happened: the VM must run on, with rejuvenation's settings
    // back to what they were.
    let mut cap = Some(cap);
    if result.is_err() && ctx.migrating {
        // Stop capturing first, in every mode: the relay then discards the
        // rest of the stream, so QEMU is never left blocked writing to a
        // capture that stopped reading. (In its completion phase QEMU writes
        // with its main loop locked: QMP, `migrate_cancel` and `cont`
        // included, would not answer until it could write again.)
        if let Some(c) = cap.take() {
            c.abort();
        }
        if opts.mode != Mode::Hot {
            // QEMU 7.2 removes the write protection of guest RAM only when a
            // background snapshot completes: one that fails or is cancelled
            // leaves RAM protected with nobody serving the faults, and the
            // guest hangs at its next write. So a hot snapshot is never
            // cancelled but left to finish into the relay; the others are.
            if let Err(e) = vm.execute("migrate_cancel", Value::Null) {
                log(format!(
                    "VM {}: cancelling the failed snapshot's migration: {e}",
                    vm.name
                ));
            }
        }
        // Until the migration has ended, QEMU refuses the settings below
        // and a next snapshot.
        vm.wait_migration_end("the failed snapshot's migration", MIGRATION_TIMEOUT);
    }
    release_unused(vm, &mut ctx);
    restore_settings(vm, &saved_params);
    if let Ok(q) = vm.qmp() {
        q.set_timeout(Duration::from_secs(10));
    }
    let resumed = if was_running {
        ensure_running(vm)
    } else {
        Ok(())
    };
    if resumed.is_ok() {
        crate::intent::clear(&vm.config);
    }
    if ctx.disk_done {
        // The VM writes to the overlays from now on; a restarted QEMU must too.
        for d in &ctx.disks {
            if let Some(c) = vm.config.disk_mut(&d.config_node) {
                c.path = d.overlay.clone();
            }
        }
    }
    let _ = std::fs::remove_file(&sock);
    let captured = match (with_resume(&vm.name, result, resumed), cap.take()) {
        (Ok(()), Some(cap)) => {
            let name = vm.name.clone();
            cap.join(&mut |m| progress(&format!("{name}: {m}")))
                .map_err(&fail)
        }
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
                disks::remove_overlays(&ctx.disks);
            }
            log(format!("snapshot {name} of {} failed: {e}", vm.name));
            return Err(e);
        }
    };
    let t = ctx.t.clone();
    let stats = captured.stats().clone();
    let duration_ms = t_req.elapsed().as_secs_f64() * 1000.0;
    {
        let m = captured.metrics_mut();
        m.downtime_ms = Some(t.downtime_ms.round() as u64);
        m.disk_snapshot_ms = Some(t.disk_snapshot_ms.round() as u64);
        m.pause = t.breakdown.clone();
        m.duration_ms = Some(duration_ms.round() as u64);
        m.other.insert(
            "downtime_us".into(),
            json!((t.downtime_ms * 1000.0).round() as u64),
        );
        // The capture's own notes (stream bytes, a parent it refused).
        let mut known = vmcsnap_control::SnapshotMetrics::read(&m.other);
        // HotRestore's WSS_sample: the sampler's mean over the last minutes.
        crate::sampler::record_in(&crate::sampler::load(&vm_dir), unix_ms(), &mut known);
        if let Some(d) = &disk_layer {
            d.record(m);
        }
        known.access_data = Some(access.note().to_string());
        // The capture's own note wins (a parent of another RAM layout).
        known.parent.get_or_insert_with(|| parent_metric.clone());
        known.record(&mut m.other);
        if let Some(ms) = ctx
            .ram_check
            .as_ref()
            .and_then(final_ram::RamCheck::hash_ms)
        {
            m.other.insert("precopy_ram_hash_ms".into(), json!(ms));
        }
    }
    let decided = parent_metric;
    let parent_metric = vmcsnap_control::SnapshotMetrics::read(&captured.metrics_mut().other)
        .parent
        .unwrap_or_default();
    if parent_metric != decided {
        tracing::warn!(vm = %vm.name, parent = %parent_metric, "snapshot is full: the capture could not use its parent");
    }
    let deadline = commit_watch::deadline_for(stats.stream_bytes);
    let vm_name = vm.name.clone();
    let committed = match commit_watch::commit_within(captured, deadline, opts.fault, &mut |m| {
        progress(&format!("{vm_name}: {m}"))
    }) {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&disks_dir);
            return Err(fail(format!("commit: {e}")));
        }
    };
    access.finish(&committed.path, &committed.manifest.ram_blocks);
    let report = Report {
        vm: vm.name.clone(),
        name,
        path: committed.path.clone(),
        mode: opts.mode,
        memory_mib: vm.config.memory_mib,
        downtime_ms: t.downtime_ms,
        disk_snapshot_ms: t.disk_snapshot_ms,
        pause: t.breakdown.clone(),
        duration_ms,
        stream_bytes: stats.stream_bytes,
        pages_stored: stats.pages_stored,
        pages_zero: stats.pages_zero,
        pages_guest_written: stats.pages_guest_written,
        parent: parent_metric,
        stream_mb_per_s: stats.stream_mb_per_s(),
        frozen_disk: frozen,
        frozen_disks: ctx.disks.iter().map(|d| d.frozen.clone()).collect(),
        overlay,
        reference: opts.reference,
        start_unix_us,
        pause_start_unix_us: t.stop_us,
        pause_end_unix_us: t.resume_us,
        transient_done_unix_us: t.transient_done_us,
        complete_unix_us: unix_us(),
        ram: ctx.ram,
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

struct Ctx {
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

#[allow(clippy::too_many_arguments)]
fn run_mode(
    vm: &mut Vm,
    mode: Mode,
    was_running: bool,
    dialect: vmcsnap_migstream::Dialect,
    sock: &Path,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    vm.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": SNAPSHOT_BANDWIDTH }),
    )?;
    set_caps(vm, mode == Mode::Hot, mode == Mode::Precopy, true)?;
    take_events(vm)?;
    // QEMU writes to a relay it owns, not to our socket: see `relay`.
    // The agent's own image, by its /proc link: it stays valid while the
    // agent runs even if the file was replaced or deleted since (a rebuild
    // or a package upgrade; `current_exe` would name a "(deleted)" path).
    let exe = PathBuf::from(format!("/proc/{}/exe", std::process::id()));
    let uri = prepare_relay(vm, &exe, sock, ctx)?;
    // The overlay, opened by QEMU now: in the pause it is only put on top.
    disks::add_overlays(vm, &mut ctx.disks, ctx.stamp)?;
    if mode == Mode::Hot {
        // Whatever unmapped guest RAM since the snapshot began (or a read
        // that missed some) is made up for here, outside the pause.
        ensure_ram_mapped(vm, &*hooks, progress, Duration::ZERO, &mut ctx.ram)?;
    }
    hooks.ready()?;
    match mode {
        Mode::Hot | Mode::StopCopy => {
            progress(&format!(
                "{}: pausing for the {} snapshot",
                vm.name,
                if mode == Mode::Hot {
                    "hot"
                } else {
                    "stop-copy"
                }
            ));
            // The work inside a hot pause is QEMU's (migration setup, device
            // state, write protection): ahead of other VMs' vCPUs, so that
            // the pauses of a cluster snapshot do not queue for the CPU.
            // The background copy after it runs at the VM's own priority.
            // Raised before `before_pause`, whose end a cluster snapshot's
            // VMs wait for together: nothing is left between it and `stop`.
            let boost = (mode == Mode::Hot)
                .then(|| {
                    let file = crate::thread_priority::record_path(&vm.config);
                    crate::thread_priority::Boost::start(vm.pid, PAUSE_NICE, &file)
                })
                .flatten();
            hooks.before_pause()?;
            // Nothing to do between `stop` and the disk snapshot: send the
            // three commands at once (no round trip inside the pause).
            let all_at_once = was_running && !hooks.works_while_paused() && ctx.reference.is_none();
            let mut commands = vec![
                ("transaction", disks::transaction(&ctx.disks)),
                ("migrate", uri),
            ];
            if all_at_once {
                commands.insert(0, ("stop", Value::Null));
            } else if was_running {
                vm.execute("stop", Value::Null)?;
                let stopped = unix_us();
                ctx.t.stop_us = event_ts(vm, "STOP")?;
                ctx.t.pause.start(ctx.t.stop_us);
                ctx.t.pause.mark("stop", stopped);
            } else {
                ctx.t.stop_us = unix_us();
                ctx.t.pause.start(ctx.t.stop_us);
            }
            if !all_at_once {
                hooks.paused()?;
                copy_reference(vm, ctx)?;
                ctx.t.pause.mark("agent", unix_us());
            }
            cap.expect_connection();
            let mut replies = vm.execute_pipelined(commands)?;
            let (migrate, _) = replies.pop().expect("a reply per command");
            let (disk, t_disk) = replies.pop().expect("a reply per command");
            // Set before any error returns: a migration that started must be
            // waited for whatever else failed.
            ctx.migrating = migrate.is_ok();
            if let Some((stopped, t)) = replies.pop() {
                stopped?;
                ctx.t.stop_us = event_ts(vm, "STOP")?;
                ctx.t.pause.start(ctx.t.stop_us);
                ctx.t.pause.mark("stop", t);
            }
            disk?;
            disk_snapshot_done(ctx);
            ctx.t.pause.mark("disk_snapshot", t_disk);
            migrate?;
            if mode == Mode::Hot {
                // The guest resumes once write protection is on (by QEMU
                // itself or by `cont`, as the version does it).
                ctx.t.resume_us = hot_resume(vm, dialect)?;
                drop(boost);
                ctx.t.transient_done_us = unix_us();
                hooks.running();
                let setup = migration_event_ts(vm, "setup");
                let active = migration_event_ts(vm, "active");
                if let (Some(setup), Some(active)) = (setup, active) {
                    ctx.t.pause.mark("migrate_command", setup);
                    ctx.t.pause.mark("qemu_setup", active);
                }
                ctx.t.breakdown = ctx.t.pause.finish("device_state", ctx.t.resume_us);
            }
            wait_migration(vm, &["completed"], cap, hooks, progress)?;
            if mode == Mode::StopCopy && !was_running {
                // Paused it was, paused it stays; it lost no running time.
                ctx.t.resume_us = ctx.t.stop_us;
                ctx.t.transient_done_us = unix_us();
                hooks.running();
            } else if mode == Mode::StopCopy {
                if let Some(done) = migration_event_ts(vm, "completed") {
                    ctx.t.pause.mark("copy", done);
                }
                cont_when_finalized(vm)?;
                ctx.t.resume_us = event_ts(vm, "RESUME")?;
                ctx.t.transient_done_us = unix_us();
                hooks.running();
                ctx.t.breakdown = ctx.t.pause.finish("resume", ctx.t.resume_us);
            }
        }
        Mode::Precopy => {
            progress(&format!("{}: live pre-copy", vm.name));
            ctx.migrating = true;
            cap.expect_connection();
            vm.execute("migrate", uri)?;
            wait_migration(vm, &["pre-switchover"], cap, hooks, progress)?;
            let seen = unix_us();
            ctx.t.stop_us = event_ts(vm, "STOP")?;
            ctx.t.pause.start(ctx.t.stop_us);
            ctx.t.pause.mark("switchover", seen);
            if let Some(page) = crate::fault::precopy_untracked_write(ctx.fault) {
                ctx.untracked_write =
                    Some(final_ram::UntrackedWrite::make(&vm.config.ram_file, page)?);
            }
            // Guest RAM stays as it is now until `cont`: hash it meanwhile.
            if let Some(check) = &ctx.ram_check {
                check.start(&vm.config.ram_file);
            }
            hooks.paused()?;
            copy_reference(vm, ctx)?;
            ctx.t.pause.mark("agent", unix_us());
            vm.execute("transaction", disks::transaction(&ctx.disks))?;
            let t_disk = unix_us();
            disk_snapshot_done(ctx);
            ctx.t.pause.mark("disk_snapshot", t_disk);
            vm.execute("migrate-continue", json!({ "state": "pre-switchover" }))?;
            wait_migration(vm, &["completed"], cap, hooks, progress)?;
            if let Some(done) = migration_event_ts(vm, "completed") {
                ctx.t.pause.mark("copy", done);
            }
            if let Some(check) = &ctx.ram_check {
                let found = check
                    .wait_checked(cap)
                    .map_err(|detail| AgentError::Snapshot {
                        vm: vm.name.clone(),
                        detail,
                    })?;
                ctx.t.pause.mark("ram_check", unix_us());
                if found.pages_patched > 0 {
                    tracing::warn!(
                        vm = %vm.name,
                        pages_patched = found.pages_patched,
                        first_pages = ?found.first_patched,
                        "pre-copy: QEMU's stream missed guest writes; those pages were taken from the paused guest's RAM"
                    );
                }
            }
            if let Some(w) = ctx.untracked_write.take() {
                w.undo();
            }
            cont_when_finalized(vm)?;
            ctx.t.resume_us = event_ts(vm, "RESUME")?;
            ctx.t.transient_done_us = unix_us();
            hooks.running();
            ctx.t.breakdown = ctx.t.pause.finish("resume", ctx.t.resume_us);
        }
    }
    ctx.migrating = false;
    ctx.t.downtime_ms = ctx.t.resume_us.saturating_sub(ctx.t.stop_us) as f64 / 1000.0;
    if let Some(b) = &ctx.t.breakdown {
        ctx.t.disk_snapshot_ms = b.part_us("disk_snapshot") as f64 / 1000.0;
    }
    Ok(())
}
/// Copies (hard links where it can) the files an image VM's QEMU reads at
/// start besides its writable disks, the cloud-init seed and the workload
/// script, into `dir`, and points the recorded QEMU configuration there.
fn freeze_aux_files(q: &mut crate::qemu::QemuConfig, dir: &Path) -> Result<(), AgentError> {
    if q.image.is_none() {
        return Ok(());
    }
    let keep = |p: &Path| -> Result<PathBuf, AgentError> {
        let to = dir.join(p.file_name().unwrap_or_default());
        if std::fs::hard_link(p, &to).is_err() {
            std::fs::copy(p, &to).map_err(AgentError::io("copying into the snapshot", p))?;
        }
        Ok(to)
    };
    for d in q.disks.iter_mut().filter(|d| d.read_only) {
        d.path = keep(&d.path)?;
    }
    if let Some(dev) = q.image.as_mut() {
        if let Some(w) = dev.workload_file.as_mut() {
            *w = keep(w)?;
        }
    }
    Ok(())
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
