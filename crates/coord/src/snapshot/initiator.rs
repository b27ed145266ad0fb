//! The initiator's state machine (sans-IO).

use std::collections::BTreeSet;
use std::time::Instant;

use super::msg::{Ignored, Msg, Timeouts};
use crate::transport::Envelope;
use crate::NodeId;

/// Where the initiator is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitiatorState {
    /// Created, [`Initiator::start`] not called yet.
    NotStarted,
    /// `SNAPSHOT` sent; waiting for the `TRANSIENT_SNAP_FIN` of `missing`.
    AwaitTransient {
        /// Peers whose `TRANSIENT_SNAP_FIN` has not arrived.
        missing: BTreeSet<NodeId>,
    },
    /// `ALL_TRANSIENT_SNAP_FIN` sent; waiting for the `FULL_SNAP_FIN` of
    /// `missing`.
    AwaitFull {
        /// Peers whose `FULL_SNAP_FIN` has not arrived.
        missing: BTreeSet<NodeId>,
    },
    /// `ALL_FULL_SNAP_FIN` sent: the cluster snapshot is complete.
    Done,
    /// `ABORT` sent: the cluster snapshot is abandoned.
    Aborted {
        /// Why (names the peer at fault, if any).
        reason: String,
    },
}

/// What happened, for the log and for progress reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitiatorEventKind {
    /// `SNAPSHOT` sent to every peer.
    Started {
        /// Number of peers.
        peers: usize,
    },
    /// A peer's transient snapshot is done (its `TRANSIENT_SNAP_FIN`, or an
    /// early `FULL_SNAP_FIN`, arrived).
    TransientFin {
        /// The peer.
        peer: NodeId,
    },
    /// Every transient snapshot is done; `ALL_TRANSIENT_SNAP_FIN` sent.
    AllTransient,
    /// A peer's `FULL_SNAP_FIN` arrived.
    FullFin {
        /// The peer.
        peer: NodeId,
    },
    /// Every full snapshot is done; `ALL_FULL_SNAP_FIN` sent.
    Done,
    /// The snapshot was aborted; `ABORT` sent to every peer.
    Aborted {
        /// Why.
        reason: String,
    },
    /// A message was sent again (timer or answer to a duplicate).
    Retransmit {
        /// The receiver.
        to: NodeId,
        /// The message name, e.g. `"SNAPSHOT"`.
        msg: &'static str,
    },
    /// A peer reported `FAILED` after the cluster snapshot was complete;
    /// the snapshot stays complete, but that peer's image may be missing.
    FailedAfterDone {
        /// The peer.
        peer: NodeId,
        /// Its error.
        error: String,
    },
}

/// An entry of [`Initiator::events`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitiatorEvent {
    /// When (the `now` of the input that caused it).
    pub at: Instant,
    /// What.
    pub kind: InitiatorEventKind,
}

/// The initiator of one cluster snapshot (one epoch), as a state machine
/// without I/O: every input returns the envelopes to send.
///
/// Rules (all handlers are idempotent):
/// - [`start`](Self::start) sends `SNAPSHOT` to every peer; `SNAPSHOT` is
///   re-sent every `retry` to peers whose `TRANSIENT_SNAP_FIN` is missing.
/// - A `FULL_SNAP_FIN` that arrives before `ALL_TRANSIENT_SNAP_FIN` is
///   remembered and also counts as that peer's `TRANSIENT_SNAP_FIN`.
/// - `ALL_*` messages are re-sent on demand only: in `AwaitFull`/`Done` a
///   `TRANSIENT_SNAP_FIN` is answered with `ALL_TRANSIENT_SNAP_FIN`, in
///   `Done` a `FULL_SNAP_FIN` with `ALL_FULL_SNAP_FIN`.
/// - `FAILED` from any peer, a missed deadline or [`abort`](Self::abort)
///   aborts: `ABORT` to every peer (the failed one too). An aborted
///   initiator answers any message from a peer with `ABORT`, and
///   re-broadcasts `ABORT` every `retry` for [`Timeouts::linger`].
/// - Once `Done`, [`abort`](Self::abort) does nothing (the snapshot is
///   complete); a late `FAILED` is logged as
///   [`InitiatorEventKind::FailedAfterDone`].
/// - Messages of another epoch, from nodes that are not peers, or that make
///   no sense in the state are ignored and counted ([`ignored`](Self::ignored)).
#[derive(Debug)]
pub struct Initiator {
    epoch: u64,
    me: NodeId,
    peers: BTreeSet<NodeId>,
    t: Timeouts,
    state: InitiatorState,
    early_full: BTreeSet<NodeId>,
    deadline: Option<Instant>,
    next_retry: Option<Instant>,
    linger_until: Option<Instant>,
    events: Vec<InitiatorEvent>,
    ignored: Ignored,
}

