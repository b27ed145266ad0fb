//! A threaded restore cluster for the driver tests: a coordinator and one
//! cohort per VM on an InProcessNetwork, fake workers that "load" and
//! "start" after small sleeps, and the checks every run must pass.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use vmcsnap_coord::restore::*;
use vmcsnap_coord::transport::{Envelope, InProcessNetwork, NetStats};

pub const MGR: &str = "mgr";

#[path = "../shared/mod.rs"]
mod shared;
pub use shared::XorShift;

/// What a fake worker or the network did, in one global order.
#[derive(Debug, Clone, PartialEq)]
pub enum Act {
    Load,
    Loaded,
    Start,
    Started(u64),
    Restored,
    Abandon(String),
    /// A message passed the network (`dropped` = lost).
    Net {
        env: Envelope<Msg>,
        dropped: bool,
    },
}

pub type Log = shared::Log<Act>;

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// How long a fake worker takes, and whether it fails.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Working-set load time.
    pub load_ms: u64,
    /// Background loading of the other pages, after the working set.
    pub rest_ms: u64,
    /// Report `Failed(error)` halfway through the working-set load.
    pub fail: Option<String>,
}

pub struct FakeWorker {
    name: String,
    inbox: Sender<CohortInput>,
    log: Arc<Log>,
    plan: Plan,
    start_ms: u64,
    loaded: Arc<AtomicBool>,
    cancelled: Arc<AtomicBool>,
    calls: (u32, u32),
    violations: Arc<Mutex<Vec<String>>>,
}

impl FakeWorker {
    fn violation(&self, what: &str) {
        let v = format!("{}: {what}", self.name);
        self.violations.lock().unwrap().push(v);
    }
}

impl CohortWorker for FakeWorker {
    fn load(&mut self) {
        self.calls.0 += 1;
        if self.calls.0 > 1 {
            self.violation("second load");
        }
        self.log.push(&self.name, Act::Load);
        let (name, inbox, log, plan) = (
            self.name.clone(),
            self.inbox.clone(),
            Arc::clone(&self.log),
            self.plan.clone(),
        );
        let (loaded, cancelled) = (Arc::clone(&self.loaded), Arc::clone(&self.cancelled));
        thread::spawn(move || {
            if let Some(e) = plan.fail {
                thread::sleep(Duration::from_millis(plan.load_ms / 2));
                let _ = inbox.send(CohortInput::Failed(e));
                return;
            }
            thread::sleep(Duration::from_millis(plan.load_ms));
            if cancelled.load(Ordering::SeqCst) {
                return;
            }
            loaded.store(true, Ordering::SeqCst);
            log.push(&name, Act::Loaded);
            let _ = inbox.send(CohortInput::Loaded);
            thread::sleep(Duration::from_millis(plan.rest_ms));
            if cancelled.load(Ordering::SeqCst) {
                return;
            }
            log.push(&name, Act::Restored);
            let _ = inbox.send(CohortInput::Restored);
        });
    }

    fn start(&mut self) {
        self.calls.1 += 1;
        if self.calls.1 > 1 {
            self.violation("second start");
        }
        if !self.loaded.load(Ordering::SeqCst) {
            self.violation("started before its working set was loaded");
        }
        self.log.push(&self.name, Act::Start);
        let (name, inbox, log) = (self.name.clone(), self.inbox.clone(), Arc::clone(&self.log));
        let (cancelled, ms) = (Arc::clone(&self.cancelled), self.start_ms);
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(ms));
            if cancelled.load(Ordering::SeqCst) {
                return;
            }
            let us = unix_us();
            log.push(&name, Act::Started(us));
            let _ = inbox.send(CohortInput::Started { unix_us: us });
        });
    }

    fn abandon(&mut self, reason: &str) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.log.push(&self.name, Act::Abandon(reason.to_string()));
    }
}

/// Who sends to whom: `(from, to)`, so `to` must run before `from`.
pub type Links = Vec<(&'static str, &'static str)>;

/// The restore dependency graph of `cohorts` with `links` (weight 1).
pub fn rdg(cohorts: &[&str], links: &[(&str, &str)]) -> Rdg {
    let names = cohorts.iter().map(|s| s.to_string()).collect();
    let edges = links.iter().map(|&(a, b)| Edge::new(a, b, 1)).collect();
    Rdg::new(names, edges).expect("a valid graph")
}

