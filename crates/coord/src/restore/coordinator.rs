//! The coordinator's state machine with its Checker (sans-IO).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use vmcsnap_restoreline::{Rdg, StartGroup};

use super::msg::{Msg, RestoreProtocolError, Timeouts};
use super::report::{CohortPhase, CoordinatorEvent, CoordinatorEventKind, CoordinatorState};
use crate::snapshot::Ignored;
use crate::transport::Envelope;
use crate::NodeId;

/// When the coordinator lets a loaded VM start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Policy {
    /// HotRestore's restore line: the start groups of the restore
    /// dependency graph ([`Rdg::start_groups`]): a VM starts once the VMs it
    /// sends to run, a ring together once all its members are loaded.
    #[default]
    RestoreLine,
    /// Every VM starts as soon as its working set is loaded
    /// ([`Rdg::unordered_groups`]): the baseline without a restore line.
    Independent,
}

#[derive(Debug)]
struct Slot {
    phase: CohortPhase,
    started_unix_us: Option<u64>,
    /// `RESTORE_FIN` arrived (possibly before the lost `START_FIN`).
    restore_fin: bool,
    /// When to re-send `LOAD` (Loading) or `START` (Starting).
    resend_at: Option<Instant>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    NotStarted,
    Load,
    Start,
    Restore,
    Done,
    Aborted(String),
}

/// The coordinator of one cluster restore (one epoch), as a state machine
/// without I/O: every input returns the envelopes to send.
///
/// Rules (all handlers are idempotent; the full table is in
/// `docs/cluster-protocol.md`):
/// - [`start`](Self::start) sends `LOAD` to every cohort; `LOAD` is re-sent
///   every `retry` to each cohort without `LOAD_FIN`, `START` to each cohort
///   that got `START` but whose `START_FIN` is missing.
/// - The **Checker** runs after every `LOAD_FIN` and `START_FIN`: a
///   [`StartGroup`] (a ring, or one VM) gets `START` once all its members
///   are loaded and every VM it waits for has reported `START_FIN`. Under
///   [`Policy::Independent`] every group is one VM waiting for nothing.
/// - `START_FIN` is answered with `START_ACK` (every copy); once every
///   cohort sent `RESTORE_FIN`, `ALL_RESTORE_FIN` goes to all, and again to
///   any cohort that repeats its `RESTORE_FIN`.
/// - `FAILED`, a missed deadline or [`abort`](Self::abort) aborts: `ABORT`
///   to every cohort; an aborted coordinator answers anything with `ABORT`
///   and re-broadcasts it every `retry` for [`Timeouts::linger`].
#[derive(Debug)]
pub struct Coordinator {
    epoch: u64,
    me: NodeId,
    policy: Policy,
    t: Timeouts,
    groups: Vec<StartGroup>,
    slots: BTreeMap<NodeId, Slot>,
    stage: Stage,
    deadline: Option<Instant>,
    abort_retry: Option<Instant>,
    linger_until: Option<Instant>,
    events: Vec<CoordinatorEvent>,
    ignored: Ignored,
}

impl Coordinator {
    /// A coordinator for restore `epoch`, named `me`, whose cohorts are the
    /// VMs of `rdg`, started in its order under `policy`. Fails if `me` is
    /// a cohort.
    pub fn new(
        epoch: u64,
        me: NodeId,
        rdg: &Rdg,
        policy: Policy,
        t: Timeouts,
    ) -> Result<Self, RestoreProtocolError> {
        if rdg.nodes().contains(&me) {
            return Err(RestoreProtocolError::CoordinatorIsCohort(me));
        }
        let groups = match policy {
            Policy::RestoreLine => rdg.start_groups(),
            Policy::Independent => rdg.unordered_groups(),
        };
        let slots = (rdg.nodes().iter().cloned())
            .map(|c| {
                let slot = Slot {
                    phase: CohortPhase::Loading,
                    started_unix_us: None,
                    restore_fin: false,
                    resend_at: None,
                };
                (c, slot)
            })
            .collect();
        Ok(Coordinator {
            epoch,
            me,
            policy,
            t,
            groups,
            slots,
            stage: Stage::NotStarted,
            deadline: None,
            abort_retry: None,
            linger_until: None,
            events: Vec::new(),
            ignored: Ignored::default(),
        })
    }

