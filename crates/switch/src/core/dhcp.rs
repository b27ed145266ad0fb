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
        self.dhcp
            .as_mut()
            .ok_or(DhcpError::Disabled)?
            .set_lease(port, lease)
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

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use dhcproto::v4::MessageType;

    use super::*;
    use crate::dhcp::tests::{discover_frame, reply_kind};

    fn vm_mac(n: u8) -> MacAddr {
        MacAddr([0x52, 0x54, 0x00, 0x77, 0x00, n])
    }

    /// A core with DHCP on, `n` connected ports; port i leases vm_mac(i+2)
    /// = 10.77.0.(i+2) as "vm<i>".
    fn setup(n: u8) -> (SwitchCore, Vec<PortId>) {
        let mut c = SwitchCore::new(1 << 20);
        c.set_dhcp(Some(DhcpConfig::default())).unwrap();
        let p: Vec<PortId> = (0..n)
            .map(|i| {
                let id = c.add_port(format!("vm{i}"));
                c.client_connected(id);
                let lease = DhcpLease {
                    mac: vm_mac(i + 2),
                    ip: Ipv4Addr::new(10, 77, 0, i + 2),
                    hostname: format!("vm{i}"),
                };
                c.set_dhcp_lease(id, lease).unwrap();
                id
            })
            .collect();
        (c, p)
    }

    fn queued(c: &SwitchCore, p: PortId) -> usize {
        c.port(p).unwrap().queued_frames
    }

    #[test]
    fn requests_are_answered_to_the_ingress_and_never_forwarded() {
        let (mut c, p) = setup(3);
        let d = c.receive(p[0], &discover_frame(vm_mac(2)));
        assert_eq!(d, Decision::Answered(Some(p[0])));
        let reply = c.pop_tx(p[0]).expect("the offer is queued");
        assert_eq!(reply_kind(&reply), Some(MessageType::Offer));
        assert_eq!(reply.tag.sender(), None, "untagged, like injected frames");
        assert_eq!((queued(&c, p[1]), queued(&c, p[2])), (0, 0), "not flooded");
        let counters = c.port(p[0]).unwrap().counters;
        assert_eq!(
            (
                counters.rx_frames,
                counters.dhcp_requests,
                counters.dhcp_replies
            ),
            (1, 1, 1)
        );

        // An unknown MAC: intercepted, counted, unanswered, not forwarded.
        let d = c.receive(p[1], &discover_frame(vm_mac(9)));
        assert_eq!(d, Decision::Answered(None));
        assert_eq!(
            (queued(&c, p[0]), queued(&c, p[1]), queued(&c, p[2])),
            (0, 0, 0)
        );
        assert_eq!((c.totals().dhcp_requests, c.totals().dhcp_replies), (2, 1));

        // Removing a port removes its leases.
        c.remove_port(p[2]);
        assert!(c.dhcp().unwrap().lease(vm_mac(4)).is_none());
        assert!(c.dhcp().unwrap().lease(vm_mac(3)).is_some());
    }

    #[test]
    fn without_dhcp_requests_are_switched_as_usual() {
        let (mut c, p) = setup(2);
        c.set_dhcp(None).unwrap();
        assert_eq!(
            c.receive(p[0], &discover_frame(vm_mac(2))),
            Decision::Flood(vec![p[1]])
        );
        assert_eq!(c.totals().dhcp_requests, 0);
        let lease = DhcpLease {
            mac: vm_mac(2),
            ip: Ipv4Addr::new(10, 77, 0, 2),
            hostname: "a".into(),
        };
        assert_eq!(c.set_dhcp_lease(p[0], lease), Err(DhcpError::Disabled));
    }

    #[test]
    fn a_held_port_keeps_its_reply_until_release() {
        let (mut c, p) = setup(1);
        c.hold(p[0]);
        c.receive(p[0], &discover_frame(vm_mac(2)));
        assert_eq!(c.pop_tx(p[0]), None);
        assert_eq!(c.port(p[0]).unwrap().counters.held, 1);
        c.release(p[0]);
        assert_eq!(
            reply_kind(&c.pop_tx(p[0]).unwrap()),
            Some(MessageType::Offer)
        );
    }

    #[test]
    fn replies_are_never_colored_held_or_logged_in_a_cut_session() {
        let (mut c, p) = setup(2);
        c.begin_session(7, &p, 1 << 20).unwrap();
        // p0 is cut (post); p1 is not (pre).
        c.prepare_cut(p[0]).unwrap();
        c.cut(p[0], false).unwrap();
        c.release(p[0]);
        // A post VM's request: its reply is not logged as channel state.
        c.receive(p[0], &discover_frame(vm_mac(2)));
        assert_eq!(
            reply_kind(&c.pop_tx(p[0]).unwrap()),
            Some(MessageType::Offer)
        );
        // A pre VM's request, answered after another VM's cut: no auto
        // hold, no trigger.
        c.receive(p[1], &discover_frame(vm_mac(3)));
        assert!(!c.port(p[1]).unwrap().holding);
        assert!(c.take_triggers().is_empty());
        assert_eq!(
            reply_kind(&c.pop_tx(p[1]).unwrap()),
            Some(MessageType::Offer)
        );
        // A request read while the pre VM is held for its cut, answered
        // across the cut: not channel state either.
        c.prepare_cut(p[1]).unwrap();
        c.receive(p[1], &discover_frame(vm_mac(3)));
        c.cut(p[1], false).unwrap();
        c.release(p[1]);
        assert_eq!(
            reply_kind(&c.pop_tx(p[1]).unwrap()),
            Some(MessageType::Offer)
        );
        let (log, _) = c.end_session().unwrap();
        assert!(log.frames.is_empty());
        assert_eq!(
            (log.stats.logged, log.stats.violations, log.stats.triggers),
            (0, 0, 0)
        );
        assert_eq!(c.totals().logged, 0);
    }
}
