//! Driving one restore's postcopy source: QEMU is told to listen, the
//! source ([`postcopy::run_source`]) feeds it from the image while this
//! thread watches for the guest's start (QMP RESUME), reports progress
//! (and, in a cluster restore, the Cohort's events), gives the fault path its
//! CPU priorities ([`super::priority`]), and finally records what the
//! restore learned ([`super::finish`]). The source is a process of its own
//! that outlives the agent ([`super::page_source`], followed through its
//! event pipe); in a cluster restore START holds its background push, and
//! the counters of what it loaded are read, on its control socket
//! ([`super::control`]).
//!
//! The guest's way to running ([`Phase`]):
//!
//! ```text
//!  Loading ── RUN sent ──▶ Starting ── RESUME ──▶ Running       (single restore)
//!     │                                               ▲
//!     └─ RUN sent ─▶ Preparing ─ query-status ─▶ Ready ─ START: cont ─▶ Starting
//!        (cluster: QEMU -S)      leaves inmigrate    LOAD_FIN told
//! ```
//!
//! In a cluster restore the device state is loaded while the VM waits for
//! START, so that START → running is a `cont` (a fraction of a ms) and the
//! VMs of a ring, which get START together, start together: loading the
//! device state after START took 5-70 ms per VM on a busy host, different
//! for each (docs/restore.md). Pages keep loading (postcopy, background
//! order) while it waits. An abandon before START, an error, or a QEMU
//! that does not get there in time closes the migration socket, which
//! ends the source; the caller stops the QEMU. A QEMU that dies is noticed
//! within one turn of the loop (at most 20 ms), whatever the phase.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vmcsnap_image::PageKey;
use vmcsnap_migstream::postcopy::SourceEvent;

use super::control::Control;
use super::finish;
use super::job::{fail, unix_us, Job, Report, RestoreEvent, TRACE_WINDOW};
use super::page_source::{self, Ended, FinishJob, Observed, SourceJob, SourcePlan};
use super::priority;
use crate::accessed::{self, RamUse};
use crate::record::VmRecord;
use crate::vm::Vm;
use crate::AgentError;

/// How long to look for QEMU's fault-path threads after RUN.
const RAISE_WITHIN: Duration = Duration::from_secs(5);

/// While QEMU loads the device state (cluster restore), how often to ask
/// whether it is done.
const PREPARE_POLL: Duration = Duration::from_millis(2);
/// How long QEMU may take to load the device state.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long after RUN (or `cont`) the guest may take to start.
const RESUME_TIMEOUT: Duration = Duration::from_secs(60);

/// After the migration socket fails, how long to wait for QEMU to be
/// reapable if it died (its sockets close a moment before it can be).
const DEATH_REAP: Duration = Duration::from_millis(200);

/// Whether `vm`'s QEMU has exited, or does within `within`.
fn died_within(vm: &mut Vm, within: Duration) -> bool {
    let t = Instant::now();
    loop {
        if vm.exited().is_some() {
            return true;
        }
        if t.elapsed() >= within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What the feeding thread waits for.
enum Input {
    /// From the source thread.
    Source(SourceEvent),
    /// The source thread ended (its result says how).
    SourceDone { ok: bool },
    /// The Coordinator's START (`opened`) or abandon.
    Gate { opened: bool },
}

/// Where the guest is on its way to running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before RUN.
    Loading,
    /// RUN sent to a QEMU started with -S: it loads the device state.
    Preparing,
    /// The device state is loaded; waiting for START.
    Ready,
    /// RUN (or `cont`) sent; waiting for RESUME.
    Starting,
    /// The guest runs (or, with `--paused`, its state is loaded).
    Running,
}

impl Phase {
    /// Where an abandoned restore was, for its error.
    fn during(self) -> &'static str {
        match self {
            Phase::Loading => "while loading its working set",
            Phase::Preparing => "while QEMU loaded its device state",
            Phase::Ready => "while paused, loaded and waiting for START",
            Phase::Starting => "while starting",
            Phase::Running => "after its start",
        }
    }
}

/// What the feeding thread saw on the way.
#[derive(Default)]
struct Started {
    /// What goes to `observed.json` (see [`page_source`]).
    obs: Observed,
    failure: Option<AgentError>,
    at_full_load: Option<(u64, RamUse)>,
}

/// Clears QEMU's accessed bits as the guest starts and reads the RAM
/// counters (see [`crate::accessed`]); `None` where /proc says no.
fn clear_accessed(vm: &Vm) -> Option<(u64, RamUse)> {
    accessed::clear(vm.pid).ok()?;
    finish::ram_use_now(vm.pid, &vm.config.ram_file)
}

