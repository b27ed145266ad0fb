//! Whether a port is connected to its peer, and waiting until it is: what
//! the agent needs after (re)starting a VM's QEMU, which listens at the
//! port's socket path and is connected by the switch on its own.

use std::time::{Duration, Instant};

use super::{Command, SwitchHandle};
use crate::core::PortId;
use crate::error::Result;

/// Longest sleep between two polls of [`SwitchHandle::wait_connected`].
const POLL: Duration = Duration::from_millis(1);

/// See [`SwitchHandle::connection_state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectionState {
    /// Whether the switch holds a connection to the port's peer (else it is
    /// dialing).
    pub connected: bool,
    /// Successful connects so far (the port's `connections` counter): a new
    /// QEMU is connected once this exceeds its value from before the old
    /// QEMU went away.
    pub connections: u64,
}

impl ConnectionState {
    /// Connected, by connection number `min_connections` or a later one.
    pub fn connected_since(&self, min_connections: u64) -> bool {
        self.connected && self.connections >= min_connections
    }
}

impl SwitchHandle {
    /// Whether the port is connected to its peer, and how many times it
    /// connected so far. Cheap (one round trip to the event loop).
    pub fn connection_state(&self, port: PortId) -> Result<ConnectionState> {
        self.request(|reply| Command::Connection { port, reply })?
    }

    /// Whether the port is connected to its peer.
    pub fn port_connected(&self, port: PortId) -> Result<bool> {
        Ok(self.connection_state(port)?.connected)
    }

    /// Waits, at most `bound`, until the port is connected by connection
    /// number `min_connections` or a later one
    /// ([`ConnectionState::connected_since`]), polling from the calling
    /// thread; returns the last state seen (check `connected_since` on it).
    ///
    /// To wait for a restarted QEMU: read `connections` before the old
    /// QEMU goes away, start the new one, and wait with that value plus 1
    /// (the old connection may still look connected until the switch sees
    /// its EOF).
    pub fn wait_connected(
        &self,
        port: PortId,
        min_connections: u64,
        bound: Duration,
    ) -> Result<ConnectionState> {
        let start = Instant::now();
        loop {
            let state = self.connection_state(port)?;
            let elapsed = start.elapsed();
            if state.connected_since(min_connections) || elapsed >= bound {
                return Ok(state);
            }
            std::thread::sleep(POLL.min(bound - elapsed));
        }
    }
}
