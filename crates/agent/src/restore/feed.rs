//! Driving one restore's postcopy source: QEMU is told to listen, the
//! source thread ([`postcopy::run_source`]) feeds it from the image while
//! this thread watches for the guest's start (QMP RESUME), reports progress
//! (and, in a cluster restore, the Cohort's events), gives the fault path its
//! CPU priorities ([`super::priority`]), and finally records what the
//! restore learned ([`super::traces`]).
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
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};
use vmcsnap_image::PageKey;
use vmcsnap_migstream::postcopy::{
    self, BackgroundHold, DestBlock, PageId, PostcopyError, SourceConfig, SourceEvent,
};
use vmcsnap_workingset::{self as ws, Mode};

use super::pages::ImagePages;
use super::priority::{self, Priorities};
use super::run::{fail, unix_us, Job, Quality, Report, RestoreEvent, RAM_SECTION_ID, TRACE_WINDOW};
use super::traces::{self, Learned, Record};
use crate::accessed::{self, RamUse};
use crate::vm::Vm;
use crate::AgentError;

/// Faults later than this after the start are not learned from: the next
/// restore's working set is what the guest touches in its first seconds.
pub const LEARN_WINDOW: Duration = Duration::from_secs(10);

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
    latency_ms: Option<f64>,
    run_sent_ms: Option<f64>,
    start_received_ms: Option<f64>,
    bytes_before: u64,
    pages_before: u64,
    failure: Option<AgentError>,
    /// The guest-RAM counters when the accessed bits were cleared at the
    /// start, and when all pages were sent.
    at_start: Option<(Instant, RamUse)>,
    at_full_load: Option<(Instant, RamUse)>,
}

/// Clears QEMU's accessed bits as the guest starts and reads the RAM
/// counters (see [`crate::accessed`]); `None` where /proc says no.
fn clear_accessed(vm: &Vm) -> Option<(Instant, RamUse)> {
    accessed::clear(vm.pid).ok()?;
    let u = accessed::ram_use(vm.pid, &vm.config.ram_file).ok()?;
    Some((Instant::now(), u))
}

/// Whether a QEMU started with -S has loaded the device state after RUN
/// (it leaves `inmigrate` for `paused`).
fn device_state_loaded(vm: &mut Vm) -> Result<bool, AgentError> {
    let st = vm.execute("query-status", Value::Null)?;
    Ok(st["status"].as_str().is_some_and(|s| s != "inmigrate"))
}

/// The fault path's priorities, if this process may raise them (checked
/// once).
fn priorities() -> Option<Priorities> {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    (*AVAILABLE.get_or_init(Priorities::available)).then_some(Priorities::DEFAULT)
}