/// Whether a QEMU started with -S has loaded the device state after RUN
/// (it leaves `inmigrate` for `paused`).
fn device_state_loaded(vm: &mut Vm) -> Result<bool, AgentError> {
    let st = vm.execute("query-status", Value::Null)?;
    Ok(st["status"].as_str().is_some_and(|s| s != "inmigrate"))
}

/// The page source's plan and what finishing the restore takes, from the
/// job (see [`page_source`]).
fn source_job(job: &Job, background_after: Option<Duration>, member: VmRecord) -> SourceJob {
    let Job {
        opts,
        snap_dir,
        planned,
        t0_wall,
        ..
    } = job;
    let pairs =
        |v: &[PageKey]| -> Vec<(u32, u32)> { v.iter().map(|k| (k.ram_block, k.page)).collect() };
    SourceJob {
        plan: SourcePlan {
            snap_dir: snap_dir.to_path_buf(),
            before_run: pairs(&planned.plan.before_run),
            background: pairs(&planned.plan.background),
            demand_cluster: planned.plan.demand_cluster,
            background_after_ms: background_after.map(|d| d.as_millis() as u64),
            prefetch_blocks: opts.prefetch_blocks,
            priorities: opts.priorities,
            start_quiet_ms: opts.start_quiet.as_millis() as u64,
            hold_until_start: opts.cluster.is_some(),
            hold_until_exists: opts
                .cluster
                .as_ref()
                .and_then(|c| c.hold_background_until.clone()),
            preempt: opts.preempt,
        },
        finish: FinishJob {
            snapshot: opts.snapshot.clone(),
            snap_dir: snap_dir.to_path_buf(),
            mode: opts.mode,
            paused: opts.paused,
            trace: opts.trace,
            prepared: opts.cluster.is_some(),
            t0_unix_us: unix_us(*t0_wall),
            before_run: pairs(&planned.plan.before_run),
            queue: pairs(&planned.queue),
            wss: planned.wss,
            hybrid: planned.hybrid,
            wss_sample: planned.wss_sample,
            wss_snapshot: planned.wss_snapshot,
            learned: planned.learned,
            access_data: planned.access.to_string(),
        },
        member,
    }
}

/// The page-source process of the restore (see [`page_source`]), followed
/// through its event pipe.
struct Source {
    dir: PathBuf,
    events: std::fs::File,
}

impl Source {
    /// Follows the source to its end, sending its events to `tx`.
    fn run(self, tx: &mpsc::Sender<(Input, Instant)>) -> Ended {
        let ended = page_source::follow(&self.dir, self.events, &mut |ev| {
            let _ = tx.send((Input::Source(ev), Instant::now()));
        });
        let ok = matches!(ended, Ended::Done(_));
        let _ = tx.send((Input::SourceDone { ok }, Instant::now()));
        ended
    }
}

/// What the page source has read so far, asked on its control socket in a
/// cluster restore (a restore of one VM takes it from the source's result).
struct Loaded<'a> {
    control: Option<Control>,
    dir: &'a Path,
}

impl Loaded<'_> {
    /// (bytes, pages) read; zeros where unknown.
    fn now(&mut self) -> (u64, u64) {
        let Some(c) = self.control.as_mut() else {
            return (0, 0);
        };
        page_source::counters(self.dir, c).map_or((0, 0), |n| (n.bytes_read, n.pages_read))
    }

    /// START: ends the hold until START, holds the background push for
    /// `quiet` from now. Whether the source had pushed in the background
    /// before (`None`: unknown).
    fn start(&mut self, quiet: Duration) -> Option<bool> {
        let c = self.control.as_mut()?;
        page_source::start(self.dir, c, quiet.as_millis() as u64).map(|n| n.background_begun)
    }
}

