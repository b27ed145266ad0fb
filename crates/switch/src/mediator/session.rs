//! The rules of the mediator as pure functions, and the state of an
//! active cut session (see the [module docs](super)).

use std::collections::BTreeMap;

use super::{Color, FrameTag, LogReason, LoggedFrame, PairCount, SessionPort, SessionStats};
use crate::core::{Counters, PortId};
use crate::error::{Result, SwitchError};

/// Where a frame in the session log is, to take it out again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogRef {
    serial: u64,
    index: usize,
}

/// A session port as a receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Receiver {
    Outside,
    Pre,
    /// Cut when the core's queue sequence was at `cut_seq`.
    Post {
        cut_seq: u64,
    },
}

/// What to do with a frame taken from a receiver's queue (rules 2 and 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PopAction {
    Deliver,
    Log(LogReason),
    Violation,
}

/// Rules 2 and 3: the fate of a frame of sender color `color`, queued at
/// sequence `seq`, when it is handed to `receiver`.
pub(crate) fn classify_pop(color: Option<Color>, receiver: Receiver, seq: u64) -> PopAction {
    match (color, receiver) {
        (Some(Color::Pre), Receiver::Post { cut_seq }) if seq < cut_seq => {
            PopAction::Log(LogReason::HeldAtCut)
        }
        (Some(Color::Pre), Receiver::Post { .. }) => PopAction::Log(LogReason::InFlight),
        (Some(Color::Post), Receiver::Pre) => PopAction::Violation,
        _ => PopAction::Deliver,
    }
}

/// Rule 1: whether queueing a frame of color `color` for `receiver` must
/// hold the receiver.
pub(crate) fn needs_auto_hold(color: Option<Color>, receiver: Receiver) -> bool {
    color == Some(Color::Post) && receiver == Receiver::Pre
}

#[derive(Debug, Clone, Copy)]
struct CutMark {
    at_unix_us: u64,
    seq: u64,
}

#[derive(Debug)]
struct PortState {
    name: String,
    cut: Option<CutMark>,
    /// Frames it sends are tagged post.
    sends_post: bool,
    partial_pending: bool,
    auto_held: bool,
    session_hold: bool,
    triggered: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    logged: u64,
    logged_bytes: u64,
    violations: u64,
    triggers: u64,
    bound_hits: u64,
    unread_bytes_at_cut: u64,
    unsettled_cuts: u64,
    log_overflow: u64,
}

/// State of an active cut session, owned by the core.
#[derive(Debug)]
pub(crate) struct Session {
    epoch: u64,
    serial: u64,
    max_log_bytes: usize,
    ports: BTreeMap<PortId, PortState>,
    log: Vec<Option<LoggedFrame>>,
    pending_triggers: Vec<PortId>,
    pairs: BTreeMap<(PortId, PortId), PairCount>,
    /// The core's totals when the session began.
    base: Counters,
    tally: Tally,
}

impl Session {
    /// A session over `ports` (id, name), all pre. `serial` must differ
    /// from every earlier session's of the same core and not be 0.
    pub(crate) fn new(
        epoch: u64,
        serial: u64,
        ports: impl IntoIterator<Item = (PortId, String)>,
        max_log_bytes: usize,
        base: Counters,
    ) -> Self {
        debug_assert_ne!(serial, 0);
        let ports = ports
            .into_iter()
            .map(|(id, name)| {
                let st = PortState {
                    name,
                    cut: None,
                    sends_post: false,
                    partial_pending: false,
                    auto_held: false,
                    session_hold: false,
                    triggered: false,
                };
                (id, st)
            })
            .collect();
        Session {
            epoch,
            serial,
            max_log_bytes,
            ports,
            log: Vec::new(),
            pending_triggers: Vec::new(),
            pairs: BTreeMap::new(),
            base,
            tally: Tally::default(),
        }
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }

    /// Every port is cut and its frames are post (no half frame pending).
    pub(crate) fn all_post(&self) -> bool {
        self.ports.values().all(|p| p.sends_post)
    }

    pub(crate) fn contains(&self, port: PortId) -> bool {
        self.ports.contains_key(&port)
    }

    pub(crate) fn receiver(&self, port: PortId) -> Receiver {
        match self.ports.get(&port) {
            None => Receiver::Outside,
            Some(PortState { cut: None, .. }) => Receiver::Pre,
            Some(PortState { cut: Some(c), .. }) => Receiver::Post { cut_seq: c.seq },
        }
    }

    /// The color a frame received from `port` now gets.
    pub(crate) fn sender_color(&self, port: PortId) -> Option<Color> {
        self.ports.get(&port).map(|p| {
            if p.sends_post {
                Color::Post
            } else {
                Color::Pre
            }
        })
    }

    /// The color of a tagged frame in this session: its own if it was
    /// tagged in this session, else pre for senders of the session (it was
    /// received before the session began, so before any cut).
    pub(crate) fn color_of(&self, tag: &FrameTag) -> Option<Color> {
        if tag.session == self.serial {
            tag.color
        } else {
            tag.sender.filter(|s| self.contains(*s)).map(|_| Color::Pre)
        }
    }

