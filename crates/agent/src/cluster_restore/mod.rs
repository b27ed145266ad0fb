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
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmcsnap_coord::restore::{
    run_cohort, run_coordinator, Cohort, CohortOutcome, Coordinator, CoordinatorEvent,
    CoordinatorEventKind, CoordinatorOutcome, Msg, Policy, Timeouts,
};
use vmcsnap_coord::transport::InProcessNetwork;
use vmcsnap_image::cluster::{check_cluster_committed, ClusterManifest};
use vmcsnap_restoreline::{revise_wss_scaled, Edge, Rdg};
use vmcsnap_spec::ClusterSpec;
use vmcsnap_workingset as ws;

pub use vmcsnap_control::{ClusterRestoreReport, ClusterRunning, VmRestoreReport, VmRunning};

use crate::cluster::Cluster;
use crate::fault::RestoreFault;
use crate::restore::{self, WssChoice};
use crate::{log, AgentError, RunDir};

/// The Coordinator's node name on the protocol's transport.
pub const COORDINATOR: &str = "coordinator";

/// For the LP: pages of working-set difference asked per frame logged from
/// a sender to a receiver (the paper's W is a frame count; a difference of
/// a few pages would not order real load times).
pub const PAGES_PER_FRAME: u64 = 64;

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
    let plan = plan(&m, &dir, opts.mode)?;
    let mut saved = Vec::new();
    let qemu_bin = crate::qemu::find_qemu()?;
    for v in &plan.vms {
        let img = crate::frozen_disks::open_image(&v.dir)
            .map_err(|e| AgentError::BadRequest(format!("VM {}: {e}", v.name)))?;
        // Every VM's QEMU version before any VM starts.
        restore::check_versions(&img, &opts.snapshot, &qemu_bin)?;
        saved.push(restore::saved_vm(&img, &opts.snapshot)?);
    }
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

/// One VM's part of the plan.
pub struct PlannedVm {
    /// The VM.
    pub name: String,
    /// Its snapshot directory.
    pub dir: PathBuf,
    /// HotRestore's hybrid working-set size (pages).
    pub hybrid: u64,
    /// The size this mode restores with (revised for `hotrestore-rl`).
    pub size: u64,
}

/// The graph, the sizes and the start policy of a cluster restore.
pub struct Plan {
    /// Per VM, in the manifest's order.
    pub vms: Vec<PlannedVm>,
    /// The restore dependency graph.
    pub rdg: Rdg,
    /// The restore line (ascending revised size) or, without one, the VMs.
    pub line: Vec<String>,
    /// Σ|S*_i − S_i| of the revision (0 without one).
    pub lp_objective: f64,
}

fn plan(m: &ClusterManifest, dir: &Path, mode: Mode) -> Result<Plan, AgentError> {
    let names: Vec<String> = m.vms.iter().map(|v| v.name.clone()).collect();
    let edges = graph_edges(m, &names);
    let rdg = Rdg::new(names.clone(), edges)
        .map_err(|e| AgentError::BadRequest(format!("restore dependency graph: {e}")))?;
    let mut vms = Vec::new();
    let mut sizes = BTreeMap::new();
    for v in &m.vms {
        let vdir = dir.join(&v.snapshot);
        let hybrid = restore::hybrid_size(&vdir)?;
        sizes.insert(v.name.clone(), hybrid);
        vms.push(PlannedVm {
            name: v.name.clone(),
            dir: vdir,
            hybrid,
            size: hybrid,
        });
    }
    let (line, lp_objective) = if mode == Mode::HotrestoreRl {
        let r = revise_wss_scaled(&rdg, &sizes, PAGES_PER_FRAME)
            .map_err(|e| AgentError::BadRequest(format!("revising working-set sizes: {e}")))?;
        for v in &mut vms {
            v.size = r.sizes.get(&v.name).copied().unwrap_or(v.hybrid);
        }
        (r.restore_line, r.objective)
    } else {
        (names, 0.0)
    };
    Ok(Plan {
        vms,
        rdg,
        line,
        lp_objective,
    })
}

