//! Statistics snapshots returned by [`SwitchHandle::stats`](crate::SwitchHandle::stats).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::core::{Counters, PortId};
use crate::tunnel::TunnelError;

/// State and counters of one port.
///
/// Serialized flat: the [`Counters`] fields appear next to `name`,
/// `connected` and the others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortStats {
    /// Port id.
    pub id: PortId,
    /// Port name given to `add_port`.
    pub name: String,
    /// Path the port's peer (QEMU) listens on, which the switch dials;
    /// empty for a tunnel port.
    pub socket_path: PathBuf,
    /// Whether the switch holds a connection to the port's peer; `false`
    /// while it is dialing (the peer is not listening yet, is gone, or the
    /// last connection ended). See `counters.connections` for how many
    /// times it connected.
    pub connected: bool,
    /// Whether the port is currently held.
    pub holding: bool,
    /// Frames waiting for this port (queued, or in the current write batch).
    pub queued_frames: u64,
    /// Bytes waiting for this port: queued frame bytes plus the unwritten
    /// rest of the current write batch (which includes length prefixes).
    pub queued_bytes: u64,
    /// Frame and byte counters.
    #[serde(flatten)]
    pub counters: Counters,
    /// For a tunnel port ([`SwitchHandle::add_tunnel`](crate::SwitchHandle::add_tunnel)):
    /// its addresses and datagram counters; `None` for a VM's port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<TunnelPortStats>,
}

/// State of a tunnel port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunnelPortStats {
    /// The local UDP address the tunnel is bound to.
    pub local: SocketAddr,
    /// The other switch's tunnel address.
    pub remote: SocketAddr,
    /// A datagram (frame or keepalive) came from the other switch within
    /// the last [`PEER_ALIVE_MS`](crate::server::TUNNEL_PEER_ALIVE_MS).
    pub peer_alive: bool,
    /// The other switch's latest word that its cut session is complete
    /// (every VM cut: it sends no more pre frames of that epoch), and how
    /// many datagrams it sent before saying so have not arrived yet.
    /// Before ending a cut session of that epoch, wait (bounded) for
    /// `missing` 0 on every tunnel: pre frames still in the network would
    /// otherwise arrive after the session, unlogged.
    #[serde(default)]
    pub peer_cut: Option<PeerCut>,
    /// Datagram counters.
    pub counters: TunnelCounters,
}

/// See [`TunnelPortStats::peer_cut`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerCut {
    /// The epoch of the other switch's session whose ports are all cut.
    pub epoch: u64,
    /// Datagrams it sent before that word that have not arrived (within
    /// the sequence window of 64; older ones are delivered or lost).
    pub missing: u64,
}

/// Datagram counters of a tunnel (or summed over every tunnel).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunnelCounters {
    /// Datagrams sent (frames and keepalives).
    pub datagrams_sent: u64,
    /// Of them, keepalives.
    pub keepalives_sent: u64,
    /// Datagrams received with a valid header (duplicates and stale ones
    /// included; refused ones not).
    pub datagrams_received: u64,
    /// Of them, keepalives delivered.
    pub keepalives_received: u64,
    /// Frames delivered to the switch (each at most once).
    pub frames_received: u64,
    /// Datagrams dropped as repeated (UDP duplicated them).
    pub duplicates: u64,
    /// Datagrams dropped as too old to tell or from an older incarnation
    /// of the other switch.
    pub stale: u64,
    /// Datagrams that have not arrived: gaps in the sequence, less those
    /// that arrived late.
    pub lost: u64,
    /// Datagrams delivered after a newer one (reordered).
    pub late: u64,
    /// The other switch started again (a larger incarnation).
    pub restarts: u64,
    /// Frames whose header named another cut epoch than this switch's
    /// active session (or with no session active): switched untagged.
    pub other_epoch: u64,
    /// Frames too large for one datagram of the tunnel's path: dropped
    /// (also counted in the port's `drops`), never split.
    pub too_large: u64,
    /// Datagrams the socket refused to send (e.g. nobody bound at the
    /// remote address yet): the frame is dropped and counted in `drops`.
    pub send_errors: u64,
    /// Datagrams refused, by reason.
    pub refused: RefusedCounts,
}

/// Received datagrams refused by [`crate::tunnel::decode`], by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedCounts {
    /// Shorter than the header.
    pub short: u64,
    /// Not starting with "VMTN".
    pub magic: u64,
    /// Another version.
    pub version: u64,
    /// An unknown kind.
    pub kind: u64,
    /// An unknown color.
    pub color: u64,
    /// Flags set.
    pub flags: u64,
    /// Untagged with an epoch.
    pub untagged_epoch: u64,
    /// A payload of an impossible length.
    pub payload_len: u64,
}

impl RefusedCounts {
    /// Counts one datagram refused with `e`.
    pub fn count(&mut self, e: &TunnelError) {
        let c = match e {
            TunnelError::Short(_) => &mut self.short,
            TunnelError::Magic(_) => &mut self.magic,
            TunnelError::Version(_) => &mut self.version,
            TunnelError::Kind(_) => &mut self.kind,
            TunnelError::Color(_) => &mut self.color,
            TunnelError::Flags(_) => &mut self.flags,
            TunnelError::UntaggedEpoch(_) => &mut self.untagged_epoch,
            TunnelError::PayloadLen { .. } => &mut self.payload_len,
        };
        *c += 1;
    }

    /// All refused datagrams.
    pub fn total(&self) -> u64 {
        self.short
            + self.magic
            + self.version
            + self.kind
            + self.color
            + self.flags
            + self.untagged_epoch
            + self.payload_len
    }

    fn add(&mut self, o: &RefusedCounts) {
        self.short += o.short;
        self.magic += o.magic;
        self.version += o.version;
        self.kind += o.kind;
        self.color += o.color;
        self.flags += o.flags;
        self.untagged_epoch += o.untagged_epoch;
        self.payload_len += o.payload_len;
    }
}

impl TunnelCounters {
    /// Adds `o` to these counters.
    pub fn add(&mut self, o: &TunnelCounters) {
        self.datagrams_sent += o.datagrams_sent;
        self.keepalives_sent += o.keepalives_sent;
        self.datagrams_received += o.datagrams_received;
        self.keepalives_received += o.keepalives_received;
        self.frames_received += o.frames_received;
        self.duplicates += o.duplicates;
        self.stale += o.stale;
        self.lost += o.lost;
        self.late += o.late;
        self.restarts += o.restarts;
        self.other_epoch += o.other_epoch;
        self.too_large += o.too_large;
        self.send_errors += o.send_errors;
        self.refused.add(&o.refused);
    }
}

/// Snapshot of the whole switch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchStats {
    /// Current ports, by increasing id.
    pub ports: Vec<PortStats>,
    /// Counters summed over every port the switch ever had, including
    /// removed ones.
    pub totals: Counters,
    /// Sum of `queued_bytes` over the current ports.
    pub queued_bytes: u64,
    /// Tunnel counters summed over the current tunnel ports.
    #[serde(default)]
    pub tunnels: TunnelCounters,
}

impl SwitchStats {
    /// Stats of the port with this id.
    pub fn port(&self, id: PortId) -> Option<&PortStats> {
        self.ports.iter().find(|p| p.id == id)
    }

    /// Stats of the port with this name.
    pub fn port_by_name(&self, name: &str) -> Option<&PortStats> {
        self.ports.iter().find(|p| p.name == name)
    }
}
