//! The initiator's state table, one transition at a time, without threads.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use vmcsnap_coord::snapshot::*;
use vmcsnap_coord::transport::Envelope;

const E: u64 = 7;

fn t() -> Timeouts {
    Timeouts {
        retry: Duration::from_millis(100),
        transient_deadline: Duration::from_secs(5),
        full_deadline: Duration::from_secs(50),
    }
}

fn init(n: usize) -> Initiator {
    let peers = (1..=n).map(|i| format!("vm{i}")).collect();
    Initiator::new(E, "mgr".into(), peers, t())
}

fn from(p: &str, msg: Msg) -> Envelope<Msg> {
    Envelope {
        from: p.into(),
        to: "mgr".into(),
        msg,
    }
}

/// (receiver, message name) of every envelope.
fn sends(out: &[Envelope<Msg>]) -> Vec<(String, &'static str)> {
    out.iter().map(|e| (e.to.clone(), e.msg.name())).collect()
}

fn to_all(n: usize, name: &'static str) -> Vec<(String, &'static str)> {
    (1..=n).map(|i| (format!("vm{i}"), name)).collect()
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

#[test]
fn start_sends_snapshot_to_every_peer_once() {
    let now = Instant::now();
    let mut i = init(3);
    assert_eq!(i.state(), &InitiatorState::NotStarted);
    assert_eq!(i.next_wakeup(), None);
    let out = i.start(now);
    assert_eq!(sends(&out), to_all(3, "SNAPSHOT"));
    assert!(out.iter().all(|e| e.from == "mgr" && e.msg.epoch() == E));
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitTransient {
            missing: set(&["vm1", "vm2", "vm3"])
        }
    );
    assert_eq!(i.next_wakeup(), Some(now + ms(100)));
    assert!(i.start(now).is_empty(), "second start must not send again");
    assert_eq!(i.events()[0].kind, InitiatorEventKind::Started { peers: 3 });
}

#[test]
fn message_before_start_is_ignored() {
    let mut i = init(1);
    assert!(i
        .on_message(
            from("vm1", Msg::TransientSnapFin { epoch: E }),
            Instant::now()
        )
        .is_empty());
    assert_eq!(i.ignored().unexpected, 1);
    assert_eq!(i.state(), &InitiatorState::NotStarted);
}

#[test]
fn all_transient_only_after_the_last_transient_fin() {
    let now = Instant::now();
    let mut i = init(3);
    i.start(now);
    assert!(i
        .on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), now)
        .is_empty());
    // Duplicate: nothing, still missing the same.
    assert!(i
        .on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), now)
        .is_empty());
    assert!(i
        .on_message(from("vm1", Msg::TransientSnapFin { epoch: E }), now)
        .is_empty());
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitTransient {
            missing: set(&["vm3"])
        }
    );
    let out = i.on_message(
        from("vm3", Msg::TransientSnapFin { epoch: E }),
        now + ms(10),
    );
    assert_eq!(sends(&out), to_all(3, "ALL_TRANSIENT_SNAP_FIN"));
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitFull {
            missing: set(&["vm1", "vm2", "vm3"])
        }
    );
    // Only the full deadline is pending now (no retransmission timer).
    assert_eq!(
        i.next_wakeup(),
        Some(now + ms(10) + Duration::from_secs(50))
    );
    let kinds: Vec<_> = i.events().iter().map(|e| e.kind.clone()).collect();
    assert_eq!(
        kinds[1..],
        [
            InitiatorEventKind::TransientFin { peer: "vm2".into() },
            InitiatorEventKind::TransientFin { peer: "vm1".into() },
            InitiatorEventKind::TransientFin { peer: "vm3".into() },
            InitiatorEventKind::AllTransient,
        ]
    );
}

#[test]
fn early_full_fin_counts_as_transient_and_is_remembered() {
    let now = Instant::now();
    let mut i = init(2);
    i.start(now);
    // vm1's TRANSIENT_SNAP_FIN was lost; its FULL_SNAP_FIN arrives first.
    assert!(i
        .on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now)
        .is_empty());
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitTransient {
            missing: set(&["vm2"])
        }
    );
    let out = i.on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), now);
    assert_eq!(sends(&out), to_all(2, "ALL_TRANSIENT_SNAP_FIN"));
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitFull {
            missing: set(&["vm2"])
        }
    );
    let out = i.on_message(from("vm2", Msg::FullSnapFin { epoch: E }), now);
    assert_eq!(sends(&out), to_all(2, "ALL_FULL_SNAP_FIN"));
    assert_eq!(i.state(), &InitiatorState::Done);
}

#[test]
fn all_full_fins_early_go_straight_to_done() {
    let now = Instant::now();
    let mut i = init(2);
    i.start(now);
    i.on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now);
    let out = i.on_message(from("vm2", Msg::FullSnapFin { epoch: E }), now);
    let mut want = to_all(2, "ALL_TRANSIENT_SNAP_FIN");
    want.extend(to_all(2, "ALL_FULL_SNAP_FIN"));
    assert_eq!(sends(&out), want);
    assert_eq!(i.state(), &InitiatorState::Done);
    assert!(i.is_finished());
}

