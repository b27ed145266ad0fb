//! The restore state machines in a deterministic discrete-event
//! simulation: virtual time, 30% message loss, random delays (so
//! reordering), random dependency graphs (rings found by restoreline's Rdg),
//! both policies, failures mid-load, hundreds of seeds. No threads, no
//! sleeps.

mod restore_common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use restore_common::XorShift;
use vmcsnap_coord::restore::*;
use vmcsnap_coord::transport::Envelope;

const MGR: &str = "mgr";
const EPOCH: u64 = 42;

enum Ev {
    Deliver(Envelope<Msg>),
    Loaded(usize),
    Restored(usize),
    Started(usize),
    Fail(usize),
}

struct Sim {
    rng: XorShift,
    loss: u64,
    base: Instant,
    now: Instant,
    seq: u64,
    queue: BTreeMap<(Instant, u64), Ev>,
    coord: Coordinator,
    /// While finished, the coordinator is fed until this instant (as
    /// run_coordinator lingers).
    linger_end: Option<Instant>,
    names: Vec<String>,
    cohorts: Vec<Cohort>,
    fails: Option<usize>,
    acts: Vec<Vec<&'static str>>,
    loaded: Vec<bool>,
    started: Vec<bool>,
    /// Start group of each cohort: (members, after), as indices.
    group: Vec<(Vec<usize>, Vec<usize>)>,
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
        self.names.iter().position(|n| n == name).unwrap()
    }

    fn coord_alive(&self) -> bool {
        !self.coord.is_finished() || self.linger_end.is_some_and(|l| self.now < l)
    }

    fn coord_out(&mut self, out: Vec<Envelope<Msg>>) {
        if self.coord.is_finished() && self.linger_end.is_none() {
            self.linger_end = Some(self.now + self.coord.timeouts().linger());
        }
        for e in out {
            self.send(e);
        }
    }

    fn cohort_out(&mut self, i: usize, out: Vec<CohortAction>) {
        for a in out {
            match a {
                CohortAction::Send(e) => self.send(e),
                CohortAction::Load => {
                    self.acts[i].push("load");
                    let d = ms(1 + self.rng.below(50));
                    let ev = if self.fails == Some(i) {
                        Ev::Fail(i)
                    } else {
                        Ev::Loaded(i)
                    };
                    self.at(d, ev);
                }
                CohortAction::Start => {
                    self.acts[i].push("start");
                    let name = &self.names[i];
                    assert!(self.loaded[i], "{name} started before it was loaded");
                    // The Checker's promise, seen from the workers.
                    let (members, after) = self.group[i].clone();
                    for m in members {
                        assert!(self.loaded[m], "{name} started before ring mate {m} loaded");
                    }
                    for d in after {
                        assert!(self.started[d], "{name} started before vm{d} ran");
                    }
                    let d = ms(1 + self.rng.below(3));
                    self.at(d, Ev::Started(i));
                }
                CohortAction::Abandon { .. } => self.acts[i].push("abandon"),
            }
        }
    }

    fn step(&mut self, ev: Ev) {
        let now = self.now;
        let alive = |s: &Sim, i: usize| !matches!(s.cohorts[i].state(), CohortState::Abandoned);
        match ev {
            Ev::Deliver(env) if env.to == MGR => {
                if self.coord_alive() {
                    if self.linger_end.is_some() {
                        self.linger_end = Some(now + self.coord.timeouts().linger());
                    }
                    let out = self.coord.on_message(env, now);
                    self.coord_out(out);
                }
            }
            Ev::Deliver(env) => {
                let i = self.index(&env.to);
                let out = self.cohorts[i].on_message(env, now);
                self.cohort_out(i, out);
            }
            Ev::Loaded(i) if alive(self, i) => {
                self.loaded[i] = true;
                let out = self.cohorts[i].on_loaded(now);
                self.cohort_out(i, out);
                let d = ms(self.rng.below(100));
                self.at(d, Ev::Restored(i));
            }
            Ev::Restored(i) if alive(self, i) => {
                let out = self.cohorts[i].on_restored(now);
                self.cohort_out(i, out);
            }
            Ev::Started(i) if alive(self, i) => {
                self.started[i] = true;
                let us = (now - self.base).as_micros() as u64;
                let out = self.cohorts[i].on_started(us, now);
                self.cohort_out(i, out);
            }
            Ev::Fail(i) => {
                let out = self.cohorts[i].on_failed(format!("vm{i} broke"), now);
                self.cohort_out(i, out);
            }
            Ev::Loaded(_) | Ev::Restored(_) | Ev::Started(_) => {} // worker stopped
        }
    }

    /// Runs until nothing is pending; panics past 60 s of virtual time.
    fn run(&mut self) {
        let out = self.coord.start(self.now);
        self.coord_out(out);
        loop {
            let q = self.queue.keys().next().map(|k| k.0);
            let cw = if self.coord_alive() {
                self.coord
                    .next_wakeup()
                    .into_iter()
                    .chain(self.linger_end)
                    .min()
            } else {
                None
            };
            let pw = (0..self.cohorts.len())
                .filter_map(|i| self.cohorts[i].next_wakeup().map(|w| (w, i)))
                .min();
            let Some(t) = [q, cw, pw.map(|p| p.0)].into_iter().flatten().min() else {
                break;
            };
            assert!(
                t - self.base < Duration::from_secs(60),
                "hang at {:?}",
                t - self.base
            );
            self.now = self.now.max(t);
            if q == Some(t) {
                let key = *self.queue.keys().next().unwrap();
                let ev = self.queue.remove(&key).unwrap();
                self.step(ev);
            } else if cw == Some(t) {
                let out = self.coord.on_tick(self.now);
                self.coord_out(out);
            } else if let Some((_, i)) = pw {
                let out = self.cohorts[i].on_tick(self.now);
                self.cohort_out(i, out);
            }
        }
    }
}

