//! The restore cohort's state table, one transition at a time, without
//! threads.

use std::time::{Duration, Instant};

use vmcsnap_coord::restore::*;
use vmcsnap_coord::transport::Envelope;

const E: u64 = 4;

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

fn cohort() -> Cohort {
    Cohort::new(E, "vm1".into(), "mgr".into(), t())
}

fn msg(m: Msg) -> Envelope<Msg> {
    Envelope {
        from: "mgr".into(),
        to: "vm1".into(),
        msg: m,
    }
}

/// Actions with sends shown as their message name.
#[derive(Debug, PartialEq)]
enum A {
    Send(&'static str),
    Load,
    Start,
    Abandon,
}
use A::*;

fn acts(v: Vec<CohortAction>) -> Vec<A> {
    v.into_iter()
        .map(|a| match a {
            CohortAction::Send(e) => {
                assert_eq!(
                    (e.from.as_str(), e.to.as_str(), e.msg.epoch()),
                    ("vm1", "mgr", E)
                );
                Send(e.msg.name())
            }
            CohortAction::Load => Load,
            CohortAction::Start => Start,
            CohortAction::Abandon { .. } => Abandon,
        })
        .collect()
}

fn load() -> Envelope<Msg> {
    msg(Msg::Load { epoch: E })
}
fn start() -> Envelope<Msg> {
    msg(Msg::Start { epoch: E })
}
fn start_ack() -> Envelope<Msg> {
    msg(Msg::StartAck { epoch: E })
}
fn all_restore_fin() -> Envelope<Msg> {
    msg(Msg::AllRestoreFin { epoch: E })
}
fn abort() -> Envelope<Msg> {
    msg(Msg::Abort {
        epoch: E,
        reason: "r".into(),
    })
}

/// A cohort that has loaded and started (START_FIN sent at `now`).
fn running(now: Instant) -> Cohort {
    let mut c = cohort();
    c.on_message(load(), now);
    c.on_loaded(now);
    c.on_message(start(), now);
    c.on_started(42, now);
    c
}

#[test]
fn load_is_acted_on_once() {
    let now = Instant::now();
    let mut c = cohort();
    assert_eq!(c.state(), CohortState::Idle);
    assert_eq!(acts(c.on_message(load(), now)), [Load]);
    assert_eq!(c.state(), CohortState::Loading);
    assert!(c.on_message(load(), now).is_empty());
    assert_eq!(c.next_wakeup(), None, "no timer while the worker loads");
}

#[test]
fn load_fin_is_resent_until_start() {
    let now = Instant::now();
    let mut c = cohort();
    c.on_message(load(), now);
    assert_eq!(acts(c.on_loaded(now)), [Send("LOAD_FIN")]);
    assert_eq!(c.state(), CohortState::Loaded);
    assert_eq!(c.next_wakeup(), Some(now + ms(100)));
    assert!(c.on_tick(now + ms(99)).is_empty());
    assert_eq!(acts(c.on_tick(now + ms(100))), [Send("LOAD_FIN")]);
    assert_eq!(acts(c.on_message(load(), now)), [Send("LOAD_FIN")]);
    assert_eq!(acts(c.on_message(start(), now + ms(150))), [Start]);
    assert_eq!(c.state(), CohortState::Starting);
    assert_eq!(c.next_wakeup(), None, "LOAD_FIN acknowledged by START");
    assert!(c.on_message(start(), now).is_empty(), "no second Start");
    assert!(c.on_message(load(), now).is_empty());
}

#[test]
fn start_fin_is_resent_until_start_ack() {
    let now = Instant::now();
    let mut c = cohort();
    c.on_message(load(), now);
    c.on_loaded(now);
    c.on_message(start(), now);
    let out = c.on_started(1234, now);
    assert_eq!(
        out,
        [CohortAction::Send(Envelope {
            from: "vm1".into(),
            to: "mgr".into(),
            msg: Msg::StartFin {
                epoch: E,
                started_unix_us: 1234
            }
        })]
    );
    assert_eq!(c.state(), CohortState::Running);
    assert_eq!(c.started_unix_us(), Some(1234));
    assert_eq!(acts(c.on_tick(now + ms(100))), [Send("START_FIN")]);
    // A duplicate START means START_FIN was lost: answer, do not restart.
    assert_eq!(acts(c.on_message(start(), now)), [Send("START_FIN")]);
    assert!(c.on_message(start_ack(), now + ms(150)).is_empty());
    assert_eq!(c.next_wakeup(), None);
    assert_eq!(c.state(), CohortState::Running);
}

#[test]
fn restore_fin_is_resent_until_all_restore_fin() {
    let now = Instant::now();
    let mut c = running(now);
    c.on_message(start_ack(), now);
    assert_eq!(acts(c.on_restored(now)), [Send("RESTORE_FIN")]);
    assert_eq!(c.state(), CohortState::Restored);
    assert_eq!(acts(c.on_tick(now + ms(100))), [Send("RESTORE_FIN")]);
    assert!(c.on_message(all_restore_fin(), now).is_empty());
    assert_eq!(c.state(), CohortState::Done);
    assert!(c.is_finished());
    assert_eq!(c.next_wakeup(), None);
    // ABORT after Done is stale: ignored.
    assert!(c.on_message(abort(), now).is_empty());
    assert_eq!(c.state(), CohortState::Done);
}

#[test]
fn all_restore_fin_implies_start_ack() {
    let now = Instant::now();
    let mut c = running(now);
    c.on_restored(now);
    assert_eq!(
        acts(c.on_tick(now + ms(100))),
        [Send("START_FIN"), Send("RESTORE_FIN")]
    );
    c.on_message(all_restore_fin(), now);
    assert_eq!(c.state(), CohortState::Done);
}

#[test]
fn pages_loaded_before_start_are_reported_after_start_fin() {
    let now = Instant::now();
    let mut c = cohort();
    c.on_message(load(), now);
    c.on_loaded(now);
    assert!(c.on_restored(now).is_empty());
    assert!(c.pages_loaded());
    assert_eq!(c.state(), CohortState::Loaded);
    c.on_message(start(), now);
    assert_eq!(
        acts(c.on_started(9, now)),
        [Send("START_FIN"), Send("RESTORE_FIN")]
    );
    assert_eq!(c.state(), CohortState::Restored);
}

#[test]
fn unearned_messages_are_ignored() {
    let now = Instant::now();
    let mut c = cohort();
    assert!(c.on_message(start(), now).is_empty());
    assert!(c.on_message(all_restore_fin(), now).is_empty());
    c.on_message(load(), now);
    assert!(c.on_message(start(), now).is_empty(), "not loaded yet");
    assert!(c.on_message(start_ack(), now).is_empty());
    let mut r = running(now);
    assert!(
        r.on_message(all_restore_fin(), now).is_empty(),
        "pages not loaded"
    );
    assert_eq!(r.state(), CohortState::Running);
    assert_eq!(c.ignored().unexpected, 4);
    assert_eq!(c.state(), CohortState::Loading);
}

#[test]
fn reports_out_of_order_are_ignored() {
    let now = Instant::now();
    let mut c = cohort();
    assert!(c.on_loaded(now).is_empty());
    assert!(c.on_restored(now).is_empty());
    assert!(c.on_started(1, now).is_empty());
    c.on_message(load(), now);
    assert!(c.on_started(1, now).is_empty(), "no START yet");
    c.on_loaded(now);
    assert!(c.on_loaded(now).is_empty(), "second report");
    c.on_message(start(), now);
    c.on_started(1, now);
    assert!(c.on_started(2, now).is_empty());
    assert_eq!(c.started_unix_us(), Some(1));
}

#[test]
fn abort_abandons_once_in_every_non_final_state() {
    let now = Instant::now();
    let states: [fn(&mut Cohort, Instant); 6] = [
        |_, _| {},
        |c, now| {
            c.on_message(load(), now);
        },
        |c, now| {
            c.on_message(load(), now);
            c.on_loaded(now);
        },
        |c, now| {
            c.on_message(load(), now);
            c.on_loaded(now);
            c.on_message(start(), now);
        },
        |c, now| *c = running(now),
        |c, now| {
            *c = running(now);
            c.on_restored(now);
        },
    ];
    for setup in states {
        let mut c = cohort();
        setup(&mut c, now);
        let before = c.state();
        assert_eq!(acts(c.on_message(abort(), now)), [Abandon], "{before:?}");
        assert_eq!(c.state(), CohortState::Abandoned);
        assert!(c.is_finished());
        assert!(c.on_message(abort(), now).is_empty());
        assert!(c.on_message(start(), now).is_empty());
        assert_eq!(c.next_wakeup(), None);
    }
}

#[test]
fn local_failure_sends_failed_until_abort() {
    let now = Instant::now();
    let mut c = cohort();
    c.on_message(load(), now);
    assert_eq!(
        acts(c.on_failed("disk".into(), now)),
        [Send("FAILED"), Abandon]
    );
    assert_eq!(c.state(), CohortState::Abandoned);
    assert!(!c.is_finished(), "FAILED not acknowledged yet");
    assert_eq!(acts(c.on_tick(now + ms(100))), [Send("FAILED")]);
    assert_eq!(acts(c.on_message(load(), now)), [Send("FAILED")]);
    assert!(c.on_failed("again".into(), now).is_empty());
    assert!(c.on_message(abort(), now + ms(150)).is_empty());
    assert!(c.is_finished());
    assert_eq!(c.next_wakeup(), None);
}

#[test]
fn unanswered_failure_gives_up_after_linger() {
    let now = Instant::now();
    let mut c = cohort();
    c.on_failed("cancelled".into(), now);
    for k in 1..10 {
        assert_eq!(acts(c.on_tick(now + ms(100 * k))), [Send("FAILED")]);
    }
    assert!(c.on_tick(now + ms(1000)).is_empty());
    assert!(c.is_finished());
}

#[test]
fn silent_coordinator_makes_a_waiting_cohort_give_up() {
    let now = Instant::now();
    let mut c = cohort();
    c.on_message(load(), now);
    c.on_loaded(now);
    let give_up = t().cohort_give_up();
    assert_eq!(give_up, Duration::from_secs(66));
    // Held by the Checker for a while: a message restarts the silence timer.
    let later = now + Duration::from_secs(60);
    c.on_message(load(), later);
    let mut ticks = Vec::new();
    let mut at = later;
    while !c.is_finished() {
        at = c.next_wakeup().unwrap();
        ticks.extend(acts(c.on_tick(at)));
    }
    assert_eq!(at, later + give_up);
    assert_eq!(&ticks[ticks.len() - 2..], [Send("FAILED"), Abandon]);
    assert_eq!(c.state(), CohortState::Abandoned);
}

#[test]
fn stale_epoch_and_strangers_are_counted() {
    let now = Instant::now();
    let mut c = cohort();
    assert!(c
        .on_message(msg(Msg::Load { epoch: E - 1 }), now)
        .is_empty());
    let mut stranger = load();
    stranger.from = "vm2".into();
    assert!(c.on_message(stranger, now).is_empty());
    assert_eq!(c.ignored().stale_epoch, 1);
    assert_eq!(c.ignored().unknown_sender, 1);
    assert_eq!(c.state(), CohortState::Idle);
}
