//! The state machines in a deterministic discrete-event simulation: virtual
//! time, 30% message loss, random delays (so reordering), random triggers
//! and failures, hundreds of seeds. No threads, no sleeps.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::XorShift;
use vmcsnap_coord::snapshot::*;
use vmcsnap_coord::transport::Envelope;

const MGR: &str = "mgr";
const EPOCH: u64 = 42;

enum Ev {
    Deliver(Envelope<Msg>),
    Trigger(usize),
    TransientDone(usize),
    FullDone(usize),
    Fail(usize),
}

struct Sim {
    rng: XorShift,
    loss: u64,
    base: Instant,
    now: Instant,
    seq: u64,
    queue: BTreeMap<(Instant, u64), Ev>,
    init: Initiator,
    /// While finished, the initiator is fed until this instant (as
    /// run_initiator lingers).
    linger_end: Option<Instant>,
    peers: Vec<Peer>,
    fails: Option<usize>,
    acts: Vec<Vec<&'static str>>,
    full_reported: Vec<bool>,
}

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

impl Sim {
    fn at(&mut self, delay: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.now + delay, self.seq), ev);
    }

    fn send(&mut self, env: Envelope<Msg>) {
        if !self.rng.chance(self.loss) {
            let d = ms(self.rng.below(6));
            self.at(d, Ev::Deliver(env));
        }
    }

    fn index(&self, name: &str) -> usize {
        name.strip_prefix("vm").unwrap().parse::<usize>().unwrap() - 1
    }

    fn initiator_alive(&self) -> bool {
        !self.init.is_finished() || self.linger_end.is_some_and(|l| self.now < l)
    }

    fn init_out(&mut self, out: Vec<Envelope<Msg>>) {
        if self.init.is_finished() && self.linger_end.is_none() {
            self.linger_end = Some(self.now + self.init.timeouts().linger());
        }
        for e in out {
            self.send(e);
        }
    }

    fn peer_out(&mut self, i: usize, out: Vec<PeerAction>) {
        for a in out {
            match a {
                PeerAction::Send(e) => self.send(e),
                PeerAction::StartSnapshot => {
                    self.acts[i].push("start");
                    let d = ms(1 + self.rng.below(30));
                    self.at(d, Ev::TransientDone(i));
                }
                PeerAction::EndColoring => self.acts[i].push("end_coloring"),
                PeerAction::Complete => {
                    assert!(
                        self.full_reported[i],
                        "vm{} completed without its full snapshot",
                        i + 1
                    );
                    self.acts[i].push("complete");
                }
                PeerAction::Abandon { .. } => self.acts[i].push("abandon"),
            }
        }
    }

    fn step(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Deliver(env) if env.to == MGR => {
                if self.initiator_alive() {
                    if self.linger_end.is_some() {
                        self.linger_end = Some(now + self.init.timeouts().linger());
                    }
                    let out = self.init.on_message(env, now);
                    self.init_out(out);
                }
            }
            Ev::Deliver(env) => {
                let i = self.index(&env.to);
                let out = self.peers[i].on_message(env, now);
                self.peer_out(i, out);
            }
            Ev::Trigger(i) => {
                let out = self.peers[i].on_trigger(now);
                self.peer_out(i, out);
            }
            Ev::TransientDone(i) if !self.peers[i].is_finished() => {
                self.acts[i].push("transient_done");
                let out = self.peers[i].on_transient_done(now);
                self.peer_out(i, out);
                let d = ms(5 + self.rng.below(200));
                let next = if self.fails == Some(i) {
                    Ev::Fail(i)
                } else {
                    Ev::FullDone(i)
                };
                self.at(d, next);
            }
            Ev::FullDone(i) if !self.peers[i].is_finished() => {
                self.full_reported[i] = true;
                let out = self.peers[i].on_full_done(now);
                self.peer_out(i, out);
            }
            Ev::Fail(i) => {
                let out = self.peers[i].on_failed(format!("vm{} broke", i + 1), now);
                self.peer_out(i, out);
            }
            Ev::TransientDone(_) | Ev::FullDone(_) => {} // worker cancelled
        }
    }

    /// Runs until nothing is pending; panics past 60 s of virtual time.
    fn run(&mut self) {
        let out = self.init.start(self.now);
        self.init_out(out);
        loop {
            let q = self.queue.keys().next().map(|k| k.0);
            let iw = if self.initiator_alive() {
                let w = self.init.next_wakeup();
                match (w, self.linger_end) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            } else {
                None
            };
            let pw = (0..self.peers.len())
                .filter_map(|i| self.peers[i].next_wakeup().map(|w| (w, i)))
                .min();
            let Some(t) = [q, iw, pw.map(|p| p.0)].into_iter().flatten().min() else {
                break;
            };
            assert!(
                t - self.base < Duration::from_secs(60),
                "hang: still busy at {:?}",
                t - self.base
            );
            self.now = self.now.max(t);
            if q == Some(t) {
                let key = *self.queue.keys().next().unwrap();
                let ev = self.queue.remove(&key).unwrap();
                self.step(ev);
            } else if iw == Some(t) {
                let out = self.init.on_tick(self.now);
                self.init_out(out);
            } else if let Some((_, i)) = pw {
                let out = self.peers[i].on_tick(self.now);
                self.peer_out(i, out);
            }
        }
    }
}

