//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`sample_lines`] is every message of both protocols as the wire carries
//! them (one JSON object per line); [`exercise_lines`] decodes lines from
//! another host and feeds them to the four state machines. The
//! `coord_messages` fuzz target (`crates/coord/fuzz`) and the unit tests in
//! `src/tests_fuzz.rs` run them.

use std::time::{Duration, Instant};

use crate::restore::{self, Cohort, CohortAction, Coordinator, Edge, Policy, Rdg};
use crate::snapshot::{self, Initiator, Peer, PeerAction};
use crate::transport::Envelope;
use crate::NodeId;

/// The epoch of the state machines [`exercise_lines`] drives.
pub const EPOCH: u64 = 7;

const VMS: [&str; 3] = ["a", "b", "c"];
const INITIATOR: &str = "manager";

/// Every message of both protocols at epoch [`EPOCH`], one JSON line each.
pub fn sample_lines() -> String {
    let e = EPOCH;
    let snap = [
        snapshot::Msg::Snapshot { epoch: e },
        snapshot::Msg::TransientSnapFin { epoch: e },
        snapshot::Msg::AllTransientSnapFin { epoch: e },
        snapshot::Msg::FullSnapFin { epoch: e },
        snapshot::Msg::AllFullSnapFin { epoch: e },
        snapshot::Msg::Failed {
            epoch: e,
            error: "disk full".into(),
        },
        snapshot::Msg::Abort {
            epoch: e,
            reason: "peer b failed".into(),
        },
    ];
    let rest = [
        restore::Msg::Load { epoch: e },
        restore::Msg::LoadFin { epoch: e },
        restore::Msg::Start { epoch: e },
        restore::Msg::StartFin {
            epoch: e,
            started_unix_us: 1_700_000_000_000_000,
        },
        restore::Msg::StartAck { epoch: e },
        restore::Msg::RestoreFin { epoch: e },
        restore::Msg::AllRestoreFin { epoch: e },
        restore::Msg::Failed {
            epoch: e,
            error: "no such snapshot".into(),
        },
        restore::Msg::Abort {
            epoch: e,
            reason: "timeout".into(),
        },
    ];
    let mut out: String = snap.iter().map(snapshot::Msg::to_json_line).collect();
    out.extend(rest.iter().map(restore::Msg::to_json_line));
    out
}

/// What [`exercise_lines`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exercised {
    /// Lines that decoded as a snapshot-protocol message.
    pub snapshot_msgs: usize,
    /// Lines that decoded as a restore-protocol message.
    pub restore_msgs: usize,
}

