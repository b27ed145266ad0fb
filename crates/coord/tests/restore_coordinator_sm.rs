//! The restore coordinator's state table and its Checker, one transition at
//! a time, without threads.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use vmcsnap_coord::restore::*;
use vmcsnap_coord::transport::Envelope;

const E: u64 = 11;

fn t() -> Timeouts {
    Timeouts {
        retry: ms(100),
        load_deadline: Duration::from_secs(5),
        start_deadline: Duration::from_secs(10),
        restore_deadline: Duration::from_secs(50),
    }
}

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

/// A coordinator of `cohorts` whose VMs send to each other along `links`
/// (`(from, to)`: `to` must run before `from`).
fn coord(cohorts: &[&str], links: &[(&str, &str)], policy: Policy) -> Coordinator {
    let names = cohorts.iter().map(|s| s.to_string()).collect();
    let edges = links.iter().map(|&(a, b)| Edge::new(a, b, 1)).collect();
    let rdg = Rdg::new(names, edges).unwrap();
    Coordinator::new(E, "mgr".into(), &rdg, policy, t()).unwrap()
}

fn from(c: &str, msg: Msg) -> Envelope<Msg> {
    Envelope {
        from: c.into(),
        to: "mgr".into(),
        msg,
    }
}

fn load_fin(c: &str) -> Envelope<Msg> {
    from(c, Msg::LoadFin { epoch: E })
}

fn start_fin(c: &str, us: u64) -> Envelope<Msg> {
    from(
        c,
        Msg::StartFin {
            epoch: E,
            started_unix_us: us,
        },
    )
}

fn restore_fin(c: &str) -> Envelope<Msg> {
    from(c, Msg::RestoreFin { epoch: E })
}

/// (receiver, message name) of every envelope, sorted.
fn sends(out: &[Envelope<Msg>]) -> Vec<(String, &'static str)> {
    assert!(out.iter().all(|e| e.from == "mgr" && e.msg.epoch() == E));
    let mut v: Vec<_> = out.iter().map(|e| (e.to.clone(), e.msg.name())).collect();
    v.sort();
    v
}

