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
mod protocol;
mod report;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use vmcsnap_coord::restore::CoordinatorOutcome;
use vmcsnap_image::cluster::{check_cluster_committed, ClusterManifest};
use vmcsnap_spec::ClusterSpec;

pub use vmcsnap_control::{ClusterRestoreReport, ClusterRunning, VmRestoreReport, VmRunning};
pub use vmcsnap_orchestrator::cluster_restore::{Plan, PlannedVm, RdgReport, PAGES_PER_FRAME};

use crate::cluster::Cluster;
use crate::fault::RestoreFault;
use crate::restore;
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
    let r = load(run, &opts, start_unix_us)?;
    let planned_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let first = r.saved.first().ok_or_else(|| {
        AgentError::BadRequest(format!("cluster snapshot {:?} has no VM", opts.snapshot))
    })?;
    // Will every VM fit? Checked before anything is created.
    let demand = crate::capacity::demand(
        run,
        &first.cluster.name,
        r.saved
            .iter()
            .map(|s| (s.qemu.name.as_str(), s.qemu.memory_mib)),
    );
    crate::capacity::ensure(
        crate::capacity::Start::ClusterRestore(&r.m.name),
        &demand,
        run,
    )?;
    journal(run, &opts, &r, journaled)?;
    let mut c = new_cluster(run, &opts, &r, first, progress)?;
    let replay = replay_frames(&r.dir, &r.m)?;
    let names = (c.spec.cluster.name.clone(), c.accel.name().to_string());
    // Every guest's clock is set before the early answer (which reports it).
    let mut early_clocks = None;
    let mut on_running = |starts: &BTreeMap<String, u64>| {
        if let Some(ctx) = early {
            early_clocks = Some(answer_early(ctx, run, &r, &opts, &names, starts));
        }
    };
    let early = early.map(|ctx| Early {
        loads: ctx.loads.clone(),
        on_running: &mut on_running,
    });
    let load_sent_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let (outcome, outcomes, start_order) =
        protocol::run_protocol(&c, run, &r.plan, &opts, replay, early, progress);
    let (restored, errors) = collect(outcomes);
    if let Some(reason) = failure(&outcome, &errors) {
        return Err(fail(&mut c, restored, errors, &reason, &r.m.name));
    }
    // Every guest runs: their clocks go to the host's (`guest_clock`),
    // unless that was done for the early answer.
    let clocks = early_clocks
        .unwrap_or_else(|| crate::guest_clock::sync_all(restored.iter().map(|r| &r.0.vm.config)));
    let mut report = report::build(
        &r.m,
        &r.plan,
        &opts,
        &restored,
        &start_order,
        t0,
        start_unix_us,
    );
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

/// A cluster restore's inputs: the committed cluster snapshot, its plan,
/// every VM's saved configuration.
struct Restoring {
    /// When the restore began (unix µs).
    start_unix_us: u64,
    dir: PathBuf,
    m: ClusterManifest,
    plan: Plan,
    saved: Vec<restore::Saved>,
}

/// Checks the cluster snapshot, plans its restore, and reads every VM's
/// saved configuration (and its QEMU version, before any VM starts).
fn load(run: &RunDir, opts: &Options, start_unix_us: u64) -> Result<Restoring, AgentError> {
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
    Ok(Restoring {
        start_unix_us,
        dir,
        m,
        plan,
        saved,
    })
}

