//! The core's hook for the switch's DHCP server ([`crate::dhcp`]): frames
//! for a DHCP server are taken out of the forwarding path in
//! [`SwitchCore::receive`] and answered into the ingress port's queue.

use super::*;
use crate::dhcp::{DhcpConfig, DhcpError, DhcpLease, DhcpServer, Outcome};

impl SwitchCore {
    /// Turns the DHCP server on with `config` (dropping any leases of a
    /// previous one), or off with `None`.
    pub fn set_dhcp(&mut self, config: Option<DhcpConfig>) -> Result<(), DhcpError> {
        self.dhcp = config.map(DhcpServer::new).transpose()?;
        Ok(())
    }

    /// The DHCP server, if on.
    pub fn dhcp(&self) -> Option<&DhcpServer> {
        self.dhcp.as_ref()
    }

    /// Registers (or replaces) a static lease, answered to requests from
    /// `port` only. See [`DhcpServer::set_lease`].
    pub fn set_dhcp_lease(&mut self, port: PortId, lease: DhcpLease) -> Result<(), DhcpError> {
        self.dhcp.as_mut().ok_or(DhcpError::Disabled)?.set_lease(port, lease)
    }

    /// Removes the lease of `mac`; returns whether there was one.
    pub fn remove_dhcp_lease(&mut self, mac: MacAddr) -> bool {
        self.dhcp.as_mut().is_some_and(|d| d.remove_lease(mac))
    }

    /// Forgets the leases of a removed port.
    pub(super) fn dhcp_port_removed(&mut self, id: PortId) {
        if let Some(d) = self.dhcp.as_mut() {
            d.remove_port(id);
        }
    }

    /// If `frame` (received on `ingress`, counted, not a runt) is for a DHCP
    /// server and the server is on: counts it, queues the reply, if any, to
    /// `ingress` (untagged, like an injected frame: it originates at the
    /// switch, so a cut session never colors, holds for or logs it) and
    /// returns the decision. `None`: switch the frame as usual.
    pub(super) fn intercept_dhcp(&mut self, ingress: PortId, frame: &[u8]) -> Option<Decision> {
        let reply = match self.dhcp.as_ref()?.handle(ingress, frame) {
            Outcome::NotDhcp => return None,
            Outcome::Ignored(_) => None,
            Outcome::Reply(r) => Some(r),
        };
        let p = self.ports.get_mut(&ingress)?;
        p.counters.dhcp_requests += 1;
        self.totals.dhcp_requests += 1;
        let Some(reply) = reply else {
            return Some(Decision::Answered(None));
        };
        p.counters.dhcp_replies += 1;
        self.totals.dhcp_replies += 1;
        self.enqueue(ingress, Arc::from(reply));
        Some(Decision::Answered(Some(ingress)))
    }
}
