//! Restoring a whole cluster from a cluster snapshot (HotRestore): the
//! restore dependency graph from the frames logged at the cut
//! (`vmcsnap_restoreline`), working-set sizes revised by the LP so that
//! receivers finish loading before senders, and the Coordinator/Cohort
//! protocol (`vmcsnap_coord::restore`) whose Checker starts a VM only once
//! the VMs it sends to run. Each VM is restored through postcopy
//! (`crate::restore`) with its start held by a start gate: its QEMU runs
//! with -S and loads the device state, pages keep loading while it waits,
//! and START is a `cont`. Once a VM runs, the switch replays to it the
//! frames that were in flight to it at the cut.
//!
//! Modes (`vmcsnap restore --cluster SNAP --mode ...`):
//! - `eager`: every VM independently, all of its memory before it starts;
//! - `eager-rl`: all memory first, starts in restore-line order;
//! - `workingset-restore`: every VM restored independently with the
//!   sampled working set (the paper's "Working Set Restore" baseline);
//! - `hotrestore`: HotRestore's elastic working set, each VM started as
//!   soon as it is loaded (no restore line);
//! - `hotrestore-rl`: elastic working set with LP-revised sizes, and starts
//!   in restore-line order by the Coordinator's Checker.

pub mod adopt;
mod cohort;
mod report;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmcsnap_coord::restore::{
    run_cohort, run_coordinator, Cohort, CohortOutcome, Coordinator, CoordinatorEvent,
    CoordinatorEventKind, CoordinatorOutcome, Msg, Policy, Timeouts,
};
use vmcsnap_coord::transport::InProcessNetwork;
use vmcsnap_image::cluster::{check_cluster_committed, ClusterManifest};
use vmcsnap_spec::ClusterSpec;
use vmcsnap_workingset as ws;

pub use vmcsnap_control::{ClusterRestoreReport, ClusterRunning, VmRestoreReport, VmRunning};
pub use vmcsnap_orchestrator::cluster_restore::{Plan, PlannedVm, RdgReport, PAGES_PER_FRAME};

use crate::cluster::Cluster;
use crate::fault::RestoreFault;
use crate::restore::{self, WssChoice};
use crate::{log, AgentError, RunDir};

/// The Coordinator's node name on the protocol's transport.
pub const COORDINATOR: &str = "coordinator";

/// How the cluster is restored.
pub use vmcsnap_control::ClusterRestoreMode as Mode;

/// What `vmcsnap restore --cluster` asks for.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cluster snapshot (name under the snapshots root, or a path).
    pub snapshot: String,
    /// The mode.
    pub mode: Mode,
    /// Raise the fault path's CPU priority and lower background loading's
    /// (when permitted; see `restore::Options::priorities`).
    pub priorities: bool,
    /// After each guest starts, only its demand faults are served for this
    /// long (`restore::Options::start_quiet`).
    pub start_quiet: std::time::Duration,
    /// Testing: a fault to inject (`crate::fault`).
    pub fault: Option<RestoreFault>,
}

/// Restores every VM of a cluster snapshot into a new cluster.
///
/// With `early`, the request answers once every guest runs (see
/// [`crate::loading`]; the answer is a [`ClusterRunning`]) and this goes on
/// until every page is loaded.
pub fn restore_cluster(
    cluster: &mut Option<Cluster>,
    run: &RunDir,
    opts: Options,
    early: Option<&crate::loading::Ctx<'_>>,
    progress: &mut dyn FnMut(&str),
) -> Result<ClusterRestoreReport, AgentError> {
    // The journal (see `restore_journal`) is begun once the plan is known,
    // and ended here whatever happened.
    let vms = Mutex::new(Vec::new());
    let r = restore_cluster_journaled(cluster, run, opts, early, progress, &vms);
    crate::restore_journal::end(run);
    // Only now: should this agent die before the journal's end, the next
    // one adopts the restore from the page sources' files.
    for vm in vms.into_inner().unwrap_or_else(|p| p.into_inner()) {
        let _ = std::fs::remove_dir_all(restore::page_source::dir_of(&run.vm_dir(&vm)));
    }
    if let Some(ctx) = early {
        ctx.loads.clear();
    }
    r
}

