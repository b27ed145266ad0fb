//! The cohort's state machine (sans-IO).

use std::time::Instant;

use super::msg::{Msg, Timeouts};
use crate::fin_timers::{Due, FinTimers};
use crate::snapshot::Ignored;
use crate::transport::Envelope;
use crate::NodeId;

/// What the cohort's owner must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CohortAction {
    /// Send this envelope.
    Send(Envelope<Msg>),
    /// Load the VM's working set (the VM does not run), then keep loading
    /// the other pages in the background; report `on_loaded` when the
    /// working set is in, `on_restored` when every page is.
    Load,
    /// Start the VM (its remaining pages load on demand and in the
    /// background); report `on_started` with the guest's start time.
    Start,
    /// The restore is abandoned: stop loading and stop the VM.
    Abandon {
        /// Why.
        reason: String,
    },
}

/// Where the cohort is. See `docs/cluster-protocol.md` for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CohortState {
    /// No `LOAD` yet.
    Idle,
    /// Loading the working set.
    Loading,
    /// `LOAD_FIN` sent, waiting for `START` (pages keep loading).
    Loaded,
    /// `START` received, the VM is being started.
    Starting,
    /// `START_FIN` sent, the VM runs; pages still loading.
    Running,
    /// `RESTORE_FIN` sent, waiting for `ALL_RESTORE_FIN`.
    Restored,
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

/// A cohort (one VM) of one cluster restore (one epoch), as a state
/// machine without I/O: every input returns the [`CohortAction`]s to carry
/// out, in order.
///
/// Rules (all handlers are idempotent):
/// - `LOAD` emits `Load` once; `START` (after `LOAD_FIN`) emits `Start`
///   once. Duplicates are answered with the FIN they ask for, never acted
///   on twice.
/// - Each FIN is re-sent every `retry` until the coordinator shows it
///   arrived: `LOAD_FIN` until `START`, `START_FIN` until `START_ACK`,
///   `RESTORE_FIN` until `ALL_RESTORE_FIN` (which implies `START_ACK`).
/// - `RESTORE_FIN` is sent only after `START_FIN`: pages that finish
///   loading before `START` are remembered.
/// - `ABORT` in any non-final state abandons (the VM is stopped); after
///   `Done` it is ignored.
/// - [`on_failed`](Self::on_failed) sends `FAILED` and abandons; `FAILED`
///   is re-sent every `retry` (and in answer to anything) until `ABORT`
///   arrives, for at most [`Timeouts::linger`].
/// - A cohort with an unacknowledged FIN that hears nothing from the
///   coordinator for [`Timeouts::cohort_give_up`] sends `FAILED` once and
///   abandons. An `Idle` cohort waits forever.
#[derive(Debug)]
pub struct Cohort {
    epoch: u64,
    me: NodeId,
    coordinator: NodeId,
    t: Timeouts,
    load_requested: bool,
    loaded: bool,
    start_requested: bool,
    started_unix_us: Option<u64>,
    start_acked: bool,
    pages_loaded: bool,
    end: Option<End>,
    failure: String,
    timers: FinTimers,
    ignored: Ignored,
}

impl Cohort {
    /// Cohort `me` of restore `epoch` coordinated by `coordinator`.
    pub fn new(epoch: u64, me: NodeId, coordinator: NodeId, t: Timeouts) -> Self {
        Cohort {
            epoch,
            me,
            coordinator,
            t,
            load_requested: false,
            loaded: false,
            start_requested: false,
            started_unix_us: None,
            start_acked: false,
            pages_loaded: false,
            end: None,
            failure: String::new(),
            timers: FinTimers::default(),
            ignored: Ignored::default(),
        }
    }