    /// Sends `LOAD` to every cohort and starts the load deadline. Does
    /// nothing if already started. With no cohorts the restore is Done.
    pub fn start(&mut self, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        if self.stage != Stage::NotStarted {
            return out;
        }
        self.stage = Stage::Load;
        self.deadline = Some(now + self.t.load_deadline);
        let cohorts = self.slots.len();
        self.event(now, CoordinatorEventKind::Started { cohorts });
        for (c, slot) in &mut self.slots {
            slot.resend_at = Some(now + self.t.retry);
            out.push(envelope(
                &self.me,
                c.clone(),
                Msg::Load { epoch: self.epoch },
            ));
        }
        self.advance(now, &mut out);
        out
    }

    /// Handles a message from a cohort.
    pub fn on_message(&mut self, env: Envelope<Msg>, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        if env.msg.epoch() != self.epoch {
            self.ignored.stale_epoch += 1;
            log::debug!(
                "coordinator {}: ignoring {:?} of another epoch from {}",
                self.me,
                env.msg,
                env.from
            );
            return out;
        }
        let Some(phase) = self.slots.get(&env.from).map(|s| s.phase) else {
            self.ignored.unknown_sender += 1;
            log::debug!(
                "coordinator {}: ignoring {} from non-cohort {}",
                self.me,
                env.msg.name(),
                env.from
            );
            return out;
        };
        let (from, e) = (env.from, self.epoch);
        let restoring = matches!(self.stage, Stage::Load | Stage::Start | Stage::Restore);
        use CohortPhase as P;
        match (&self.stage, env.msg) {
            (Stage::Aborted(reason), _) => {
                let msg = Msg::Abort {
                    epoch: e,
                    reason: reason.clone(),
                };
                self.resend(now, from, msg, &mut out);
            }
            (Stage::Done, Msg::StartFin { .. }) => {
                self.resend(now, from, Msg::StartAck { epoch: e }, &mut out)
            }
            (Stage::Done, Msg::RestoreFin { .. }) => {
                self.resend(now, from, Msg::AllRestoreFin { epoch: e }, &mut out)
            }
            (Stage::Done, Msg::LoadFin { .. }) => {} // stale duplicate
            (Stage::Done, Msg::Failed { error, .. }) => {
                log::warn!("coordinator {}: cohort {from} reported a failure after the restore was complete: {error}", self.me);
                self.event(
                    now,
                    CoordinatorEventKind::FailedAfterDone {
                        cohort: from,
                        error,
                    },
                );
            }
            (_, Msg::LoadFin { .. }) if restoring => match phase {
                P::Loading => {
                    let slot = self.slot(&from);
                    slot.phase = P::Loaded;
                    slot.resend_at = None;
                    self.event(now, CoordinatorEventKind::LoadFin { cohort: from });
                    self.check(now, &mut out);
                    self.advance(now, &mut out);
                }
                P::Starting => {
                    // START was lost: answer at once, and restart its timer.
                    self.slot(&from).resend_at = Some(now + self.t.retry);
                    self.resend(now, from, Msg::Start { epoch: e }, &mut out);
                }
                P::Loaded | P::Started | P::Restored => {} // duplicate
            },
            (
                _,
                Msg::StartFin {
                    started_unix_us, ..
                },
            ) if restoring => match phase {
                P::Starting => {
                    let slot = self.slot(&from);
                    slot.phase = if slot.restore_fin {
                        P::Restored
                    } else {
                        P::Started
                    };
                    slot.started_unix_us = Some(started_unix_us);
                    slot.resend_at = None;
                    out.push(envelope(&self.me, from.clone(), Msg::StartAck { epoch: e }));
                    let ev = CoordinatorEventKind::StartFin {
                        cohort: from,
                        started_unix_us,
                    };
                    self.event(now, ev);
                    self.check(now, &mut out);
                    self.advance(now, &mut out);
                }
                P::Started | P::Restored => {
                    self.resend(now, from, Msg::StartAck { epoch: e }, &mut out)
                }
                P::Loading | P::Loaded => self.unexpected("START_FIN", &from),
            },
            (_, Msg::RestoreFin { .. }) if restoring => match phase {
                P::Starting | P::Started => {
                    let slot = self.slot(&from);
                    if !slot.restore_fin {
                        slot.restore_fin = true;
                        if slot.phase == P::Started {
                            slot.phase = P::Restored;
                        }
                        self.event(now, CoordinatorEventKind::RestoreFin { cohort: from });
                        self.advance(now, &mut out);
                    }
                }
                P::Restored => {} // duplicate: ALL_RESTORE_FIN comes when all are restored
                P::Loading | P::Loaded => self.unexpected("RESTORE_FIN", &from),
            },
            (_, Msg::Failed { error, .. }) if restoring => {
                let reason = format!("cohort {from} failed: {error}");
                self.do_abort(reason, now, &mut out);
            }
            (_, msg) => self.unexpected(msg.name(), &from),
        }
        out
    }

