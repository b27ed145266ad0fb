//! The event loop's side of a cut session (see [`crate::mediator`]): the
//! I/O around the core's session methods.

use super::*;
use crate::mediator::{CutReport, PrepareReport, SessionLog, SessionStats};

impl EventLoop {
    pub(super) fn begin_cut_session(
        &mut self,
        epoch: u64,
        ports: &[PortId],
        triggers: Sender<PortId>,
    ) -> Result<()> {
        for &p in ports {
            self.known(p)?;
            if self.tunnels.contains_key(&p) {
                return Err(SwitchError::TunnelInCutSession(p));
            }
        }
        self.core.begin_session(epoch, ports, self.max_log_bytes)?;
        self.triggers = Some(triggers);
        log::debug!("cut session {epoch} begun over {ports:?}");
        Ok(())
    }

    /// Holds the port for its cut; the handle then polls its drain state.
    pub(super) fn prepare_cut(&mut self, port: PortId) -> Result<()> {
        self.known(port)?;
        self.core.prepare_cut(port)?;
        self.take_back_unstarted(port);
        Ok(())
    }

    /// Writes a cut probe ([`crate::mediator::probe`]) to the port's peer
    /// if nothing else is on its way to it; `false` if it was not written
    /// (no peer, or frames still being written).
    pub(super) fn probe(&mut self, port: PortId) -> Result<bool> {
        self.known(port)?;
        let Some(conn) = self.ports.get_mut(&port).and_then(|io| io.conn.as_mut()) else {
            return Ok(false);
        };
        if !conn.out.is_empty() {
            return Ok(false);
        }
        conn.out
            .push_probe(&crate::mediator::probe::PROBE_FRAME)
            .expect("the probe frame is a valid frame");
        self.flush(port);
        Ok(true)
    }

    pub(super) fn prepare_done(&mut self, port: PortId, report: PrepareReport) -> Result<()> {
        self.known(port)?;
        if report.bound_hit {
            log::warn!(
                "{port}: peer did not read everything before its cut \
                 ({} bytes unread after {} µs)",
                report.unread_bytes,
                report.waited_us
            );
        }
        if report.unsettled {
            log::warn!(
                "{port}: peer did not read both cut probes before its cut \
                 ({} read, {} µs after the drain): it may hold frames the guest \
                 has not taken",
                report.probes_read,
                report.settle_us
            );
        }
        self.core.record_prepare(&report)
    }

    /// Switches everything the paused peer already wrote, then cuts.
    pub(super) fn cut(&mut self, port: PortId) -> Result<CutReport> {
        self.known(port)?;
        self.core.check_cuttable(port)?;
        let count = self.read_conn(port, None);
        // The connection may have closed while reading; then nothing is pending.
        let partial_pending = self
            .ports
            .get(&port)
            .and_then(|io| io.conn.as_ref())
            .is_some_and(|c| c.decoder.buffered_len() > 0);
        self.core.set_now(unix_us());
        self.core.cut(port, partial_pending)?;
        self.mark_tunnels_if_all_post();
        log::debug!(
            "{port}: cut after draining {} frames ({} bytes){}",
            count.frames,
            count.bytes,
            if partial_pending {
                ", half a frame pending"
            } else {
                ""
            }
        );
        Ok(CutReport {
            frames_drained: count.frames,
            bytes_drained: count.bytes,
            partial_pending,
        })
    }

    pub(super) fn end_cut_session(&mut self) -> Result<SessionLog> {
        self.send_triggers();
        let (log, released) = self.core.end_session()?;
        self.session_ended(released);
        Ok(log)
    }

    pub(super) fn abort_cut_session(&mut self) -> Result<SessionStats> {
        self.send_triggers();
        let (stats, released) = self.core.abort_session()?;
        self.session_ended(released);
        Ok(stats)
    }

    fn session_ended(&mut self, released: Vec<PortId>) {
        self.triggers = None;
        self.dirty.extend(released);
    }

    /// Reports ports the core auto-held on the session's triggers channel.
    pub(super) fn send_triggers(&mut self) {
        for port in self.core.take_triggers() {
            if let Some(tx) = &self.triggers {
                // A receiver that went away does not stop the session.
                let _ = tx.send(port);
            }
        }
    }
}
