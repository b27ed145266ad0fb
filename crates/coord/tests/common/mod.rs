//! A threaded cluster for the driver tests: an initiator and N peers on an
//! InProcessNetwork, fake workers that "snapshot" after random small sleeps.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use vmcsnap_coord::snapshot::*;
use vmcsnap_coord::transport::{Envelope, InProcessNetwork, NetStats};

pub const MGR: &str = "mgr";

#[path = "../shared/mod.rs"]
mod shared;
pub use shared::XorShift;

/// What a fake worker or the network did, in one global order.
#[derive(Debug, Clone, PartialEq)]
pub enum Act {
    Start,
    TransientDone,
    FullDone,
    EndColoring,
    Complete,
    Abandon(String),
    /// A message passed the network (`dropped` = lost).
    Net {
        env: Envelope<Msg>,
        dropped: bool,
    },
}

pub type Log = shared::Log<Act>;

/// What a peer's worker does after `StartSnapshot`.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    Normal,
    /// Report `Failed(error)` after the transient snapshot.
    FailAfterTransient(String),
}

pub struct FakeWorker {
    name: String,
    inbox: Sender<PeerInput>,
    log: Arc<Log>,
    rng: XorShift,
    max_ms: u64,
    full_extra_ms: u64,
    plan: Plan,
    full_done: Arc<AtomicBool>,
    cancelled: Arc<AtomicBool>,
    pub violations: Arc<Mutex<Vec<String>>>,
}

impl PeerWorker for FakeWorker {
    fn start_snapshot(&mut self) {
        self.log.push(&self.name, Act::Start);
        let (name, inbox, log) = (self.name.clone(), self.inbox.clone(), Arc::clone(&self.log));
        let (t1, t2) = (
            self.rng.below(self.max_ms + 1),
            self.rng.below(self.max_ms + 1) + self.full_extra_ms,
        );
        let (plan, full_done, cancelled) = (
            self.plan.clone(),
            Arc::clone(&self.full_done),
            Arc::clone(&self.cancelled),
        );
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(t1));
            if cancelled.load(Ordering::SeqCst) {
                return;
            }
            log.push(&name, Act::TransientDone);
            let _ = inbox.send(PeerInput::TransientDone);
            thread::sleep(Duration::from_millis(t2));
            if cancelled.load(Ordering::SeqCst) {
                return;
            }
            match plan {
                Plan::Normal => {
                    log.push(&name, Act::FullDone);
                    full_done.store(true, Ordering::SeqCst);
                    let _ = inbox.send(PeerInput::FullDone);
                }
                Plan::FailAfterTransient(e) => {
                    let _ = inbox.send(PeerInput::Failed(e));
                }
            }
        });
    }
    fn end_coloring(&mut self) {
        self.log.push(&self.name, Act::EndColoring);
    }
    fn complete(&mut self) {
        if !self.full_done.load(Ordering::SeqCst) {
            self.violations
                .lock()
                .unwrap()
                .push(format!("{} completed without its full snapshot", self.name));
        }
        self.log.push(&self.name, Act::Complete);
    }
    fn abandon(&mut self, reason: &str) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.log.push(&self.name, Act::Abandon(reason.to_string()));
    }
}

pub type Fault = Box<dyn FnMut(&Envelope<Msg>) -> bool + Send>;

pub struct Setup {
    pub peers: usize,
    pub epoch: u64,
    pub t: Timeouts,
    /// Worker sleeps are random in 0..=max_ms (full: plus full_extra_ms).
    pub max_ms: u64,
    pub full_extra_ms: u64,
    pub seed: u64,
    /// Peer index (1-based) → plan; others Normal.
    pub plans: Vec<(usize, Plan)>,
    /// Peers (1-based) that join and leave at once (crashed hosts).
    pub silent: Vec<usize>,
    /// Peers (1-based) that get a Trigger before the initiator starts.
    pub triggers: Vec<usize>,
    /// Messages for which this returns true are lost.
    pub fault: Option<Fault>,
    /// Wall-clock bound for the whole run; exceeding it is a hang.
    pub limit: Duration,
}