pub type Fault = Box<dyn FnMut(&Envelope<Msg>) -> bool + Send>;

pub struct Setup {
    pub cohorts: Vec<String>,
    pub rdg: Rdg,
    pub policy: Policy,
    pub epoch: u64,
    pub t: Timeouts,
    /// Plans by cohort; the others get random times in 0..=max_ms.
    pub plans: BTreeMap<String, Plan>,
    pub max_ms: u64,
    pub seed: u64,
    /// Cohorts that join and leave at once (crashed hosts).
    pub silent: Vec<String>,
    /// Messages for which this returns true are lost.
    pub fault: Option<Fault>,
    /// Wall-clock bound for the whole run; exceeding it is a hang.
    pub limit: Duration,
}

impl Setup {
    pub fn new(cohorts: &[&str], links: Links, policy: Policy) -> Self {
        Setup {
            cohorts: cohorts.iter().map(|s| s.to_string()).collect(),
            rdg: rdg(cohorts, &links),
            policy,
            epoch: 1,
            t: Timeouts {
                retry: Duration::from_millis(20),
                load_deadline: Duration::from_secs(2),
                start_deadline: Duration::from_secs(2),
                restore_deadline: Duration::from_secs(2),
            },
            plans: BTreeMap::new(),
            max_ms: 10,
            seed: 1,
            silent: vec![],
            fault: None,
            limit: Duration::from_secs(20),
        }
    }

    /// Fixed times for `vm`: working set `load_ms`, the rest `rest_ms`.
    pub fn plan(mut self, vm: &str, load_ms: u64, rest_ms: u64) -> Self {
        let p = Plan {
            load_ms,
            rest_ms,
            fail: None,
        };
        self.plans.insert(vm.into(), p);
        self
    }
}

pub struct Run {
    /// Every cohort of the restore, silent ones included.
    pub names: Vec<String>,
    pub policy: Policy,
    pub rdg: Rdg,
    pub coordinator: CoordinatorOutcome,
    pub events: Vec<CoordinatorEvent>,
    pub start_order: Vec<(String, u64)>,
    pub cohorts: Vec<(String, CohortOutcome)>,
    pub rescued: Vec<String>,
    pub log: Vec<(String, Act)>,
    pub violations: Vec<String>,
    pub stats: NetStats,
}

impl Run {
    /// The acts of one cohort (network entries left out).
    pub fn acts(&self, vm: &str) -> Vec<Act> {
        self.log
            .iter()
            .filter(|(n, a)| n == vm && !matches!(a, Act::Net { .. }))
            .map(|(_, a)| a.clone())
            .collect()
    }
    pub fn outcome(&self, vm: &str) -> &CohortOutcome {
        &self.cohorts.iter().find(|(n, _)| n == vm).unwrap().1
    }
    pub fn kinds(&self) -> Vec<CoordinatorEventKind> {
        self.events.iter().map(|e| e.kind.clone()).collect()
    }
    /// The cohorts in the order of their reported start times.
    pub fn order(&self) -> Vec<&str> {
        self.start_order.iter().map(|(n, _)| n.as_str()).collect()
    }
    /// Index of the first event matching `f`.
    pub fn pos(&self, f: impl Fn(&CoordinatorEventKind) -> bool) -> Option<usize> {
        self.events.iter().position(|e| f(&e.kind))
    }
    pub fn load_fin(&self, vm: &str) -> Option<usize> {
        self.pos(|k| matches!(k, CoordinatorEventKind::LoadFin { cohort } if cohort == vm))
    }
    pub fn start_fin(&self, vm: &str) -> Option<usize> {
        self.pos(|k| matches!(k, CoordinatorEventKind::StartFin { cohort, .. } if cohort == vm))
    }
    pub fn start_sent(&self, vm: &str) -> Option<usize> {
        self.pos(
            |k| matches!(k, CoordinatorEventKind::StartSent { cohorts } if cohorts.iter().any(|c| c == vm)),
        )
    }
}

