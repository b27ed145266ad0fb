//! Blocking drivers: run a coordinator or a cohort against a transport, an
//! inbox channel and (for a cohort) a worker.

use std::sync::mpsc::Receiver;
use std::time::Instant;

use super::cohort::{Cohort, CohortAction, CohortState};
use super::coordinator::Coordinator;
use super::msg::Msg;
use super::report::{CoordinatorEvent, CoordinatorState};
use crate::inbox::{next, Next};
use crate::transport::{send_all, Envelope, Transport};

/// An input of [`run_cohort`]: what arrives in a cohort's inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CohortInput {
    /// A message from the network.
    Message(Envelope<Msg>),
    /// The worker loaded the working set.
    Loaded,
    /// The worker started the VM; the guest runs since `unix_us`
    /// (µs since the Unix epoch).
    Started {
        /// The guest's start time.
        unix_us: u64,
    },
    /// The worker loaded every page.
    Restored,
    /// The worker failed (or the owner cancels the restore).
    Failed(String),
}

/// Does the real work of a cohort for [`run_cohort`]. Every method must
/// return quickly: long work goes to other threads, which report back by
/// sending [`CohortInput`]s into the cohort's inbox.
pub trait CohortWorker {
    /// Load the working set, report `Loaded`; keep loading the other pages
    /// in the background and report `Restored` when all are in (or
    /// `Failed`). The VM must not run yet.
    fn load(&mut self);
    /// Start the VM (it was loaded); report `Started { unix_us }`.
    fn start(&mut self);
    /// The restore is abandoned: stop loading, stop the VM if it runs.
    fn abandon(&mut self, reason: &str);
}

/// How [`run_cohort`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CohortOutcome {
    /// The cluster restore is complete; the VM runs.
    Completed,
    /// The restore was abandoned and [`CohortWorker::abandon`] was called.
    Abandoned {
        /// Why.
        reason: String,
    },
}

/// How [`run_coordinator`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorOutcome {
    /// Every cohort is restored; `ALL_RESTORE_FIN` was sent.
    Completed,
    /// The restore was aborted; `ABORT` was sent.
    Aborted {
        /// Why (names the cohort at fault, if any).
        reason: String,
    },
}

/// Runs `cohort` until it is finished: feeds it the inbox and timer ticks,
/// sends its messages through `transport` and calls `worker` for `Load`,
/// `Start` and `Abandon`. A cohort that never hears `LOAD` waits forever;
/// send it [`CohortInput::Failed`] to cancel. If the inbox is closed before
/// the end, the cohort fails with that reason.
pub fn run_cohort(
    mut cohort: Cohort,
    transport: &dyn Transport<Msg>,
    inbox: &Receiver<CohortInput>,
    worker: &mut dyn CohortWorker,
) -> CohortOutcome {
    let mut abandoned = None;
    let mut execute = |actions: Vec<CohortAction>, abandoned: &mut Option<String>| {
        for a in actions {
            match a {
                CohortAction::Send(env) => send_all(transport, vec![env]),
                CohortAction::Load => worker.load(),
                CohortAction::Start => worker.start(),
                CohortAction::Abandon { reason } => {
                    worker.abandon(&reason);
                    *abandoned = Some(reason);
                }
            }
        }
    };
    loop {
        if cohort.is_finished() {
            return match (cohort.state(), abandoned) {
                (CohortState::Done, _) => CohortOutcome::Completed,
                (_, reason) => CohortOutcome::Abandoned {
                    reason: reason.unwrap_or_else(|| "the cohort was already abandoned".into()),
                },
            };
        }
        let input = next(inbox, cohort.next_wakeup());
        let now = Instant::now();
        let actions = match input {
            Next::Tick => cohort.on_tick(now),
            Next::Item(CohortInput::Message(env)) => cohort.on_message(env, now),
            Next::Item(CohortInput::Loaded) => cohort.on_loaded(now),
            Next::Item(CohortInput::Started { unix_us }) => cohort.on_started(unix_us, now),
            Next::Item(CohortInput::Restored) => cohort.on_restored(now),
            Next::Item(CohortInput::Failed(e)) => cohort.on_failed(e, now),
            Next::Closed => {
                let reason = format!("cohort {}: inbox closed", cohort.me());
                execute(cohort.on_failed(reason.clone(), now), &mut abandoned);
                return CohortOutcome::Abandoned {
                    reason: abandoned.unwrap_or(reason),
                };
            }
        };
        execute(actions, &mut abandoned);
    }
}

/// Runs `coord` (starting it if it is not started yet) until it is
/// finished and then for [`Timeouts::linger`](super::Timeouts::linger)
/// after the last message received, answering retransmitted FINs so that
/// cohorts that lost a `START_ACK`, `ALL_RESTORE_FIN` or `ABORT` get it
/// again. `on_event` sees every event as it happens (`Done`/`Aborted`
/// before the linger). If the inbox is closed (every sender dropped, e.g.
/// the node left the network) before the end, the restore is aborted; once
/// finished, closing it ends the linger at once.
pub fn run_coordinator(
    coord: &mut Coordinator,
    transport: &dyn Transport<Msg>,
    inbox: &Receiver<Envelope<Msg>>,
    on_event: &mut dyn FnMut(&CoordinatorEvent),
) -> CoordinatorOutcome {
    let mut reported = 0;
    let mut report = |coord: &Coordinator| {
        for ev in &coord.events()[reported..] {
            on_event(ev);
        }
        reported = coord.events().len();
    };
    let linger = coord.timeouts().linger();
    send_all(transport, coord.start(Instant::now()));
    report(coord);
    // While finished: the instant lingering ends (moved on by every message).
    let mut linger_end: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if coord.is_finished() {
            let end = *linger_end.get_or_insert(now + linger);
            if now >= end {
                break;
            }
        }
        let wake = coord.next_wakeup().into_iter().chain(linger_end).min();
        let out = match next(inbox, wake) {
            Next::Item(env) => {
                let now = Instant::now();
                if linger_end.is_some() {
                    linger_end = Some(now + linger);
                }
                coord.on_message(env, now)
            }
            Next::Tick => coord.on_tick(Instant::now()),
            Next::Closed => {
                let reason = format!("coordinator {}: inbox closed", coord.me());
                send_all(transport, coord.abort(reason, Instant::now()));
                report(coord);
                break;
            }
        };
        send_all(transport, out);
        report(coord);
    }
    match coord.state() {
        CoordinatorState::Done => CoordinatorOutcome::Completed,
        CoordinatorState::Aborted { reason } => CoordinatorOutcome::Aborted { reason },
        s => unreachable!("coordinator finished in state {s:?}"),
    }
}
