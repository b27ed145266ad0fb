//! The peer's state table, one transition at a time, without threads.

use std::time::{Duration, Instant};

use vmcsnap_coord::snapshot::*;
use vmcsnap_coord::transport::Envelope;

const E: u64 = 3;

fn t() -> Timeouts {
    Timeouts {
        retry: Duration::from_millis(100),
        transient_deadline: Duration::from_secs(5),
        full_deadline: Duration::from_secs(50),
    }
}

fn peer() -> Peer {
    Peer::new(E, "vm1".into(), "mgr".into(), t())
}

fn msg(m: Msg) -> Envelope<Msg> {
    Envelope {
        from: "mgr".into(),
        to: "vm1".into(),
        msg: m,
    }
}

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

/// Actions with sends shown as their message name.
#[derive(Debug, PartialEq)]
enum A {
    Send(&'static str),
    Start,
    EndColoring,
    Complete,
    Abandon,
}
use A::*;

fn acts(v: Vec<PeerAction>) -> Vec<A> {
    v.into_iter()
        .map(|a| match a {
            PeerAction::Send(e) => {
                assert_eq!(
                    (e.from.as_str(), e.to.as_str(), e.msg.epoch()),
                    ("vm1", "mgr", E)
                );
                Send(e.msg.name())
            }
            PeerAction::StartSnapshot => Start,
            PeerAction::EndColoring => EndColoring,
            PeerAction::Complete => Complete,
            PeerAction::Abandon { .. } => Abandon,
        })
        .collect()
}

fn snapshot() -> Envelope<Msg> {
    msg(Msg::Snapshot { epoch: E })
}
fn all_transient() -> Envelope<Msg> {
    msg(Msg::AllTransientSnapFin { epoch: E })
}
fn all_full() -> Envelope<Msg> {
    msg(Msg::AllFullSnapFin { epoch: E })
}
fn abort() -> Envelope<Msg> {
    msg(Msg::Abort {
        epoch: E,
        reason: "because".into(),
    })
}

/// A peer driven to `state` at `now`.
fn peer_in(state: PeerState, now: Instant) -> Peer {
    let mut p = peer();
    if state == PeerState::Idle {
        return p;
    }
    p.on_message(snapshot(), now);
    if state == PeerState::Transient {
        return p;
    }
    p.on_transient_done(now);
    if state == PeerState::Post {
        return p;
    }
    p.on_message(all_transient(), now);
    if state == PeerState::Full {
        return p;
    }
    p.on_full_done(now);
    if state == PeerState::FullDone {
        return p;
    }
    p.on_message(all_full(), now);
    assert_eq!(p.state(), PeerState::Done);
    p
}

#[test]
fn the_happy_sequence() {
    let now = Instant::now();
    let mut p = peer();
    assert_eq!(p.state(), PeerState::Idle);
    assert_eq!(acts(p.on_message(snapshot(), now)), [Start]);
    assert_eq!(p.state(), PeerState::Transient);
    assert_eq!(
        p.next_wakeup(),
        None,
        "nothing to retransmit while the transient runs"
    );
    assert_eq!(acts(p.on_transient_done(now)), [Send("TRANSIENT_SNAP_FIN")]);
    assert_eq!(p.state(), PeerState::Post);
    assert_eq!(p.next_wakeup(), Some(now + ms(100)));
    assert_eq!(acts(p.on_message(all_transient(), now)), [EndColoring]);
    assert_eq!(p.state(), PeerState::Full);
    assert_eq!(p.next_wakeup(), None);
    assert_eq!(acts(p.on_full_done(now)), [Send("FULL_SNAP_FIN")]);
    assert_eq!(p.state(), PeerState::FullDone);
    assert_eq!(acts(p.on_message(all_full(), now)), [Complete]);
    assert_eq!(p.state(), PeerState::Done);
    assert!(p.is_finished());
    assert_eq!(p.next_wakeup(), None);
}

#[test]
fn duplicate_snapshot() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Transient, now);
    assert!(
        p.on_message(snapshot(), now).is_empty(),
        "no second StartSnapshot"
    );
    p.on_transient_done(now);
    assert_eq!(
        acts(p.on_message(snapshot(), now)),
        [Send("TRANSIENT_SNAP_FIN")],
        "FIN lost: resend"
    );
    p.on_message(all_transient(), now);
    assert!(
        p.on_message(snapshot(), now).is_empty(),
        "stale after ALL_TRANSIENT"
    );
}

