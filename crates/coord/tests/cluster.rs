//! The drivers with threads on an InProcessNetwork: happy paths, lost
//! messages, failing and silent peers, triggers, stale epochs.

mod common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use vmcsnap_coord::snapshot::*;
use vmcsnap_coord::transport::{Envelope, InProcessNetwork};

fn happy(n: usize) {
    let mut s = Setup::new(n);
    s.seed = n as u64;
    s.max_ms = 10;
    let r = run(s);
    assert_eq!(r.initiator, InitiatorOutcome::Completed);
    assert!(
        r.peers.iter().all(|(_, o)| *o == PeerOutcome::Completed),
        "{:?}",
        r.peers
    );
    assert_eq!(r.peers.len(), n);
    check_consistent(&r);

    // Initiator events: Started, a TransientFin per peer, AllTransient, a
    // FullFin per peer, Done; every TransientFin before AllTransient.
    let k = r.kinds();
    let pos = |e: &InitiatorEventKind| {
        k.iter()
            .position(|x| x == e)
            .unwrap_or_else(|| panic!("{e:?} missing: {k:?}"))
    };
    assert_eq!(k[0], InitiatorEventKind::Started { peers: n });
    let all_t = pos(&InitiatorEventKind::AllTransient);
    let done = pos(&InitiatorEventKind::Done);
    for i in 1..=n {
        let tf = pos(&InitiatorEventKind::TransientFin { peer: name(i) });
        let ff = pos(&InitiatorEventKind::FullFin { peer: name(i) });
        assert!(tf < all_t && ff < done, "{k:?}");
    }
    assert!(all_t < done);

    // On the network: the first ALL_TRANSIENT_SNAP_FIN went out after every
    // peer's TRANSIENT_SNAP_FIN had arrived.
    let net: Vec<_> = r
        .log
        .iter()
        .filter_map(|(_, a)| match a {
            Act::Net {
                env,
                dropped: false,
            } => Some(env.clone()),
            _ => None,
        })
        .collect();
    let first_all = net
        .iter()
        .position(|e| e.msg.name() == "ALL_TRANSIENT_SNAP_FIN")
        .unwrap();
    for i in 1..=n {
        let fin = net
            .iter()
            .position(|e| e.from == name(i) && e.msg.name() == "TRANSIENT_SNAP_FIN")
            .unwrap();
        assert!(fin < first_all);
    }
    assert_eq!(r.stats.dropped, 0);
}

#[test]
fn happy_path_1_peer() {
    happy(1);
}

#[test]
fn happy_path_3_peers() {
    happy(3);
}

#[test]
fn happy_path_8_peers() {
    happy(8);
}

/// Drops the first message for which `pred` holds.
fn drop_first(pred: impl Fn(&Envelope<Msg>) -> bool + Send + 'static) -> Fault {
    let mut done = false;
    Box::new(move |e| {
        if !done && pred(e) {
            done = true;
            return true;
        }
        false
    })
}

fn retransmits(r: &Run, to: &str, msg: &str) -> usize {
    r.kinds()
        .iter()
        .filter(|k| matches!(k, InitiatorEventKind::Retransmit { to: t, msg: m } if t == to && *m == msg))
        .count()
}

fn lossy(fault: Fault, full_extra_ms: u64) -> Run {
    let mut s = Setup::new(3);
    s.fault = Some(fault);
    s.full_extra_ms = full_extra_ms;
    let r = run(s);
    assert_eq!(r.initiator, InitiatorOutcome::Completed);
    assert!(
        r.peers.iter().all(|(_, o)| *o == PeerOutcome::Completed),
        "{:?}",
        r.peers
    );
    check_consistent(&r);
    assert_eq!(r.stats.dropped, 1);
    r
}

#[test]
fn lost_snapshot_is_retransmitted() {
    let r = lossy(
        drop_first(|e| e.to == "vm2" && e.msg.name() == "SNAPSHOT"),
        0,
    );
    assert!(retransmits(&r, "vm2", "SNAPSHOT") >= 1);
}

