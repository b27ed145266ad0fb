//! The peer's state machine (sans-IO).

use std::time::Instant;

use super::msg::{Ignored, Msg, Timeouts};
use crate::fin_timers::{Due, FinTimers};
use crate::transport::Envelope;
use crate::NodeId;

/// What the peer's owner must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAction {
    /// Send this envelope.
    Send(Envelope<Msg>),
    /// Take the transient snapshot now (hold the port, pause, cut, save
    /// device state, write-protect memory, resume), then start coloring
    /// outgoing packets "post" and report `on_transient_done`.
    StartSnapshot,
    /// Every transient snapshot of the cluster is done: stop coloring.
    EndColoring,
    /// The cluster snapshot is complete: commit this VM's image.
    Complete,
    /// The cluster snapshot is abandoned: discard this VM's snapshot; the VM
    /// keeps running.
    Abandon {
        /// Why.
        reason: String,
    },
}

/// Where the peer is. See `docs/cluster-protocol.md` for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerState {
    /// No `SNAPSHOT` and no trigger yet.
    Idle,
    /// Transient snapshot running.
    Transient,
    /// Transient snapshot done, coloring packets, waiting for
    /// `ALL_TRANSIENT_SNAP_FIN` (the full snapshot may already be done, see
    /// [`Peer::full_done`]).
    Post,
    /// Coloring ended, full snapshot running.
    Full,
    /// Full snapshot done, waiting for `ALL_FULL_SNAP_FIN`.
    FullDone,
    /// Complete (final).
    Done,
    /// Abandoned (final).
    Abandoned,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Done,
    Abandoned,
}

/// A peer (one VM) of one cluster snapshot (one epoch), as a state machine
/// without I/O: every input returns the [`PeerAction`]s to carry out, in
/// order.
///
/// Rules (all handlers are idempotent):
/// - `SNAPSHOT` or [`on_trigger`](Self::on_trigger) (a red packet arrived
///   first) start the snapshot; `StartSnapshot` is emitted once.
/// - A FIN is retransmitted every `retry` until its `ALL_*` (or `ABORT`)
///   arrives; a duplicate `SNAPSHOT` after `TRANSIENT_SNAP_FIN` resends it.
/// - `EndColoring` is emitted once, on `ALL_TRANSIENT_SNAP_FIN` or on an
///   `ALL_FULL_SNAP_FIN` that arrives first (it implies both). `Complete` is
///   emitted once, on `ALL_FULL_SNAP_FIN` after the own full snapshot is
///   done; an `ALL_*` the peer cannot have earned (before its own FIN) is
///   ignored.
/// - `ABORT` in any non-final state abandons; after `Complete` it is ignored
///   (the cluster snapshot is already complete and committed).
/// - [`on_failed`](Self::on_failed) sends `FAILED` and abandons; `FAILED` is
///   then retransmitted every `retry` until `ABORT` arrives, for at most
///   `transient_deadline`; [`is_finished`](Self::is_finished) is `false`
///   until then.
/// - Deadline: a peer with an unanswered FIN that hears nothing from the
///   initiator for [`Timeouts::peer_give_up`] (`transient_deadline +
///   full_deadline + linger`) sends `FAILED` once and abandons. A peer that
///   never hears `SNAPSHOT` stays `Idle` (no deadline).
/// - Messages of another epoch or from another node than the initiator are
///   ignored and counted.
#[derive(Debug)]
pub struct Peer {
    epoch: u64,
    me: NodeId,
    initiator: NodeId,
    t: Timeouts,
    started: bool,
    transient_done: bool,
    all_transient: bool,
    full_done: bool,
    end: Option<End>,
    failure: String,
    /// Retry, silence and (after `FAILED`) linger.
    timers: FinTimers,
    ignored: Ignored,
}

impl Peer {
    /// Peer `me` of snapshot `epoch` coordinated by `initiator`.
    pub fn new(epoch: u64, me: NodeId, initiator: NodeId, t: Timeouts) -> Self {
        Peer {
            epoch,
            me,
            initiator,
            t,
            started: false,
            transient_done: false,
            all_transient: false,
            full_done: false,
            end: None,
            failure: String::new(),
            timers: FinTimers::default(),
            ignored: Ignored::default(),
        }
    }

