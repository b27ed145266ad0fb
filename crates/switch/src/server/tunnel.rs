//! The control-API side of tunnel ports ([`SwitchHandle::add_tunnel`]):
//! a port that is another host's switch, reached by UDP datagrams (see
//! [`crate::tunnel`] for the wire format and `event_loop/tunnel.rs` for the
//! I/O).

use std::net::SocketAddr;
use std::time::Duration;

use super::{Command, SwitchHandle};
use crate::core::PortId;
use crate::error::{Result, SwitchError};
use crate::tunnel::{HEADER_LEN, MIN_FRAME_LEN};

/// The largest UDP payload over IPv4 (65535 less the IP and UDP headers):
/// the default [`TunnelConfig::max_datagram_len`], right for loopback.
pub const MAX_UDP_PAYLOAD: usize = 65507;

/// How often each end of a tunnel sends a keepalive.
pub const TUNNEL_KEEPALIVE: Duration = Duration::from_secs(1);

/// A tunnel's peer counts as alive while a datagram came from it within
/// this many ms (three keepalives).
pub const TUNNEL_PEER_ALIVE_MS: u64 = 3000;

/// A tunnel port: this switch's end at `local`, the other switch's at
/// `remote`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelConfig {
    /// The port's name (unique among the switch's ports).
    pub name: String,
    /// The UDP address to bind.
    pub local: SocketAddr,
    /// The other switch's tunnel address: datagrams go there, and only
    /// datagrams from there are received (the socket is connected).
    pub remote: SocketAddr,
    /// The largest datagram the path carries without fragmenting (header
    /// included): a frame that does not fit is dropped and counted in
    /// `too_large`, never split. Default [`MAX_UDP_PAYLOAD`] (loopback);
    /// between hosts, the path MTU less 28 (IPv4 and UDP headers).
    pub max_datagram_len: usize,
}

impl TunnelConfig {
    /// A tunnel with the default [`max_datagram_len`](Self::max_datagram_len).
    pub fn new(name: &str, local: SocketAddr, remote: SocketAddr) -> Self {
        TunnelConfig {
            name: name.to_owned(),
            local,
            remote,
            max_datagram_len: MAX_UDP_PAYLOAD,
        }
    }

    /// Checks the datagram bound: room for a header and the shortest frame,
    /// no more than a UDP datagram.
    pub(crate) fn validate(&self) -> Result<()> {
        let min = HEADER_LEN + MIN_FRAME_LEN;
        if (min..=MAX_UDP_PAYLOAD).contains(&self.max_datagram_len) {
            Ok(())
        } else {
            Err(SwitchError::TunnelDatagramLen {
                name: self.name.clone(),
                len: self.max_datagram_len,
                min,
                max: MAX_UDP_PAYLOAD,
            })
        }
    }
}

impl SwitchHandle {
    /// Adds a tunnel port to another host's switch (see
    /// [`add_tunnel_with`](Self::add_tunnel_with)), with the default
    /// datagram bound.
    pub fn add_tunnel(&self, name: &str, local: SocketAddr, remote: SocketAddr) -> Result<PortId> {
        self.add_tunnel_with(TunnelConfig::new(name, local, remote))
    }

    /// Adds a tunnel port: binds a UDP socket at `config.local`, connected
    /// to `config.remote`, and treats the other switch as one more port.
    /// Frames routed to it go out as one datagram each, their header
    /// carrying the sender's color at reception; frames received from it
    /// are switched with the color their header carries (see
    /// [`crate::tunnel`] and docs/network.md). MACs learned on it route to
    /// it. Both ends send a keepalive every [`TUNNEL_KEEPALIVE`]. The port
    /// counts as connected from the start (UDP needs no handshake);
    /// [`PortStats::tunnel`](crate::PortStats::tunnel) tells whether the
    /// peer is alive and counts the datagrams.
    ///
    /// Fails with [`SwitchError::DuplicateName`],
    /// [`SwitchError::TunnelDatagramLen`], or [`SwitchError::TunnelSocket`]
    /// when the address cannot be bound (in use, not local) or connected.
    pub fn add_tunnel_with(&self, config: TunnelConfig) -> Result<PortId> {
        config.validate()?;
        self.request(|reply| Command::AddTunnel { config, reply })?
    }
}