#[test]
fn lost_transient_fin_is_retransmitted() {
    // The full snapshot takes long enough that only a TRANSIENT_SNAP_FIN
    // retransmission (not the early FULL_SNAP_FIN) can save the day.
    let r = lossy(drop_first(|e| e.msg.name() == "TRANSIENT_SNAP_FIN"), 100);
    let lost_by = r
        .log
        .iter()
        .find_map(|(n, a)| matches!(a, Act::Net { dropped: true, .. }).then(|| n.clone()))
        .unwrap();
    let sent = r
        .log
        .iter()
        .filter(|(n, a)| {
            *n == lost_by
                && matches!(a, Act::Net { env, .. } if env.msg.name() == "TRANSIENT_SNAP_FIN")
        })
        .count();
    assert!(sent >= 2, "{lost_by} sent its FIN {sent} times");
}

#[test]
fn lost_all_transient_is_resent_on_demand() {
    let r = lossy(
        drop_first(|e| e.to == "vm1" && e.msg.name() == "ALL_TRANSIENT_SNAP_FIN"),
        100,
    );
    assert!(retransmits(&r, "vm1", "ALL_TRANSIENT_SNAP_FIN") >= 1);
    assert!(r.acts("vm1").contains(&Act::EndColoring));
}

#[test]
fn lost_all_full_is_resent_on_demand() {
    let r = lossy(
        drop_first(|e| e.to == "vm3" && e.msg.name() == "ALL_FULL_SNAP_FIN"),
        0,
    );
    assert!(retransmits(&r, "vm3", "ALL_FULL_SNAP_FIN") >= 1);
}

#[test]
fn random_loss_completes_or_aborts_cleanly() {
    let mut completed = 0;
    // A few clusters at a time: they mostly sleep.
    for batch in 0..4u64 {
        let handles: Vec<_> = (0..4u64)
            .map(|k| {
                let seed = 1 + batch * 4 + k;
                thread::spawn(move || {
                    let mut s = Setup::new(4);
                    s.seed = seed;
                    s.t.retry = Duration::from_millis(10);
                    s.t.transient_deadline = Duration::from_secs(1);
                    s.t.full_deadline = Duration::from_secs(1);
                    let mut rng = XorShift::new(seed * 7919);
                    s.fault = Some(Box::new(move |_| rng.chance(30)));
                    (seed, run(s))
                })
            })
            .collect();
        for h in handles {
            let (seed, r) = h.join().unwrap();
            check_consistent(&r);
            assert!(r.stats.dropped > 0, "seed {seed}: loss was injected");
            if r.initiator == InitiatorOutcome::Completed {
                completed += 1;
                assert!(
                    r.peers.iter().all(|(_, o)| *o == PeerOutcome::Completed),
                    "seed {seed}: initiator completed but {:?}",
                    r.peers
                );
            }
        }
    }
    assert!(
        completed >= 14,
        "30% loss with 1 s deadlines should rarely abort: {completed}/16"
    );
}

#[test]
fn failing_peer_aborts_everyone() {
    let mut s = Setup::new(3);
    s.plans = vec![(2, Plan::FailAfterTransient("disk full".into()))];
    s.full_extra_ms = 30;
    let r = run(s);
    let InitiatorOutcome::Aborted { reason } = &r.initiator else {
        panic!("{:?}", r.initiator)
    };
    assert!(
        reason.contains("vm2") && reason.contains("disk full"),
        "{reason}"
    );
    for (p, o) in &r.peers {
        assert!(matches!(o, PeerOutcome::Abandoned { .. }), "{p}: {o:?}");
    }
    check_consistent(&r);
    // Nobody completed (coloring may have ended before vm2 failed).
    assert!(r.log.iter().all(|(_, a)| *a != Act::Complete));
}

#[test]
fn silent_peer_aborts_after_transient_deadline() {
    let mut s = Setup::new(3);
    s.silent = vec![3];
    s.t.transient_deadline = Duration::from_millis(300);
    let begin = Instant::now();
    let r = run(s);
    let InitiatorOutcome::Aborted { reason } = &r.initiator else {
        panic!("{:?}", r.initiator)
    };
    assert!(
        reason.contains("vm3") && !reason.contains("vm1"),
        "{reason}"
    );
    let aborted_at = r
        .events
        .iter()
        .find(|e| matches!(e.kind, InitiatorEventKind::Aborted { .. }))
        .unwrap()
        .at;
    assert!(aborted_at - begin >= Duration::from_millis(300));
    assert_eq!(r.peers.len(), 2);
    for (p, o) in &r.peers {
        let PeerOutcome::Abandoned { reason } = o else {
            panic!("{p}: {o:?}")
        };
        assert!(reason.contains("vm3"), "{p}: {reason}");
    }
    assert!(r.rescued.is_empty());
    assert!(retransmits(&r, "vm3", "SNAPSHOT") >= 5);
    check_consistent(&r);
}