impl Initiator {
    /// An initiator for snapshot `epoch`, named `me`, of `peers`
    /// (duplicates are ignored).
    pub fn new(epoch: u64, me: NodeId, peers: Vec<NodeId>, t: Timeouts) -> Self {
        Initiator {
            epoch,
            me,
            peers: peers.into_iter().collect(),
            t,
            state: InitiatorState::NotStarted,
            early_full: BTreeSet::new(),
            deadline: None,
            next_retry: None,
            linger_until: None,
            events: Vec::new(),
            ignored: Ignored::default(),
        }
    }

    /// Sends `SNAPSHOT` to every peer and starts the transient deadline.
    /// Does nothing if already started. With no peers the snapshot is
    /// complete at once.
    pub fn start(&mut self, now: Instant) -> Vec<Envelope<Msg>> {
        if self.state != InitiatorState::NotStarted {
            return Vec::new();
        }
        self.state = InitiatorState::AwaitTransient {
            missing: self.peers.clone(),
        };
        self.deadline = Some(now + self.t.transient_deadline);
        self.next_retry = Some(now + self.t.retry);
        self.event(
            now,
            InitiatorEventKind::Started {
                peers: self.peers.len(),
            },
        );
        let mut out = self.broadcast(Msg::Snapshot { epoch: self.epoch });
        self.advance(now, &mut out);
        out
    }

    /// Handles a message from a peer.
    pub fn on_message(&mut self, env: Envelope<Msg>, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        if env.msg.epoch() != self.epoch {
            self.ignored.stale_epoch += 1;
            log::debug!(
                "initiator {}: ignoring {:?} of another epoch from {}",
                self.me,
                env.msg,
                env.from
            );
            return out;
        }
        if !self.peers.contains(&env.from) {
            self.ignored.unknown_sender += 1;
            log::debug!(
                "initiator {}: ignoring {} from non-peer {}",
                self.me,
                env.msg.name(),
                env.from
            );
            return out;
        }
        let from = env.from;
        match (&mut self.state, env.msg) {
            (InitiatorState::Aborted { reason }, _) => {
                let msg = Msg::Abort {
                    epoch: self.epoch,
                    reason: reason.clone(),
                };
                self.resend(now, from, msg, &mut out);
            }
            (InitiatorState::AwaitTransient { missing }, Msg::TransientSnapFin { .. }) => {
                if missing.remove(&from) {
                    self.event(now, InitiatorEventKind::TransientFin { peer: from });
                    self.advance(now, &mut out);
                }
            }
            (InitiatorState::AwaitTransient { missing }, Msg::FullSnapFin { .. }) => {
                let newly_transient = missing.remove(&from);
                if newly_transient {
                    self.event(now, InitiatorEventKind::TransientFin { peer: from.clone() });
                }
                if self.early_full.insert(from.clone()) {
                    self.event(now, InitiatorEventKind::FullFin { peer: from });
                }
                self.advance(now, &mut out);
            }
            (
                InitiatorState::AwaitFull { .. } | InitiatorState::Done,
                Msg::TransientSnapFin { .. },
            ) => {
                let msg = Msg::AllTransientSnapFin { epoch: self.epoch };
                self.resend(now, from, msg, &mut out);
            }
            (InitiatorState::AwaitFull { missing }, Msg::FullSnapFin { .. }) => {
                if missing.remove(&from) {
                    self.event(now, InitiatorEventKind::FullFin { peer: from });
                    self.advance(now, &mut out);
                }
            }
            (InitiatorState::Done, Msg::FullSnapFin { .. }) => {
                let msg = Msg::AllFullSnapFin { epoch: self.epoch };
                self.resend(now, from, msg, &mut out);
            }
            (
                InitiatorState::AwaitTransient { .. } | InitiatorState::AwaitFull { .. },
                Msg::Failed { error, .. },
            ) => {
                let reason = format!("peer {from} failed: {error}");
                self.do_abort(reason, now, &mut out);
            }
            (InitiatorState::Done, Msg::Failed { error, .. }) => {
                log::warn!("initiator {}: peer {from} reported a failure after the cluster snapshot was complete: {error}", self.me);
                self.event(
                    now,
                    InitiatorEventKind::FailedAfterDone { peer: from, error },
                );
            }
            (_, msg) => {
                self.ignored.unexpected += 1;
                log::debug!(
                    "initiator {}: ignoring unexpected {} from {from}",
                    self.me,
                    msg.name()
                );
            }
        }
        out
    }