    /// Handles a message from the coordinator.
    pub fn on_message(&mut self, env: Envelope<Msg>, now: Instant) -> Vec<CohortAction> {
        let mut out = Vec::new();
        if env.msg.epoch() != self.epoch {
            self.ignored.stale_epoch += 1;
            log::debug!(
                "cohort {}: ignoring {:?} of another epoch",
                self.me,
                env.msg
            );
            return out;
        }
        if env.from != self.coordinator {
            self.ignored.unknown_sender += 1;
            log::debug!(
                "cohort {}: ignoring {} from {} (not the coordinator)",
                self.me,
                env.msg.name(),
                env.from
            );
            return out;
        }
        if self.end.is_some() {
            if self.timers.lingering() {
                if matches!(env.msg, Msg::Abort { .. }) {
                    self.timers.stop_lingering();
                } else {
                    // The coordinator has not heard of the failure yet.
                    out.push(self.failed_msg());
                }
            } else {
                self.ignored.unexpected += 1;
            }
            return out;
        }
        self.timers.heard(now, self.t.cohort_give_up());
        let started = self.started_unix_us.is_some();
        match env.msg {
            Msg::Load { .. } if !self.load_requested => {
                self.load_requested = true;
                out.push(CohortAction::Load);
            }
            Msg::Load { .. } => {
                if self.loaded && !self.start_requested {
                    out.push(self.send(Msg::LoadFin { epoch: self.epoch }));
                }
            }
            Msg::Start { .. } if self.loaded && !self.start_requested => {
                self.start_requested = true;
                out.push(CohortAction::Start);
                self.rearm(now);
            }
            Msg::Start { .. } if started => out.push(self.start_fin()),
            Msg::Start { .. } if self.start_requested => {} // still starting
            Msg::StartAck { .. } if started => {
                self.start_acked = true;
                self.rearm(now);
            }
            Msg::AllRestoreFin { .. } if started && self.pages_loaded => {
                self.end = Some(End::Done);
                self.timers.disarm();
            }
            Msg::Abort { reason, .. } => {
                let reason = format!("coordinator {} aborted: {reason}", self.coordinator);
                out.push(CohortAction::Abandon { reason });
                self.end = Some(End::Abandoned);
                self.timers.disarm();
            }
            msg => {
                self.ignored.unexpected += 1;
                log::debug!(
                    "cohort {}: ignoring unexpected {} in state {:?}",
                    self.me,
                    msg.name(),
                    self.state()
                );
            }
        }
        out
    }