#[test]
fn trigger_before_snapshot_starts_once() {
    let mut s = Setup::new(3);
    s.triggers = vec![2];
    let r = run(s);
    assert_eq!(r.initiator, InitiatorOutcome::Completed);
    check_consistent(&r);
    let starts = r.acts("vm2").iter().filter(|a| **a == Act::Start).count();
    assert_eq!(starts, 1);
}

#[test]
fn stale_epoch_messages_are_ignored_by_the_drivers() {
    let net = InProcessNetwork::<Msg>::new();
    let (itx, irx) = mpsc::channel();
    let mgr = net.join(MGR, move |e| {
        let _ = itx.send(e);
    });
    let (ptx, prx) = mpsc::channel();
    let ptx2 = ptx.clone();
    let vm1 = net.join("vm1", move |e| {
        let _ = ptx2.send(PeerInput::Message(e));
    });
    let t = Timeouts {
        retry: Duration::from_millis(10),
        ..Timeouts::default()
    };

    // A peer of epoch 5 gets ABORT and SNAPSHOT of epoch 4 first, then is
    // cancelled locally: it must not have started nor abandoned on epoch 4.
    struct W(Vec<&'static str>);
    impl PeerWorker for W {
        fn start_snapshot(&mut self) {
            self.0.push("start");
        }
        fn end_coloring(&mut self) {}
        fn complete(&mut self) {}
        fn abandon(&mut self, _: &str) {
            self.0.push("abandon");
        }
    }
    let old = |m| {
        PeerInput::Message(Envelope {
            from: MGR.into(),
            to: "vm1".into(),
            msg: m,
        })
    };
    ptx.send(old(Msg::Abort {
        epoch: 4,
        reason: "old".into(),
    }))
    .unwrap();
    ptx.send(old(Msg::Snapshot { epoch: 4 })).unwrap();
    ptx.send(PeerInput::Failed("cancelled".into())).unwrap();
    let mut w = W(vec![]);
    // The FAILED it sends reaches nobody who answers: it gives up after
    // transient_deadline; use a short one.
    let peer_t = Timeouts {
        transient_deadline: Duration::from_millis(50),
        ..t.clone()
    };
    let peer = Peer::new(5, "vm1".into(), MGR.into(), peer_t);
    let o = run_peer(peer, &vm1, &prx, &mut w);
    assert_eq!(
        o,
        PeerOutcome::Abandoned {
            reason: "cancelled".into()
        }
    );
    assert_eq!(w.0, ["abandon"]);

    // The initiator of epoch 9 ignores the FAILED of epoch 5 sitting in its
    // inbox, and completes with a peer that answers in epoch 9.
    let mut init = Initiator::new(9, MGR.into(), vec!["vm1".into()], t);
    let h = thread::spawn(move || {
        let o = run_initiator(&mut init, &mgr, &irx, &mut |_| {});
        (o, init.ignored())
    });
    let mut answered = 0;
    while answered < 2 {
        let PeerInput::Message(e) = prx.recv_timeout(Duration::from_secs(5)).unwrap() else {
            continue;
        };
        let reply = match e.msg {
            Msg::Snapshot { epoch: 9 } => Msg::TransientSnapFin { epoch: 9 },
            Msg::AllTransientSnapFin { epoch: 9 } => Msg::FullSnapFin { epoch: 9 },
            _ => continue,
        };
        // A stale copy first, then the real one.
        use vmcsnap_coord::transport::Transport;
        vm1.send(&MGR.into(), Msg::TransientSnapFin { epoch: 8 })
            .unwrap();
        vm1.send(&MGR.into(), reply).unwrap();
        answered += 1;
    }
    let (o, ignored) = h.join().unwrap();
    assert_eq!(o, InitiatorOutcome::Completed);
    assert!(ignored.stale_epoch >= 3, "{ignored:?}");
}