fn in_await_full(n: usize, now: Instant) -> Initiator {
    let mut i = init(n);
    i.start(now);
    for k in 1..=n {
        i.on_message(
            from(&format!("vm{k}"), Msg::TransientSnapFin { epoch: E }),
            now,
        );
    }
    assert!(matches!(i.state(), InitiatorState::AwaitFull { .. }));
    i
}

#[test]
fn await_full_answers_late_transient_fin_to_that_peer_only() {
    let now = Instant::now();
    let mut i = in_await_full(3, now);
    let out = i.on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), now);
    assert_eq!(
        sends(&out),
        vec![("vm2".to_string(), "ALL_TRANSIENT_SNAP_FIN")]
    );
    assert_eq!(
        i.events().last().unwrap().kind,
        InitiatorEventKind::Retransmit {
            to: "vm2".into(),
            msg: "ALL_TRANSIENT_SNAP_FIN"
        }
    );
}

#[test]
fn await_full_to_done_and_done_answers_duplicates() {
    let now = Instant::now();
    let mut i = in_await_full(2, now);
    assert!(i
        .on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now)
        .is_empty());
    assert!(
        i.on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now)
            .is_empty(),
        "duplicate"
    );
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitFull {
            missing: set(&["vm2"])
        }
    );
    let out = i.on_message(from("vm2", Msg::FullSnapFin { epoch: E }), now);
    assert_eq!(sends(&out), to_all(2, "ALL_FULL_SNAP_FIN"));
    assert_eq!(i.state(), &InitiatorState::Done);
    assert_eq!(i.next_wakeup(), None);
    let out = i.on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now);
    assert_eq!(sends(&out), vec![("vm1".to_string(), "ALL_FULL_SNAP_FIN")]);
    let out = i.on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), now);
    assert_eq!(
        sends(&out),
        vec![("vm2".to_string(), "ALL_TRANSIENT_SNAP_FIN")]
    );
    assert!(i.on_tick(now + Duration::from_secs(1000)).is_empty());
}

#[test]
fn failed_aborts_to_every_peer_naming_the_peer() {
    let now = Instant::now();
    for mut i in [init(3), in_await_full(3, now)] {
        i.start(now);
        let out = i.on_message(
            from(
                "vm2",
                Msg::Failed {
                    epoch: E,
                    error: "disk full".into(),
                },
            ),
            now,
        );
        assert_eq!(sends(&out), to_all(3, "ABORT"));
        let InitiatorState::Aborted { reason } = i.state() else {
            panic!("{:?}", i.state())
        };
        assert!(
            reason.contains("vm2") && reason.contains("disk full"),
            "{reason}"
        );
        assert!(matches!(&out[0].msg, Msg::Abort { reason: r, .. } if r == reason));
        assert!(i.is_finished());
    }
}

#[test]
fn aborted_answers_anything_with_abort() {
    let now = Instant::now();
    let mut i = init(2);
    i.start(now);
    i.abort("user asked".into(), now);
    for msg in [
        Msg::TransientSnapFin { epoch: E },
        Msg::FullSnapFin { epoch: E },
        Msg::Failed {
            epoch: E,
            error: "x".into(),
        },
    ] {
        let out = i.on_message(from("vm1", msg), now);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].to, "vm1");
        assert_eq!(
            out[0].msg,
            Msg::Abort {
                epoch: E,
                reason: "user asked".into()
            }
        );
    }
}

#[test]
fn snapshot_is_retransmitted_to_missing_peers_every_retry() {
    let now = Instant::now();
    let mut i = init(3);
    i.start(now);
    i.on_message(from("vm1", Msg::TransientSnapFin { epoch: E }), now);
    assert!(i.on_tick(now + ms(99)).is_empty(), "too early");
    let out = i.on_tick(now + ms(100));
    assert_eq!(
        sends(&out),
        vec![("vm2".into(), "SNAPSHOT"), ("vm3".into(), "SNAPSHOT")]
    );
    assert_eq!(i.next_wakeup(), Some(now + ms(200)));
    assert!(i.on_tick(now + ms(150)).is_empty());
    assert_eq!(i.on_tick(now + ms(200)).len(), 2);
    let retransmits = i
        .events()
        .iter()
        .filter(|e| {
            matches!(
                &e.kind,
                InitiatorEventKind::Retransmit {
                    msg: "SNAPSHOT",
                    ..
                }
            )
        })
        .count();
    assert_eq!(retransmits, 4);
}

#[test]
fn transient_deadline_aborts_naming_the_silent_peers() {
    let now = Instant::now();
    let mut i = init(3);
    i.start(now);
    i.on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), now);
    let before = i.on_tick(now + Duration::from_millis(4999));
    assert!(before.iter().all(|e| e.msg.name() == "SNAPSHOT"));
    let out = i.on_tick(now + Duration::from_secs(5));
    assert_eq!(sends(&out), to_all(3, "ABORT"));
    let InitiatorState::Aborted { reason } = i.state() else {
        panic!()
    };
    assert!(
        reason.contains("vm1, vm3") && !reason.contains("vm2"),
        "{reason}"
    );
}