    /// Handles a message from the initiator.
    pub fn on_message(&mut self, env: Envelope<Msg>, now: Instant) -> Vec<PeerAction> {
        let mut out = Vec::new();
        if env.msg.epoch() != self.epoch {
            self.ignored.stale_epoch += 1;
            log::debug!("peer {}: ignoring {:?} of another epoch", self.me, env.msg);
            return out;
        }
        if env.from != self.initiator {
            self.ignored.unknown_sender += 1;
            log::debug!(
                "peer {}: ignoring {} from {} (not the initiator)",
                self.me,
                env.msg.name(),
                env.from
            );
            return out;
        }
        if let Some(end) = self.end {
            if end == End::Abandoned && self.timers.lingering() {
                if matches!(env.msg, Msg::Abort { .. }) {
                    self.timers.stop_lingering();
                } else {
                    // The initiator has not heard of the failure yet.
                    let error = self.failure.clone();
                    out.push(self.send(Msg::Failed {
                        epoch: self.epoch,
                        error,
                    }));
                }
            } else {
                self.ignored.unexpected += 1;
            }
            return out;
        }
        self.timers.heard(now, self.t.peer_give_up());
        match env.msg {
            Msg::Snapshot { .. } => {
                if !self.started {
                    self.start(&mut out);
                } else if self.transient_done && !self.all_transient {
                    out.push(self.send(Msg::TransientSnapFin { epoch: self.epoch }));
                }
            }
            Msg::AllTransientSnapFin { .. } if self.transient_done => {
                if !self.all_transient {
                    self.end_coloring(&mut out);
                }
            }
            Msg::AllFullSnapFin { .. } if self.full_done => {
                if !self.all_transient {
                    self.end_coloring(&mut out);
                }
                out.push(PeerAction::Complete);
                self.end = Some(End::Done);
                self.timers.disarm();
            }
            Msg::Abort { reason, .. } => {
                out.push(PeerAction::Abandon {
                    reason: format!("initiator {} aborted: {reason}", self.initiator),
                });
                self.end = Some(End::Abandoned);
                self.timers.disarm();
            }
            msg => {
                self.ignored.unexpected += 1;
                log::debug!(
                    "peer {}: ignoring unexpected {} in state {:?}",
                    self.me,
                    msg.name(),
                    self.state()
                );
            }
        }
        out
    }

    /// A red (post-snapshot) packet arrived before `SNAPSHOT`: start the
    /// snapshot (once).
    pub fn on_trigger(&mut self, _now: Instant) -> Vec<PeerAction> {
        let mut out = Vec::new();
        if self.end.is_none() && !self.started {
            self.start(&mut out);
        }
        out
    }