/// Begins the restore journal (`restore_journal`) with the plan's VMs,
/// and checks that a fault to inject names one of them.
fn journal(
    run: &RunDir,
    opts: &Options,
    r: &Restoring,
    journaled: &Mutex<Vec<String>>,
) -> Result<(), AgentError> {
    crate::restore_journal::begin(
        run,
        &crate::restore_journal::Restoring::Cluster {
            snapshot: opts.snapshot.clone(),
            vms: r.plan.vms.iter().map(|v| v.name.clone()).collect(),
        },
    )?;
    *journaled.lock().unwrap_or_else(|p| p.into_inner()) =
        r.plan.vms.iter().map(|v| v.name.clone()).collect();
    if let Some(vm) = crate::fault::restore_fault_vm(&opts.fault) {
        if !r.plan.vms.iter().any(|v| v.name == vm) {
            return Err(AgentError::BadRequest(format!(
                "the fault names VM {vm:?}, which is not in cluster snapshot {:?} (its VMs: {})",
                opts.snapshot,
                r.plan
                    .vms
                    .iter()
                    .map(|v| v.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    Ok(())
}

/// The new, empty cluster the VMs are restored into.
fn new_cluster(
    run: &RunDir,
    opts: &Options,
    r: &Restoring,
    first: &restore::Saved,
    progress: &mut dyn FnMut(&str),
) -> Result<Cluster, AgentError> {
    let spec = ClusterSpec {
        cluster: first.cluster.clone(),
        vm: r.saved.iter().map(|s| s.spec.clone()).collect(),
    };
    let c = Cluster::empty(run, spec, first.qemu.accel)?;
    progress(&format!(
        "restoring cluster {} from {} ({} VMs, mode {})",
        r.m.cluster,
        r.m.name,
        r.plan.vms.len(),
        mode_name(opts.mode)
    ));
    if opts.mode == Mode::HotrestoreRl {
        progress(&format!("restore line: {}", r.plan.line.join(" < ")));
    }
    Ok(c)
}

/// Once every guest runs, for a restore that answers early: shows the
/// VMs, sets the guests' clocks and answers; returns the clocks.
fn answer_early(
    ctx: &crate::loading::Ctx<'_>,
    run: &RunDir,
    r: &Restoring,
    opts: &Options,
    (cluster, accel): &(String, String),
    starts: &BTreeMap<String, u64>,
) -> Vec<vmcsnap_control::ClockSync> {
    let vms = r
        .saved
        .iter()
        .map(|s| {
            let n = &s.qemu.name;
            let started = starts.get(n).copied().unwrap_or(r.start_unix_us);
            let qmp = run.vm_dir(n).join("qmp.sock");
            restore::vm_status(n, &s.address, s.qemu.memory_mib, &qmp, started)
        })
        .collect();
    ctx.early.show(cluster, accel, vms);
    let configs: Vec<_> = r
        .saved
        .iter()
        .map(|s| crate::guest_clock::restored_in(&s.qemu, &run.vm_dir(&s.qemu.name)))
        .collect();
    let mut running = report::running(&r.m, &r.plan, opts, starts, r.start_unix_us);
    running.guest_clocks = crate::guest_clock::sync_all(&configs);
    ctx.early
        .reply(vmcsnap_control::Response::ClusterRunning(running.clone()));
    running.guest_clocks
}

/// The VMs restored (logged) and the errors of those that failed.
fn collect(outcomes: Vec<cohort::Outcome>) -> (Vec<cohort::Restored>, Vec<String>) {
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
    (restored, errors)
}

/// Why the restore failed, if it did. A VM whose restore failed after the
/// protocol was done (e.g. its destination reported the migration failed)
/// fails the whole restore too: a cluster restore never silently leaves a
/// VM out.
fn failure(outcome: &CoordinatorOutcome, errors: &[String]) -> Option<String> {
    match outcome {
        CoordinatorOutcome::Aborted { reason } => Some(reason.clone()),
        CoordinatorOutcome::Completed if !errors.is_empty() => {
            Some("a VM failed after the protocol completed".to_string())
        }
        CoordinatorOutcome::Completed => None,
    }
}

/// Removes every VM of a failed cluster restore and the cluster; the error.
fn fail(
    c: &mut Cluster,
    restored: Vec<cohort::Restored>,
    mut errors: Vec<String>,
    reason: &str,
    snapshot: &str,
) -> AgentError {
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
        reason.to_string()
    } else {
        format!("{reason} ({})", errors.join("; "))
    };
    log(format!("cluster restore of {snapshot} failed: {detail}"));
    AgentError::BadRequest(format!(
        "cluster restore failed: {detail}; nothing was left running"
    ))
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
    use super::protocol::protocol_line;
    use super::*;
    use vmcsnap_coord::restore::{CoordinatorEvent, CoordinatorEventKind};

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
