//! Statistics snapshots returned by [`SwitchHandle::stats`](crate::SwitchHandle::stats).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::core::{Counters, PortId};

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
    /// Path the port's peer (QEMU) listens on, which the switch dials.
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