/// Decodes each line of `text` as a message of either protocol, as the
/// receiving host does (what the `coord_messages` fuzz target runs). A
/// message that decodes must encode back to one line that decodes to
/// itself; it is then delivered (from a sender picked by the line number:
/// a VM, the initiator or a stranger) to a snapshot initiator and peer and
/// a restore coordinator and cohort of epoch [`EPOCH`], whose local work
/// (snapshots, loads, starts) completes at once, with the clock advancing
/// and timers ticking between lines. Every envelope a state machine sends
/// must come from it. Panics on a violation, which is a bug; never on
/// input it rejects.
pub fn exercise_lines(text: &str) -> Exercised {
    let mut seen = Exercised::default();
    let mut now = Instant::now();
    let t_snap = snapshot::Timeouts::default();
    let t_rest = restore::Timeouts::default();
    let peers: Vec<NodeId> = VMS.iter().map(|s| s.to_string()).collect();
    let mut initiator = Initiator::new(EPOCH, INITIATOR.into(), peers.clone(), t_snap.clone());
    let mut peer = Peer::new(EPOCH, "a".into(), INITIATOR.into(), t_snap);
    // b sends to a; b and c form a ring.
    let edges = vec![
        Edge::new("b", "a", 1),
        Edge::new("b", "c", 1),
        Edge::new("c", "b", 1),
    ];
    let rdg = match Rdg::new(peers.clone(), edges) {
        Ok(r) => r,
        Err(e) => panic!("the sample graph is valid: {e}"),
    };
    let mut coordinator = match Coordinator::new(
        EPOCH,
        INITIATOR.into(),
        &rdg,
        Policy::RestoreLine,
        t_rest.clone(),
    ) {
        Ok(c) => c,
        Err(e) => panic!("the sample dependencies are valid: {e}"),
    };
    let mut cohort = Cohort::new(EPOCH, "a".into(), INITIATOR.into(), t_rest);
    check_from(INITIATOR, &initiator.start(now));
    check_from(INITIATOR, &coordinator.start(now));
    for (i, line) in text.split('\n').enumerate() {
        let from: NodeId = ["a", "b", "c", INITIATOR, "stranger"][i % 5].into();
        now += Duration::from_millis(1 << (i % 20));
        if let Ok(msg) = snapshot::Msg::from_json_line(line) {
            seen.snapshot_msgs += 1;
            let wire = msg.to_json_line();
            assert!(wire.ends_with('\n') && wire.matches('\n').count() == 1);
            match snapshot::Msg::from_json_line(&wire) {
                Ok(back) => assert_eq!(back, msg, "the JSON line round trip changed {wire}"),
                Err(e) => panic!("a re-encoded message does not decode: {e}"),
            }
            let env = |to: &str| Envelope {
                from: from.clone(),
                to: to.into(),
                msg: msg.clone(),
            };
            check_from(INITIATOR, &initiator.on_message(env(INITIATOR), now));
            let actions = peer.on_message(env("a"), now);
            run_peer(&mut peer, actions, now);
        }
        if let Ok(msg) = restore::Msg::from_json_line(line) {
            seen.restore_msgs += 1;
            let wire = msg.to_json_line();
            assert!(wire.ends_with('\n') && wire.matches('\n').count() == 1);
            match restore::Msg::from_json_line(&wire) {
                Ok(back) => assert_eq!(back, msg, "the JSON line round trip changed {wire}"),
                Err(e) => panic!("a re-encoded message does not decode: {e}"),
            }
            let env = |to: &str| Envelope {
                from: from.clone(),
                to: to.into(),
                msg: msg.clone(),
            };
            check_from(INITIATOR, &coordinator.on_message(env(INITIATOR), now));
            let actions = cohort.on_message(env("a"), now);
            run_cohort(&mut cohort, actions, now);
        }
        check_from(INITIATOR, &initiator.on_tick(now));
        check_from(INITIATOR, &coordinator.on_tick(now));
        let actions = peer.on_tick(now);
        run_peer(&mut peer, actions, now);
        let actions = cohort.on_tick(now);
        run_cohort(&mut cohort, actions, now);
        let _ = (initiator.state(), coordinator.state(), peer.state());
        let _ = (
            cohort.state(),
            initiator.next_wakeup(),
            coordinator.next_wakeup(),
        );
    }
    seen
}

fn check_from<M: std::fmt::Debug>(me: &str, out: &[Envelope<M>]) {
    for env in out {
        assert_eq!(env.from, me, "{env:?} is not from {me}");
    }
}

/// Runs the peer's actions, completing its local work at once.
fn run_peer(peer: &mut Peer, actions: Vec<PeerAction>, now: Instant) {
    let mut todo = actions;
    for _ in 0..8 {
        let mut next = Vec::new();
        for a in todo {
            match a {
                PeerAction::Send(env) => check_from("a", &[env]),
                PeerAction::StartSnapshot => {
                    next.extend(peer.on_transient_done(now));
                    next.extend(peer.on_full_done(now));
                }
                PeerAction::EndColoring | PeerAction::Complete | PeerAction::Abandon { .. } => {}
            }
        }
        if next.is_empty() {
            return;
        }
        todo = next;
    }
}

/// Runs the cohort's actions, completing its local work at once.
fn run_cohort(cohort: &mut Cohort, actions: Vec<CohortAction>, now: Instant) {
    let mut todo = actions;
    for _ in 0..8 {
        let mut next = Vec::new();
        for a in todo {
            match a {
                CohortAction::Send(env) => check_from("a", &[env]),
                CohortAction::Load => next.extend(cohort.on_loaded(now)),
                CohortAction::Start => {
                    next.extend(cohort.on_started(1_700_000_000_000_000, now));
                    next.extend(cohort.on_restored(now));
                }
                CohortAction::Abandon { .. } => {}
            }
        }
        if next.is_empty() {
            return;
        }
        todo = next;
    }
}
