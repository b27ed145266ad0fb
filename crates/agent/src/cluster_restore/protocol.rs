//! Running a cluster restore's protocol: the Coordinator and, per VM, a
//! Cohort and a restore thread, on the in-process transport (see the docs
//! of `super`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use vmcsnap_coord::restore::{
    run_cohort, run_coordinator, Cohort, CohortInput, CohortOutcome, Coordinator, CoordinatorEvent,
    CoordinatorEventKind, CoordinatorOutcome, Msg, Policy, Timeouts,
};
use vmcsnap_coord::transport::{Envelope, InProcessEndpoint, InProcessNetwork};
use vmcsnap_workingset as ws;

use super::{cohort, Early, Mode, Options, Plan, PlannedVm, COORDINATOR};
use crate::cluster::Cluster;
use crate::restore::{self, WssChoice};
use crate::{log, RunDir};

/// What `run_protocol` returns: the Coordinator's outcome, every VM's,
/// and the order the VMs started in.
pub(super) type Ran = (CoordinatorOutcome, Vec<cohort::Outcome>, Vec<(String, u64)>);

/// The Coordinator's end of the in-process network; its inbox is emptied
/// once every Cohort and restore has finished.
struct CoordinatorLink {
    ep: InProcessEndpoint<Msg>,
    rx: Receiver<Envelope<Msg>>,
    inbox: Arc<Mutex<Option<Sender<Envelope<Msg>>>>>,
}

/// What the threads of one protocol run share.
struct Shared<'a> {
    c: &'a Cluster,
    run: &'a RunDir,
    plan: &'a Plan,
    opts: &'a Options,
    epoch: u64,
    timeouts: Timeouts,
    net: Arc<InProcessNetwork<Msg>>,
    progress: Sender<String>,
    loads: Option<crate::loading::Loads>,
    loaded: Arc<cohort::LoadedCount>,
}

/// Every guest runs (the Coordinator's AllStarted), and since when each.
#[derive(Default)]
struct Starts {
    at: Mutex<BTreeMap<String, u64>>,
    all: AtomicBool,
}

/// Runs the Coordinator and, per VM, a Cohort and a restore thread.
pub(super) fn run_protocol(
    c: &Cluster,
    run: &RunDir,
    plan: &Plan,
    opts: &Options,
    mut replay: HashMap<String, Vec<Vec<u8>>>,
    mut early: Option<Early<'_>>,
    progress: &mut dyn FnMut(&str),
) -> Ran {
    let timeouts = Timeouts::default();
    let epoch = crate::snapshot::unix_us() / 1000;
    let net = InProcessNetwork::<Msg>::new();
    let link = CoordinatorLink::join(&net);
    let (ptx, prx) = mpsc::channel::<String>();
    let coordinator = Coordinator::new(
        epoch,
        COORDINATOR.to_string(),
        &plan.rdg,
        policy_for(opts.mode),
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
    let shared = Shared {
        c,
        run,
        plan,
        opts,
        epoch,
        timeouts,
        net: net.clone(),
        progress: ptx,
        loads: early.as_ref().map(|e| e.loads.clone()),
        loaded: Arc::new(cohort::LoadedCount::default()),
    };
    let starts = Starts::default();
    std::thread::scope(|s| {
        let mut restores = Vec::new();
        let mut cohorts = Vec::new();
        for v in &plan.vms {
            let replay = replay.remove(&v.name).unwrap_or_default();
            let (restore, cohort) = spawn_vm(s, &shared, v, replay);
            restores.push(restore);
            cohorts.push(cohort);
        }
        let (ep, rx, ptx2) = (link.ep, link.rx, shared.progress.clone());
        let starts = &starts;
        let coord = s.spawn(move || {
            let outcome = coordinate(&mut coordinator, &ep, &rx, starts, &ptx2);
            (outcome, coordinator.start_order())
        });
        drop(shared);
        forward_progress(
            &prx,
            starts,
            &mut early,
            &link.inbox,
            progress,
            &|| cohorts.iter().all(|h| h.is_finished()) && restores.iter().all(|h| h.is_finished()),
            &coord,
        );
        join_all(cohorts, restores, coord)
    })
}

/// The order itself is restoreline's (`Rdg::start_groups`); the
/// coordinator only follows it.
fn policy_for(mode: Mode) -> Policy {
    match mode {
        Mode::HotrestoreRl | Mode::EagerRl => Policy::RestoreLine,
        _ => Policy::Independent,
    }
}

impl CoordinatorLink {
    fn join(net: &Arc<InProcessNetwork<Msg>>) -> CoordinatorLink {
        let (tx, rx) = mpsc::channel();
        let inbox = Arc::new(Mutex::new(Some(tx)));
        let deliver = inbox.clone();
        let ep = net.join(COORDINATOR, move |env| {
            if let Some(tx) = deliver.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                let _ = tx.send(env);
            }
        });
        CoordinatorLink { ep, rx, inbox }
    }
}

/// Starts one VM's restore thread and its Cohort's thread.
#[allow(clippy::type_complexity)]
fn spawn_vm<'scope>(
    s: &'scope Scope<'scope, '_>,
    sh: &Shared<'scope>,
    v: &PlannedVm,
    replay: Vec<Vec<u8>>,
) -> (
    ScopedJoinHandle<'scope, cohort::Outcome>,
    ScopedJoinHandle<'scope, (String, CohortOutcome)>,
) {
    let (in_tx, in_rx) = mpsc::channel();
    let deliver = in_tx.clone();
    let ep = sh.net.join(v.name.clone(), move |env| {
        let _ = deliver.send(CohortInput::Message(env));
    });
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let gate = restore::StartGate::new();
    let job = cohort_job(sh, v, replay, gate.clone(), cmd_rx, in_tx);
    let run = sh.run;
    let restore = s.spawn(move || cohort::restore_thread(run, job));
    let mut worker = cohort::Worker {
        cmds: cmd_tx,
        gate,
        start_held_until: crate::fault::start_held_until(&sh.opts.fault),
    };
    let (name, t, epoch) = (v.name.clone(), sh.timeouts.clone(), sh.epoch);
    let cohort = s.spawn(move || {
        let co = Cohort::new(epoch, name.clone(), COORDINATOR.to_string(), t);
        let outcome = run_cohort(co, &ep, &in_rx, &mut worker);
        (name, outcome)
    });
    (restore, cohort)
}

