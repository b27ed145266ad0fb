//! The restore drivers with threads on an InProcessNetwork: the restore
//! line on a chain, a ring and an orphan, the independent baseline, lost
//! messages, a failing and a silent cohort, stopping the linger.

mod restore_common;

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use restore_common::*;
use vmcsnap_coord::restore::*;
use vmcsnap_coord::transport::{Envelope, InProcessNetwork};

fn completed(r: &Run) {
    assert_eq!(
        r.coordinator,
        CoordinatorOutcome::Completed,
        "{:?}",
        r.kinds()
    );
    for (vm, o) in &r.cohorts {
        assert_eq!(*o, CohortOutcome::Completed, "{vm}");
    }
    check_consistent(r, true);
}

/// a sends to b, b sends to c.
fn chain() -> Links {
    vec![("a", "b"), ("b", "c")]
}

#[test]
fn restore_line_starts_a_chain_from_its_end() {
    // a loads first, c last: the Checker still starts c, then b, then a.
    let s = Setup::new(&["a", "b", "c"], chain(), Policy::RestoreLine)
        .plan("a", 1, 5)
        .plan("b", 50, 5)
        .plan("c", 100, 5);
    let r = run(s);
    completed(&r);
    assert_eq!(r.order(), ["c", "b", "a"]);
    assert!(r.load_fin("a").unwrap() < r.load_fin("c").unwrap());
    assert!(r.start_fin("c").unwrap() < r.start_sent("b").unwrap());
    assert!(r.start_fin("b").unwrap() < r.start_sent("a").unwrap());
    assert_eq!(r.stats.dropped, 0);
}

#[test]
fn independent_policy_starts_each_vm_when_loaded() {
    // Same cluster and times without the restore line: every START goes
    // out with its VM's LOAD_FIN (checked in check_consistent), so a starts
    // before the VMs it sends to run.
    let s = Setup::new(&["a", "b", "c"], chain(), Policy::Independent)
        .plan("a", 1, 5)
        .plan("b", 50, 5)
        .plan("c", 100, 5);
    let r = run(s);
    completed(&r);
    assert!(r.start_sent("a").unwrap() < r.start_fin("b").unwrap());
    assert!(r.start_sent("b").unwrap() < r.start_fin("c").unwrap());
    assert_eq!(r.order(), ["a", "b", "c"]);
    // Random times over a few seeds: START always goes with the LOAD_FIN
    // (checked in check_consistent), whatever the dependencies say.
    for seed in 1..=3 {
        let mut s = Setup::new(&["a", "b", "c", "d"], chain(), Policy::Independent);
        s.seed = seed;
        s.max_ms = 30;
        completed(&run(s));
    }
}

#[test]
fn ring_starts_together_after_both_loaded_and_before_its_dependent() {
    let deps = vec![("x", "y"), ("y", "x"), ("z", "x")];
    let s = Setup::new(&["x", "y", "z"], deps, Policy::RestoreLine)
        .plan("z", 1, 5)
        .plan("x", 40, 5)
        .plan("y", 80, 5);
    let r = run(s);
    completed(&r);
    let together = r
        .pos(|k| matches!(k, CoordinatorEventKind::StartSent { cohorts } if *cohorts == ["x", "y"]))
        .expect("one START decision for the ring");
    assert!(r.load_fin("y").unwrap() < together);
    assert!(r.load_fin("z").unwrap() < r.load_fin("x").unwrap());
    assert!(r.start_fin("x").unwrap() < r.start_sent("z").unwrap());
    assert!(together < r.start_sent("z").unwrap());
    // z starts after x, the VM it depends on. (Not necessarily after y:
    // y's START goes out with x's, but its cohort thread may report its
    // start after z's on a loaded machine; CI saw exactly that.)
    let order = r.order();
    let at = |vm| order.iter().position(|&v| v == vm).unwrap();
    assert!(at("x") < at("z"), "{order:?}");
}

#[test]
fn orphan_starts_as_soon_as_it_is_loaded() {
    let s = Setup::new(&["a", "b", "c", "o"], chain(), Policy::RestoreLine)
        .plan("a", 1, 5)
        .plan("b", 5, 5)
        .plan("o", 10, 5)
        .plan("c", 100, 5);
    let r = run(s);
    completed(&r);
    let (l, st) = (r.load_fin("o").unwrap(), r.start_sent("o").unwrap());
    assert_eq!(r.events[l].at, r.events[st].at, "START with its LOAD_FIN");
    assert!(
        st < r.load_fin("c").unwrap(),
        "o does not wait for the chain"
    );
    assert_eq!(r.order(), ["o", "c", "b", "a"]);
}

/// A cluster with every shape: a chain, a ring with an external dependency
/// and a dependent, an orphan.
fn mixed() -> (Vec<&'static str>, Links) {
    let deps = vec![
        ("a", "b"),
        ("b", "c"),
        ("x", "y"),
        ("y", "x"),
        ("y", "c"),
        ("z", "x"),
    ];
    (vec!["a", "b", "c", "x", "y", "z", "o"], deps)
}