    /// Handles the passing of time: re-sends `LOAD`/`START`, aborts at a
    /// deadline, re-broadcasts `ABORT` while lingering. Call it at
    /// [`next_wakeup`](Self::next_wakeup) (more often is harmless).
    pub fn on_tick(&mut self, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        match &self.stage {
            Stage::Load | Stage::Start | Stage::Restore
                if self.deadline.is_some_and(|d| now >= d) =>
            {
                let (fin, limit) = match self.stage {
                    Stage::Load => ("LOAD_FIN", ("load", self.t.load_deadline)),
                    Stage::Start => ("START_FIN", ("start", self.t.start_deadline)),
                    _ => ("RESTORE_FIN", ("restore", self.t.restore_deadline)),
                };
                let missing = self.missing().into_iter().collect::<Vec<_>>().join(", ");
                let reason = format!(
                    "no {fin} from {missing} within the {} deadline of {:?}",
                    limit.0, limit.1
                );
                self.do_abort(reason, now, &mut out);
            }
            Stage::Load | Stage::Start | Stage::Restore => {
                let due: Vec<(NodeId, CohortPhase)> = (self.slots.iter())
                    .filter(|(_, s)| s.resend_at.is_some_and(|r| now >= r))
                    .map(|(c, s)| (c.clone(), s.phase))
                    .collect();
                for (c, phase) in due {
                    self.slot(&c).resend_at = Some(now + self.t.retry);
                    let msg = match phase {
                        CohortPhase::Loading => Msg::Load { epoch: self.epoch },
                        _ => Msg::Start { epoch: self.epoch },
                    };
                    self.resend(now, c, msg, &mut out);
                }
            }
            Stage::Aborted(reason) if self.abort_retry.is_some_and(|r| now >= r) => {
                if self.linger_until.is_some_and(|l| now < l) {
                    let msg = Msg::Abort {
                        epoch: self.epoch,
                        reason: reason.clone(),
                    };
                    for c in self.slots.keys().cloned().collect::<Vec<_>>() {
                        self.resend(now, c, msg.clone(), &mut out);
                    }
                    self.abort_retry = Some(now + self.t.retry);
                } else {
                    self.abort_retry = None;
                }
            }
            _ => {}
        }
        out
    }

