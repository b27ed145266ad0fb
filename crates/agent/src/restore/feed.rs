//! Driving one restore's postcopy source: QEMU is told to listen, the
//! source thread ([`postcopy::run_source`]) feeds it from the image while
//! this thread watches for the guest's start (QMP RESUME), reports progress
//! (and, in a cluster restore, the Cohort's events), gives the fault path its
//! CPU priorities ([`super::priority`]), and finally records what the
//! restore learned ([`super::traces`]).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};
use vmcsnap_image::PageKey;
use vmcsnap_migstream::postcopy::{self, DestBlock, PageId, SourceConfig, SourceEvent};

use super::pages::ImagePages;
use super::priority::{self, Priorities};
use super::run::{fail, unix_us, Job, Report, RestoreEvent, RAM_SECTION_ID, TRACE_WINDOW};
use super::traces::{self, Record};
use crate::vm::Vm;
use crate::AgentError;

/// How long to look for QEMU's fault-path threads after RUN.
const RAISE_WITHIN: Duration = Duration::from_secs(5);

/// The fault path's priorities, if this process may raise them (checked
/// once).
fn priorities() -> Option<Priorities> {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    (*AVAILABLE.get_or_init(Priorities::available)).then_some(Priorities::DEFAULT)
}

pub(super) fn feed(vm: &mut Vm, job: &Job, progress: &mut dyn FnMut(&str)) -> Result<Report, AgentError> {
    let Job { opts, img, snap_dir, planned, t0, t0_wall, .. } = job;
    let (t0, t0_wall) = (*t0, *t0_wall);
    let name = vm.name.clone();
    let vm_dir = vm.config.qmp_socket.parent().expect("in the VM dir").to_path_buf();
    let incoming = vm_dir.join("incoming.sock");
    let _ = std::fs::remove_file(&incoming);
    vm.qmp()?.set_timeout(Duration::from_secs(60));
    vm.execute(
        "migrate-set-capabilities",
        json!({ "capabilities": [ { "capability": "postcopy-ram", "state": true } ] }),
    )?;
    vm.execute("migrate-incoming", json!({ "uri": format!("unix:{}", incoming.display()) }))?;
    let stream = connect(vm, &incoming)?;
    let _ = std::fs::remove_file(&incoming);

    let to_id = |k: &PageKey| PageId { block: k.ram_block, page: k.page };
    let device_state = img.device_state().map_err(|e| fail(&name, format!("device state: {e}")))?;
    let scfg = SourceConfig {
        machine: img.manifest().qemu.machine.clone(),
        blocks: img.ram_blocks().iter().map(|b| DestBlock { name: b.name.clone(), used_length: b.used_length }).collect(),
        page_size: img.page_size(),
        ram_section_id: RAM_SECTION_ID,
        device_state,
        before_run: planned.plan.before_run.iter().map(to_id).collect(),
        demand_cluster: planned.plan.demand_cluster,
        background: planned.plan.background.iter().map(to_id).collect(),
        background_after: opts.no_background.then_some(TRACE_WINDOW),
        shut_timeout: Duration::from_secs(60),
        run_gate: opts.cluster.as_ref().map(|c| c.gate.clone()),
    };
    let mut pages = ImagePages::new(img, &planned.plan.before_run).map_err(|e| fail(&name, e))?;
    let bytes_read = pages.bytes_read.clone();
    let (tx, rx) = mpsc::channel::<(SourceEvent, Instant)>();
    let source_start = Instant::now();
    let mut latency_ms = None;
    let mut bytes_before = 0;
    let tell = |ev: RestoreEvent| {
        if let Some(c) = &opts.cluster {
            let _ = c.events.send(ev);
        }
    };
    let prio = priorities().filter(|_| opts.priorities);
    let source_done = AtomicBool::new(false);
    let outcome = std::thread::scope(|s| {
        let h = s.spawn(move || {
            // The return-path reader (started first) inherits the fault
            // path's priority; the sender follows its work.
            if let Some(p) = prio {
                let _ = priority::set_current_thread(p.fault_path);
            }
            postcopy::run_source(&scfg, &mut pages, stream, &mut |ev| {
                if let (SourceEvent::Work(w), Some(p)) = (&ev, prio) {
                    let _ = priority::set_current_thread(p.for_work(*w));
                }
                let _ = tx.send((ev, Instant::now()));
            })
        });
        let mut last_progress = Instant::now();
        let mut waiting_for_resume = false;
        let mut raiser = None;
        loop {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok((SourceEvent::RunSent, at)) => {
                    if let Some(p) = prio {
                        let pid = vm.pid;
                        let done = &source_done;
                        raiser = Some(s.spawn(move || priority::raise_qemu_fault_path(pid, p.fault_path, RAISE_WITHIN, done)));
                    }
                    bytes_before = bytes_read.load(Ordering::Relaxed);
                    progress(&format!(
                        "{name}: device state and {} pages sent, guest starting",
                        planned.plan.before_run.len()
                    ));
                    if opts.paused {
                        latency_ms = Some(at.duration_since(t0).as_secs_f64() * 1000.0);
                    } else {
                        waiting_for_resume = true;
                    }
                }
                Ok((SourceEvent::Loaded { pages }, _)) => {
                    progress(&format!("{name}: {pages} pages loaded, waiting for START"));
                    tell(RestoreEvent::Loaded);
                }
                Ok((SourceEvent::AllSent, _)) => tell(RestoreEvent::AllLoaded),
                Ok((SourceEvent::Progress { sent, total }, _)) if last_progress.elapsed() > Duration::from_millis(500) => {
                    last_progress = Instant::now();
                    progress(&format!("{name}: {sent} of {total} pages loaded"));
                }
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) if !waiting_for_resume => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
            if waiting_for_resume {
                // The guest starts once QEMU has loaded the package; its
                // QMP may stall meanwhile (it faults on missing pages).
                if let Ok(q) = vm.qmp() {
                    if let Ok(e) = q.wait_event("RESUME", Duration::from_millis(20)) {
                        latency_ms = Some(e.timestamp_us.saturating_sub(unix_us(t0_wall)) as f64 / 1000.0);
                        waiting_for_resume = false;
                        tell(RestoreEvent::Started(e.timestamp_us));
                    }
                }
                if h.is_finished() && waiting_for_resume && latency_ms.is_none() {
                    // One last look, then give up on the event.
                    if let Ok(Ok(e)) = vm.qmp().map(|q| q.wait_event("RESUME", Duration::from_secs(2))) {
                        latency_ms = Some(e.timestamp_us.saturating_sub(unix_us(t0_wall)) as f64 / 1000.0);
                        tell(RestoreEvent::Started(e.timestamp_us));
                    }
                    waiting_for_resume = false;
                }
            }
        }
        source_done.store(true, Ordering::Relaxed);
        let raised = raiser.map(|r| r.join().expect("priority thread panicked"));
        (h.join().expect("postcopy source thread panicked"), raised)
    });
    let (outcome, qemu_threads_raised) = outcome;
    let rep = outcome.map_err(|e| fail(&name, e))?;
    let full_load_ms = (source_start.duration_since(t0) + rep.all_sent_after).as_secs_f64() * 1000.0;
    wait_completed(vm)?;
    let restore_latency_ms = latency_ms.ok_or_else(|| fail(&name, "the guest did not start (no RESUME event)"))?;
    let mut per_100ms = vec![0u64; 100];
    for (d, _) in &rep.demand {
        let i = (d.as_millis() / 100) as usize;
        if i < per_100ms.len() {
            per_100ms[i] += 1;
        }
    }
    let record = Record {
        unix_ms: crate::handover::unix_ms(SystemTime::now()),
        mode: opts.mode.name().to_string(),
        trace: opts.trace,
        preloaded: planned.plan.before_run.iter().map(|k| (k.ram_block, k.page)).collect(),
        faults: rep.demand.iter().map(|(d, id)| (id.block, id.page, d.as_secs_f64() * 1000.0)).collect(),
    };
    let record_path = traces::save(snap_dir, &record).map_err(AgentError::io("writing the restore record in", snap_dir))?;
    Ok(Report {
        vm: name,
        snapshot: opts.snapshot.clone(),
        mode: opts.mode,
        paused: opts.paused,
        restore_latency_ms,
        ws_pages: rep.pages_before_run,
        wss: planned.wss,
        wss_sample: planned.wss_sample,
        wss_snapshot: planned.wss_snapshot,
        learned: planned.learned,
        bytes_read_before_start: bytes_before,
        demand_faults: rep.demand.len() as u64,
        demand_faults_per_100ms: per_100ms,
        full_load_ms,
        pages_total: rep.pages_total,
        pages_on_demand: rep.pages_on_demand,
        pages_background: rep.pages_background,
        qemu_threads_raised,
        overlay: PathBuf::new(),
        record: record_path,
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
                    return Err(fail(&vm.name, format!("QEMU exited ({status}): {}", crate::vm::tail(&vm.qemu_log, 1500))));
                }
                if Instant::now() > deadline {
                    return Err(AgentError::io("connecting to the restore destination", path)(e));
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
                return Err(fail(&vm.name, format!("the destination reports {}", st["status"])));
            }
            _ if Instant::now() > deadline => return Err(fail(&vm.name, "the destination did not complete within 60 s")),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