pub fn run(mut s: Setup) -> Run {
    let begin = Instant::now();
    let net = InProcessNetwork::<Msg>::new();
    let log = Arc::new(Log::default());
    let violations = Arc::new(Mutex::new(Vec::new()));
    let fault = Arc::new(Mutex::new(s.fault.take()));
    {
        let log = Arc::clone(&log);
        net.set_fault(move |env| {
            let dropped = fault.lock().unwrap().as_mut().is_some_and(|f| f(env));
            let act = Act::Net {
                env: env.clone(),
                dropped,
            };
            log.push(&env.from, act);
            dropped
        });
    }
    let (itx, irx) = mpsc::channel();
    let coord_ep = net.join(MGR, move |e| {
        let _ = itx.send(e);
    });
    let (done_tx, done_rx) = mpsc::channel();
    let mut inboxes = Vec::new();
    let mut rng = XorShift::new(s.seed);
    for n in s.cohorts.clone() {
        let (ctx, crx) = mpsc::channel();
        let ctx2 = ctx.clone();
        let ep = net.join(n.clone(), move |e| {
            let _ = ctx2.send(CohortInput::Message(e));
        });
        let random = Plan {
            load_ms: rng.below(s.max_ms + 1),
            rest_ms: rng.below(s.max_ms + 1),
            fail: None,
        };
        let start_ms = 1 + rng.below(3);
        if s.silent.contains(&n) {
            net.leave(&n);
            continue;
        }
        inboxes.push((n.clone(), ctx.clone()));
        let mut worker = FakeWorker {
            name: n.clone(),
            inbox: ctx,
            log: Arc::clone(&log),
            plan: s.plans.get(&n).cloned().unwrap_or(random),
            start_ms,
            loaded: Arc::new(AtomicBool::new(false)),
            cancelled: Arc::new(AtomicBool::new(false)),
            calls: (0, 0),
            violations: Arc::clone(&violations),
        };
        let cohort = Cohort::new(s.epoch, n.clone(), MGR.into(), s.t.clone());
        let done_tx = done_tx.clone();
        thread::spawn(move || {
            let o = run_cohort(cohort, &ep, &crx, &mut worker);
            let _ = done_tx.send((n, o));
        });
    }
    drop(done_tx);
    let mut coord = Coordinator::new(s.epoch, MGR.into(), &s.rdg, s.policy, s.t.clone())
        .expect("valid dependencies");
    // The coordinator runs in its own thread so that a hang is caught here.
    let (ctx_out, crx_out) = mpsc::channel();
    thread::spawn(move || {
        let mut seen = Vec::new();
        let o = run_coordinator(&mut coord, &coord_ep, &irx, &mut |e| seen.push(e.clone()));
        assert_eq!(seen, coord.events(), "on_event saw every event once");
        let _ = ctx_out.send((o, seen, coord.start_order()));
    });
    let (coordinator, events, start_order) = crx_out
        .recv_timeout(s.limit.saturating_sub(begin.elapsed()))
        .unwrap_or_else(|e| panic!("coordinator did not finish within {:?}: {e}", s.limit));
    // Cohorts that never heard LOAD wait forever by design; give them the
    // ABORT the network lost (as the agent would cancel them).
    let mut results = Vec::new();
    let mut rescued = Vec::new();
    while results.len() < inboxes.len() {
        match done_rx.recv_timeout(Duration::from_millis(300)) {
            Ok(r) => results.push(r),
            Err(_) => {
                let entries = log.entries();
                for (n, tx) in &inboxes {
                    let loading = entries.iter().any(|(m, a)| m == n && *a == Act::Load);
                    let finished = results.iter().any(|(m, _)| m == n);
                    if !loading && !finished && !rescued.contains(n) {
                        rescued.push(n.clone());
                        let msg = Msg::Abort {
                            epoch: s.epoch,
                            reason: "rescue".into(),
                        };
                        let env = Envelope {
                            from: MGR.into(),
                            to: n.clone(),
                            msg,
                        };
                        let _ = tx.send(CohortInput::Message(env));
                    }
                }
                assert!(begin.elapsed() < s.limit, "cohorts hang past {:?}", s.limit);
            }
        }
    }
    results.sort_by(|a, b| a.0.cmp(&b.0));
    let violations = violations.lock().unwrap().clone();
    Run {
        names: s.cohorts,
        policy: s.policy,
        rdg: s.rdg,
        coordinator,
        events,
        start_order,
        cohorts: results,
        rescued,
        log: log.entries(),
        violations,
        stats: net.stats(),
    }
}