pub(super) fn feed(
    vm: &mut Vm,
    job: &Job,
    member: VmRecord,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, AgentError> {
    let Job {
        opts,
        planned,
        t0,
        t0_wall,
        ..
    } = job;
    let (t0, t0_wall) = (*t0, *t0_wall);
    let name = vm.name.clone();
    let vm_dir = vm
        .config
        .qmp_socket
        .parent()
        .expect("in the VM dir")
        .to_path_buf();
    let incoming = vm_dir.join("incoming.sock");
    let _ = std::fs::remove_file(&incoming);
    vm.qmp()?.set_timeout(Duration::from_secs(60));
    // The QEMU that answered is the release the restore was checked for
    // (`super::versions`, from `--version` before it started).
    let v = vm.qmp()?.version();
    let greeted = vmcsnap_migstream::Dialect::for_qemu(v.major, v.minor, v.micro);
    if greeted.as_ref().ok() != Some(&job.dialect) {
        return Err(fail(
            &name,
            format!(
                "its QEMU greets as {}.{}.{} but its binary reported {} before it started",
                v.major, v.minor, v.micro, job.dialect
            ),
        ));
    }
    vm.execute(
        "migrate-set-capabilities",
        // `events`: QEMU sends MIGRATION status changes, which a failed
        // restore's post-mortem shows (`super::postmortem`).
        json!({ "capabilities": [
            { "capability": "postcopy-ram", "state": true },
            { "capability": "postcopy-preempt", "state": opts.preempt },
            // How long the vCPUs waited on faults (`vcpu_blocktime_ms`).
            { "capability": "postcopy-blocktime", "state": true },
            { "capability": "events", "state": true },
        ] }),
    )?;
    vm.execute(
        "migrate-incoming",
        json!({ "uri": format!("unix:{}", incoming.display()) }),
    )?;
    let stream = connect(vm, &incoming)?;
    // QEMU takes the second connection for the preempt channel (it tells
    // them apart by order only: docs/qemu-10.0-wire-format.md).
    let preempt = match opts.preempt {
        true => Some(connect(vm, &incoming)?),
        false => None,
    };
    // To stop the source early (the caller then stops QEMU).
    let clone = |s: &UnixStream| {
        s.try_clone()
            .map_err(AgentError::io("cloning the socket to", &incoming))
    };
    let stop = clone(&stream)?;
    let stop_preempt = preempt.as_ref().map(clone).transpose()?;
    let _ = std::fs::remove_file(&incoming);

    // In a cluster restore QEMU runs with -S: RUN loads the device state
    // while the VM waits for START, and START is a `cont`.
    let prepared = opts.cluster.is_some();
    // Only demand faults for `start_quiet` once the guest starts: from RUN
    // where RUN starts it, from `cont` in a cluster restore (a hold asked
    // on the source's control socket).
    let quiet = opts.start_quiet;
    let background_after = match (opts.no_background, prepared || opts.paused) {
        (true, _) => Some(TRACE_WINDOW.max(quiet)),
        (false, false) => Some(quiet),
        (false, true) => None,
    };
    let sjob = source_job(job, background_after, member);
    let ps_dir = page_source::dir_of(&vm_dir);
    page_source::write_job(&ps_dir, &sjob).map_err(|e| fail(&name, e))?;
    // The agent's own image, by its /proc link (as for the stream relay).
    let exe = PathBuf::from(format!("/proc/{}/exe", std::process::id()));
    let events = page_source::spawn(&exe, &ps_dir, stream, preempt).map_err(|e| fail(&name, e))?;
    let source_spawned = Instant::now();
    let source = Source {
        dir: ps_dir.clone(),
        events,
    };
    let mut loaded = Loaded {
        control: prepared.then(|| Control::new(&ps_dir)),
        dir: &ps_dir,
    };
    // What the next agent needs should this one die.
    let observe = |obs: &Observed| page_source::write_observed(&ps_dir, obs);
    let (tx, rx) = mpsc::channel::<(Input, Instant)>();
    let ms_since_t0 = |at: Instant| at.duration_since(t0).as_secs_f64() * 1000.0;
    let tell = |ev: RestoreEvent| {
        if let Some(o) = &opts.observer {
            let _ = o.send(ev.clone());
        }
        if let Some(c) = &opts.cluster {
            let _ = c.events.send(ev);
        }
    };
    let prio = priority::priorities().filter(|_| opts.priorities);
    let source_done = AtomicBool::new(false);
    // A cluster restore starts the guest on START with `cont`: the device
    // state was loaded while the VM waited.
    let _start_watch = opts.cluster.as_ref().map(|c| {
        let tx = tx.clone();
        c.gate.watch(Box::new(move |opened| {
            let _ = tx.send((Input::Gate { opened }, Instant::now()));
        }))
    });
    let mut st = Started::default();
    st.obs.qemu_ready_ms = Some(ms_since_t0(source_spawned));
    let outcome = std::thread::scope(|s| {
        let h = s.spawn(move || source.run(&tx));
        let mut last_progress = Instant::now();
        let mut raiser = None;
        let (mut phase, mut since) = (Phase::Loading, Instant::now());
        let (mut start_requested, mut source_finished) = (false, false);
        // Where the guest was when its QEMU was found dead.
        let mut qemu_died = None;
        loop {
            let wait = if phase == Phase::Preparing {
                PREPARE_POLL
            } else {
                Duration::from_millis(20)
            };
            match rx.recv_timeout(wait) {
                Ok((Input::Source(SourceEvent::RunSent), at)) => {
                    st.obs.run_sent_ms = Some(ms_since_t0(at));
                    if let Some(p) = prio {
                        let (pid, dialect) = (vm.pid, job.dialect);
                        let done = &source_done;
                        raiser = Some(s.spawn(move || {
                            priority::raise_qemu_fault_path(
                                pid,
                                dialect,
                                p.fault_path,
                                RAISE_WITHIN,
                                done,
                            )
                        }));
                    }
                    st.obs.bytes_before = loaded.now().0;
                    let next = if prepared {
                        "QEMU loads the device state, the guest waits for START"
                    } else {
                        "guest starting"
                    };
                    progress(&format!(
                        "{name}: {} pages and the device state sent, {next}",
                        planned.plan.before_run.len()
                    ));
                    (phase, since) = match (opts.paused, prepared) {
                        (true, _) => {
                            st.obs.latency_ms = st.obs.run_sent_ms;
                            (Phase::Running, at)
                        }
                        (false, true) => (Phase::Preparing, at),
                        (false, false) => (Phase::Starting, at),
                    };
                    observe(&st.obs);
                }
                Ok((Input::Source(SourceEvent::AllSent), _)) => tell(RestoreEvent::AllLoaded),
                Ok((Input::Source(SourceEvent::Progress { sent, total }), _)) => {
                    tell(RestoreEvent::Loading { sent, total });
                    if last_progress.elapsed() > Duration::from_millis(500) {
                        last_progress = Instant::now();
                        progress(&format!("{name}: {sent} of {total} pages loaded"));
                    }
                }
                Ok((Input::SourceDone { ok }, _)) => {
                    source_finished = true;
                    if ok && st.obs.at_start.is_some() {
                        st.at_full_load = finish::ram_use_now(vm.pid, &vm.config.ram_file);
                    }
                    if !ok {
                        // Its error says why, unless QEMU died first (see
                        // `qemu_died` after the loop).
                        if died_within(vm, DEATH_REAP) {
                            qemu_died = Some(phase);
                        }
                        break;
                    }
                }
                Ok((Input::Gate { opened: true }, at)) => {
                    st.obs.start_received_ms = Some(ms_since_t0(at));
                    start_requested = true;
                }
                Ok((Input::Gate { opened: false }, _)) => {
                    st.failure.get_or_insert_with(|| AgentError::Abandoned {
                        vm: name.clone(),
                        during: phase.during(),
                    });
                    break;
                }
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            // A QEMU that dies while nothing is asked of it (paused, waiting
            // for START, with every page sent) is noticed now, not when
            // START's `cont` fails: in a cluster restore the Coordinator then
            // abandons the others while they are still paused.
            if vm.exited().is_some() {
                qemu_died = Some(phase);
                break;
            }
            match phase {
                Phase::Preparing => match device_state_loaded(vm) {
                    Ok(true) => {
                        let n = loaded.now().1;
                        progress(&format!(
                            "{name}: device state and {n} pages loaded, waiting for START"
                        ));
                        st.obs.loaded_ms = Some(ms_since_t0(Instant::now()));
                        observe(&st.obs);
                        tell(RestoreEvent::Loaded { qemu_pid: vm.pid });
                        (phase, since) = (Phase::Ready, Instant::now());
                    }
                    Ok(false) if since.elapsed() < PREPARE_TIMEOUT => {}
                    Ok(false) => {
                        st.failure = Some(fail(
                            &name,
                            format!(
                                "QEMU did not load the device state within {PREPARE_TIMEOUT:?}"
                            ),
                        ));
                        break;
                    }
                    Err(e) => {
                        st.failure = Some(e);
                        break;
                    }
                },
                Phase::Ready if start_requested => {
                    st.obs.background_before_start = loaded.start(quiet).unwrap_or(false);
                    if let Err(e) = vm.execute("cont", Value::Null) {
                        st.failure = Some(e);
                        break;
                    }
                    (phase, since) = (Phase::Starting, Instant::now());
                }
                Phase::Starting => {
                    // The guest starts once QEMU has loaded the package (or
                    // on `cont`); its QMP may stall meanwhile (it faults on
                    // missing pages).
                    let limit = if source_finished || since.elapsed() > RESUME_TIMEOUT {
                        Duration::from_secs(2)
                    } else {
                        Duration::from_millis(20)
                    };
                    match vm.qmp().map(|q| q.wait_event("RESUME", limit)) {
                        Ok(Ok(e)) => {
                            // Every page loaded before the start is in
                            // place now (QEMU read them before RUN).
                            st.obs.at_start = clear_accessed(vm);
                            st.obs.latency_ms = Some(
                                e.timestamp_us.saturating_sub(unix_us(t0_wall)) as f64 / 1000.0,
                            );
                            if prepared {
                                // Pages pushed while it waited count as loaded before its start.
                                (st.obs.bytes_before, st.obs.pages_before) = loaded.now();
                                vm.config.paused = false;
                            }
                            phase = Phase::Running;
                            observe(&st.obs);
                            tell(RestoreEvent::Started(e.timestamp_us));
                        }
                        _ if limit > Duration::from_millis(20) => {
                            st.failure =
                                Some(fail(&name, "the guest did not start (no RESUME event)"));
                            break;
                        }
                        _ => {}
                    }
                }
                _ => {}
            }
            if source_finished && phase == Phase::Running {
                break;
            }
        }
        if st.failure.is_some() || qemu_died.is_some() || !source_finished {
            // Ends the source (QEMU fails the incoming migration, or waits
            // paused in postcopy, until the caller stops it).
            let _ = stop.shutdown(std::net::Shutdown::Both);
            if let Some(p) = &stop_preempt {
                let _ = p.shutdown(std::net::Shutdown::Both);
            }
        }
        source_done.store(true, Ordering::Relaxed);
        let raised = raiser.map(|r| r.join().expect("priority thread panicked"));
        (
            h.join().expect("postcopy source thread panicked"),
            raised,
            qemu_died,
        )
    });
    let (ended, qemu_threads_raised, qemu_died) = outcome;
    if let Some(e) = st.failure {
        return Err(e);
    }
    if let Some(phase) = qemu_died {
        // A source that failed by itself (a corrupt page) leaves QEMU a
        // broken stream, which QEMU then dies of: its error is the cause.
        // Otherwise the dead QEMU is, and the source's socket error only
        // follows from it.
        if !matches!(&ended, Ended::Failed { own: true, .. }) {
            return Err(fail(&name, format!("its QEMU died {}", phase.during())));
        }
    }
    let out = match ended {
        Ended::Done(out) => out,
        Ended::Failed { detail, .. } => return Err(fail(&name, detail)),
    };
    let done = wait_completed(vm)?;
    st.obs.qemu_threads_raised = qemu_threads_raised;
    let mut report = finish::report(&finish::Finishing {
        vm: &name,
        job: &sjob.finish,
        obs: &st.obs,
        out: &out,
        at_full_load: st.at_full_load,
    })?;
    report.vcpu_blocktime_ms = vcpu_blocktime_ms(&done);
    Ok(report)
}

/// The time the destination's vCPUs spent blocked on postcopy faults,
/// summed over the vCPUs (QEMU's `postcopy-vcpu-blocktime`, ms), from its
/// `query-migrate` once completed.
fn vcpu_blocktime_ms(done: &Value) -> Option<u64> {
    done["postcopy-vcpu-blocktime"]
        .as_array()
        .map(|v| v.iter().filter_map(Value::as_u64).sum())
}

/// Connects to the destination's incoming socket once QEMU listens.
fn connect(vm: &mut Vm, path: &Path) -> Result<UnixStream, AgentError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) => {
                if let Some(status) = vm.exited() {
                    return Err(fail(
                        &vm.name,
                        format!(
                            "QEMU exited ({status}): {}",
                            crate::vm::tail(&vm.qemu_log, 1500)
                        ),
                    ));
                }
                if Instant::now() > deadline {
                    return Err(AgentError::io(
                        "connecting to the restore destination",
                        path,
                    )(e));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Waits until the destination reports the migration completed; returns
/// its `query-migrate` then.
pub(super) fn wait_completed(vm: &mut Vm) -> Result<Value, AgentError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = vm.execute("query-migrate", Value::Null)?;
        match st["status"].as_str().unwrap_or("") {
            "completed" => return Ok(st),
            "failed" | "cancelled" => {
                return Err(fail(
                    &vm.name,
                    format!("the destination reports {}", st["status"]),
                ));
            }
            _ if Instant::now() > deadline => {
                return Err(fail(
                    &vm.name,
                    "the destination did not complete within 60 s",
                ))
            }
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