/// The edges of the restore dependency graph: VM i → VM j with W(i,j) =
/// frames from i to j logged at the cut (cluster.json's `edges`), plus,
/// with weight 1, every pair that exchanged unicast frames while the cut
/// was being taken (the switch's per-pair counts, `metrics.switch.pairs`).
///
/// vmcsnap's cut is exact and short, so it logs only a handful of frames
/// (often none): the logged frames alone leave most VMs as orphans and
/// their starts unordered, and a VM that starts before a peer it talks to
/// backs off. Traffic during the cut is the same evidence HotRestore uses,
/// "VM i sent to VM j at the cut", over the few milliseconds of the cut
/// instead of only the frames crossing it. A TCP conversation sends both
/// ways, so its VMs form a ring and start together.
fn graph_edges(m: &ClusterManifest, names: &[String]) -> Vec<Edge> {
    let mut w: BTreeMap<(String, String), u64> = BTreeMap::new();
    for e in &m.edges {
        *w.entry((e.from.clone(), e.to.clone())).or_default() += e.frames;
    }
    let known = |n: &str| names.iter().any(|x| x == n);
    for p in m.metrics["switch"]["pairs"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let (Some(from), Some(to)) = (p["from"].as_str(), p["to"].as_str()) else {
            continue;
        };
        if p["unicast_frames"].as_u64().unwrap_or(0) > 0 && from != to && known(from) && known(to) {
            let e = w.entry((from.to_string(), to.to_string())).or_default();
            *e = (*e).max(1);
        }
    }
    w.into_iter()
        .map(|((from, to), weight)| Edge::new(from, to, weight))
        .collect()
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

/// The restore dependency graph of a cluster snapshot and what a
/// `hotrestore-rl` restore would do with it (`vmcsnap inspect --rdg`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RdgReport {
    /// The cluster snapshot.
    pub snapshot: String,
    /// VMs.
    pub vms: Vec<String>,
    /// Edges (from, to, frames logged at the cut).
    pub edges: Vec<(String, String, u64)>,
    /// Rings: VMs that sent to each other (they start together).
    pub rings: Vec<Vec<String>>,
    /// VMs without any edge.
    pub orphans: Vec<String>,
    /// HotRestore's causal restore order (rules 1-6), in groups.
    pub causal_order: Vec<Vec<String>>,
    /// Per VM: the VMs that must run before it starts.
    pub must_start_after: BTreeMap<String, Vec<String>>,
    /// HotRestore's hybrid working-set sizes (pages).
    pub sizes: BTreeMap<String, u64>,
    /// The LP-revised sizes (pages).
    pub revised: BTreeMap<String, u64>,
    /// Σ|S*_i − S_i|.
    pub lp_objective: f64,
    /// The restore line: ascending revised size.
    pub restore_line: Vec<String>,
    /// Graphviz DOT of the graph with the revised sizes.
    pub dot: String,
}

/// The restore dependency graph of the cluster snapshot in `dir`.
pub fn dependency_report(dir: &Path) -> Result<RdgReport, AgentError> {
    let m = check_cluster_committed(dir)
        .map_err(|e| AgentError::BadRequest(format!("cluster snapshot {}: {e}", dir.display())))?;
    let p = plan(&m, dir, Mode::HotrestoreRl)?;
    let sizes: BTreeMap<String, u64> = p.vms.iter().map(|v| (v.name.clone(), v.hybrid)).collect();
    let revised: BTreeMap<String, u64> = p.vms.iter().map(|v| (v.name.clone(), v.size)).collect();
    Ok(RdgReport {
        snapshot: m.name.clone(),
        vms: p.vms.iter().map(|v| v.name.clone()).collect(),
        edges: p
            .rdg
            .edges()
            .iter()
            .map(|e| (e.from.clone(), e.to.clone(), e.weight))
            .collect(),
        rings: p.rdg.rings(),
        orphans: p.rdg.orphans(),
        causal_order: p.rdg.causal_order(),
        must_start_after: p
            .rdg
            .nodes()
            .iter()
            .map(|n| (n.clone(), p.rdg.must_start_before(n)))
            .collect(),
        dot: p.rdg.to_dot(Some(&revised)),
        sizes,
        revised,
        lp_objective: p.lp_objective,
        restore_line: p.line,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn manifest(edges: serde_json::Value, pairs: serde_json::Value) -> ClusterManifest {
        let vm = |n: &str| {
            json!({ "name": n, "snapshot": format!("vms/{n}"), "memory_mib": 128, "ip": "", "mac": "",
                    "timeline": { "start_us": 0, "pause_start_us": 0, "pause_end_us": 0, "transient_done_us": 0, "complete_us": 0 } })
        };
        serde_json::from_value(json!({
            "format": "vmcsnap-cluster-snapshot", "version": 1, "name": "s", "cluster": "c", "mode": "hot",
            "created_unix_ms": 0, "network": {}, "vms": [vm("a"), vm("b"), vm("c")],
            "channel_state": { "file": "channel-state.bin", "frames": 0, "bytes": 0, "file_size": 0 },
            "edges": edges, "metrics": { "switch": { "pairs": pairs } },
        }))
        .unwrap()
    }

    #[test]
    fn graph_edges_join_logged_frames_and_unicast_pairs() {
        let m = manifest(
            json!([{ "from": "a", "to": "b", "frames": 3, "bytes": 300 }]),
            json!([
                { "from": "a", "to": "b", "frames": 50, "bytes": 1, "unicast_frames": 40 },
                { "from": "b", "to": "a", "frames": 50, "bytes": 1, "unicast_frames": 40 },
                { "from": "c", "to": "a", "frames": 5, "bytes": 1, "unicast_frames": 0 },
                { "from": "c", "to": "zz", "frames": 5, "bytes": 1, "unicast_frames": 5 },
            ]),
        );
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let e: Vec<(String, String, u64)> = graph_edges(&m, &names)
            .into_iter()
            .map(|e| (e.from, e.to, e.weight))
            .collect();
        // Logged frames keep their count; a talking pair adds weight 1;
        // broadcasts only (no unicast) and unknown VMs add nothing.
        assert_eq!(
            e,
            vec![("a".into(), "b".into(), 3), ("b".into(), "a".into(), 1)]
        );
        let rdg = Rdg::new(
            names,
            graph_edges(&m, &["a".into(), "b".into(), "c".into()]),
        )
        .unwrap();
        assert_eq!(rdg.rings(), vec![vec!["a".to_string(), "b".to_string()]]);
        assert_eq!(rdg.orphans(), vec!["c".to_string()]);
    }

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