/// Checks what every run must satisfy, whatever the losses:
/// - workers: at most one Load, Start, Abandon each; Start only after the
///   working set was loaded; no Load/Start after Abandon;
/// - outcomes agree with the coordinator's (`strict`: a completed
///   coordinator means every cohort completed);
/// - the Checker: no cohort gets two START decisions; under RestoreLine a
///   group's START goes out only after all its members' LOAD_FIN and the
///   START_FIN of everything it waits for, and the workers started in that
///   order; under Independent a VM's START goes out with its LOAD_FIN.
pub fn check_consistent(r: &Run, strict: bool) {
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    for (vm, outcome) in &r.cohorts {
        let acts = r.acts(vm);
        let pos = |a: &Act| acts.iter().position(|x| x == a);
        let count = |f: &dyn Fn(&Act) -> bool| acts.iter().filter(|a| f(a)).count();
        assert!(count(&|a| *a == Act::Load) <= 1, "{vm}: {acts:?}");
        assert!(count(&|a| *a == Act::Start) <= 1, "{vm}: {acts:?}");
        let abandons = count(&|a| matches!(a, Act::Abandon(_)));
        assert!(abandons <= 1, "{vm}: {acts:?}");
        if let Some(s) = pos(&Act::Start) {
            assert!(pos(&Act::Loaded).is_some_and(|l| l < s), "{vm}: {acts:?}");
        }
        if let Some(ab) = acts.iter().position(|a| matches!(a, Act::Abandon(_))) {
            let late = acts[ab..]
                .iter()
                .any(|a| *a == Act::Load || *a == Act::Start);
            assert!(!late, "{vm}: acted after abandoning: {acts:?}");
        }
        match outcome {
            CohortOutcome::Completed => {
                assert_eq!(
                    r.coordinator,
                    CoordinatorOutcome::Completed,
                    "{vm} completed alone"
                );
                assert!(
                    acts.contains(&Act::Restored) && abandons == 0,
                    "{vm}: {acts:?}"
                );
                assert!(
                    acts.iter().any(|a| matches!(a, Act::Started(_))),
                    "{vm}: {acts:?}"
                );
            }
            CohortOutcome::Abandoned { .. } => {
                assert_eq!(abandons, 1, "{vm}: {acts:?}");
                assert!(
                    !(strict && r.coordinator == CoordinatorOutcome::Completed),
                    "{vm} abandoned, coordinator completed"
                );
            }
        }
    }
    if r.coordinator == CoordinatorOutcome::Completed {
        let mut started: Vec<_> = r.order().into_iter().map(String::from).collect();
        started.sort();
        let mut all: Vec<_> = r.cohorts.iter().map(|(n, _)| n.clone()).collect();
        all.sort();
        assert_eq!(started, all, "every VM reported its start");
    }
    check_checker(r);
}

fn check_checker(r: &Run) {
    let groups = match r.policy {
        Policy::RestoreLine => r.rdg.start_groups(),
        Policy::Independent => r.rdg.unordered_groups(),
    };
    let mut decided = BTreeSet::new();
    for (i, ev) in r.events.iter().enumerate() {
        let CoordinatorEventKind::StartSent { cohorts } = &ev.kind else {
            continue;
        };
        for c in cohorts {
            assert!(decided.insert(c.clone()), "{c} got two START decisions");
        }
        let g = groups.iter().find(|g| &g.members == cohorts);
        let g = g.unwrap_or_else(|| panic!("START to {cohorts:?}, not a start group"));
        for m in &g.members {
            assert!(
                r.load_fin(m).is_some_and(|l| l < i),
                "START to {m} before its LOAD_FIN"
            );
        }
        for d in &g.after {
            assert!(
                r.start_fin(d).is_some_and(|f| f < i),
                "START to {cohorts:?} before {d} ran"
            );
        }
        if r.policy == Policy::Independent {
            let m = &cohorts[0];
            let l = r.load_fin(m).unwrap();
            assert_eq!(
                r.events[l].at, ev.at,
                "{m}: START not sent with its LOAD_FIN"
            );
        }
        // The workers too: each dependency's guest ran before this one was
        // started.
        let at =
            |vm: &str, f: &dyn Fn(&Act) -> bool| r.log.iter().position(|(n, a)| n == vm && f(a));
        for m in &g.members {
            let Some(s) = at(m, &|a| *a == Act::Start) else {
                continue;
            };
            for d in &g.after {
                let started = at(d, &|a| matches!(a, Act::Started(_)));
                assert!(started.is_some_and(|x| x < s), "{m} started before {d} ran");
            }
        }
    }
}