/// What the protocol's driver does for a restore that answers early.
struct Early<'a> {
    /// Where the VMs' loads are shown.
    loads: crate::loading::Loads,
    /// Called once every guest runs, with their start times (unix µs).
    on_running: &'a mut dyn FnMut(&BTreeMap<String, u64>),
}

fn restore_cluster_journaled(
    cluster: &mut Option<Cluster>,
    run: &RunDir,
    opts: Options,
    early: Option<&crate::loading::Ctx<'_>>,
    progress: &mut dyn FnMut(&str),
    journaled: &Mutex<Vec<String>>,
) -> Result<ClusterRestoreReport, AgentError> {
    let t0 = Instant::now();
    let start_unix_us = crate::snapshot::unix_us();
    if let Some(c) = cluster.as_ref() {
        return Err(AgentError::BadRequest(format!(
            "cluster {:?} is up: a cluster restore starts a cluster of its own (`vmcsnap down` first)",
            c.spec.cluster.name
        )));
    }
    let dir = crate::cluster_snapshot::resolve(run, Path::new(&opts.snapshot));
    let m = check_cluster_committed(&dir).map_err(|e| {
        AgentError::BadRequest(format!(
            "cluster snapshot {:?}: {e} (see `vmcsnap snapshots`)",
            opts.snapshot
        ))
    })?;
    let plan = vmcsnap_orchestrator::cluster_restore::plan(
        &m,
        &dir,
        opts.mode,
        &crate::host_api::LocalHost,
    )
    .map_err(|e| AgentError::BadRequest(e.to_string()))?;
    let mut saved = Vec::new();
    let qemu_bin = crate::qemu::find_qemu()?;
    for v in &plan.vms {
        let img = crate::frozen_disks::open_image(&v.dir)
            .map_err(|e| AgentError::BadRequest(format!("VM {}: {e}", v.name)))?;
        // Every VM's QEMU version before any VM starts.
        restore::check_versions(&img, &opts.snapshot, &qemu_bin)?;
        saved.push(restore::saved_vm(&img, &opts.snapshot)?);
    }
    let planned_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let first = saved.first().ok_or_else(|| {
        AgentError::BadRequest(format!("cluster snapshot {:?} has no VM", opts.snapshot))
    })?;
    // Will every VM fit? Checked before anything is created.
    let demand = crate::capacity::demand(
        run,
        &first.cluster.name,
        saved
            .iter()
            .map(|s| (s.qemu.name.as_str(), s.qemu.memory_mib)),
    );
    crate::capacity::ensure(
        crate::capacity::Start::ClusterRestore(&m.name),
        &demand,
        run,
    )?;
    crate::restore_journal::begin(
        run,
        &crate::restore_journal::Restoring::Cluster {
            snapshot: opts.snapshot.clone(),
            vms: plan.vms.iter().map(|v| v.name.clone()).collect(),
        },
    )?;
    *journaled.lock().unwrap_or_else(|p| p.into_inner()) =
        plan.vms.iter().map(|v| v.name.clone()).collect();
    if let Some(vm) = crate::fault::restore_fault_vm(&opts.fault) {
        if !plan.vms.iter().any(|v| v.name == vm) {
            return Err(AgentError::BadRequest(format!(
                "the fault names VM {vm:?}, which is not in cluster snapshot {:?} (its VMs: {})",
                opts.snapshot,
                plan.vms
                    .iter()
                    .map(|v| v.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let spec = ClusterSpec {
        cluster: first.cluster.clone(),
        vm: saved.iter().map(|s| s.spec.clone()).collect(),
    };
    let mut c = Cluster::empty(run, spec, first.qemu.accel)?;
    progress(&format!(
        "restoring cluster {} from {} ({} VMs, mode {})",
        m.cluster,
        m.name,
        plan.vms.len(),
        mode_name(opts.mode)
    ));
    if opts.mode == Mode::HotrestoreRl {
        progress(&format!("restore line: {}", plan.line.join(" < ")));
    }
    let replay = replay_frames(&dir, &m)?;
    let (cname, accel) = (c.spec.cluster.name.clone(), c.accel.name().to_string());
    // Every guest's clock is set before the early answer (which reports it).
    let mut early_clocks = None;
    let mut on_running = |starts: &BTreeMap<String, u64>| {
        let Some(ctx) = early else { return };
        let vms = saved
            .iter()
            .map(|s| {
                let n = &s.qemu.name;
                let started = starts.get(n).copied().unwrap_or(start_unix_us);
                let qmp = run.vm_dir(n).join("qmp.sock");
                restore::vm_status(n, &s.address, s.qemu.memory_mib, &qmp, started)
            })
            .collect();
        ctx.early.show(&cname, &accel, vms);
        let configs: Vec<_> = saved
            .iter()
            .map(|s| crate::guest_clock::restored_in(&s.qemu, &run.vm_dir(&s.qemu.name)))
            .collect();
        let mut r = report::running(&m, &plan, &opts, starts, start_unix_us);
        r.guest_clocks = crate::guest_clock::sync_all(&configs);
        ctx.early
            .reply(vmcsnap_control::Response::ClusterRunning(r.clone()));
        early_clocks = Some(r.guest_clocks);
    };
    let early = early.map(|ctx| Early {
        loads: ctx.loads.clone(),
        on_running: &mut on_running,
    });
    let load_sent_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let (outcome, outcomes, start_order) =
        run_protocol(&c, run, &plan, &opts, replay, early, progress);
    let mut errors = Vec::new();
    let mut restored = Vec::new();
    for o in outcomes {
        if o.result.is_ok() {
            log(format!(
                "cluster restore: {} restored, {} frames replayed",
                o.vm, o.replayed
            ));
        }
        match o.result {
            Ok((member, rep)) => restored.push((member, rep, o.started_unix_us, o.replayed)),
            Err(e) => errors.push(e),
        }
    }
    // A VM whose restore failed after the protocol was done (e.g. its
    // destination reported the migration failed) fails the whole restore
    // too: a cluster restore never silently leaves a VM out.
    let failed = match &outcome {
        CoordinatorOutcome::Aborted { reason } => Some(reason.clone()),
        CoordinatorOutcome::Completed if !errors.is_empty() => {
            Some("a VM failed after the protocol completed".to_string())
        }
        CoordinatorOutcome::Completed => None,
    };
    if let Some(reason) = &failed {
        for (mut member, ..) in restored {
            // Nothing of a failed cluster restore is kept: no need to ask.
            member
                .vm
                .discard("the cluster restore failed, nothing of it is kept");
            member.vm.config.remove_runtime_files();
        }
        c.teardown();
        // The failed VM's error is usually the reason already: once is enough.
        errors.retain(|e| !reason.contains(e.as_str()));
        let detail = if errors.is_empty() {
            reason.clone()
        } else {
            format!("{reason} ({})", errors.join("; "))
        };
        log(format!("cluster restore of {} failed: {detail}", m.name));
        return Err(AgentError::BadRequest(format!(
            "cluster restore failed: {detail}; nothing was left running"
        )));
    }
    // Every guest runs: their clocks go to the host's (`guest_clock`),
    // unless that was done for the early answer.
    let clocks = early_clocks
        .unwrap_or_else(|| crate::guest_clock::sync_all(restored.iter().map(|r| &r.0.vm.config)));
    let mut report = report::build(&m, &plan, &opts, &restored, &start_order, t0, start_unix_us);
    report.guest_clocks = clocks;
    (report.planned_ms, report.load_sent_ms) = (planned_ms, load_sent_ms);
    for (member, ..) in restored {
        c.members.push(member);
    }
    progress(&format!(
        "cluster restored: backoff avg {:.1} ms, max {:.1} ms; disruption avg {:.1} ms",
        report.backoff_avg_ms, report.backoff_max_ms, report.disruption_avg_ms
    ));
    *cluster = Some(c);
    Ok(report)
}

/// The frames logged at the cut, by receiver.
fn replay_frames(
    dir: &Path,
    m: &ClusterManifest,
) -> Result<HashMap<String, Vec<Vec<u8>>>, AgentError> {
    let frames = vmcsnap_image::channel_log::read_channel_log(&dir.join(&m.channel_state.file))
        .map_err(|e| AgentError::BadRequest(format!("channel state of {}: {e}", m.name)))?;
    let mut by = HashMap::new();
    for f in frames {
        by.entry(f.receiver).or_insert_with(Vec::new).push(f.data);
    }
    Ok(by)
}

/// Runs the Coordinator and, per VM, a Cohort and a restore thread.
fn run_protocol(
    c: &Cluster,
    run: &RunDir,
    plan: &Plan,
    opts: &Options,
    mut replay: HashMap<String, Vec<Vec<u8>>>,
    mut early: Option<Early<'_>>,
    progress: &mut dyn FnMut(&str),
) -> (CoordinatorOutcome, Vec<cohort::Outcome>, Vec<(String, u64)>) {
    let mode = opts.mode;
    // The order itself is restoreline's (`Rdg::start_groups`); the
    // coordinator only follows it.
    let policy = match mode {
        Mode::HotrestoreRl | Mode::EagerRl => Policy::RestoreLine,
        _ => Policy::Independent,
    };
    let timeouts = Timeouts::default();
    let epoch = crate::snapshot::unix_us() / 1000;
    let net = InProcessNetwork::<Msg>::new();
    let (co_tx, co_rx) = mpsc::channel();
    let co_inbox = Arc::new(Mutex::new(Some(co_tx)));
    let deliver = co_inbox.clone();
    let co_ep = net.join(COORDINATOR, move |env| {
        if let Some(tx) = deliver.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = tx.send(env);
        }
    });
    let (ptx, prx) = mpsc::channel::<String>();
    let coordinator = Coordinator::new(
        epoch,
        COORDINATOR.to_string(),
        &plan.rdg,
        policy,
        timeouts.clone(),
    );
    let mut coordinator = match coordinator {
        Ok(co) => co,
        Err(e) => {
            return (
                CoordinatorOutcome::Aborted {
                    reason: format!("restore dependencies: {e}"),
                },
                vec![],
                vec![],
            )
        }
    };
    let loaded = Arc::new(cohort::LoadedCount::default());
    // Every guest runs (the Coordinator's AllStarted), and since when each.
    let starts: Mutex<BTreeMap<String, u64>> = Mutex::default();
    let all_started = std::sync::atomic::AtomicBool::new(false);
    let loads = early.as_ref().map(|e| e.loads.clone());
    std::thread::scope(|s| {
        let mut restores = Vec::new();
        let mut cohorts = Vec::new();
        for v in &plan.vms {
            let (in_tx, in_rx) = mpsc::channel();
            let deliver = in_tx.clone();
            let ep = net.join(v.name.clone(), move |env| {
                let _ = deliver.send(vmcsnap_coord::restore::CohortInput::Message(env));
            });
            let (cmd_tx, cmd_rx) = mpsc::channel();
            let gate = restore::StartGate::new();
            let (ws_mode, wss) = match mode {
                Mode::Eager | Mode::EagerRl => (ws::Mode::Eager, WssChoice::Auto),
                Mode::WorkingsetRestore => (ws::Mode::SamplingWs, WssChoice::Auto),
                Mode::Hotrestore => (ws::Mode::Workingset, WssChoice::Auto),
                Mode::HotrestoreRl => (ws::Mode::Workingset, WssChoice::Pages(v.size)),
            };
            let job = cohort::Job {
                vm: v.name.clone(),
                dir: v.dir.clone(),
                opts: restore::Options {
                    snapshot: format!("{}/{}", plan_name(&v.dir), v.name),
                    mode: ws_mode,
                    wss,
                    paused: false,
                    trace: false,
                    no_background: false,
                    priorities: opts.priorities,
                    start_quiet: opts.start_quiet,
                    prefetch_blocks: restore::pages::PREFETCH_BLOCKS,
                    preempt: false,
                    cluster: None,
                    observer: None,
                },
                gate: gate.clone(),
                cmds: cmd_rx,
                inbox: in_tx,
                switch: c.switch.clone(),
                cluster: c.spec.cluster.name.clone(),
                replay: replay.remove(&v.name).unwrap_or_default(),
                progress: ptx.clone(),
                loads: loads.clone(),
                loaded: loaded.clone(),
                when_peers_loaded: crate::fault::when_peers_loaded(&opts.fault, &v.name)
                    .map(|kind| (kind, plan.vms.len())),
                hold_background_until: crate::fault::background_held_until(&opts.fault),
            };
            restores.push(s.spawn(move || cohort::restore_thread(run, job)));
            let mut worker = cohort::Worker {
                cmds: cmd_tx,
                gate,
                start_held_until: crate::fault::start_held_until(&opts.fault),
            };
            let (name, t) = (v.name.clone(), timeouts.clone());
            cohorts.push(s.spawn(move || {
                let co = Cohort::new(epoch, name.clone(), COORDINATOR.to_string(), t);
                let outcome = run_cohort(co, &ep, &in_rx, &mut worker);
                (name, outcome)
            }));
        }
        let ptx2 = ptx.clone();
        let (starts, all_started) = (&starts, &all_started);
        let coord = s.spawn(move || {
            let t_start = Instant::now();
            let outcome = run_coordinator(&mut coordinator, &co_ep, &co_rx, &mut |ev| {
                match &ev.kind {
                    CoordinatorEventKind::StartFin {
                        cohort,
                        started_unix_us,
                    } => {
                        let mut st = starts.lock().unwrap_or_else(|p| p.into_inner());
                        st.insert(cohort.clone(), *started_unix_us);
                    }
                    CoordinatorEventKind::AllStarted => {
                        all_started.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    _ => {}
                }
                if let Some(line) = protocol_line(ev, t_start) {
                    let _ = ptx2.send(line);
                }
            });
            (outcome, coordinator.start_order())
        });
        drop(ptx);
        loop {
            match prx.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => progress(&line),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if all_started.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(e) = early.take() {
                    let st = starts.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    progress("every guest runs; the rest of the pages load in the background");
                    (e.on_running)(&st);
                }
            }
            if cohorts.iter().all(|h| h.is_finished()) && restores.iter().all(|h| h.is_finished()) {
                co_inbox.lock().unwrap_or_else(|p| p.into_inner()).take();
                if coord.is_finished() {
                    break;
                }
            }
        }
        for line in prx.try_iter() {
            progress(&line);
        }
        for h in cohorts {
            let (name, o) = h.join().expect("cohort thread panicked");
            if let CohortOutcome::Abandoned { reason } = o {
                log(format!(
                    "cluster restore: cohort {name} abandoned: {reason}"
                ));
            }
        }
        let outcomes: Vec<cohort::Outcome> = restores
            .into_iter()
            .map(|h| h.join().expect("restore thread panicked"))
            .collect();
        let (outcome, order) = coord.join().expect("coordinator thread panicked");
        (outcome, outcomes, order)
    })
}

/// The progress line of a protocol event, or `None` for a routine
/// retransmission (a dozen in a restore that succeeds), which goes to the
/// log only.
fn protocol_line(ev: &CoordinatorEvent, t0: Instant) -> Option<String> {
    let at = ev.at.saturating_duration_since(t0).as_secs_f64() * 1000.0;
    if let CoordinatorEventKind::Retransmit { to, msg } = &ev.kind {
        tracing::info!(to = %to, msg = *msg, at_ms = at, "cluster restore protocol: message sent again");
        return None;
    }
    Some(format!("protocol: {at:.1} ms: {:?}", ev.kind))
}

fn plan_name(vm_dir: &Path) -> String {
    vm_dir
        .parent()
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn mode_name(mode: Mode) -> String {
    crate::snapshot::serde_name(mode)
}

/// The restore dependency graph of the cluster snapshot in `dir`
/// (`vmcsnap inspect --rdg`), planned with this host's working sets.
pub fn dependency_report(dir: &Path) -> Result<RdgReport, AgentError> {
    vmcsnap_orchestrator::cluster_restore::dependency_report(dir, &crate::host_api::LocalHost)
        .map_err(|e| AgentError::BadRequest(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retransmissions_are_no_progress_lines() {
        let t0 = Instant::now();
        let ev = |kind| CoordinatorEvent { at: t0, kind };
        let retransmit = ev(CoordinatorEventKind::Retransmit {
            to: "a".into(),
            msg: "LOAD",
        });
        assert_eq!(protocol_line(&retransmit, t0), None);
        let line = protocol_line(&ev(CoordinatorEventKind::AllStarted), t0).unwrap();
        assert!(line.starts_with("protocol: 0.0 ms: AllStarted"), "{line}");
    }

    #[test]
    fn modes_parse() {
        assert_eq!("hotrestore-rl".parse::<Mode>().unwrap(), Mode::HotrestoreRl);
        assert_eq!("eager".parse::<Mode>().unwrap(), Mode::Eager);
        assert_eq!("eager-rl".parse::<Mode>().unwrap(), Mode::EagerRl);
        assert!("lazy"
            .parse::<Mode>()
            .unwrap_err()
            .contains("eager, eager-rl, workingset-restore, hotrestore or hotrestore-rl"));
    }
}