    /// The working set is loaded: sends `LOAD_FIN`. Ignored unless loading
    /// and the first report.
    pub fn on_loaded(&mut self, now: Instant) -> Vec<CohortAction> {
        let mut out = Vec::new();
        if self.end.is_some() || !self.load_requested || self.loaded {
            log::debug!(
                "cohort {}: loaded report ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        self.loaded = true;
        out.push(self.send(Msg::LoadFin { epoch: self.epoch }));
        self.rearm(now);
        out
    }

    /// The VM runs since `started_unix_us`: sends `START_FIN` (and
    /// `RESTORE_FIN` if every page is already loaded). Ignored unless
    /// starting and the first report.
    pub fn on_started(&mut self, started_unix_us: u64, now: Instant) -> Vec<CohortAction> {
        let mut out = Vec::new();
        if self.end.is_some() || !self.start_requested || self.started_unix_us.is_some() {
            log::debug!(
                "cohort {}: started report ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        self.started_unix_us = Some(started_unix_us);
        out.push(self.start_fin());
        if self.pages_loaded {
            out.push(self.send(Msg::RestoreFin { epoch: self.epoch }));
        }
        self.rearm(now);
        out
    }

    /// Every page is loaded: sends `RESTORE_FIN` if the VM runs, else
    /// remembers it for [`on_started`](Self::on_started). Ignored before
    /// `Load` and after the first report.
    pub fn on_restored(&mut self, now: Instant) -> Vec<CohortAction> {
        let mut out = Vec::new();
        if self.end.is_some() || !self.load_requested || self.pages_loaded {
            log::debug!(
                "cohort {}: restored report ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        self.pages_loaded = true;
        if self.started_unix_us.is_some() {
            out.push(self.send(Msg::RestoreFin { epoch: self.epoch }));
            self.rearm(now);
        }
        out
    }

    /// The local restore failed (or the owner cancels it): sends `FAILED`
    /// and abandons. Ignored in a final state.
    pub fn on_failed(&mut self, error: String, now: Instant) -> Vec<CohortAction> {
        let mut out = Vec::new();
        if self.end.is_some() {
            log::debug!(
                "cohort {}: failure ({error}) ignored in state {:?}",
                self.me,
                self.state()
            );
            return out;
        }
        self.failure = error.clone();
        out.push(self.failed_msg());
        out.push(CohortAction::Abandon { reason: error });
        self.end = Some(End::Abandoned);
        self.timers.linger(now, self.t.retry, self.t.linger());
        out
    }

    /// Handles the passing of time: re-sends unacknowledged FINs (or
    /// `FAILED`), abandons after [`Timeouts::cohort_give_up`] of silence.
    pub fn on_tick(&mut self, now: Instant) -> Vec<CohortAction> {
        let mut out = Vec::new();
        match self.timers.due(now, self.t.retry, self.end.is_some()) {
            Due::Nothing => {}
            Due::LingerOver => log::warn!("cohort {}: no ABORT after FAILED; giving up", self.me),
            Due::ResendFailed => out.push(self.failed_msg()),
            Due::Silent => {
                let reason = format!(
                "no answer from coordinator {} for {:?} (load + start + restore deadline + linger)",
                self.coordinator,
                self.t.cohort_give_up()
            );
                log::warn!("cohort {}: {reason}; abandoning", self.me);
                self.failure = reason.clone();
                out.push(self.failed_msg());
                out.push(CohortAction::Abandon { reason });
                self.end = Some(End::Abandoned);
                self.timers.disarm();
            }
            Due::Resend => out.extend(self.unacked().into_iter().map(|m| self.send(m))),
        }
        out
    }

    /// The current state.
    pub fn state(&self) -> CohortState {
        match self.end {
            Some(End::Done) => CohortState::Done,
            Some(End::Abandoned) => CohortState::Abandoned,
            None if !self.load_requested => CohortState::Idle,
            None if !self.loaded => CohortState::Loading,
            None if !self.start_requested => CohortState::Loaded,
            None if self.started_unix_us.is_none() => CohortState::Starting,
            None if !self.pages_loaded => CohortState::Running,
            None => CohortState::Restored,
        }
    }

    /// Whether every page has been reported loaded.
    pub fn pages_loaded(&self) -> bool {
        self.pages_loaded
    }

    /// The guest's reported start time, once started.
    pub fn started_unix_us(&self) -> Option<u64> {
        self.started_unix_us
    }

    /// When [`on_tick`](Self::on_tick) has something to do next, if ever.
    pub fn next_wakeup(&self) -> Option<Instant> {
        self.timers.next_wakeup()
    }

    /// `true` when `Done`, or `Abandoned` with nothing left to send.
    pub fn is_finished(&self) -> bool {
        self.end.is_some() && !self.timers.lingering()
    }

    /// The restore's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The cohort's node name.
    pub fn me(&self) -> &NodeId {
        &self.me
    }

    /// The coordinator's node name.
    pub fn coordinator(&self) -> &NodeId {
        &self.coordinator
    }

    /// Counts of ignored messages.
    pub fn ignored(&self) -> Ignored {
        self.ignored
    }

    fn send(&self, msg: Msg) -> CohortAction {
        let to = self.coordinator.clone();
        CohortAction::Send(Envelope {
            from: self.me.clone(),
            to,
            msg,
        })
    }

    fn start_fin(&self) -> CohortAction {
        let started_unix_us = self.started_unix_us.unwrap_or_default();
        self.send(Msg::StartFin {
            epoch: self.epoch,
            started_unix_us,
        })
    }

    fn failed_msg(&self) -> CohortAction {
        self.send(Msg::Failed {
            epoch: self.epoch,
            error: self.failure.clone(),
        })
    }

    /// The FINs sent and not yet acknowledged.
    fn unacked(&self) -> Vec<Msg> {
        let e = self.epoch;
        let started = self.started_unix_us.is_some();
        let mut v = Vec::new();
        if self.loaded && !self.start_requested {
            v.push(Msg::LoadFin { epoch: e });
        }
        if let (Some(us), false) = (self.started_unix_us, self.start_acked) {
            v.push(Msg::StartFin {
                epoch: e,
                started_unix_us: us,
            });
        }
        if started && self.pages_loaded {
            v.push(Msg::RestoreFin { epoch: e });
        }
        v
    }

    /// Something was sent or acknowledged: keep the retry and give-up
    /// timers running while a FIN is unacknowledged, stop them otherwise.
    fn rearm(&mut self, now: Instant) {
        if self.unacked().is_empty() {
            self.timers.disarm();
        } else {
            self.timers.arm(now, self.t.retry, self.t.cohort_give_up());
        }
    }
}