/// One VM's restore job: its mode and working set by the cluster mode.
fn cohort_job(
    sh: &Shared<'_>,
    v: &PlannedVm,
    replay: Vec<Vec<u8>>,
    gate: restore::StartGate,
    cmds: Receiver<cohort::Cmd>,
    inbox: Sender<CohortInput>,
) -> cohort::Job {
    let (ws_mode, wss) = match sh.opts.mode {
        Mode::Eager | Mode::EagerRl => (ws::Mode::Eager, WssChoice::Auto),
        Mode::WorkingsetRestore => (ws::Mode::SamplingWs, WssChoice::Auto),
        Mode::Hotrestore => (ws::Mode::Workingset, WssChoice::Auto),
        Mode::HotrestoreRl => (ws::Mode::Workingset, WssChoice::Pages(v.size)),
    };
    cohort::Job {
        vm: v.name.clone(),
        dir: v.dir.clone(),
        opts: restore::Options {
            snapshot: format!("{}/{}", super::plan_name(&v.dir), v.name),
            mode: ws_mode,
            wss,
            paused: false,
            trace: false,
            no_background: false,
            priorities: sh.opts.priorities,
            start_quiet: sh.opts.start_quiet,
            prefetch_blocks: restore::pages::PREFETCH_BLOCKS,
            preempt: false,
            cluster: None,
            observer: None,
        },
        gate,
        cmds,
        inbox,
        switch: sh.c.switch.clone(),
        cluster: sh.c.spec.cluster.name.clone(),
        replay,
        progress: sh.progress.clone(),
        loads: sh.loads.clone(),
        loaded: sh.loaded.clone(),
        when_peers_loaded: crate::fault::when_peers_loaded(&sh.opts.fault, &v.name)
            .map(|kind| (kind, sh.plan.vms.len())),
        hold_background_until: crate::fault::background_held_until(&sh.opts.fault),
    }
}

/// The Coordinator's thread: runs it, notes when each guest started and
/// when all run, and sends its events as progress lines.
fn coordinate(
    coordinator: &mut Coordinator,
    ep: &InProcessEndpoint<Msg>,
    rx: &Receiver<Envelope<Msg>>,
    starts: &Starts,
    progress: &Sender<String>,
) -> CoordinatorOutcome {
    let t_start = Instant::now();
    run_coordinator(coordinator, ep, rx, &mut |ev| {
        match &ev.kind {
            CoordinatorEventKind::StartFin {
                cohort,
                started_unix_us,
            } => {
                let mut st = starts.at.lock().unwrap_or_else(|p| p.into_inner());
                st.insert(cohort.clone(), *started_unix_us);
            }
            CoordinatorEventKind::AllStarted => {
                starts.all.store(true, Ordering::SeqCst);
            }
            _ => {}
        }
        if let Some(line) = protocol_line(ev, t_start) {
            let _ = progress.send(line);
        }
    })
}

/// Forwards progress lines until every thread has finished; answers early
/// once every guest runs.
fn forward_progress(
    prx: &Receiver<String>,
    starts: &Starts,
    early: &mut Option<Early<'_>>,
    coordinator_inbox: &Mutex<Option<Sender<Envelope<Msg>>>>,
    progress: &mut dyn FnMut(&str),
    vms_done: &dyn Fn() -> bool,
    coord: &ScopedJoinHandle<'_, (CoordinatorOutcome, Vec<(String, u64)>)>,
) {
    loop {
        match prx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => progress(&line),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if starts.all.load(Ordering::SeqCst) {
            if let Some(e) = early.take() {
                let st = starts.at.lock().unwrap_or_else(|p| p.into_inner()).clone();
                progress("every guest runs; the rest of the pages load in the background");
                (e.on_running)(&st);
            }
        }
        if vms_done() {
            coordinator_inbox
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if coord.is_finished() {
                break;
            }
        }
    }
    for line in prx.try_iter() {
        progress(&line);
    }
}

/// Joins every thread: the VMs' outcomes, the Coordinator's and the start
/// order.
fn join_all(
    cohorts: Vec<ScopedJoinHandle<'_, (String, CohortOutcome)>>,
    restores: Vec<ScopedJoinHandle<'_, cohort::Outcome>>,
    coord: ScopedJoinHandle<'_, (CoordinatorOutcome, Vec<(String, u64)>)>,
) -> Ran {
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
}

/// The progress line of a protocol event, or `None` for a routine
/// retransmission (a dozen in a restore that succeeds), which goes to the
/// log only.
pub(super) fn protocol_line(ev: &CoordinatorEvent, t0: Instant) -> Option<String> {
    let at = ev.at.saturating_duration_since(t0).as_secs_f64() * 1000.0;
    if let CoordinatorEventKind::Retransmit { to, msg } = &ev.kind {
        tracing::info!(to = %to, msg = *msg, at_ms = at, "cluster restore protocol: message sent again");
        return None;
    }
    Some(format!("protocol: {at:.1} ms: {:?}", ev.kind))
}