#[test]
fn fins_are_retransmitted_until_acknowledged() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Post, now);
    assert!(p.on_tick(now + ms(99)).is_empty());
    assert_eq!(acts(p.on_tick(now + ms(100))), [Send("TRANSIENT_SNAP_FIN")]);
    assert_eq!(p.next_wakeup(), Some(now + ms(200)));
    p.on_message(all_transient(), now + ms(150));
    assert!(
        p.on_tick(now + ms(200)).is_empty(),
        "acknowledged: no retransmission"
    );
    p.on_full_done(now + ms(300));
    assert_eq!(acts(p.on_tick(now + ms(400))), [Send("FULL_SNAP_FIN")]);
}

#[test]
fn duplicate_all_transient_and_all_full() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Full, now);
    assert!(p.on_message(all_transient(), now).is_empty());
    p.on_full_done(now);
    assert!(p.on_message(all_transient(), now).is_empty());
    assert_eq!(acts(p.on_message(all_full(), now)), [Complete]);
    assert!(p.on_message(all_full(), now).is_empty());
}

#[test]
fn full_done_before_all_transient() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Post, now);
    assert_eq!(acts(p.on_full_done(now)), [Send("FULL_SNAP_FIN")]);
    assert_eq!(p.state(), PeerState::Post, "still coloring");
    assert!(p.full_done());
    assert_eq!(
        acts(p.on_tick(now + ms(100))),
        [Send("TRANSIENT_SNAP_FIN"), Send("FULL_SNAP_FIN")],
        "both FINs await their ALL_*"
    );
    assert_eq!(acts(p.on_message(all_transient(), now)), [EndColoring]);
    assert_eq!(p.state(), PeerState::FullDone);
    assert_eq!(acts(p.on_tick(now + ms(200))), [Send("FULL_SNAP_FIN")]);
}

#[test]
fn all_full_implies_all_transient() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Post, now);
    p.on_full_done(now);
    assert_eq!(acts(p.on_message(all_full(), now)), [EndColoring, Complete]);
    assert_eq!(p.state(), PeerState::Done);
}

#[test]
fn unearned_all_messages_are_ignored() {
    let now = Instant::now();
    for s in [PeerState::Idle, PeerState::Transient] {
        let mut p = peer_in(s, now);
        assert!(p.on_message(all_transient(), now).is_empty());
        assert!(p.on_message(all_full(), now).is_empty());
        assert_eq!(p.state(), s);
        assert_eq!(p.ignored().unexpected, 2);
    }
    for s in [PeerState::Post, PeerState::Full] {
        let mut p = peer_in(s, now);
        assert!(
            p.on_message(all_full(), now).is_empty(),
            "no Complete before own full done"
        );
        assert_eq!(p.state(), s);
    }
}

#[test]
fn trigger_starts_once() {
    let now = Instant::now();
    let mut p = peer();
    assert_eq!(acts(p.on_trigger(now)), [Start]);
    assert_eq!(p.state(), PeerState::Transient);
    assert!(p.on_trigger(now).is_empty());
    assert!(
        p.on_message(snapshot(), now).is_empty(),
        "SNAPSHOT after trigger: no second start"
    );
    let mut p = peer_in(PeerState::Post, now);
    assert!(p.on_trigger(now).is_empty());
}

#[test]
fn abort_abandons_every_non_final_state() {
    let now = Instant::now();
    for s in [
        PeerState::Idle,
        PeerState::Transient,
        PeerState::Post,
        PeerState::Full,
        PeerState::FullDone,
    ] {
        let mut p = peer_in(s, now);
        let out = p.on_message(abort(), now);
        assert_eq!(out.len(), 1, "{s:?}");
        let PeerAction::Abandon { reason } = &out[0] else {
            panic!("{out:?}")
        };
        assert!(
            reason.contains("mgr") && reason.contains("because"),
            "{reason}"
        );
        assert_eq!(p.state(), PeerState::Abandoned);
        assert!(p.is_finished());
        assert_eq!(p.next_wakeup(), None);
        assert!(p.on_message(abort(), now).is_empty(), "duplicate ABORT");
        assert!(p.on_transient_done(now).is_empty() && p.on_full_done(now).is_empty());
    }
}

#[test]
fn abort_after_complete_is_ignored() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Done, now);
    assert!(p.on_message(abort(), now).is_empty());
    assert_eq!(p.state(), PeerState::Done);
    assert!(p.on_failed("late".into(), now).is_empty());
    assert_eq!(p.state(), PeerState::Done);
}

