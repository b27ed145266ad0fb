//! Dialing: connecting each port without a connection to its peer, again
//! and again until it succeeds.
//!
//! A port is dialed right away when it is added (or thawed without a
//! connection), then every [`RETRY`] while the attempts fail, and again
//! [`RETRY`] after its connection closed. The loop never spins: it sleeps
//! in `poll` until the earliest due attempt ([`EventLoop::dial_timeout`]).
//! Failures that only mean "the peer does not listen yet"
//! ([`peer::is_not_yet`]) are logged at debug level, others as warnings;
//! a streak of identical failures is logged once.

use super::*;

/// Pause between two connection attempts of a port.
pub(crate) const RETRY: Duration = Duration::from_millis(20);

impl EventLoop {
    /// How long `poll` may sleep before a port is due for dialing; `None`
    /// when every port is connected.
    pub(super) fn dial_timeout(&self, now: Instant) -> Option<Duration> {
        self.ports
            .values()
            .filter(|io| io.conn.is_none())
            .map(|io| io.next_dial.saturating_duration_since(now))
            .min()
    }

    /// Dials every port without a connection whose attempt is due.
    pub(super) fn dial_due(&mut self, now: Instant) {
        let due: Vec<PortId> = self
            .ports
            .iter()
            .filter(|(_, io)| io.conn.is_none() && io.next_dial <= now)
            .map(|(&id, _)| id)
            .collect();
        for port in due {
            self.dial(port, now);
        }
    }

    /// One connection attempt for `port` (which has no connection).
    pub(super) fn dial(&mut self, port: PortId, now: Instant) {
        let Some(io) = self.ports.get_mut(&port) else {
            return;
        };
        debug_assert!(io.conn.is_none(), "a port holds one connection at most");
        let failed = match peer::dial(&io.addr) {
            Ok(mut stream) => {
                let interest = Interest::READABLE | Interest::WRITABLE;
                match self
                    .poll
                    .registry()
                    .register(&mut stream, conn_token(port), interest)
                {
                    Ok(()) => {
                        io.conn = Some(Conn::new(stream));
                        io.last_dial_error = None;
                        log::debug!("{port}: connected to {}", io.path.display());
                        self.core.client_connected(port);
                        self.dirty.insert(port);
                        return;
                    }
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        io.next_dial = now + RETRY;
        let code = failed.raw_os_error();
        if io.last_dial_error.is_some() && io.last_dial_error == code {
            return;
        }
        io.last_dial_error = code.or(Some(-1));
        if peer::is_not_yet(&failed) {
            log::debug!(
                "{port}: no peer listening at {} yet ({failed}); retrying every {RETRY:?}",
                io.path.display()
            );
        } else {
            log::warn!(
                "{port}: cannot connect to {}: {failed}; retrying every {RETRY:?}",
                io.path.display()
            );
        }
    }

    pub(super) fn connection_state(&self, port: PortId) -> Result<ConnectionState> {
        if self.tunnels.contains_key(&port) {
            let v = self.core.port(port).ok_or(SwitchError::UnknownPort(port))?;
            return Ok(ConnectionState {
                connected: v.connected,
                connections: v.counters.connections,
            });
        }
        let io = self
            .ports
            .get(&port)
            .ok_or(SwitchError::UnknownPort(port))?;
        let connections = self.core.port(port).map_or(0, |v| v.counters.connections);
        Ok(ConnectionState {
            connected: io.conn.is_some(),
            connections,
        })
    }
}