#[test]
fn random_loss_completes_or_aborts_cleanly() {
    let mut completed_runs = 0;
    let (vms, deps) = mixed();
    // A few clusters at a time: they mostly sleep.
    for batch in 0..4u64 {
        let handles: Vec<_> = (0..4u64)
            .map(|k| {
                let seed = 1 + batch * 4 + k;
                let (vms, deps) = (vms.clone(), deps.clone());
                thread::spawn(move || {
                    let policy = if seed % 4 == 0 {
                        Policy::Independent
                    } else {
                        Policy::RestoreLine
                    };
                    let mut s = Setup::new(&vms, deps, policy);
                    s.seed = seed;
                    s.max_ms = 20;
                    s.t.retry = Duration::from_millis(10);
                    s.t.load_deadline = Duration::from_secs(1);
                    s.t.start_deadline = Duration::from_secs(1);
                    s.t.restore_deadline = Duration::from_secs(1);
                    let mut rng = XorShift::new(seed * 7919);
                    s.fault = Some(Box::new(move |_| rng.chance(30)));
                    (seed, run(s))
                })
            })
            .collect();
        for h in handles {
            let (seed, r) = h.join().unwrap();
            check_consistent(&r, true);
            assert!(r.stats.dropped > 0, "seed {seed}: loss was injected");
            if r.coordinator == CoordinatorOutcome::Completed {
                completed_runs += 1;
            }
        }
    }
    assert!(
        completed_runs >= 14,
        "30% loss with 1 s deadlines should rarely abort: {completed_runs}/16"
    );
}

#[test]
fn cohort_failing_mid_load_aborts_everyone() {
    let (vms, deps) = mixed();
    let mut s = Setup::new(&vms, deps, Policy::RestoreLine)
        .plan("o", 1, 200)
        .plan("c", 5, 200);
    let fail = Plan {
        load_ms: 120,
        rest_ms: 0,
        fail: Some("snapshot file truncated".into()),
    };
    s.plans.insert("b".into(), fail);
    let r = run(s);
    let CoordinatorOutcome::Aborted { reason } = &r.coordinator else {
        panic!("{:?}", r.coordinator)
    };
    assert!(
        reason.contains("cohort b failed") && reason.contains("snapshot file truncated"),
        "{reason}"
    );
    for (vm, o) in &r.cohorts {
        assert!(matches!(o, CohortOutcome::Abandoned { .. }), "{vm}: {o:?}");
        let acts = r.acts(vm);
        assert!(
            acts.iter().any(|a| matches!(a, Act::Abandon(_))),
            "{vm}: {acts:?}"
        );
    }
    // The orphan and c were already running: their VMs are stopped.
    assert!(r.acts("o").contains(&Act::Start));
    assert!(!r.acts("a").contains(&Act::Start), "a waits for b");
    assert!(r.rescued.is_empty());
    check_consistent(&r, true);
}

#[test]
fn silent_cohort_aborts_at_the_load_deadline() {
    let mut s = Setup::new(&["a", "b", "c"], chain(), Policy::RestoreLine);
    s.silent = vec!["c".into()];
    s.t.load_deadline = Duration::from_millis(300);
    let r = run(s);
    let CoordinatorOutcome::Aborted { reason } = &r.coordinator else {
        panic!("{:?}", r.coordinator)
    };
    assert!(
        reason.contains("LOAD_FIN from c") && !reason.contains("a,"),
        "{reason}"
    );
    assert_eq!(r.cohorts.len(), 2);
    let resent = r
        .kinds()
        .iter()
        .filter(|k| matches!(k, CoordinatorEventKind::Retransmit { to, msg: "LOAD" } if to == "c"))
        .count();
    assert!(resent >= 5, "{resent}");
    assert!(
        r.log.iter().all(|(_, a)| *a != Act::Start),
        "nobody may start"
    );
    check_consistent(&r, true);
}

#[test]
fn closing_the_inbox_ends_the_linger() {
    let net = InProcessNetwork::<Msg>::new();
    let (itx, irx) = mpsc::channel();
    let mgr = net.join(MGR, move |e| {
        let _ = itx.send(e);
    });
    // A cohort answered by hand, so that only the network holds a sender.
    let (vtx, vrx) = mpsc::channel::<Envelope<Msg>>();
    let vm = net.join("vm1", move |e| {
        let _ = vtx.send(e);
    });
    // A long linger: 10 x 500 ms.
    let t = Timeouts {
        retry: Duration::from_millis(500),
        ..Timeouts::default()
    };
    let mut coord =
        Coordinator::new(1, MGR.into(), &rdg(&["vm1"], &[]), Policy::RestoreLine, t).unwrap();
    let (dtx, drx) = mpsc::channel();
    let h = thread::spawn(move || {
        let o = run_coordinator(&mut coord, &mgr, &irx, &mut |e| {
            if e.kind == CoordinatorEventKind::Done {
                let _ = dtx.send(());
            }
        });
        (o, Instant::now())
    });
    use vmcsnap_coord::transport::Transport;
    let to = MGR.to_string();
    let mut acked = false;
    while !acked {
        let e = vrx.recv_timeout(Duration::from_secs(5)).unwrap();
        match e.msg {
            Msg::Load { .. } => vm.send(&to, Msg::LoadFin { epoch: 1 }).unwrap(),
            Msg::Start { .. } => {
                let fin = Msg::StartFin {
                    epoch: 1,
                    started_unix_us: 1,
                };
                vm.send(&to, fin).unwrap();
                vm.send(&to, Msg::RestoreFin { epoch: 1 }).unwrap();
            }
            Msg::AllRestoreFin { .. } => acked = true,
            _ => {}
        }
    }
    drx.recv_timeout(Duration::from_secs(5)).unwrap();
    let closed_at = Instant::now();
    net.leave(MGR); // drops the delivery callback, the inbox's last sender
    let (o, ended) = h.join().unwrap();
    assert_eq!(o, CoordinatorOutcome::Completed);
    assert!(
        ended - closed_at < Duration::from_secs(1),
        "linger not cut short: {:?}",
        ended - closed_at
    );
}
