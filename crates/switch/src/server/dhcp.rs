//! The control-API side of the switch's DHCP server ([`crate::dhcp`]):
//! enabling it from [`SwitchConfig::dhcp`] and registering leases through
//! [`SwitchHandle`]. Kept apart from the event loop, which only forwards
//! [`Command::DhcpLease`] here.

use std::net::Ipv4Addr;
use std::sync::mpsc::Sender;

use super::{Command, SwitchConfig, SwitchHandle};
use crate::core::{MacAddr, PortId, SwitchCore};
use crate::dhcp::DhcpLease;
use crate::error::{Result, SwitchError};

/// Checks [`SwitchConfig::dhcp`] before a switch starts.
pub(super) fn validate(config: &SwitchConfig) -> Result<()> {
    if let Some(c) = &config.dhcp {
        c.validate()?;
    }
    Ok(())
}

/// Turns on the core's DHCP server as configured (validated by [`validate`]).
pub(crate) fn enable(core: &mut SwitchCore, config: &SwitchConfig) {
    if let Err(e) = core.set_dhcp(config.dhcp.clone()) {
        log::error!("switch: DHCP stays off: {e}");
    }
}

pub(crate) enum LeaseOp {
    Set(DhcpLease),
    Remove(MacAddr),
}

/// A lease change for the event loop to apply.
pub(crate) struct LeaseCommand {
    port: PortId,
    op: LeaseOp,
    reply: Sender<Result<bool>>,
}

impl LeaseCommand {
    /// Applies the change to the core and answers the caller.
    pub(crate) fn apply(self, core: &mut SwitchCore) {
        let result = if core.port(self.port).is_none() {
            Err(SwitchError::UnknownPort(self.port))
        } else {
            match self.op {
                LeaseOp::Set(lease) => core
                    .set_dhcp_lease(self.port, lease)
                    .map(|()| true)
                    .map_err(SwitchError::from),
                LeaseOp::Remove(mac) => Ok(core
                    .dhcp()
                    .and_then(|d| d.lease(mac))
                    .is_some_and(|(p, _)| p == self.port)
                    && core.remove_dhcp_lease(mac)),
            }
        };
        let _ = self.reply.send(result);
    }
}

impl SwitchHandle {
    /// Registers the static DHCP lease of the VM on `port`: DHCP requests
    /// from that port with client MAC `mac` are answered with address `ip`
    /// (in [`DhcpConfig`](crate::DhcpConfig)'s subnet) and host name
    /// `hostname` (option 12; letters, digits, `-`, `_`, `.`). Registering
    /// the same MAC again replaces its lease (also moving it to `port`).
    /// Removing the port removes its leases. Leases are not part of a
    /// [frozen](Self::freeze) switch: register them again after
    /// [`Switch::thaw`](crate::Switch::thaw).
    ///
    /// Fails with [`SwitchError::Dhcp`] when the switch was started without
    /// [`SwitchConfig::dhcp`] or the lease is not usable (address outside
    /// the subnet or taken by another MAC, bad host name).
    pub fn set_dhcp_lease(
        &self,
        port: PortId,
        mac: MacAddr,
        ip: Ipv4Addr,
        hostname: &str,
    ) -> Result<()> {
        let lease = DhcpLease {
            mac,
            ip,
            hostname: hostname.to_owned(),
        };
        let op = LeaseOp::Set(lease);
        self.request(|reply| Command::DhcpLease(LeaseCommand { port, op, reply }))?
            .map(|_| ())
    }

    /// Removes the lease of `mac` registered on `port`; returns whether
    /// there was one. Its VM then gets no DHCP answers.
    pub fn remove_dhcp_lease(&self, port: PortId, mac: MacAddr) -> Result<bool> {
        let op = LeaseOp::Remove(mac);
        self.request(|reply| Command::DhcpLease(LeaseCommand { port, op, reply }))?
    }
}
