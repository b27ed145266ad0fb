//! The timers of a participant that reports to a leader with FIN messages:
//! a snapshot [`Peer`](crate::snapshot::Peer) and a restore
//! [`Cohort`](crate::restore::Cohort) keep the same three.
//!
//! * **retry**: while a FIN is unacknowledged it is re-sent every `retry`;
//! * **silence**: a participant that hears nothing from its leader for its
//!   give-up time while a FIN is unacknowledged gives up;
//! * **linger**: after a local failure, `FAILED` is re-sent every `retry`
//!   until the leader's `ABORT` arrives or the linger time has passed.
//!
//! The participant decides what to send; this only keeps the instants.

use std::time::{Duration, Instant};

/// What [`FinTimers::due`] found due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// Nothing yet.
    Nothing,
    /// Lingering after a failure: re-send `FAILED` (the retry is re-armed).
    ResendFailed,
    /// The linger time has passed without `ABORT`: stop (all timers off).
    LingerOver,
    /// No word from the leader for the give-up time: give up (the caller
    /// sends `FAILED`, abandons and [`disarm`](FinTimers::disarm)s).
    Silent,
    /// Re-send the unacknowledged FINs (the retry is re-armed).
    Resend,
}

/// Retry, silence and linger instants (see the module doc).
#[derive(Debug, Clone, Default)]
pub(crate) struct FinTimers {
    next_retry: Option<Instant>,
    silence_deadline: Option<Instant>,
    failed_until: Option<Instant>,
}

impl FinTimers {
    /// A FIN is unacknowledged: re-send every `retry`, give up after
    /// `give_up` of silence.
    pub(crate) fn arm(&mut self, now: Instant, retry: Duration, give_up: Duration) {
        self.next_retry = Some(now + retry);
        self.silence_deadline = Some(now + give_up);
    }

    /// Nothing is unacknowledged: retry and silence off.
    pub(crate) fn disarm(&mut self) {
        self.next_retry = None;
        self.silence_deadline = None;
    }

    /// The leader was heard: the silence deadline (if running) restarts.
    pub(crate) fn heard(&mut self, now: Instant, give_up: Duration) {
        if self.silence_deadline.is_some() {
            self.silence_deadline = Some(now + give_up);
        }
    }

    /// A local failure: re-send `FAILED` every `retry` for `linger`.
    pub(crate) fn linger(&mut self, now: Instant, retry: Duration, linger: Duration) {
        self.silence_deadline = None;
        self.next_retry = Some(now + retry);
        self.failed_until = Some(now + linger);
    }

    /// Whether `FAILED` is still being re-sent.
    pub(crate) fn lingering(&self) -> bool {
        self.failed_until.is_some()
    }

    /// `ABORT` arrived: `FAILED` was heard; nothing is left to send.
    pub(crate) fn stop_lingering(&mut self) {
        self.failed_until = None;
        self.next_retry = None;
    }

    /// What is due at `now`. `ended`: the participant is in a final state
    /// (then only the linger counts).
    pub(crate) fn due(&mut self, now: Instant, retry: Duration, ended: bool) -> Due {
        let retry_due = self.next_retry.is_some_and(|r| now >= r);
        if let Some(until) = self.failed_until {
            if now >= until {
                self.stop_lingering();
                return Due::LingerOver;
            }
            if retry_due {
                self.next_retry = Some(now + retry);
                return Due::ResendFailed;
            }
            return Due::Nothing;
        }
        if ended {
            Due::Nothing
        } else if self.silence_deadline.is_some_and(|d| now >= d) {
            Due::Silent
        } else if retry_due {
            self.next_retry = Some(now + retry);
            Due::Resend
        } else {
            Due::Nothing
        }
    }

    /// When [`due`](Self::due) has something to do next, if ever.
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        if let Some(until) = self.failed_until {
            return Some(self.next_retry.map_or(until, |r| r.min(until)));
        }
        self.next_retry
            .into_iter()
            .chain(self.silence_deadline)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Duration = Duration::from_millis(10);

    #[test]
    fn retry_then_silence() {
        let t0 = Instant::now();
        let mut t = FinTimers::default();
        assert_eq!(t.next_wakeup(), None);
        t.arm(t0, R, Duration::from_millis(25));
        assert_eq!(t.due(t0, R, false), Due::Nothing);
        assert_eq!(t.due(t0 + R, R, false), Due::Resend);
        assert_eq!(t.next_wakeup(), Some(t0 + 2 * R));
        t.heard(t0 + R, Duration::from_millis(25));
        assert_eq!(t.due(t0 + Duration::from_millis(30), R, false), Due::Resend);
        assert_eq!(t.due(t0 + Duration::from_millis(35), R, false), Due::Silent);
        assert_eq!(
            t.due(t0 + Duration::from_millis(35), R, true),
            Due::Nothing,
            "ended"
        );
        t.disarm();
        assert_eq!(t.next_wakeup(), None);
    }

    #[test]
    fn linger_resends_failed_until_abort_or_time() {
        let t0 = Instant::now();
        let mut t = FinTimers::default();
        t.arm(t0, R, Duration::from_secs(1));
        t.linger(t0, R, Duration::from_millis(25));
        assert!(t.lingering());
        assert_eq!(t.due(t0 + R, R, true), Due::ResendFailed);
        assert_eq!(t.due(t0 + R, R, true), Due::Nothing);
        assert_eq!(t.next_wakeup(), Some(t0 + 2 * R));
        assert_eq!(
            t.due(t0 + Duration::from_millis(25), R, true),
            Due::LingerOver
        );
        assert!(!t.lingering());
        assert_eq!(t.next_wakeup(), None);
        t.linger(t0, R, Duration::from_secs(1));
        t.stop_lingering();
        assert_eq!((t.lingering(), t.next_wakeup()), (false, None));
    }
}