/// Runs one seed with `loss` percent of messages lost; returns whether the
/// coordinator completed, which cohort (if any) was made to fail, and
/// whether the dependencies had a ring.
fn simulate(seed: u64, loss: u64, t: Timeouts, strict: bool) -> (bool, Option<usize>, bool) {
    let mut rng = XorShift::new(seed);
    let n = 1 + rng.below(8) as usize;
    let names: Vec<String> = (0..n).map(|i| format!("vm{i}")).collect();
    let mut edges = Vec::new();
    for a in &names {
        for b in &names {
            if a != b && rng.chance(20) {
                edges.push((a.clone(), b.clone()));
            }
        }
    }
    let edges = edges.into_iter().map(|(a, b)| Edge::new(a, b, 1)).collect();
    let rdg = Rdg::new(names.clone(), edges).expect("a valid graph");
    let policy = if rng.chance(25) {
        Policy::Independent
    } else {
        Policy::RestoreLine
    };
    let fails = rng.chance(10).then(|| rng.below(n as u64) as usize);
    let coord = Coordinator::new(EPOCH, MGR.into(), &rdg, policy, t.clone())
        .expect("the manager is no cohort");
    let idx = |c: &String| names.iter().position(|n| n == c).unwrap();
    let mut group = vec![(vec![], vec![]); n];
    for g in coord.start_groups() {
        for m in &g.members {
            group[idx(m)] = (
                g.members.iter().map(idx).collect(),
                g.after.iter().map(idx).collect(),
            );
        }
    }
    let base = Instant::now();
    let mut sim = Sim {
        loss,
        base,
        now: base,
        seq: 0,
        queue: BTreeMap::new(),
        coord,
        linger_end: None,
        cohorts: names
            .iter()
            .map(|c| Cohort::new(EPOCH, c.clone(), MGR.into(), t.clone()))
            .collect(),
        names,
        fails,
        acts: vec![vec![]; n],
        loaded: vec![false; n],
        started: vec![false; n],
        group,
        rng,
    };
    sim.run();

    let ctx = format!(
        "seed {seed}, {n} cohorts, {policy:?}, {:?}, failing {fails:?}",
        rdg.edges()
    );
    assert!(sim.coord.is_finished(), "{ctx}: {:?}", sim.coord.state());
    let completed = sim.coord.state() == CoordinatorState::Done;
    let mut starts = BTreeSet::new();
    for (i, c) in sim.cohorts.iter().enumerate() {
        let acts = &sim.acts[i];
        let ctx = format!("{ctx}, vm{i}: {acts:?}");
        let count = |a: &str| acts.iter().filter(|x| **x == a).count();
        assert!(
            count("load") <= 1 && count("start") <= 1 && count("abandon") <= 1,
            "{ctx}"
        );
        if count("start") == 1 {
            starts.insert(i);
        }
        match c.state() {
            CohortState::Done => {
                assert!(
                    completed,
                    "{ctx}: a cohort completed, the coordinator did not"
                );
                assert_eq!(count("start"), 1, "{ctx}");
            }
            CohortState::Abandoned => {
                assert!(c.is_finished(), "{ctx}");
                assert!(
                    !(strict && completed),
                    "{ctx}: coordinator completed, cohort abandoned"
                );
            }
            CohortState::Idle => assert!(!completed, "{ctx}: idle cohort in a completed restore"),
            s => panic!("{ctx}: cohort left in {s:?}"),
        }
    }
    if completed {
        assert_eq!(starts.len(), n, "{ctx}");
        assert_eq!(sim.coord.start_order().len(), n, "{ctx}");
    }
    if let (Some(f), true) = (fails, strict) {
        let CoordinatorState::Aborted { reason } = sim.coord.state() else {
            panic!("{ctx}: not aborted")
        };
        assert!(
            reason.contains(&format!("cohort vm{f} failed")),
            "{ctx}: {reason}"
        );
    }
    (completed, fails, !rdg.rings().is_empty())
}

#[test]
fn lossy_reordering_network_many_seeds() {
    let (mut completed, mut aborted, mut with_failure, mut with_ring) = (0, 0, 0, 0);
    let t = Timeouts {
        retry: ms(10),
        load_deadline: Duration::from_secs(2),
        start_deadline: Duration::from_secs(2),
        restore_deadline: Duration::from_secs(5),
    };
    for seed in 1..=500 {
        let (ok, fails, ring) = simulate(seed, 30, t.clone(), true);
        with_ring += usize::from(ring);
        if fails.is_some() {
            with_failure += 1;
        } else if ok {
            completed += 1;
        } else {
            aborted += 1;
        }
    }
    assert!(with_failure > 20, "failures exercised: {with_failure}");
    assert!(with_ring > 50, "rings exercised: {with_ring}");
    assert!(
        aborted * 20 < completed,
        "{aborted} aborted of {} healthy runs",
        completed + aborted
    );
}

/// Extreme loss and short deadlines: many aborts. Safety must hold anyway:
/// no duplicate Load or Start, no Start against the restore line, no cohort
/// completes unless the coordinator did, nothing left running.
#[test]
fn extreme_loss_is_safe() {
    let t = Timeouts {
        retry: ms(10),
        load_deadline: ms(150),
        start_deadline: ms(150),
        restore_deadline: ms(300),
    };
    let (mut completed, mut aborted) = (0, 0);
    for seed in 1000..1300 {
        match simulate(seed, 60, t.clone(), false) {
            (true, ..) => completed += 1,
            (false, ..) => aborted += 1,
        }
    }
    assert!(
        completed > 10 && aborted > 10,
        "both outcomes exercised: {completed} completed, {aborted} aborted"
    );
}