    /// Aborts the restore (user or agent request): `ABORT` to every cohort,
    /// which stop their VMs. Does nothing once `Done` or `Aborted`.
    pub fn abort(&mut self, reason: String, now: Instant) -> Vec<Envelope<Msg>> {
        let mut out = Vec::new();
        match self.stage {
            Stage::Done | Stage::Aborted(_) => {
                log::info!(
                    "coordinator {}: abort ({reason}) ignored in state {:?}",
                    self.me,
                    self.stage
                )
            }
            _ => self.do_abort(reason, now, &mut out),
        }
        out
    }

    /// The current state.
    pub fn state(&self) -> CoordinatorState {
        let missing = || self.missing();
        match &self.stage {
            Stage::NotStarted => CoordinatorState::NotStarted,
            Stage::Load => CoordinatorState::AwaitLoad { missing: missing() },
            Stage::Start => CoordinatorState::AwaitStart { missing: missing() },
            Stage::Restore => CoordinatorState::AwaitRestore { missing: missing() },
            Stage::Done => CoordinatorState::Done,
            Stage::Aborted(reason) => CoordinatorState::Aborted {
                reason: reason.clone(),
            },
        }
    }

    /// Where `cohort` is (`None` if it is not a cohort). Before
    /// [`start`](Self::start) every cohort is `Loading`.
    pub fn phase(&self, cohort: &str) -> Option<CohortPhase> {
        self.slots.get(cohort).map(|s| s.phase)
    }

    /// The cohorts that reported `START_FIN`, with their start times,
    /// earliest first (ties by name).
    pub fn start_order(&self) -> Vec<(NodeId, u64)> {
        let mut v: Vec<(NodeId, u64)> = (self.slots.iter())
            .filter_map(|(c, s)| s.started_unix_us.map(|us| (c.clone(), us)))
            .collect();
        v.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
        v
    }

    /// The groups the Checker starts together and what each waits for, in
    /// causal order.
    pub fn start_groups(&self) -> &[StartGroup] {
        &self.groups
    }

    /// When [`on_tick`](Self::on_tick) has something to do next, if ever.
    pub fn next_wakeup(&self) -> Option<Instant> {
        match self.stage {
            Stage::Load | Stage::Start | Stage::Restore => {
                (self.slots.values().filter_map(|s| s.resend_at))
                    .chain(self.deadline)
                    .min()
            }
            Stage::Aborted(_) => self.abort_retry,
            _ => None,
        }
    }

    /// Everything that happened so far, oldest first.
    pub fn events(&self) -> &[CoordinatorEvent] {
        &self.events
    }

    /// `true` when `Done` or `Aborted`. A finished coordinator should still
    /// be fed messages for a while ([`Timeouts::linger`]) so that cohorts
    /// that lost an `ALL_RESTORE_FIN`, `START_ACK` or `ABORT` get it again.
    pub fn is_finished(&self) -> bool {
        matches!(self.stage, Stage::Done | Stage::Aborted(_))
    }

