//! The core's side of a cut session: applying the rules of the
//! [packet mediator](crate::mediator) to the ports and their queues.

use super::*;
use crate::error::{Result, SwitchError};
use crate::mediator::{LoggedFrame, PopAction, Receiver, SessionLog, SessionStats};

impl SwitchCore {
    /// Begins a cut session with epoch `epoch` over `ports` (all pre; every
    /// other port is outside), keeping at most `max_log_bytes` frame bytes
    /// of channel state. Frames already queued count as pre-tagged if their
    /// sender is in the session.
    ///
    /// Fails if a session is active or a port does not exist.
    pub fn begin_session(
        &mut self,
        epoch: u64,
        ports: &[PortId],
        max_log_bytes: usize,
    ) -> Result<()> {
        if let Some(s) = &self.session {
            return Err(SwitchError::CutSessionActive { epoch: s.epoch() });
        }
        let mut members = Vec::with_capacity(ports.len());
        for &id in ports {
            let p = self.ports.get(&id).ok_or(SwitchError::UnknownPort(id))?;
            members.push((id, p.name.clone()));
        }
        self.last_session_serial += 1;
        let serial = self.last_session_serial;
        self.session = Some(Session::new(
            epoch,
            serial,
            members,
            max_log_bytes,
            self.totals,
        ));
        Ok(())
    }

    /// Epoch of the active cut session.
    pub fn session_epoch(&self) -> Option<u64> {
        self.session.as_ref().map(|s| s.epoch())
    }

    fn session_ref(&self) -> Result<&Session> {
        self.session.as_ref().ok_or(SwitchError::NoCutSession)
    }

    /// Checks that `port` is a session port not cut yet.
    pub fn check_cuttable(&self, port: PortId) -> Result<()> {
        if !self.ports.contains_key(&port) {
            return Err(SwitchError::UnknownPort(port));
        }
        self.session_ref()?.check_cuttable(port)
    }

    /// First step of a cut: holds `port` on behalf of the session (released
    /// by [`release`](Self::release) or at the session's end). The I/O
    /// layer then takes back unstarted frames of its write batch and waits
    /// for its peer to read everything.
    pub fn prepare_cut(&mut self, port: PortId) -> Result<()> {
        self.check_cuttable(port)?;
        let p = self.ports.get_mut(&port).expect("checked");
        if !p.holding {
            p.holding = true;
            self.session
                .as_mut()
                .expect("checked")
                .note_session_hold(port);
        }
        Ok(())
    }

    /// Records how the wait of a prepare ended.
    pub fn record_prepare(&mut self, report: &crate::mediator::PrepareReport) -> Result<()> {
        let s = self.session.as_mut().ok_or(SwitchError::NoCutSession)?;
        s.record_prepare(report);
        Ok(())
    }

    /// Cuts `port`: it turns post, as a receiver at once and as a sender
    /// once a frame its peer had half sent completes (`partial_pending`).
    /// The I/O layer must first have switched every frame the peer wrote.
    pub fn cut(&mut self, port: PortId, partial_pending: bool) -> Result<()> {
        self.check_cuttable(port)?;
        let (now, seq) = (self.now_us, self.next_seq);
        let s = self.session.as_mut().expect("checked");
        s.cut(port, now, seq, partial_pending);
        Ok(())
    }

    /// Ports to report on the triggers channel (each once per session).
    pub fn take_triggers(&mut self) -> Vec<PortId> {
        self.session
            .as_mut()
            .map_or_else(Vec::new, Session::take_triggers)
    }

    /// Pre-tagged frames queued for post ports: logged when handed over.
    pub fn pending_pre_frames(&self) -> u64 {
        let Some(s) = &self.session else { return 0 };
        self.ports
            .iter()
            .filter(|(&id, _)| matches!(s.receiver(id), Receiver::Post { .. }))
            .flat_map(|(_, p)| p.queue.iter())
            .filter(|f| s.color_of(&f.tag) == Some(crate::mediator::Color::Pre))
            .count() as u64
    }