impl Setup {
    pub fn new(peers: usize) -> Self {
        Setup {
            peers,
            epoch: 1,
            t: Timeouts {
                retry: Duration::from_millis(20),
                transient_deadline: Duration::from_secs(2),
                full_deadline: Duration::from_secs(2),
            },
            max_ms: 5,
            full_extra_ms: 0,
            seed: 1,
            plans: vec![],
            silent: vec![],
            triggers: vec![],
            fault: None,
            limit: Duration::from_secs(10),
        }
    }
}

pub fn name(i: usize) -> String {
    format!("vm{i}")
}

pub struct Run {
    pub initiator: InitiatorOutcome,
    pub events: Vec<InitiatorEvent>,
    /// (peer, outcome) of every peer that ran; `rescued` if it was still
    /// Idle when the initiator had finished and got an ABORT by hand.
    pub peers: Vec<(String, PeerOutcome)>,
    pub rescued: Vec<String>,
    pub log: Vec<(String, Act)>,
    pub violations: Vec<String>,
    pub stats: NetStats,
    pub elapsed: Duration,
}

impl Run {
    /// The acts of one peer (network entries left out).
    pub fn acts(&self, peer: &str) -> Vec<Act> {
        self.log
            .iter()
            .filter(|(n, a)| n == peer && !matches!(a, Act::Net { .. }))
            .map(|(_, a)| a.clone())
            .collect()
    }
    pub fn outcome(&self, peer: &str) -> &PeerOutcome {
        &self.peers.iter().find(|(n, _)| n == peer).unwrap().1
    }
    pub fn kinds(&self) -> Vec<InitiatorEventKind> {
        self.events.iter().map(|e| e.kind.clone()).collect()
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
            log.push(
                &env.from,
                Act::Net {
                    env: env.clone(),
                    dropped,
                },
            );
            dropped
        });
    }
    let (itx, irx) = mpsc::channel();
    let init_ep = net.join(MGR, move |e| {
        let _ = itx.send(e);
    });
    let (done_tx, done_rx) = mpsc::channel();
    let mut inboxes = Vec::new();
    let mut rng = XorShift::new(s.seed);
    for i in 1..=s.peers {
        let n = name(i);
        let (ptx, prx) = mpsc::channel();
        let ptx2 = ptx.clone();
        let ep = net.join(n.clone(), move |e| {
            let _ = ptx2.send(PeerInput::Message(e));
        });
        if s.silent.contains(&i) {
            net.leave(&n);
            continue;
        }
        if s.triggers.contains(&i) {
            ptx.send(PeerInput::Trigger).unwrap();
        }
        inboxes.push((n.clone(), ptx.clone()));
        let mut worker = FakeWorker {
            name: n.clone(),
            inbox: ptx,
            log: Arc::clone(&log),
            rng: XorShift::new(rng.next_u64()),
            max_ms: s.max_ms,
            full_extra_ms: s.full_extra_ms,
            plan: s
                .plans
                .iter()
                .find(|(k, _)| *k == i)
                .map_or(Plan::Normal, |(_, p)| p.clone()),
            full_done: Arc::new(AtomicBool::new(false)),
            cancelled: Arc::new(AtomicBool::new(false)),
            violations: Arc::clone(&violations),
        };
        let peer = Peer::new(s.epoch, n.clone(), MGR.into(), s.t.clone());
        let done_tx = done_tx.clone();
        thread::spawn(move || {
            let o = run_peer(peer, &ep, &prx, &mut worker);
            let _ = done_tx.send((n, o));
        });
    }
    drop(done_tx);
    let peers: Vec<String> = (1..=s.peers).map(name).collect();
    let mut init = Initiator::new(s.epoch, MGR.into(), peers, s.t.clone());
    // The initiator runs in its own thread so that a hang is caught here.
    let (itx_out, irx_out) = mpsc::channel();
    thread::spawn(move || {
        let mut seen = Vec::new();
        let o = run_initiator(&mut init, &init_ep, &irx, &mut |e| seen.push(e.clone()));
        assert_eq!(seen, init.events(), "on_event saw every event once");
        let _ = itx_out.send((o, seen));
    });
    let (initiator, events) = irx_out
        .recv_timeout(s.limit.saturating_sub(begin.elapsed()))
        .unwrap_or_else(|e| {
            panic!(
                "initiator did not finish within {:?} (hang or panic): {e}",
                s.limit
            )
        });
    // Peers that never heard SNAPSHOT wait forever by design; give them
    // the ABORT the network lost (as the agent would cancel them).
    let mut results = Vec::new();
    let mut rescued = Vec::new();
    let running = inboxes.len();
    while results.len() < running {
        match done_rx.recv_timeout(Duration::from_millis(300)) {
            Ok(r) => results.push(r),
            Err(_) => {
                let entries = log.entries();
                for (n, tx) in &inboxes {
                    let started = entries.iter().any(|(m, a)| m == n && *a == Act::Start);
                    let finished = results.iter().any(|(m, _)| m == n);
                    if !started && !finished && !rescued.contains(n) {
                        rescued.push(n.clone());
                        let msg = Msg::Abort {
                            epoch: s.epoch,
                            reason: "rescue".into(),
                        };
                        let _ = tx.send(PeerInput::Message(Envelope {
                            from: MGR.into(),
                            to: n.clone(),
                            msg,
                        }));
                    }
                }
                assert!(
                    begin.elapsed() < s.limit,
                    "peers did not finish within {:?}: hang",
                    s.limit
                );
            }
        }
    }
    results.sort_by(|a, b| a.0.cmp(&b.0));
    let log = log.entries();
    let violations = violations.lock().unwrap().clone();
    Run {
        initiator,
        events,
        peers: results,
        rescued,
        log,
        violations,
        stats: net.stats(),
        elapsed: begin.elapsed(),
    }
}