    /// The restore's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The coordinator's node name.
    pub fn me(&self) -> &NodeId {
        &self.me
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The timeouts in use.
    pub fn timeouts(&self) -> &Timeouts {
        &self.t
    }

    /// Counts of ignored messages.
    pub fn ignored(&self) -> Ignored {
        self.ignored
    }

    fn slot(&mut self, c: &NodeId) -> &mut Slot {
        self.slots.get_mut(c).expect("a known cohort")
    }

    /// The cohorts the running deadline waits for.
    fn missing(&self) -> BTreeSet<NodeId> {
        let waiting = |p: CohortPhase| match self.stage {
            Stage::Load => p == CohortPhase::Loading,
            Stage::Start => p < CohortPhase::Started,
            _ => p < CohortPhase::Restored,
        };
        (self.slots.iter())
            .filter(|(_, s)| waiting(s.phase))
            .map(|(c, _)| c.clone())
            .collect()
    }

    fn unexpected(&mut self, name: &str, from: &NodeId) {
        self.ignored.unexpected += 1;
        log::debug!(
            "coordinator {}: ignoring unexpected {name} from {from} in state {:?}",
            self.me,
            self.stage
        );
    }

    fn event(&mut self, at: Instant, kind: CoordinatorEventKind) {
        log::debug!("coordinator {} epoch {}: {:?}", self.me, self.epoch, kind);
        self.events.push(CoordinatorEvent { at, kind });
    }

    fn resend(&mut self, now: Instant, to: NodeId, msg: Msg, out: &mut Vec<Envelope<Msg>>) {
        let name = msg.name();
        self.event(
            now,
            CoordinatorEventKind::Retransmit {
                to: to.clone(),
                msg: name,
            },
        );
        out.push(envelope(&self.me, to, msg));
    }

    /// Asks the Checker ([`StartGroup::may_start`]) and sends `START` to
    /// every group that may start now.
    fn check(&mut self, now: Instant, out: &mut Vec<Envelope<Msg>>) {
        let with = |f: &dyn Fn(CohortPhase) -> bool| -> BTreeSet<NodeId> {
            (self.slots.iter())
                .filter(|(_, s)| f(s.phase))
                .map(|(c, _)| c.clone())
                .collect()
        };
        let loaded = with(&|p| p == CohortPhase::Loaded);
        let running = with(&|p| p >= CohortPhase::Started);
        let ready: Vec<Vec<NodeId>> = (self.groups.iter())
            .filter(|g| g.may_start(&loaded, &running))
            .map(|g| g.members.clone())
            .collect();
        let resend_at = Some(now + self.t.retry);
        for cohorts in ready {
            for c in &cohorts {
                let slot = self.slot(c);
                slot.phase = CohortPhase::Starting;
                slot.resend_at = resend_at;
                out.push(envelope(
                    &self.me,
                    c.clone(),
                    Msg::Start { epoch: self.epoch },
                ));
            }
            self.event(now, CoordinatorEventKind::StartSent { cohorts });
        }
    }

    /// Moves the stage on when nobody is missing for the running deadline.
    fn advance(&mut self, now: Instant, out: &mut Vec<Envelope<Msg>>) {
        if self.stage == Stage::Load && self.missing().is_empty() {
            self.event(now, CoordinatorEventKind::AllLoaded);
            self.stage = Stage::Start;
            self.deadline = Some(now + self.t.start_deadline);
        }
        if self.stage == Stage::Start && self.missing().is_empty() {
            self.event(now, CoordinatorEventKind::AllStarted);
            self.stage = Stage::Restore;
            self.deadline = Some(now + self.t.restore_deadline);
        }
        if self.stage == Stage::Restore && self.missing().is_empty() {
            self.event(now, CoordinatorEventKind::Done);
            for c in self.slots.keys() {
                out.push(envelope(
                    &self.me,
                    c.clone(),
                    Msg::AllRestoreFin { epoch: self.epoch },
                ));
            }
            self.stage = Stage::Done;
            self.deadline = None;
        }
    }

    fn do_abort(&mut self, reason: String, now: Instant, out: &mut Vec<Envelope<Msg>>) {
        log::warn!(
            "coordinator {} epoch {}: aborting: {reason}",
            self.me,
            self.epoch
        );
        self.event(
            now,
            CoordinatorEventKind::Aborted {
                reason: reason.clone(),
            },
        );
        for c in self.slots.keys() {
            let msg = Msg::Abort {
                epoch: self.epoch,
                reason: reason.clone(),
            };
            out.push(envelope(&self.me, c.clone(), msg));
        }
        self.stage = Stage::Aborted(reason);
        self.deadline = None;
        self.abort_retry = Some(now + self.t.retry);
        self.linger_until = Some(now + self.t.linger());
    }
}

fn envelope(me: &NodeId, to: NodeId, msg: Msg) -> Envelope<Msg> {
    Envelope {
        from: me.clone(),
        to,
        msg,
    }
}
