//! The cut-session API of [`SwitchHandle`]: the agent's side of the
//! [packet mediator](crate::mediator).

use std::sync::mpsc::Sender;
use std::time::Duration;

use super::{Command, SwitchHandle};
use crate::core::PortId;
use crate::error::Result;
use crate::mediator::probe::PROBES_BEFORE_PAUSE;
use crate::mediator::{CutReport, PrepareReport, SessionLog, SessionStats};

impl SwitchHandle {
    /// Begins a cut session for a cluster snapshot: `ports` are the VMs of
    /// the snapshot, all pre (not cut); every other port is outside. Each
    /// pre port that gets a frame sent after another VM's cut is held and
    /// reported once on `triggers`: snapshot that VM at once. See
    /// [`crate::mediator`] for the rules.
    ///
    /// Fails with [`SwitchError::CutSessionActive`](crate::SwitchError::CutSessionActive)
    /// while another session is active, and
    /// [`SwitchError::UnknownPort`](crate::SwitchError::UnknownPort) for a
    /// port that does not exist.
    pub fn begin_cut_session(
        &self,
        epoch: u64,
        ports: &[PortId],
        triggers: Sender<PortId>,
    ) -> Result<()> {
        let ports = ports.to_vec();
        self.request(|reply| Command::BeginCutSession {
            epoch,
            ports,
            triggers,
            reply,
        })?
    }

    /// First step of cutting a port, before pausing its VM: holds the port
    /// (frames of the write batch not started yet are taken back, a partly
    /// written frame completes), waits until its peer has read everything
    /// written to it (`SIOCOUTQ` of the switch's end is 0), then writes
    /// [`PROBES_BEFORE_PAUSE`] cut probes in turn, each read before the
    /// next, so that the peer (QEMU) has also handed every frame to the
    /// guest (see [`crate::mediator::probe`] and [`SwitchHandle::settle`]).
    /// All of it at most `bound`.
    ///
    /// A report with `bound_hit` means frames the peer has not read yet
    /// are in its socket: they will reach the VM after its cut, unlogged.
    /// One with fewer probes read than asked for means the peer may hold
    /// frames it read but could not hand to the guest yet: a restore of
    /// the VM lacks them (TCP retransmits them). Both are counted in the
    /// session stats.
    pub fn prepare_cut(&self, port: PortId, bound: Duration) -> Result<PrepareReport> {
        self.prepare_cut_with(port, bound, PROBES_BEFORE_PAUSE)
    }

    /// [`prepare_cut`](Self::prepare_cut) with `probes` probes (0: the
    /// socket drain only).
    pub fn prepare_cut_with(
        &self,
        port: PortId,
        bound: Duration,
        probes: u32,
    ) -> Result<PrepareReport> {
        self.request(|reply| Command::PrepareCut { port, reply })??;
        let s = self.settle(port, bound, probes)?;
        let report = PrepareReport {
            waited_us: s.waited.as_micros() as u64,
            bound_hit: !s.state.is_drained(),
            unread_bytes: s.state.unread_bytes,
            partial_bytes: s.state.partial_bytes,
            probes_read: s.probes_read,
            unsettled: s.unsettled,
            settle_us: s.settle_time().as_micros() as u64,
        };
        self.request(|reply| Command::PrepareDone {
            port,
            report,
            reply,
        })??;
        Ok(report)
    }

    /// The cut of a port, once its VM is paused: reads everything its
    /// peer already wrote (whatever the read budget) and switches it as
    /// pre-tagged, then marks the port post. If half a frame is left, that
    /// frame is still tagged pre when it completes and the port's frames
    /// turn post right after it (`partial_pending`).
    ///
    /// Allowed without [`prepare_cut`](Self::prepare_cut) (then nothing
    /// guarantees the VM read what was sent to it before the pause). Fails
    /// for a port outside the session or already cut.
    pub fn cut(&self, port: PortId) -> Result<CutReport> {
        self.request(|reply| Command::Cut { port, reply })?
    }

    /// Stats of the active cut session, `None` if there is none.
    pub fn session_stats(&self) -> Result<Option<SessionStats>> {
        self.request(|reply| Command::SessionStats { reply })
    }

    /// Ends the cut session and returns its log (the channel state). Every
    /// hold the session made (prepare holds, auto holds) is released and the
    /// ports leave the session. Call it once every port is cut and released
    /// and [`SessionStats::pending_pre_frames`] is 0: pre-tagged frames still
    /// queued for post ports go out unlogged (counted in `unlogged_at_end`).
    pub fn end_cut_session(&self) -> Result<SessionLog> {
        self.request(|reply| Command::EndCutSession { reply })?
    }

    /// Aborts the cut session: releases every hold it made, discards the
    /// log and returns the stats. No frame is dropped.
    pub fn abort_cut_session(&self) -> Result<SessionStats> {
        self.request(|reply| Command::AbortCutSession { reply })?
    }
}
