//! Waiting, before a VM is paused, until its QEMU has read everything the
//! switch wrote to it and handed it to the guest: the socket drain and the
//! cut probes of [`crate::mediator::probe`]. Used by the cut of a cluster
//! snapshot and by a VMM restart (a QEMU that quits loses its net queue).

use std::time::{Duration, Instant};

use super::{Command, DrainState, SwitchHandle};
use crate::core::PortId;
use crate::error::Result;

/// Longest sleep between two `SIOCOUTQ` polls.
const POLL: Duration = Duration::from_micros(150);

/// What [`SwitchHandle::settle`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SettleReport {
    /// The port's drain state when it returned.
    pub state: DrainState,
    /// From the call to the socket drained (or the return).
    pub drained_after: Duration,
    /// From the call to the return.
    pub waited: Duration,
    /// Probes read, in turn.
    pub probes_read: u32,
    /// A peer was connected and fewer probes than asked for were read:
    /// it may hold frames it read but had not handed to the guest.
    pub unsettled: bool,
}

impl SettleReport {
    /// Socket drained to the return: how long the guest took to take what
    /// its QEMU had read.
    pub fn settle_time(&self) -> Duration {
        self.waited.saturating_sub(self.drained_after)
    }
}

impl SwitchHandle {
    /// For a port the caller holds: waits until its peer has read
    /// everything written to it (`SIOCOUTQ` of the switch's end is 0), then
    /// writes `probes` cut probes in turn, each read before the next, so
    /// that the peer (QEMU) has handed every frame to the guest; at most
    /// `bound` in all. Polls every ~150 µs from the calling thread.
    pub fn settle(&self, port: PortId, bound: Duration, probes: u32) -> Result<SettleReport> {
        let start = Instant::now();
        let mut state = self.wait_drained(port, start, bound)?;
        let drained_after = start.elapsed();
        let mut probes_read = 0;
        while state.is_drained() && state.connected && probes_read < probes {
            if !self.request(|reply| Command::Probe { port, reply })?? {
                break;
            }
            state = self.wait_drained(port, start, bound)?;
            probes_read += u32::from(state.is_drained());
        }
        Ok(SettleReport {
            state,
            drained_after,
            waited: start.elapsed(),
            probes_read,
            unsettled: state.connected && probes_read < probes,
        })
    }

    /// Polls the port's drain state until drained or `bound` after `start`.
    fn wait_drained(&self, port: PortId, start: Instant, bound: Duration) -> Result<DrainState> {
        loop {
            let state = self.drain_state(port)?;
            let elapsed = start.elapsed();
            if state.is_drained() || elapsed >= bound {
                return Ok(state);
            }
            std::thread::sleep(POLL.min(bound - elapsed));
        }
    }
}