#[test]
fn local_failure_sends_failed_until_abort() {
    let now = Instant::now();
    let mut p = peer_in(PeerState::Post, now);
    let out = p.on_failed("qemu died".into(), now);
    assert_eq!(
        out[0],
        PeerAction::Send(Envelope {
            from: "vm1".into(),
            to: "mgr".into(),
            msg: Msg::Failed {
                epoch: E,
                error: "qemu died".into()
            },
        })
    );
    assert_eq!(
        out[1],
        PeerAction::Abandon {
            reason: "qemu died".into()
        }
    );
    assert_eq!(p.state(), PeerState::Abandoned);
    assert!(!p.is_finished(), "FAILED not yet acknowledged");
    assert!(p.on_failed("again".into(), now).is_empty());
    assert_eq!(acts(p.on_tick(now + ms(100))), [Send("FAILED")]);
    assert_eq!(
        acts(p.on_message(snapshot(), now + ms(150))),
        [Send("FAILED")],
        "initiator has not heard"
    );
    assert!(
        p.on_message(abort(), now + ms(160)).is_empty(),
        "no second Abandon"
    );
    assert!(p.is_finished());
    assert_eq!(p.next_wakeup(), None);
}

#[test]
fn local_failure_gives_up_waiting_for_abort() {
    let now = Instant::now();
    let mut p = peer();
    assert_eq!(
        acts(p.on_failed("cannot pause".into(), now)),
        [Send("FAILED"), Abandon]
    );
    let mut t = now;
    let mut resent = 0;
    while let Some(w) = p.next_wakeup() {
        t = w;
        resent += p.on_tick(t).len();
    }
    assert!(p.is_finished());
    assert_eq!(t, now + Duration::from_secs(5));
    assert_eq!(resent, 49);
}

#[test]
fn silence_past_give_up_time_abandons() {
    let now = Instant::now();
    // transient 5 s + full 50 s + linger 10 × 100 ms
    let give_up = Duration::from_secs(56);
    assert_eq!(t().peer_give_up(), give_up);
    let mut p = peer_in(PeerState::Post, now);
    assert_eq!(p.next_wakeup(), Some(now + ms(100)));
    // A message from the initiator restarts the silence timer.
    let t1 = now + Duration::from_secs(30);
    p.on_message(snapshot(), t1);
    assert!(p
        .on_tick(now + give_up)
        .iter()
        .all(|a| matches!(a, PeerAction::Send(_))));
    assert_eq!(p.state(), PeerState::Post);
    let out = acts(p.on_tick(t1 + give_up));
    assert_eq!(out, [Send("FAILED"), Abandon]);
    assert_eq!(p.state(), PeerState::Abandoned);
    assert!(p.is_finished());

    // Waiting for ALL_FULL, too; not before the give-up time.
    let mut p = peer_in(PeerState::FullDone, now);
    assert!(!acts(p.on_tick(now + give_up - ms(1))).contains(&Abandon));
    assert_eq!(acts(p.on_tick(now + give_up)), [Send("FAILED"), Abandon]);
}

#[test]
fn no_deadline_while_idle_transient_or_full() {
    let now = Instant::now();
    let later = now + Duration::from_secs(100_000);
    for s in [PeerState::Idle, PeerState::Transient, PeerState::Full] {
        let mut p = peer_in(s, now);
        assert_eq!(p.next_wakeup(), None, "{s:?}");
        assert!(p.on_tick(later).is_empty());
        assert_eq!(p.state(), s);
    }
}

#[test]
fn reports_out_of_order_are_ignored() {
    let now = Instant::now();
    let mut p = peer();
    assert!(p.on_transient_done(now).is_empty());
    assert!(p.on_full_done(now).is_empty());
    assert_eq!(p.state(), PeerState::Idle);
    let mut p = peer_in(PeerState::Transient, now);
    assert!(p.on_full_done(now).is_empty());
    assert_eq!(p.state(), PeerState::Transient);
    assert_eq!(acts(p.on_transient_done(now)), [Send("TRANSIENT_SNAP_FIN")]);
    assert!(p.on_transient_done(now).is_empty(), "duplicate report");
}

#[test]
fn stale_epoch_and_strangers_are_counted() {
    let now = Instant::now();
    let mut p = peer();
    assert!(p
        .on_message(msg(Msg::Snapshot { epoch: E - 1 }), now)
        .is_empty());
    assert!(p
        .on_message(
            msg(Msg::Abort {
                epoch: E + 1,
                reason: "old".into()
            }),
            now
        )
        .is_empty());
    let stranger = Envelope {
        from: "vm2".into(),
        to: "vm1".into(),
        msg: Msg::Snapshot { epoch: E },
    };
    assert!(p.on_message(stranger, now).is_empty());
    assert!(p
        .on_message(msg(Msg::TransientSnapFin { epoch: E }), now)
        .is_empty());
    assert_eq!(
        p.ignored(),
        Ignored {
            stale_epoch: 2,
            unknown_sender: 1,
            unexpected: 1
        }
    );
    assert_eq!(p.state(), PeerState::Idle);
}