    /// A complete frame was received from `port` (after its tag was taken):
    /// a frame pending at the cut is done, the port's frames turn post.
    pub(crate) fn frame_received(&mut self, port: PortId) {
        self.settle_partial(port);
    }

    /// The port's connection closed or was replaced: a frame pending at the
    /// cut will never complete.
    pub(crate) fn connection_changed(&mut self, port: PortId) {
        self.settle_partial(port);
    }

    fn settle_partial(&mut self, port: PortId) {
        if let Some(p) = self.ports.get_mut(&port) {
            if p.partial_pending {
                p.partial_pending = false;
                p.sends_post = true;
            }
        }
    }

    /// Rule 1 for a frame of color `color` queued for `target`: returns
    /// whether the target must be held, and queues a trigger the first time.
    pub(crate) fn on_enqueue(&mut self, target: PortId, color: Option<Color>) -> bool {
        if !needs_auto_hold(color, self.receiver(target)) {
            return false;
        }
        let p = self
            .ports
            .get_mut(&target)
            .expect("pre receiver is in the session");
        p.auto_held = true;
        if !p.triggered {
            p.triggered = true;
            self.tally.triggers += 1;
            self.pending_triggers.push(target);
        }
        true
    }

    /// Notes that the session put a hold on `port` (it releases it at the end).
    pub(crate) fn note_session_hold(&mut self, port: PortId) {
        if let Some(p) = self.ports.get_mut(&port) {
            p.session_hold = true;
        }
    }

    /// The hold on `port` was released (by `release`).
    pub(crate) fn released(&mut self, port: PortId) {
        if let Some(p) = self.ports.get_mut(&port) {
            p.session_hold = false;
        }
    }

    /// Whether `release` must keep `port` held: it is pre and post-tagged
    /// frames are queued for it.
    pub(crate) fn blocks_release(&self, port: PortId) -> bool {
        self.ports
            .get(&port)
            .is_some_and(|p| p.cut.is_none() && p.auto_held)
    }