    /// Handles the passing of time: retransmits `SNAPSHOT`, aborts at a
    /// deadline, re-broadcasts `ABORT` while lingering. Call it at
    /// [`next_wakeup`](Self::next_wakeup) (calling it more often is harmless).
    pub fn on_tick(&mut self, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        let deadline_passed = self.deadline.is_some_and(|d| now >= d);
        let retry_due = self.next_retry.is_some_and(|r| now >= r);
        match &self.state {
            InitiatorState::AwaitTransient { missing } if deadline_passed => {
                let reason = format!(
                    "no TRANSIENT_SNAP_FIN from {} within the transient deadline of {:?}",
                    list(missing),
                    self.t.transient_deadline
                );
                self.do_abort(reason, now, &mut out);
            }
            InitiatorState::AwaitFull { missing } if deadline_passed => {
                let reason = format!(
                    "no FULL_SNAP_FIN from {} within the full deadline of {:?}",
                    list(missing),
                    self.t.full_deadline
                );
                self.do_abort(reason, now, &mut out);
            }
            InitiatorState::AwaitTransient { missing } if retry_due => {
                for p in missing.clone() {
                    self.resend(now, p, Msg::Snapshot { epoch: self.epoch }, &mut out);
                }
                self.next_retry = Some(now + self.t.retry);
            }
            InitiatorState::Aborted { reason } if retry_due => {
                if self.linger_until.is_some_and(|l| now < l) {
                    let msg = Msg::Abort {
                        epoch: self.epoch,
                        reason: reason.clone(),
                    };
                    for p in self.peers.clone() {
                        self.resend(now, p, msg.clone(), &mut out);
                    }
                    self.next_retry = Some(now + self.t.retry);
                } else {
                    self.next_retry = None;
                }
            }
            _ => {}
        }
        out
    }

    /// Aborts the snapshot (user or agent request): `ABORT` to every peer.
    /// Does nothing once `Done` (the snapshot is complete) or `Aborted`.
    pub fn abort(&mut self, reason: String, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        match self.state {
            InitiatorState::Done | InitiatorState::Aborted { .. } => {
                log::info!(
                    "initiator {}: abort ({reason}) ignored in state {:?}",
                    self.me,
                    self.state
                );
            }
            _ => self.do_abort(reason, now, &mut out),
        }
        out
    }

    /// The current state.
    pub fn state(&self) -> &InitiatorState {
        &self.state
    }

