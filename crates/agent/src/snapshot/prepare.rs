//! Before the pause: the snapshot's directories, frozen disks and
//! overlays, the capture's options, and the capture thread waiting for
//! QEMU (see `super::snapshot`).

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmcsnap_capture::CaptureOptions;

use super::capture_thread::CaptureThread;
use super::qemu_steps::ensure_ram_mapped;
use super::{
    access, background_priority, disk_match, disks, final_ram, mode_name, parent, request, unix_ms,
    Ctx, Hooks, Job, Mode, Options, Timings, ACCEPT_TIMEOUT, SNAPSHOT_QMP_TIMEOUT, STALL_TIMEOUT,
};
use crate::vm::Vm;
use crate::{AgentError, RunDir};

/// What is known of a snapshot before anything of it exists.
pub(super) struct Begun {
    pub t_req: Instant,
    pub start_unix_us: u64,
    pub was_running: bool,
    pub dialect: vmcsnap_migstream::Dialect,
    /// Hot: guest RAM as QEMU had it mapped (`read_ram_first`).
    pub ram: Option<vmcsnap_control::RamResidency>,
}

/// A VM the operator paused is taken as it is and stays paused: no
/// background snapshot (QEMU would resume the guest when it starts one)
/// and no `cont` after. Its "pause" costs the guest nothing. Returns the
/// options to use and whether the VM runs.
pub(super) fn as_it_is(
    vm: &mut Vm,
    mut opts: Options,
    progress: &mut dyn FnMut(&str),
) -> (Options, bool) {
    let was_running = vm.run_state() == "running";
    if !was_running {
        progress(&format!(
            "{}: the VM is paused; copying it as it is (stop-copy), it stays paused",
            vm.name
        ));
        opts.mode = Mode::StopCopy;
    }
    (opts, was_running)
}

/// A first hot snapshot reads all of guest RAM once, while the guest
/// runs: before anything of the snapshot exists, and before the capture
/// starts waiting for QEMU's connection (a bounded wait), since the read
/// takes 20 s for a 4 GiB guest under TCG and longer on a busy host.
/// Checked again once the VM is ready to pause (`modes::make_ready`).
pub(super) fn read_ram_first(
    vm: &mut Vm,
    opts: &Options,
    hooks: &dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<Option<vmcsnap_control::RamResidency>, AgentError> {
    let mut ram = None;
    if opts.mode == Mode::Hot {
        let delay = crate::fault::ram_read_delay(opts.fault);
        ensure_ram_mapped(vm, hooks, progress, delay, &mut ram)?;
    }
    Ok(ram)
}

/// Everything outside the pause: directories, disks, capture options, the
/// capture thread, the access collector.
pub(super) fn prepare(
    vm: &mut Vm,
    run: &RunDir,
    opts: &Options,
    begun: Begun,
    progress: &mut dyn FnMut(&str),
) -> Result<Job, AgentError> {
    let layout = layout(vm, run, opts)?;
    let capture = capture_options(vm, run, opts, begun.dialect, &layout, progress)?;
    start(vm, run, opts, begun, layout, capture)
}

/// Where the snapshot goes and what it freezes.
struct Layout {
    root: PathBuf,
    name: String,
    final_dir: PathBuf,
    vm_dir: PathBuf,
    disks_dir: PathBuf,
    disks: Vec<disks::SnapDisk>,
    /// Names this snapshot's overlay nodes.
    stamp: u64,
    sock: PathBuf,
    listener: UnixListener,
}

/// The snapshot's name and directory; outside the pause: the frozen disks
/// (hard links of the chain each writable disk runs on now, whose top
/// becomes read-only backing once its overlay is on top; see `disk_chain`,
/// `disks`), the overlays, the capture socket.
fn layout(vm: &mut Vm, run: &RunDir, opts: &Options) -> Result<Layout, AgentError> {
    let root = opts
        .target
        .as_ref()
        .map_or_else(|| run.snapshots_dir(), |t| t.root.clone());
    let (name, final_dir) = super::new_snapshot_dir(&root, opts.name.clone(), &vm.name)?;
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
    let disks = match disks::prepare(vm, &qemu_img, &disks_dir, stamp) {
        Ok(d) => d,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&disks_dir);
            return Err(e);
        }
    };
    let sock = vm_dir.join("snapshot.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(AgentError::io("binding", &sock))?;
    Ok(Layout {
        root,
        name,
        final_dir,
        vm_dir,
        disks_dir,
        disks,
        stamp,
        sock,
        listener,
    })
}

