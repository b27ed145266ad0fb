//! Blocking drivers: run a state machine against a transport, an inbox
//! channel and (for a peer) a worker.

use std::sync::mpsc::Receiver;
use std::time::Instant;

use super::initiator::{Initiator, InitiatorEvent, InitiatorState};
use super::msg::Msg;
use super::peer::{Peer, PeerAction, PeerState};
use crate::inbox::{next, Next};
use crate::transport::{send_all, Envelope, Transport};

/// An input of [`run_peer`]: what arrives in a peer's inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerInput {
    /// A message from the network.
    Message(Envelope<Msg>),
    /// A red (post-snapshot) packet arrived before `SNAPSHOT`.
    Trigger,
    /// The worker's transient snapshot is done.
    TransientDone,
    /// The worker's full snapshot is done.
    FullDone,
    /// The worker's snapshot failed (or the owner cancels it).
    Failed(String),
}

/// Does the real work of a peer for [`run_peer`]. Every method must return
/// quickly: long work goes to other threads, which report back by sending
/// [`PeerInput::TransientDone`], [`PeerInput::FullDone`] or
/// [`PeerInput::Failed`] into the peer's inbox.
pub trait PeerWorker {
    /// Take the transient snapshot, then the full one in the background;
    /// report `TransientDone`, then `FullDone` (or `Failed`).
    fn start_snapshot(&mut self);
    /// Every VM of the cluster is past its transient snapshot: stop coloring.
    fn end_coloring(&mut self);
    /// The cluster snapshot is complete: commit the image.
    fn complete(&mut self);
    /// The cluster snapshot is abandoned: cancel and discard this VM's
    /// snapshot (whatever stage it is in); the VM keeps running.
    fn abandon(&mut self, reason: &str);
}

/// How [`run_peer`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerOutcome {
    /// The cluster snapshot is complete and [`PeerWorker::complete`] was called.
    Completed,
    /// The snapshot was abandoned and [`PeerWorker::abandon`] was called.
    Abandoned {
        /// Why.
        reason: String,
    },
}

/// How [`run_initiator`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitiatorOutcome {
    /// Every peer finished its full snapshot; `ALL_FULL_SNAP_FIN` was sent.
    Completed,
    /// The cluster snapshot was aborted; `ABORT` was sent.
    Aborted {
        /// Why (names the peer at fault, if any).
        reason: String,
    },
}

/// Runs `peer` until it is finished: feeds it the inbox and timer ticks,
/// sends its messages through `transport` and calls `worker` for the other
/// actions. A peer that never hears `SNAPSHOT` (nor a trigger) waits
/// forever; send it [`PeerInput::Failed`] to cancel. If the inbox is closed
/// (every sender dropped) before the end, the peer fails with that reason.
pub fn run_peer(
    mut peer: Peer,
    transport: &dyn Transport<Msg>,
    inbox: &Receiver<PeerInput>,
    worker: &mut dyn PeerWorker,
) -> PeerOutcome {
    let mut outcome = None;
    let mut execute = |actions: Vec<PeerAction>, outcome: &mut Option<PeerOutcome>| {
        for a in actions {
            match a {
                PeerAction::Send(env) => send_all(transport, vec![env]),
                PeerAction::StartSnapshot => worker.start_snapshot(),
                PeerAction::EndColoring => worker.end_coloring(),
                PeerAction::Complete => {
                    worker.complete();
                    *outcome = Some(PeerOutcome::Completed);
                }
                PeerAction::Abandon { reason } => {
                    worker.abandon(&reason);
                    *outcome = Some(PeerOutcome::Abandoned { reason });
                }
            }
        }
    };
    loop {
        if peer.is_finished() {
            // `outcome` is None only for a peer that was finished when passed in.
            return outcome.unwrap_or_else(|| match peer.state() {
                PeerState::Done => PeerOutcome::Completed,
                _ => PeerOutcome::Abandoned {
                    reason: "the peer was already abandoned".into(),
                },
            });
        }
        let input = next(inbox, peer.next_wakeup());
        let now = Instant::now();
        let actions = match input {
            Next::Tick => peer.on_tick(now),
            Next::Item(PeerInput::Message(env)) => peer.on_message(env, now),
            Next::Item(PeerInput::Trigger) => peer.on_trigger(now),
            Next::Item(PeerInput::TransientDone) => peer.on_transient_done(now),
            Next::Item(PeerInput::FullDone) => peer.on_full_done(now),
            Next::Item(PeerInput::Failed(e)) => peer.on_failed(e, now),
            Next::Closed => {
                let actions = peer.on_failed(format!("peer {}: inbox closed", peer.me()), now);
                execute(actions, &mut outcome);
                return outcome.unwrap_or_else(|| PeerOutcome::Abandoned {
                    reason: format!("peer {}: inbox closed", peer.me()),
                });
            }
        };
        execute(actions, &mut outcome);
    }
}

/// Runs `init` (starting it if it is not started yet) until it is finished
/// and then for [`Timeouts::linger`](super::Timeouts::linger) after the last
/// message received, answering retransmitted FINs so that peers that lost
/// an `ALL_*` or `ABORT` get it again. `on_event` sees every event as it
/// happens (`Done`/`Aborted` before the linger). If the inbox is closed
/// before the end, the snapshot is aborted.
pub fn run_initiator(
    init: &mut Initiator,
    transport: &dyn Transport<Msg>,
    inbox: &Receiver<Envelope<Msg>>,
    on_event: &mut dyn FnMut(&InitiatorEvent),
) -> InitiatorOutcome {
    let mut reported = 0;
    let mut report = |init: &Initiator| {
        for ev in &init.events()[reported..] {
            on_event(ev);
        }
        reported = init.events().len();
    };
    let linger = init.timeouts().linger();
    send_all(transport, init.start(Instant::now()));
    report(init);
    // While finished: the instant lingering ends (moved on by every message).
    let mut linger_end: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if init.is_finished() {
            let end = *linger_end.get_or_insert(now + linger);
            if now >= end {
                break;
            }
        }
        let wake = match (init.next_wakeup(), linger_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let out = match next(inbox, wake) {
            Next::Item(env) => {
                let now = Instant::now();
                if linger_end.is_some() {
                    linger_end = Some(now + linger);
                }
                init.on_message(env, now)
            }
            Next::Tick => init.on_tick(Instant::now()),
            Next::Closed => {
                let reason = format!("initiator {}: inbox closed", init.me());
                send_all(transport, init.abort(reason, Instant::now()));
                report(init);
                break;
            }
        };
        send_all(transport, out);
        report(init);
    }
    match init.state() {
        InitiatorState::Done => InitiatorOutcome::Completed,
        InitiatorState::Aborted { reason } => InitiatorOutcome::Aborted {
            reason: reason.clone(),
        },
        s => unreachable!("initiator finished in state {s:?}"),
    }
}