    /// The transient snapshot is done: sends `TRANSIENT_SNAP_FIN`. Ignored
    /// unless the snapshot was started and this is the first report.
    pub fn on_transient_done(&mut self, now: Instant) -> Vec<PeerAction> {
        let mut out = Vec::new();
        if self.end.is_some() || !self.started || self.transient_done {
            log::debug!(
                "peer {}: transient-done report ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        self.transient_done = true;
        out.push(self.send(Msg::TransientSnapFin { epoch: self.epoch }));
        self.arm(now);
        out
    }

    /// The full snapshot is done: sends `FULL_SNAP_FIN` (also before
    /// `ALL_TRANSIENT_SNAP_FIN`; the initiator remembers it). Ignored unless
    /// the transient snapshot is done and this is the first report.
    pub fn on_full_done(&mut self, now: Instant) -> Vec<PeerAction> {
        let mut out = Vec::new();
        if self.end.is_some() || !self.transient_done || self.full_done {
            log::debug!(
                "peer {}: full-done report ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        self.full_done = true;
        out.push(self.send(Msg::FullSnapFin { epoch: self.epoch }));
        self.arm(now);
        out
    }

    /// The local snapshot failed (or the owner cancels it): sends `FAILED`
    /// and abandons. Ignored in a final state.
    pub fn on_failed(&mut self, error: String, now: Instant) -> Vec<PeerAction> {
        let mut out = Vec::new();
        if self.end.is_some() {
            log::debug!(
                "peer {}: failure report ({error}) ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        out.push(self.send(Msg::Failed {
            epoch: self.epoch,
            error: error.clone(),
        }));
        out.push(PeerAction::Abandon {
            reason: error.clone(),
        });
        self.end = Some(End::Abandoned);
        self.failure = error;
        self.timers
            .linger(now, self.t.retry, self.t.transient_deadline);
        out
    }

    /// Handles the passing of time: retransmits unanswered FINs (or
    /// `FAILED`), abandons after [`Timeouts::peer_give_up`] of silence. Call it at
    /// [`next_wakeup`](Self::next_wakeup) (more often is harmless).
    pub fn on_tick(&mut self, now: Instant) -> Vec<PeerAction> {
        let mut out = Vec::new();
        match self.timers.due(now, self.t.retry, self.end.is_some()) {
            Due::Nothing => {}
            Due::LingerOver => log::warn!("peer {}: no ABORT after FAILED; giving up", self.me),
            Due::ResendFailed => {
                let error = self.failure.clone();
                out.push(self.send(Msg::Failed {
                    epoch: self.epoch,
                    error,
                }));
            }
            Due::Silent => {
                let reason = format!(
                    "no answer from initiator {} for {:?} (transient + full deadline + linger)",
                    self.initiator,
                    self.t.peer_give_up()
                );
                log::warn!("peer {}: {reason}; abandoning", self.me);
                out.push(self.send(Msg::Failed {
                    epoch: self.epoch,
                    error: reason.clone(),
                }));
                out.push(PeerAction::Abandon { reason });
                self.end = Some(End::Abandoned);
                self.timers.disarm();
            }
            Due::Resend => {
                if self.transient_done && !self.all_transient {
                    out.push(self.send(Msg::TransientSnapFin { epoch: self.epoch }));
                }
                if self.full_done {
                    out.push(self.send(Msg::FullSnapFin { epoch: self.epoch }));
                }
            }
        }
        out
    }

    /// The current state.
    pub fn state(&self) -> PeerState {
        match self.end {
            Some(End::Done) => PeerState::Done,
            Some(End::Abandoned) => PeerState::Abandoned,
            None if !self.started => PeerState::Idle,
            None if !self.transient_done => PeerState::Transient,
            None if !self.all_transient => PeerState::Post,
            None if !self.full_done => PeerState::Full,
            None => PeerState::FullDone,
        }
    }

    /// Whether the own full snapshot has been reported done.
    pub fn full_done(&self) -> bool {
        self.full_done
    }

    /// When [`on_tick`](Self::on_tick) has something to do next, if ever.
    pub fn next_wakeup(&self) -> Option<Instant> {
        self.timers.next_wakeup()
    }

    /// `true` when `Done`, or `Abandoned` with nothing left to send (after a
    /// local failure: once `ABORT` arrived or `FAILED` was retransmitted for
    /// `transient_deadline`).
    pub fn is_finished(&self) -> bool {
        self.end.is_some() && !self.timers.lingering()
    }

    /// The snapshot's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The peer's node name.
    pub fn me(&self) -> &NodeId {
        &self.me
    }

    /// The initiator's node name.
    pub fn initiator(&self) -> &NodeId {
        &self.initiator
    }

    /// Counts of ignored messages.
    pub fn ignored(&self) -> Ignored {
        self.ignored
    }

    fn send(&self, msg: Msg) -> PeerAction {
        PeerAction::Send(Envelope {
            from: self.me.clone(),
            to: self.initiator.clone(),
            msg,
        })
    }

    fn start(&mut self, out: &mut Vec<PeerAction>) {
        self.started = true;
        out.push(PeerAction::StartSnapshot);
    }

    fn end_coloring(&mut self, out: &mut Vec<PeerAction>) {
        self.all_transient = true;
        out.push(PeerAction::EndColoring);
        if !self.full_done {
            // Nothing awaited until the own full snapshot is done.
            self.timers.disarm();
        }
    }

    /// A FIN was sent: retransmit it every `retry`, give up after
    /// [`Timeouts::peer_give_up`] of silence.
    fn arm(&mut self, now: Instant) {
        self.timers.arm(now, self.t.retry, self.t.peer_give_up());
    }
}