    /// Stats of the active cut session.
    pub fn session_stats(&self) -> Option<SessionStats> {
        let s = self.session.as_ref()?;
        Some(s.stats(&self.totals, self.pending_pre_frames()))
    }

    /// Ends the session: releases the holds it made and returns its log and
    /// the ports it released (to flush). Pre-tagged frames still queued for
    /// post ports will go out unlogged: counted in `unlogged_at_end`.
    pub fn end_session(&mut self) -> Result<(SessionLog, Vec<PortId>)> {
        let pending = self.pending_pre_frames();
        let session = self.session.take().ok_or(SwitchError::NoCutSession)?;
        let released = self.release_session_holds(&session);
        let mut stats = session.stats(&self.totals, pending);
        stats.unlogged_at_end = pending;
        let frames = session.into_frames();
        Ok((SessionLog { stats, frames }, released))
    }

    /// Aborts the session: releases the holds it made, discards its log and
    /// returns its stats and the ports it released.
    pub fn abort_session(&mut self) -> Result<(SessionStats, Vec<PortId>)> {
        let pending = self.pending_pre_frames();
        let session = self.session.take().ok_or(SwitchError::NoCutSession)?;
        let released = self.release_session_holds(&session);
        Ok((session.stats(&self.totals, pending), released))
    }

    fn release_session_holds(&mut self, session: &Session) -> Vec<PortId> {
        let mut released = Vec::new();
        for id in session.session_holds() {
            if let Some(p) = self.ports.get_mut(&id) {
                if p.holding {
                    p.holding = false;
                    released.push(id);
                    self.discard_if_unreachable(id);
                }
            }
        }
        released
    }

    /// The tag of a frame received on `ingress` now.
    pub(super) fn ingress_tag(&self, ingress: PortId) -> FrameTag {
        let (color, session, epoch) = match &self.session {
            Some(s) => (s.sender_color(ingress), s.serial(), s.epoch()),
            None => (None, 0, 0),
        };
        FrameTag {
            sender: Some(ingress),
            color,
            session,
            epoch,
            received_unix_us: self.now_us,
            seq: 0,
            log_ref: None,
        }
    }

    pub(super) fn count_pair(&mut self, from: PortId, to: PortId, len: usize, unicast: bool) {
        let Some(s) = self.session.as_mut() else {
            return;
        };
        let name = |id| self.ports.get(&id).map_or("", |p: &Port| p.name.as_str());
        s.count_pair((from, name(from)), (to, name(to)), len, unicast);
    }

    /// Rules 2 and 3 for `frame`, just taken from `id`'s queue.
    pub(super) fn mediate_pop(&mut self, id: PortId, frame: &mut QueuedFrame) {
        let Some(s) = self.session.as_mut() else {
            return;
        };
        let color = s.color_of(&frame.tag);
        match crate::mediator::classify_pop(color, s.receiver(id), frame.tag.seq) {
            PopAction::Deliver => {}
            PopAction::Violation => s.count_violation(),
            PopAction::Log(reason) => {
                // Only frames of session senders and tunnels have a color.
                let sender = frame.tag.sender.expect("a colored frame has a sender");
                let ports = &self.ports;
                let name = |id: PortId| {
                    s.port_name(id)
                        .or_else(|| ports.get(&id).map(|p| p.name.as_str()))
                        .map_or_else(|| id.to_string(), str::to_owned)
                };
                let logged = LoggedFrame {
                    sender: name(sender),
                    receiver: name(id),
                    sender_port: sender,
                    receiver_port: id,
                    received_unix_us: frame.tag.received_unix_us,
                    delivered_unix_us: self.now_us,
                    reason,
                    data: frame.data.to_vec(),
                };
                frame.tag.log_ref = s.log(logged);
                if frame.tag.log_ref.is_some() {
                    if let Some(p) = self.ports.get_mut(&id) {
                        p.counters.logged += 1;
                    }
                    self.totals.logged += 1;
                }
            }
        }
    }

    /// Releases a port whatever the session says, to provoke a violation.
    #[cfg(test)]
    pub(crate) fn force_release(&mut self, id: PortId) {
        if let Some(p) = self.ports.get_mut(&id) {
            p.holding = false;
        }
    }
}