/// Checks that every completed peer did Start < TransientDone < EndColoring
/// < Complete (each once) and FullDone < Complete; that no peer did
/// anything after Abandon; that the outcomes agree with the initiator's.
pub fn check_consistent(r: &Run) {
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    for (peer, outcome) in &r.peers {
        let acts = r.acts(peer);
        let pos = |a: &Act| acts.iter().position(|x| x == a);
        let count = |f: &dyn Fn(&Act) -> bool| acts.iter().filter(|a| f(a)).count();
        assert!(count(&|a| *a == Act::Start) <= 1, "{peer}: {acts:?}");
        assert!(count(&|a| *a == Act::EndColoring) <= 1, "{peer}: {acts:?}");
        assert!(count(&|a| *a == Act::Complete) <= 1, "{peer}: {acts:?}");
        assert!(
            count(&|a| matches!(a, Act::Abandon(_))) <= 1,
            "{peer}: {acts:?}"
        );
        match outcome {
            PeerOutcome::Completed => {
                let p = [
                    Act::Start,
                    Act::TransientDone,
                    Act::EndColoring,
                    Act::Complete,
                ]
                .map(|a| pos(&a).unwrap_or_else(|| panic!("{peer}: {a:?} missing: {acts:?}")));
                assert!(p.windows(2).all(|w| w[0] < w[1]), "{peer}: order {acts:?}");
                assert!(pos(&Act::FullDone).unwrap() < p[3], "{peer}: {acts:?}");
                assert_eq!(
                    r.initiator,
                    InitiatorOutcome::Completed,
                    "{peer} completed, initiator did not"
                );
            }
            PeerOutcome::Abandoned { .. } => {
                assert!(pos(&Act::Complete).is_none(), "{peer}: {acts:?}");
                assert_eq!(
                    acts.iter().filter(|a| matches!(a, Act::Abandon(_))).count(),
                    1,
                    "{peer}: {acts:?}"
                );
            }
        }
    }
    if let InitiatorOutcome::Aborted { .. } = r.initiator {
        assert!(r.peers.iter().all(|(_, o)| *o != PeerOutcome::Completed));
    }
}