/// The capture's options and what comes with them.
struct Capture {
    copts: CaptureOptions,
    /// The parent decided on, or why the snapshot is full.
    parent_metric: String,
    disk_layer: Option<disk_match::DiskLayer>,
    ram_check: Option<final_ram::RamCheck>,
}

fn capture_options(
    vm: &mut Vm,
    run: &RunDir,
    opts: &Options,
    dialect: vmcsnap_migstream::Dialect,
    l: &Layout,
    progress: &mut dyn FnMut(&str),
) -> Result<Capture, AgentError> {
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
    if let Err(e) = freeze_aux_files(&mut vm_config.qemu, &l.disks_dir) {
        let _ = std::fs::remove_dir_all(&l.disks_dir);
        disks::remove_overlays(&l.disks);
        return Err(e);
    }
    copts.vm_config = vm_config.to_value();
    copts.progress_interval_bytes = 32 << 20;
    copts.writer = opts.writer;
    // An incremental snapshot of a single VM (not of a cluster snapshot's
    // VM: each cluster snapshot stands alone), or why it is full.
    let parent_metric = match parent::decide(&l.root, &vm.name, opts, progress) {
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
    copts.disks = disks::manifest_refs(&l.disks);
    copts
        .labels
        .insert("snapshot_mode".into(), mode_name(opts.mode));
    // The first disk's frozen file: the detection layer reads it.
    let disk_layer = opts
        .disk_layer
        .then(|| disk_match::start(&l.disks[0].frozen, &run.root().join("disk-index")));
    copts.disk_matcher = disk_layer.as_ref().map(disk_match::DiskLayer::matcher);
    // Pre-copy: the pages QEMU sent are checked against the paused guest's
    // RAM before the guest resumes (QEMU 7.2 under TCG can miss a write).
    let ram_check = (opts.mode == Mode::Precopy).then(|| {
        let (check, source) = final_ram::RamCheck::new();
        copts.final_ram = Some(source);
        check
    });
    Ok(Capture {
        copts,
        parent_metric,
        disk_layer,
        ram_check,
    })
}

/// Saves the migration parameters, starts the capture thread and the
/// access collector: the snapshot is ready for its pause.
fn start(
    vm: &mut Vm,
    run: &RunDir,
    opts: &Options,
    b: Begun,
    l: Layout,
    c: Capture,
) -> Result<Job, AgentError> {
    let Capture {
        copts,
        parent_metric,
        mut disk_layer,
        ram_check,
    } = c;
    // The first disk's: the report names them.
    let frozen = l.disks[0].frozen.clone();
    let overlay = l.disks[0].overlay.clone();
    let saved_params = vm.execute("query-migrate-parameters", Value::Null)?;
    // A stop-copy snapshot completes with QEMU's main loop locked: QMP
    // answers only once the whole RAM is written (7 s for a busy 1 GiB
    // guest under TCG in the benchmark), so wait longer than usual.
    vm.qmp()?.set_timeout(SNAPSHOT_QMP_TIMEOUT);
    let cap = CaptureThread::start(
        l.listener,
        l.final_dir.clone(),
        copts,
        opts.fault,
        crate::fault::short_capture_waits(opts.fault).unwrap_or(STALL_TIMEOUT),
        crate::fault::short_capture_waits(opts.fault).unwrap_or(ACCEPT_TIMEOUT),
    );
    let ctx = Ctx {
        mode: opts.mode,
        was_running: b.was_running,
        dialect: b.dialect,
        t: Timings::default(),
        disk_done: false,
        migrating: false,
        disks: l.disks,
        stamp: l.stamp,
        relay_fd_added: false,
        reference: opts.reference.clone(),
        on_disk_frozen: disk_layer
            .as_mut()
            .and_then(disk_match::DiskLayer::frozen_signal),
        ram_check,
        fault: opts.fault,
        untracked_write: None,
        ram: b.ram,
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
    Ok(Job {
        t_req: b.t_req,
        start_unix_us: b.start_unix_us,
        name: l.name,
        vm_dir: l.vm_dir,
        disks_dir: l.disks_dir,
        sock: l.sock,
        frozen,
        overlay,
        parent_metric,
        disk_layer,
        saved_params,
        cap: Some(cap),
        access,
        ctx,
    })
}

/// Copies (hard links where it can) the files an image VM's QEMU reads at
/// start besides its writable disks, the cloud-init seed and the workload
/// script, into `dir`, and points the recorded QEMU configuration there.
pub(super) fn freeze_aux_files(
    q: &mut crate::qemu::QemuConfig,
    dir: &Path,
) -> Result<(), AgentError> {
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