    /// Ports the session holds, by increasing id.
    pub(crate) fn session_holds(&self) -> Vec<PortId> {
        self.ports
            .iter()
            .filter(|(_, p)| p.session_hold)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Counts a frame of `len` bytes routed from `from` to `to`.
    pub(crate) fn count_pair(
        &mut self,
        from: (PortId, &str),
        to: (PortId, &str),
        len: usize,
        unicast: bool,
    ) {
        let pair = self
            .pairs
            .entry((from.0, to.0))
            .or_insert_with(|| PairCount {
                from: from.1.to_owned(),
                to: to.1.to_owned(),
                frames: 0,
                bytes: 0,
                unicast_frames: 0,
            });
        pair.frames += 1;
        pair.unicast_frames += u64::from(unicast);
        pair.bytes += len as u64;
    }

    /// Checks that `port` can be prepared or cut.
    pub(crate) fn check_cuttable(&self, port: PortId) -> Result<()> {
        match self.ports.get(&port) {
            None => Err(SwitchError::NotInCutSession {
                port,
                epoch: self.epoch,
            }),
            Some(p) if p.cut.is_some() => Err(SwitchError::AlreadyCut {
                port,
                epoch: self.epoch,
            }),
            Some(_) => Ok(()),
        }
    }

    /// Cuts `port` (see [`check_cuttable`](Self::check_cuttable)) when the
    /// core's next queue sequence is `seq`.
    pub(crate) fn cut(&mut self, port: PortId, now_us: u64, seq: u64, partial_pending: bool) {
        if let Some(p) = self.ports.get_mut(&port) {
            p.cut = Some(CutMark {
                at_unix_us: now_us,
                seq,
            });
            p.partial_pending = partial_pending;
            p.sends_post = !partial_pending;
        }
    }

    /// Records how a `prepare_cut` ended.
    pub(crate) fn record_prepare(&mut self, r: &super::PrepareReport) {
        self.tally.bound_hits += u64::from(r.bound_hit);
        self.tally.unread_bytes_at_cut += r.unread_bytes as u64;
        self.tally.unsettled_cuts += u64::from(r.unsettled);
    }

    /// Name of a session port.
    pub(crate) fn port_name(&self, port: PortId) -> Option<&str> {
        self.ports.get(&port).map(|p| p.name.as_str())
    }

    /// Appends a frame to the log, unless that would exceed the bound (then
    /// it is counted as overflow and `None` returned).
    pub(crate) fn log(&mut self, frame: LoggedFrame) -> Option<LogRef> {
        let len = frame.data.len() as u64;
        if self.tally.logged_bytes + len > self.max_log_bytes as u64 {
            self.tally.log_overflow += 1;
            return None;
        }
        self.tally.logged += 1;
        self.tally.logged_bytes += len;
        self.log.push(Some(frame));
        Some(LogRef {
            serial: self.serial,
            index: self.log.len() - 1,
        })
    }

    /// Takes a frame out of the log again (it was not handed over after
    /// all). Returns whether it was in this session's log.
    pub(crate) fn unlog(&mut self, r: LogRef) -> bool {
        if r.serial != self.serial {
            return false;
        }
        let Some(frame) = self.log.get_mut(r.index).and_then(Option::take) else {
            return false;
        };
        self.tally.logged -= 1;
        self.tally.logged_bytes -= frame.data.len() as u64;
        true
    }

    pub(crate) fn count_violation(&mut self) {
        self.tally.violations += 1;
    }

    pub(crate) fn take_triggers(&mut self) -> Vec<PortId> {
        std::mem::take(&mut self.pending_triggers)
    }

    /// The session's stats, given the core's current totals and the number
    /// of pre-tagged frames queued for post ports.
    pub(crate) fn stats(&self, totals: &Counters, pending_pre_frames: u64) -> SessionStats {
        let t = &self.tally;
        let ports = self
            .ports
            .iter()
            .map(|(&port, p)| SessionPort {
                port,
                name: p.name.clone(),
                color: if p.cut.is_some() {
                    Color::Post
                } else {
                    Color::Pre
                },
                cut_unix_us: p.cut.map(|c| c.at_unix_us),
                auto_held: p.auto_held,
                partial_pending: p.partial_pending,
                triggered: p.triggered,
                session_hold: p.session_hold,
            })
            .collect();
        SessionStats {
            epoch: self.epoch,
            forwarded: totals.tx_frames - self.base.tx_frames,
            held: totals.held - self.base.held,
            logged: t.logged,
            logged_bytes: t.logged_bytes,
            dropped: totals.drops - self.base.drops,
            violations: t.violations,
            triggers: t.triggers,
            bound_hits: t.bound_hits,
            unread_bytes_at_cut: t.unread_bytes_at_cut,
            unsettled_cuts: t.unsettled_cuts,
            pending_pre_frames,
            log_overflow: t.log_overflow,
            unlogged_at_end: 0,
            pairs: self.pairs.values().cloned().collect(),
            ports,
        }
    }

    /// The log, in the order frames were handed over.
    pub(crate) fn into_frames(self) -> Vec<LoggedFrame> {
        self.log.into_iter().flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pop_rules() {
        use Color::*;
        let post = Receiver::Post { cut_seq: 10 };
        assert_eq!(
            classify_pop(Some(Pre), post, 9),
            PopAction::Log(LogReason::HeldAtCut)
        );
        assert_eq!(
            classify_pop(Some(Pre), post, 10),
            PopAction::Log(LogReason::InFlight)
        );
        assert_eq!(classify_pop(Some(Post), post, 3), PopAction::Deliver);
        assert_eq!(classify_pop(None, post, 3), PopAction::Deliver);
        assert_eq!(
            classify_pop(Some(Post), Receiver::Pre, 3),
            PopAction::Violation
        );
        assert_eq!(
            classify_pop(Some(Pre), Receiver::Pre, 3),
            PopAction::Deliver
        );
        for c in [None, Some(Pre), Some(Post)] {
            assert_eq!(classify_pop(c, Receiver::Outside, 3), PopAction::Deliver);
            assert!(!needs_auto_hold(c, Receiver::Outside));
            assert!(!needs_auto_hold(c, post));
        }
        assert!(needs_auto_hold(Some(Post), Receiver::Pre));
        assert!(!needs_auto_hold(Some(Pre), Receiver::Pre));
        assert!(!needs_auto_hold(None, Receiver::Pre));
    }

    #[test]
    fn log_bound_and_unlog() {
        let mut s = Session::new(
            7,
            1,
            [(PortId::from_raw(0), "a".into())],
            10,
            Counters::default(),
        );
        let frame = |n: usize| LoggedFrame {
            sender: "a".into(),
            receiver: "a".into(),
            sender_port: PortId::from_raw(0),
            receiver_port: PortId::from_raw(0),
            received_unix_us: 0,
            delivered_unix_us: 0,
            reason: LogReason::InFlight,
            data: vec![0; n],
        };
        let r1 = s.log(frame(6)).unwrap();
        assert!(s.log(frame(6)).is_none(), "beyond the bound");
        let r2 = s.log(frame(4)).unwrap();
        assert_eq!(
            (s.tally.logged, s.tally.logged_bytes, s.tally.log_overflow),
            (2, 10, 1)
        );
        assert!(s.unlog(r1));
        assert!(!s.unlog(r1), "only once");
        assert!(
            !s.unlog(LogRef {
                serial: 2,
                index: 1
            }),
            "other session"
        );
        assert_eq!((s.tally.logged, s.tally.logged_bytes), (1, 4));
        let _ = r2;
        assert_eq!(s.into_frames(), vec![frame(4)]);
    }
}