pub(super) fn feed(
    vm: &mut Vm,
    job: &Job,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, AgentError> {
    let Job {
        opts,
        img,
        snap_dir,
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
    vm.execute(
        "migrate-set-capabilities",
        json!({ "capabilities": [ { "capability": "postcopy-ram", "state": true } ] }),
    )?;
    vm.execute(
        "migrate-incoming",
        json!({ "uri": format!("unix:{}", incoming.display()) }),
    )?;
    let stream = connect(vm, &incoming)?;
    // To stop the source early (the caller then stops QEMU).
    let stop = stream
        .try_clone()
        .map_err(AgentError::io("cloning the socket to", &incoming))?;
    let _ = std::fs::remove_file(&incoming);

    // In a cluster restore QEMU runs with -S: RUN loads the device state
    // while the VM waits for START, and START is a `cont`.
    let prepared = opts.cluster.is_some();
    let to_id = |k: &PageKey| PageId {
        block: k.ram_block,
        page: k.page,
    };
    let device_state = img
        .device_state()
        .map_err(|e| fail(&name, format!("device state: {e}")))?;
    let hold = BackgroundHold::default();
    // Only demand faults for `start_quiet` once the guest starts: from RUN
    // where RUN starts it, from `cont` in a cluster restore (`hold`).
    let quiet = opts.start_quiet;
    let background_after = match (opts.no_background, prepared || opts.paused) {
        (true, _) => Some(TRACE_WINDOW.max(quiet)),
        (false, false) => Some(quiet),
        (false, true) => None,
    };
    let scfg = SourceConfig {
        machine: img.manifest().qemu.machine.clone(),
        blocks: img
            .ram_blocks()
            .iter()
            .map(|b| DestBlock {
                name: b.name.clone(),
                used_length: b.used_length,
            })
            .collect(),
        page_size: img.page_size(),
        ram_section_id: RAM_SECTION_ID,
        device_state,
        before_run: planned.plan.before_run.iter().map(to_id).collect(),
        demand_cluster: planned.plan.demand_cluster,
        background: planned.plan.background.iter().map(to_id).collect(),
        background_after,
        hold: hold.clone(),
        shut_timeout: Duration::from_secs(60),
    };
    let mut pages = ImagePages::new(img, &planned.plan.before_run, opts.prefetch_blocks)
        .map_err(|e| fail(&name, e))?;
    let (bytes_read, pages_read) = (pages.bytes_read.clone(), pages.pages_read.clone());
    let (tx, rx) = mpsc::channel::<(Input, Instant)>();
    let source_start = Instant::now();
    let ms_since_t0 = |at: Instant| at.duration_since(t0).as_secs_f64() * 1000.0;
    let tell = |ev: RestoreEvent| {
        if let Some(c) = &opts.cluster {
            let _ = c.events.send(ev);
        }
    };
    let prio = priorities().filter(|_| opts.priorities);
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
    let outcome = std::thread::scope(|s| {
        let h = s.spawn(move || {
            // The return-path reader (started first) inherits the fault
            // path's priority; the sender follows its work.
            if let Some(p) = prio {
                let _ = priority::set_current_thread(p.fault_path);
            }
            let r = postcopy::run_source(&scfg, &mut pages, stream, &mut |ev| {
                if let (SourceEvent::Work(w), Some(p)) = (&ev, prio) {
                    let _ = priority::set_current_thread(p.for_work(*w));
                }
                let _ = tx.send((Input::Source(ev), Instant::now()));
            });
            let _ = tx.send((Input::SourceDone { ok: r.is_ok() }, Instant::now()));
            r
        });
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
                    st.run_sent_ms = Some(ms_since_t0(at));
                    if let Some(p) = prio {
                        let pid = vm.pid;
                        let done = &source_done;
                        raiser = Some(s.spawn(move || {
                            priority::raise_qemu_fault_path(pid, p.fault_path, RAISE_WITHIN, done)
                        }));
                    }
                    st.bytes_before = bytes_read.load(Ordering::Relaxed);
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
                            st.latency_ms = st.run_sent_ms;
                            (Phase::Running, at)
                        }
                        (false, true) => (Phase::Preparing, at),
                        (false, false) => (Phase::Starting, at),
                    };
                }
                Ok((Input::Source(SourceEvent::AllSent), _)) => tell(RestoreEvent::AllLoaded),
                Ok((Input::Source(SourceEvent::Progress { sent, total }), _))
                    if last_progress.elapsed() > Duration::from_millis(500) =>
                {
                    last_progress = Instant::now();
                    progress(&format!("{name}: {sent} of {total} pages loaded"));
                }
                Ok((Input::SourceDone { ok }, _)) => {
                    source_finished = true;
                    if ok && st.at_start.is_some() {
                        st.at_full_load = accessed::ram_use(vm.pid, &vm.config.ram_file)
                            .ok()
                            .map(|u| (Instant::now(), u));
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
                    st.start_received_ms = Some(ms_since_t0(at));
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
                        let n = pages_read.load(Ordering::Relaxed);
                        progress(&format!(
                            "{name}: device state and {n} pages loaded, waiting for START"
                        ));
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
                    hold.hold_until(Instant::now() + quiet);
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
                            st.at_start = clear_accessed(vm);
                            st.latency_ms = Some(
                                e.timestamp_us.saturating_sub(unix_us(t0_wall)) as f64 / 1000.0,
                            );
                            if prepared {
                                // Pages pushed while it waited count as loaded before its start.
                                st.bytes_before = bytes_read.load(Ordering::Relaxed);
                                st.pages_before = pages_read.load(Ordering::Relaxed);
                                vm.config.paused = false;
                            }
                            phase = Phase::Running;
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
        }
        source_done.store(true, Ordering::Relaxed);
        let raised = raiser.map(|r| r.join().expect("priority thread panicked"));
        (
            h.join().expect("postcopy source thread panicked"),
            raised,
            qemu_died,
        )
    });
    let (outcome, qemu_threads_raised, qemu_died) = outcome;
    if let Some(e) = st.failure {
        return Err(e);
    }
    if let Some(phase) = qemu_died {
        // A source that failed by itself (a corrupt page) leaves QEMU a
        // broken stream, which QEMU then dies of: its error is the cause.
        // Otherwise the dead QEMU is, and the source's socket error only
        // follows from it.
        if !matches!(
            &outcome,
            Err(PostcopyError::PageSource { .. } | PostcopyError::InvalidConfig { .. })
        ) {
            return Err(fail(&name, format!("its QEMU died {}", phase.during())));
        }
    }
    let rep = outcome.map_err(|e| fail(&name, e))?;
    let full_load_ms =
        (source_start.duration_since(t0) + rep.all_sent_after).as_secs_f64() * 1000.0;
    wait_completed(vm)?;
    let restore_latency_ms = st
        .latency_ms
        .ok_or_else(|| fail(&name, "the guest did not start (no RESUME event)"))?;
    let run_sent_ms = st.run_sent_ms.unwrap_or(restore_latency_ms);
    let start_after_run =
        Duration::from_secs_f64((restore_latency_ms - run_sent_ms).max(0.0) / 1000.0);
    let faults_before_start = rep
        .demand
        .iter()
        .filter(|(d, _)| *d < start_after_run)
        .count() as u64;
    let mut per_100ms = vec![0u64; 100];
    for (d, _) in &rep.demand {
        let i = (d.as_millis() / 100) as usize;
        if i < per_100ms.len() {
            per_100ms[i] += 1;
        }
    }
    let ws_loaded = if prepared {
        st.pages_before
    } else {
        rep.pages_before_run
    };
    let faults: Vec<(PageKey, f64)> = rep
        .demand
        .iter()
        .map(|(d, id)| (PageKey::new(id.block, id.page), d.as_secs_f64() * 1000.0))
        .collect();
    let quality = match (st.at_start, st.at_full_load) {
        (Some((t_start, start)), Some((t_full, full))) if opts.mode != Mode::Eager => {
            let missed = faults
                .iter()
                .map(|(k, _)| *k)
                .collect::<std::collections::HashSet<_>>()
                .len() as u64;
            Some(Quality::new(
                t_full.duration_since(t_start).as_secs_f64() * 1000.0,
                ws_loaded,
                full.working_set_used(&start),
                missed,
            ))
        }
        _ => None,
    };
    // Eager and paused restores see no first accesses: nothing to learn.
    let learned = (opts.mode != Mode::Eager && !opts.paused).then(|| {
        let l = ws::learn::learn(&ws::learn::Observation {
            queue: &planned.queue,
            size: planned.wss,
            ws_size: ws_loaded,
            ws_used: quality.map(|q| q.used),
            faults: &faults,
            window_ms: LEARN_WINDOW.as_secs_f64() * 1000.0,
            floor: planned.hybrid,
            cap: planned.hybrid.saturating_mul(2).max(planned.wss),
        });
        Learned {
            size: l.size,
            touched: l.touched,
            queue: l.queue.iter().map(|k| (k.ram_block, k.page)).collect(),
        }
    });
    let record = Record {
        unix_ms: crate::handover::unix_ms(SystemTime::now()),
        mode: opts.mode.name().to_string(),
        trace: opts.trace,
        preloaded: planned
            .plan
            .before_run
            .iter()
            .map(|k| (k.ram_block, k.page))
            .collect(),
        faults: faults
            .iter()
            .map(|(k, ms)| (k.ram_block, k.page, *ms))
            .collect(),
        size: planned.wss,
        ws_used: quality.map(|q| q.used),
        learned: learned.clone(),
    };
    let record_path = traces::save(snap_dir, &record)
        .map_err(AgentError::io("writing the restore record in", snap_dir))?;
    Ok(Report {
        vm: name,
        snapshot: opts.snapshot.clone(),
        mode: opts.mode,
        paused: opts.paused,
        restore_latency_ms,
        run_sent_ms,
        start_received_ms: st.start_received_ms,
        request_unix_us: unix_us(t0_wall),
        // Exact from the source up to RUN; in a cluster restore, what had
        // been read by the start (pages pushed while it waited count).
        ws_pages: ws_loaded,
        wss: planned.wss,
        wss_sample: planned.wss_sample,
        wss_snapshot: planned.wss_snapshot,
        learned: planned.learned,
        access_data: planned.access.to_string(),
        quality,
        next_wss: learned.map(|l| l.size),
        bytes_read_before_start: st.bytes_before,
        demand_faults: rep.demand.len() as u64,
        demand_faults_before_start: faults_before_start,
        demand_faults_per_100ms: per_100ms,
        full_load_ms,
        pages_total: rep.pages_total,
        pages_on_demand: rep.pages_on_demand,
        pages_background: rep.pages_background,
        qemu_threads_raised,
        overlay: PathBuf::new(),
        record: record_path,
        clock: None,
    })
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

/// Waits until the destination reports the migration completed.
fn wait_completed(vm: &mut Vm) -> Result<(), AgentError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = vm.execute("query-migrate", Value::Null)?;
        match st["status"].as_str().unwrap_or("") {
            "completed" => return Ok(()),
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