    /// When [`on_tick`](Self::on_tick) has something to do next, if ever.
    pub fn next_wakeup(&self) -> Option<Instant> {
        match self.state {
            InitiatorState::AwaitTransient { .. } | InitiatorState::AwaitFull { .. } => {
                match (self.deadline, self.next_retry) {
                    (Some(d), Some(r)) => Some(d.min(r)),
                    (d, r) => d.or(r),
                }
            }
            InitiatorState::Aborted { .. } => self.next_retry,
            _ => None,
        }
    }

    /// Everything that happened so far, oldest first.
    pub fn events(&self) -> &[InitiatorEvent] {
        &self.events
    }

    /// `true` when `Done` or `Aborted`. A finished initiator should still
    /// be fed messages for a while ([`Timeouts::linger`]) so that peers that
    /// lost an `ALL_*` or `ABORT` get it again.
    pub fn is_finished(&self) -> bool {
        matches!(
            self.state,
            InitiatorState::Done | InitiatorState::Aborted { .. }
        )
    }

    /// The snapshot's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The initiator's node name.
    pub fn me(&self) -> &NodeId {
        &self.me
    }

    /// The timeouts in use.
    pub fn timeouts(&self) -> &Timeouts {
        &self.t
    }

    /// Counts of ignored messages.
    pub fn ignored(&self) -> Ignored {
        self.ignored
    }

    fn event(&mut self, at: Instant, kind: InitiatorEventKind) {
        log::debug!("initiator {} epoch {}: {:?}", self.me, self.epoch, kind);
        self.events.push(InitiatorEvent { at, kind });
    }

    fn envelope(&self, to: NodeId, msg: Msg) -> Envelope<Msg> {
        Envelope {
            from: self.me.clone(),
            to,
            msg,
        }
    }

    fn broadcast(&self, msg: Msg) -> Vec<Envelope<Msg>> {
        self.peers
            .iter()
            .map(|p| self.envelope(p.clone(), msg.clone()))
            .collect()
    }

    fn resend(&mut self, now: Instant, to: NodeId, msg: Msg, out: &mut Vec<Envelope<Msg>>) {
        self.event(
            now,
            InitiatorEventKind::Retransmit {
                to: to.clone(),
                msg: msg.name(),
            },
        );
        out.push(self.envelope(to, msg));
    }

    /// Moves on from `AwaitTransient`/`AwaitFull` when nobody is missing.
    fn advance(&mut self, now: Instant, out: &mut Vec<Envelope<Msg>>) {
        if matches!(&self.state, InitiatorState::AwaitTransient { missing } if missing.is_empty()) {
            self.event(now, InitiatorEventKind::AllTransient);
            out.extend(self.broadcast(Msg::AllTransientSnapFin { epoch: self.epoch }));
            let missing = self.peers.difference(&self.early_full).cloned().collect();
            self.state = InitiatorState::AwaitFull { missing };
            self.deadline = Some(now + self.t.full_deadline);
            self.next_retry = None;
        }
        if matches!(&self.state, InitiatorState::AwaitFull { missing } if missing.is_empty()) {
            self.event(now, InitiatorEventKind::Done);
            out.extend(self.broadcast(Msg::AllFullSnapFin { epoch: self.epoch }));
            self.state = InitiatorState::Done;
            self.deadline = None;
        }
    }

    fn do_abort(&mut self, reason: String, now: Instant, out: &mut Vec<Envelope<Msg>>) {
        log::warn!(
            "initiator {} epoch {}: aborting: {reason}",
            self.me,
            self.epoch
        );
        self.event(
            now,
            InitiatorEventKind::Aborted {
                reason: reason.clone(),
            },
        );
        out.extend(self.broadcast(Msg::Abort {
            epoch: self.epoch,
            reason: reason.clone(),
        }));
        self.state = InitiatorState::Aborted { reason };
        self.deadline = None;
        self.next_retry = Some(now + self.t.retry);
        self.linger_until = Some(now + self.t.linger());
    }
}

fn list(nodes: &BTreeSet<NodeId>) -> String {
    nodes
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}