fn s(list: &[(&str, &'static str)]) -> Vec<(String, &'static str)> {
    let mut v: Vec<_> = list.iter().map(|(a, b)| (a.to_string(), *b)).collect();
    v.sort();
    v
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn kinds(c: &Coordinator) -> Vec<CoordinatorEventKind> {
    c.events().iter().map(|e| e.kind.clone()).collect()
}

fn start_sent(c: &Coordinator) -> Vec<Vec<String>> {
    kinds(c)
        .into_iter()
        .filter_map(|k| match k {
            CoordinatorEventKind::StartSent { cohorts } => Some(cohorts),
            _ => None,
        })
        .collect()
}

/// a sends to b, b sends to c: c starts first, then b, then a.
fn chain() -> &'static [(&'static str, &'static str)] {
    &[("a", "b"), ("b", "c")]
}

#[test]
fn start_sends_load_to_every_cohort_once() {
    let now = Instant::now();
    let mut c = coord(&["a", "b", "c"], &[], Policy::RestoreLine);
    assert_eq!(c.state(), CoordinatorState::NotStarted);
    assert_eq!(c.next_wakeup(), None);
    let out = c.start(now);
    assert_eq!(
        sends(&out),
        s(&[("a", "LOAD"), ("b", "LOAD"), ("c", "LOAD")])
    );
    assert_eq!(
        c.state(),
        CoordinatorState::AwaitLoad {
            missing: set(&["a", "b", "c"])
        }
    );
    assert_eq!(c.next_wakeup(), Some(now + ms(100)));
    assert!(c.start(now).is_empty(), "second start must not send again");
    assert_eq!(kinds(&c), [CoordinatorEventKind::Started { cohorts: 3 }]);
}

#[test]
fn message_before_start_is_ignored() {
    let mut c = coord(&["a"], &[], Policy::RestoreLine);
    assert!(c.on_message(load_fin("a"), Instant::now()).is_empty());
    assert_eq!(c.ignored().unexpected, 1);
    assert_eq!(c.state(), CoordinatorState::NotStarted);
}

#[test]
fn no_cohorts_is_done_at_once() {
    let mut c = coord(&[], &[], Policy::RestoreLine);
    assert!(c.start(Instant::now()).is_empty());
    assert_eq!(c.state(), CoordinatorState::Done);
    assert!(c.is_finished());
}

#[test]
fn load_is_retransmitted_to_missing_cohorts_only() {
    let now = Instant::now();
    let mut c = coord(&["a", "b", "c"], chain(), Policy::RestoreLine);
    c.start(now);
    // a is held (b has not started): its LOAD_FIN only moves it to Loaded.
    assert!(c.on_message(load_fin("a"), now + ms(10)).is_empty());
    assert_eq!(c.phase("a"), Some(CohortPhase::Loaded));
    assert!(c.on_tick(now + ms(99)).is_empty());
    let out = c.on_tick(now + ms(100));
    assert_eq!(sends(&out), s(&[("b", "LOAD"), ("c", "LOAD")]));
    assert_eq!(c.next_wakeup(), Some(now + ms(200)));
    let retransmits = kinds(&c)
        .iter()
        .filter(|k| matches!(k, CoordinatorEventKind::Retransmit { msg: "LOAD", .. }))
        .count();
    assert_eq!(retransmits, 2);
    // A duplicate LOAD_FIN of a held cohort changes nothing.
    assert!(c.on_message(load_fin("a"), now + ms(150)).is_empty());
    assert_eq!(c.phase("a"), Some(CohortPhase::Loaded));
}

#[test]
fn checker_starts_a_chain_from_its_end() {
    let now = Instant::now();
    let mut c = coord(&["a", "b", "c"], chain(), Policy::RestoreLine);
    c.start(now);
    // a and b load first: both held.
    assert!(c.on_message(load_fin("a"), now).is_empty());
    assert!(c.on_message(load_fin("b"), now).is_empty());
    // c waits for nobody.
    let out = c.on_message(load_fin("c"), now + ms(1));
    assert_eq!(sends(&out), s(&[("c", "START")]));
    assert_eq!(
        c.state(),
        CoordinatorState::AwaitStart {
            missing: set(&["a", "b", "c"])
        }
    );
    // c runs: b may start, a still waits for b.
    let out = c.on_message(start_fin("c", 100), now + ms(2));
    assert_eq!(sends(&out), s(&[("c", "START_ACK"), ("b", "START")]));
    assert_eq!(c.phase("a"), Some(CohortPhase::Loaded));
    let out = c.on_message(start_fin("b", 200), now + ms(3));
    assert_eq!(sends(&out), s(&[("b", "START_ACK"), ("a", "START")]));
    let out = c.on_message(start_fin("a", 300), now + ms(4));
    assert_eq!(sends(&out), s(&[("a", "START_ACK")]));
    assert_eq!(
        c.state(),
        CoordinatorState::AwaitRestore {
            missing: set(&["a", "b", "c"])
        }
    );
    assert_eq!(start_sent(&c), [["c"], ["b"], ["a"]]);
    assert_eq!(
        c.start_order(),
        [("c".into(), 100), ("b".into(), 200), ("a".into(), 300)]
    );
    assert!(c.on_message(restore_fin("b"), now + ms(5)).is_empty());
    assert!(c.on_message(restore_fin("b"), now + ms(5)).is_empty());
    assert!(c.on_message(restore_fin("a"), now + ms(5)).is_empty());
    let out = c.on_message(restore_fin("c"), now + ms(6));
    assert_eq!(
        sends(&out),
        s(&[
            ("a", "ALL_RESTORE_FIN"),
            ("b", "ALL_RESTORE_FIN"),
            ("c", "ALL_RESTORE_FIN")
        ])
    );
    assert_eq!(c.state(), CoordinatorState::Done);
    assert_eq!(c.next_wakeup(), None);
    let k = kinds(&c);
    let pos = |e: CoordinatorEventKind| k.iter().position(|x| *x == e).unwrap();
    assert!(pos(CoordinatorEventKind::AllLoaded) < pos(CoordinatorEventKind::AllStarted));
    assert!(pos(CoordinatorEventKind::AllStarted) < pos(CoordinatorEventKind::Done));
}

#[test]
fn ring_starts_together_once_all_members_are_loaded() {
    let now = Instant::now();
    let deps = [("x", "y"), ("y", "x"), ("z", "x")];
    let mut c = coord(&["x", "y", "z"], &deps, Policy::RestoreLine);
    c.start(now);
    assert!(c.on_message(load_fin("z"), now).is_empty());
    assert!(c.on_message(load_fin("x"), now).is_empty(), "y not loaded");
    let out = c.on_message(load_fin("y"), now);
    assert_eq!(sends(&out), s(&[("x", "START"), ("y", "START")]));
    assert_eq!(start_sent(&c), [["x", "y"]]);
    // z depends on x only: it starts when x runs, whatever y does.
    let out = c.on_message(start_fin("x", 10), now);
    assert_eq!(sends(&out), s(&[("x", "START_ACK"), ("z", "START")]));
}

#[test]
fn ring_waits_for_the_external_deps_of_every_member() {
    let now = Instant::now();
    // y sends to w: the whole ring {x, y} starts after w.
    let deps = [("x", "y"), ("y", "x"), ("y", "w")];
    let mut c = coord(&["w", "x", "y"], &deps, Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("x"), now);
    assert!(c.on_message(load_fin("y"), now).is_empty());
    let out = c.on_message(load_fin("w"), now);
    assert_eq!(sends(&out), s(&[("w", "START")]));
    let out = c.on_message(start_fin("w", 1), now);
    assert_eq!(
        sends(&out),
        s(&[("w", "START_ACK"), ("x", "START"), ("y", "START")])
    );
}

#[test]
fn orphan_starts_as_soon_as_it_is_loaded() {
    let now = Instant::now();
    let mut c = coord(&["a", "b", "c", "o"], chain(), Policy::RestoreLine);
    c.start(now);
    let out = c.on_message(load_fin("o"), now);
    assert_eq!(sends(&out), s(&[("o", "START")]));
    assert_eq!(c.phase("c"), Some(CohortPhase::Loading));
}

#[test]
fn independent_policy_starts_each_vm_when_loaded() {
    let now = Instant::now();
    let mut c = coord(&["a", "b", "c"], chain(), Policy::Independent);
    c.start(now);
    for vm in ["a", "b", "c"] {
        let out = c.on_message(load_fin(vm), now);
        assert_eq!(sends(&out), s(&[(vm, "START")]));
    }
    assert_eq!(start_sent(&c), [["a"], ["b"], ["c"]]);
    assert_eq!(c.policy(), Policy::Independent);
}

#[test]
fn start_is_retransmitted_and_duplicates_are_answered() {
    let now = Instant::now();
    let mut c = coord(&["a", "b"], &[], Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("a"), now + ms(50));
    // b still loads, a got START at 50: the tick at 100 re-sends only LOAD.
    assert_eq!(sends(&c.on_tick(now + ms(100))), s(&[("b", "LOAD")]));
    assert_eq!(sends(&c.on_tick(now + ms(150))), s(&[("a", "START")]));
    // a's LOAD_FIN again: START was lost, answer at once.
    let out = c.on_message(load_fin("a"), now + ms(160));
    assert_eq!(sends(&out), s(&[("a", "START")]));
    let out = c.on_message(start_fin("a", 7), now + ms(170));
    assert_eq!(sends(&out), s(&[("a", "START_ACK")]));
    // Duplicate START_FIN: START_ACK again, no second StartFin event.
    let out = c.on_message(start_fin("a", 7), now + ms(180));
    assert_eq!(sends(&out), s(&[("a", "START_ACK")]));
    let fins = kinds(&c)
        .iter()
        .filter(|k| matches!(k, CoordinatorEventKind::StartFin { .. }))
        .count();
    assert_eq!(fins, 1);
    // A stale LOAD_FIN after START_FIN is ignored; a is not re-sent START.
    assert!(c.on_message(load_fin("a"), now + ms(190)).is_empty());
    assert_eq!(sends(&c.on_tick(now + ms(300))), s(&[("b", "LOAD")]));
}

#[test]
fn restore_fin_before_the_lost_start_fin_is_remembered() {
    let now = Instant::now();
    let mut c = coord(&["a"], &[], Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("a"), now);
    assert!(c.on_message(restore_fin("a"), now).is_empty());
    assert_eq!(c.phase("a"), Some(CohortPhase::Starting));
    let out = c.on_message(start_fin("a", 5), now);
    assert_eq!(
        sends(&out),
        s(&[("a", "START_ACK"), ("a", "ALL_RESTORE_FIN")])
    );
    assert_eq!(c.state(), CoordinatorState::Done);
    // Done: FINs are answered with their acknowledgement.
    let out = c.on_message(restore_fin("a"), now);
    assert_eq!(sends(&out), s(&[("a", "ALL_RESTORE_FIN")]));
    let out = c.on_message(start_fin("a", 5), now);
    assert_eq!(sends(&out), s(&[("a", "START_ACK")]));
    assert!(c.on_message(load_fin("a"), now).is_empty());
}

#[test]
fn fins_that_cannot_be_earned_are_ignored() {
    let now = Instant::now();
    let mut c = coord(&["a", "b"], chain_ab(), Policy::RestoreLine);
    c.start(now);
    assert!(c.on_message(restore_fin("a"), now).is_empty());
    assert!(c.on_message(start_fin("a", 1), now).is_empty());
    c.on_message(load_fin("a"), now);
    assert!(c.on_message(start_fin("a", 1), now).is_empty(), "held");
    assert!(c
        .on_message(from("a", Msg::Load { epoch: E }), now)
        .is_empty());
    assert_eq!(c.ignored().unexpected, 4);
    assert_eq!(c.phase("a"), Some(CohortPhase::Loaded));
}

fn chain_ab() -> &'static [(&'static str, &'static str)] {
    &[("a", "b")]
}

#[test]
fn stale_epoch_and_strangers_are_counted() {
    let now = Instant::now();
    let mut c = coord(&["a"], &[], Policy::RestoreLine);
    c.start(now);
    assert!(c
        .on_message(from("a", Msg::LoadFin { epoch: E + 1 }), now)
        .is_empty());
    assert!(c.on_message(load_fin("zz"), now).is_empty());
    assert_eq!(c.ignored().stale_epoch, 1);
    assert_eq!(c.ignored().unknown_sender, 1);
    assert_eq!(c.phase("a"), Some(CohortPhase::Loading));
}

fn reason(c: &Coordinator) -> String {
    match c.state() {
        CoordinatorState::Aborted { reason } => reason,
        s => panic!("not aborted: {s:?}"),
    }
}

#[test]
fn load_deadline_aborts_naming_the_missing() {
    let now = Instant::now();
    let mut c = coord(&["a", "b"], &[], Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("a"), now);
    let out = c.on_tick(now + Duration::from_secs(5));
    assert_eq!(sends(&out), s(&[("a", "ABORT"), ("b", "ABORT")]));
    let r = reason(&c);
    assert!(r.contains("LOAD_FIN from b") && !r.contains("a,"), "{r}");
}

#[test]
fn start_deadline_runs_from_the_last_load_fin() {
    let now = Instant::now();
    let mut c = coord(&["a", "b"], chain_ab(), Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("a"), now);
    let last = now + Duration::from_secs(4);
    c.on_message(load_fin("b"), last);
    assert_eq!(c.next_wakeup(), Some(last + ms(100)), "START retry");
    // Past start + load_deadline but within last LOAD_FIN + start_deadline.
    c.on_tick(now + Duration::from_secs(9));
    assert!(!c.is_finished());
    c.on_tick(last + Duration::from_secs(10));
    let r = reason(&c);
    assert!(r.contains("START_FIN from a, b"), "{r}");
}

#[test]
fn restore_deadline_runs_from_the_last_start_fin() {
    let now = Instant::now();
    let mut c = coord(&["a"], &[], Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("a"), now);
    let started = now + Duration::from_secs(8);
    c.on_message(start_fin("a", 1), started);
    assert_eq!(c.next_wakeup(), Some(started + Duration::from_secs(50)));
    c.on_tick(started + Duration::from_secs(49));
    assert!(!c.is_finished());
    c.on_tick(started + Duration::from_secs(50));
    assert!(reason(&c).contains("RESTORE_FIN from a"));
}

#[test]
fn failed_aborts_everyone_and_lingers() {
    let now = Instant::now();
    let mut c = coord(&["a", "b", "c"], chain(), Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("c"), now);
    let out = c.on_message(
        from(
            "b",
            Msg::Failed {
                epoch: E,
                error: "snapshot file unreadable".into(),
            },
        ),
        now,
    );
    assert_eq!(
        sends(&out),
        s(&[("a", "ABORT"), ("b", "ABORT"), ("c", "ABORT")])
    );
    assert_eq!(reason(&c), "cohort b failed: snapshot file unreadable");
    assert!(c.is_finished());
    // Anything from a cohort is answered with ABORT.
    let out = c.on_message(start_fin("c", 1), now + ms(10));
    assert_eq!(sends(&out), s(&[("c", "ABORT")]));
    // ABORT re-broadcast every retry within linger (10 x retry), then quiet.
    assert_eq!(c.next_wakeup(), Some(now + ms(100)));
    assert_eq!(c.on_tick(now + ms(100)).len(), 3);
    for k in 2..=10 {
        c.on_tick(now + ms(100 * k));
    }
    assert_eq!(c.next_wakeup(), None);
    // abort() once aborted does nothing.
    assert!(c.abort("again".into(), now).is_empty());
    assert_eq!(reason(&c), "cohort b failed: snapshot file unreadable");
}

#[test]
fn abort_before_start_and_after_done() {
    let now = Instant::now();
    let mut c = coord(&["a"], &[], Policy::RestoreLine);
    let out = c.abort("operator".into(), now);
    assert_eq!(sends(&out), s(&[("a", "ABORT")]));
    assert_eq!(reason(&c), "operator");

    let mut c = coord(&["a"], &[], Policy::RestoreLine);
    c.start(now);
    c.on_message(load_fin("a"), now);
    c.on_message(start_fin("a", 1), now);
    c.on_message(restore_fin("a"), now);
    assert_eq!(c.state(), CoordinatorState::Done);
    assert!(c.abort("late".into(), now).is_empty());
    assert_eq!(c.state(), CoordinatorState::Done);
    let failed = Msg::Failed {
        epoch: E,
        error: "oops".into(),
    };
    assert!(c.on_message(from("a", failed), now).is_empty());
    assert!(kinds(&c).contains(&CoordinatorEventKind::FailedAfterDone {
        cohort: "a".into(),
        error: "oops".into()
    }));
    assert_eq!(c.state(), CoordinatorState::Done);
}

#[test]
fn start_groups_are_exposed() {
    let c = coord(&["a", "b", "c"], chain(), Policy::RestoreLine);
    let g = c.start_groups();
    assert_eq!(g.len(), 3);
    let a = g.iter().find(|g| g.members == ["a"]).unwrap();
    assert_eq!(a.after, ["b"]);
    // In causal order: c first.
    assert_eq!(g[0].members, ["c"]);
}