/// Runs one seed with `loss` percent of messages lost; returns whether the
/// initiator completed and which peer (if any) was made to fail. `strict`:
/// also require that a completed initiator means every peer completed
/// (true in practice at moderate loss; at extreme loss a peer may give up
/// while the initiator completes, see docs/cluster-protocol.md).
fn simulate(seed: u64, loss: u64, t: Timeouts, strict: bool) -> (bool, Option<usize>) {
    let mut rng = XorShift::new(seed);
    let n = 1 + rng.below(6) as usize;
    let names: Vec<String> = (1..=n).map(|i| format!("vm{i}")).collect();
    let base = Instant::now();
    let fails = rng.chance(10).then(|| rng.below(n as u64) as usize);
    let mut sim = Sim {
        loss,
        base,
        now: base,
        seq: 0,
        queue: BTreeMap::new(),
        init: Initiator::new(EPOCH, MGR.into(), names.clone(), t.clone()),
        linger_end: None,
        peers: names
            .iter()
            .map(|p| Peer::new(EPOCH, p.clone(), MGR.into(), t.clone()))
            .collect(),
        fails,
        acts: vec![vec![]; n],
        full_reported: vec![false; n],
        rng,
    };
    for i in 0..n {
        if sim.rng.chance(20) {
            let d = ms(sim.rng.below(20));
            sim.at(d, Ev::Trigger(i));
        }
    }
    sim.run();

    let ctx = format!("seed {seed}, {n} peers, failing {fails:?}");
    assert!(
        sim.init.is_finished(),
        "{ctx}: initiator {:?}",
        sim.init.state()
    );
    let completed = *sim.init.state() == InitiatorState::Done;
    for (i, p) in sim.peers.iter().enumerate() {
        let acts = &sim.acts[i];
        let ctx = format!("{ctx}, vm{}: {acts:?}", i + 1);
        let count = |a: &str| acts.iter().filter(|x| **x == a).count();
        assert!(
            count("start") <= 1 && count("end_coloring") <= 1 && count("complete") <= 1,
            "{ctx}"
        );
        assert!(count("abandon") <= 1, "{ctx}");
        match p.state() {
            PeerState::Done => {
                assert!(completed, "{ctx}: a peer completed, the initiator did not");
                let pos = |a: &str| acts.iter().position(|x| *x == a).unwrap();
                assert!(pos("start") < pos("transient_done"), "{ctx}");
                assert!(pos("transient_done") < pos("end_coloring"), "{ctx}");
                assert!(pos("end_coloring") < pos("complete"), "{ctx}");
            }
            PeerState::Abandoned => {
                assert!(p.is_finished(), "{ctx}");
                assert!(
                    !(strict && completed),
                    "{ctx}: initiator completed but a peer abandoned"
                );
            }
            PeerState::Idle => assert!(!completed, "{ctx}: idle peer in a completed snapshot"),
            s => panic!("{ctx}: peer left in {s:?}"),
        }
    }
    if let (Some(f), true) = (fails, strict) {
        let InitiatorState::Aborted { reason } = sim.init.state() else {
            panic!("{ctx}: not aborted")
        };
        assert!(reason.contains(&format!("vm{}", f + 1)), "{ctx}: {reason}");
    }
    (completed, fails)
}

#[test]
fn lossy_reordering_network_many_seeds() {
    let (mut completed, mut aborted, mut with_failure) = (0, 0, 0);
    let t = Timeouts {
        retry: ms(10),
        transient_deadline: Duration::from_secs(2),
        full_deadline: Duration::from_secs(5),
    };
    for seed in 1..=500 {
        let (ok, fails) = simulate(seed, 30, t.clone(), true);
        if fails.is_some() {
            with_failure += 1;
        } else if ok {
            completed += 1;
        } else {
            aborted += 1;
        }
    }
    assert!(with_failure > 20, "failures exercised: {with_failure}");
    assert!(
        aborted * 20 < completed,
        "{aborted} aborted of {} healthy runs",
        completed + aborted
    );
}

/// Extreme loss and short deadlines: many aborts. Safety must hold anyway:
/// no peer completes unless the initiator did, no peer completes without its
/// own full snapshot, no action twice, nothing left running.
#[test]
fn extreme_loss_is_safe() {
    let t = Timeouts {
        retry: ms(10),
        transient_deadline: ms(150),
        full_deadline: ms(400),
    };
    let (mut completed, mut aborted) = (0, 0);
    for seed in 1000..1300 {
        match simulate(seed, 60, t.clone(), false) {
            (true, _) => completed += 1,
            (false, _) => aborted += 1,
        }
    }
    assert!(
        completed > 10 && aborted > 10,
        "both outcomes exercised: {completed} completed, {aborted} aborted"
    );
}