#[test]
fn full_deadline_counts_from_all_transient() {
    let now = Instant::now();
    let mut i = init(2);
    i.start(now);
    i.on_message(from("vm1", Msg::TransientSnapFin { epoch: E }), now);
    let t1 = now + Duration::from_secs(4);
    i.on_message(from("vm2", Msg::TransientSnapFin { epoch: E }), t1);
    i.on_message(from("vm1", Msg::FullSnapFin { epoch: E }), t1);
    assert!(i.on_tick(t1 + Duration::from_secs(49)).is_empty());
    let out = i.on_tick(t1 + Duration::from_secs(50));
    assert_eq!(sends(&out), to_all(2, "ABORT"));
    let InitiatorState::Aborted { reason } = i.state() else {
        panic!()
    };
    assert!(reason.contains("FULL_SNAP_FIN from vm2"), "{reason}");
}

#[test]
fn abort_api_before_done_only() {
    let now = Instant::now();
    let mut i = init(2);
    let out = i.abort("cancelled".into(), now);
    assert_eq!(
        sends(&out),
        to_all(2, "ABORT"),
        "abort before start tells peers too"
    );
    assert!(i.abort("again".into(), now).is_empty());
    assert!(
        i.start(now).is_empty(),
        "an aborted initiator does not start"
    );

    let mut i = in_await_full(2, now);
    i.on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now);
    i.on_message(from("vm2", Msg::FullSnapFin { epoch: E }), now);
    assert!(i.abort("too late".into(), now).is_empty());
    assert_eq!(i.state(), &InitiatorState::Done);
}

#[test]
fn aborted_rebroadcasts_abort_while_lingering() {
    let now = Instant::now();
    let mut i = init(2);
    i.start(now);
    i.abort("x".into(), now);
    // linger = 10 × retry = 1 s
    assert_eq!(i.next_wakeup(), Some(now + ms(100)));
    assert_eq!(sends(&i.on_tick(now + ms(100))), to_all(2, "ABORT"));
    let mut t = now + ms(100);
    let mut rounds = 1;
    while let Some(w) = i.next_wakeup() {
        assert!(w > t);
        t = w;
        if !i.on_tick(t).is_empty() {
            rounds += 1;
        }
    }
    assert_eq!(rounds, 9, "re-broadcast every retry until linger ends");
}

#[test]
fn failure_after_done_is_logged_not_acted_on() {
    let now = Instant::now();
    let mut i = in_await_full(1, now);
    i.on_message(from("vm1", Msg::FullSnapFin { epoch: E }), now);
    let out = i.on_message(
        from(
            "vm1",
            Msg::Failed {
                epoch: E,
                error: "late".into(),
            },
        ),
        now,
    );
    assert!(out.is_empty());
    assert_eq!(i.state(), &InitiatorState::Done);
    assert_eq!(
        i.events().last().unwrap().kind,
        InitiatorEventKind::FailedAfterDone {
            peer: "vm1".into(),
            error: "late".into()
        }
    );
}

#[test]
fn stale_epoch_unknown_sender_and_nonsense_are_counted() {
    let now = Instant::now();
    let mut i = init(2);
    i.start(now);
    assert!(i
        .on_message(from("vm1", Msg::TransientSnapFin { epoch: E - 1 }), now)
        .is_empty());
    assert!(i
        .on_message(
            from(
                "vm1",
                Msg::Failed {
                    epoch: E + 1,
                    error: "old".into()
                }
            ),
            now
        )
        .is_empty());
    assert!(i
        .on_message(from("vm9", Msg::TransientSnapFin { epoch: E }), now)
        .is_empty());
    assert!(i
        .on_message(from("vm1", Msg::Snapshot { epoch: E }), now)
        .is_empty());
    assert!(i
        .on_message(from("vm1", Msg::AllFullSnapFin { epoch: E }), now)
        .is_empty());
    assert_eq!(
        i.ignored(),
        Ignored {
            stale_epoch: 2,
            unknown_sender: 1,
            unexpected: 2
        }
    );
    assert_eq!(
        i.state(),
        &InitiatorState::AwaitTransient {
            missing: set(&["vm1", "vm2"])
        }
    );
}

#[test]
fn no_peers_is_done_at_start() {
    let mut i = Initiator::new(E, "mgr".into(), vec![], t());
    assert!(i.start(Instant::now()).is_empty());
    assert_eq!(i.state(), &InitiatorState::Done);
}

#[test]
fn duplicate_peer_names_count_once() {
    let now = Instant::now();
    let mut i = Initiator::new(E, "mgr".into(), vec!["a".into(), "a".into()], t());
    assert_eq!(i.start(now).len(), 1);
    i.on_message(from("a", Msg::TransientSnapFin { epoch: E }), now);
    assert!(matches!(i.state(), InitiatorState::AwaitFull { .. }));
}
