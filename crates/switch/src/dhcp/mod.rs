//! The switch's DHCPv4 server: static leases for the VMs of the cluster.
//!
//! Stock Debian/Ubuntu guests (systemd-networkd, ifupdown with dhclient,
//! netplan) configure their NIC with DHCP. Every VM's address is fixed by
//! the cluster spec (VM `i` gets `10.77.0.(i+2)/24` and MAC
//! `52:54:00:77:XX:YY`, see `vmcsnap_spec::addressing`), and every frame of
//! a VM passes the switch, so the switch answers DHCP itself from a static
//! table MAC → (address, host name), registered per port
//! ([`SwitchHandle::set_dhcp_lease`](crate::SwitchHandle::set_dhcp_lease)).
//!
//! # Why static leases
//!
//! A VM must keep its address across snapshot, restore and warm restart:
//! a restored guest still holds the lease it had at its snapshot, and its
//! peers still talk to that address. A static table answers the same
//! address to the same MAC forever, with no lease database to snapshot,
//! hand over or expire, and nothing a guest can do changes it.
//!
//! # What is answered
//!
//! [`DhcpServer::handle`] is pure and does no I/O. The switch calls it on
//! every frame it receives from a port, when DHCP is configured
//! ([`SwitchConfig::dhcp`](crate::SwitchConfig::dhcp)):
//!
//! - Frames that are not IPv4 UDP to port 67 are [`Outcome::NotDhcp`] and
//!   are switched as usual.
//! - Every IPv4 UDP frame to port 67 is taken out of the forwarding path,
//!   whatever its destination MAC (a renewal is unicast to the server's IP,
//!   whose MAC may belong to a host side or to nobody), and never forwarded.
//! - Answered, for a client whose MAC has a lease registered on the port
//!   the frame came from: DHCPDISCOVER with a DHCPOFFER; DHCPREQUEST with a
//!   DHCPACK when it asks for the leased address (SELECTING with our server
//!   identifier, INIT-REBOOT, RENEWING, REBINDING), a DHCPNAK when it asks
//!   for another one; DHCPINFORM with a DHCPACK without lease.
//! - Not answered ([`Outcome::Ignored`]): unknown MACs and MACs leased on
//!   another port (no answer at all: another server, if any, is not
//!   reached either), a REQUEST selecting another server, DHCPDECLINE
//!   (logged as a warning: the guest saw its address in use) and
//!   DHCPRELEASE (the lease is static), relayed messages (`giaddr` set),
//!   non-Ethernet hardware types, and malformed frames (bad length or
//!   checksum, undecodable DHCP).
//!
//! Replies carry: subnet mask, broadcast address, server identifier, lease
//! time with T1 = 1/2 and T2 = 7/8 of it (not in the INFORM answer), host
//! name (option 12, the lease's name), router and DNS servers when
//! configured, and the client identifier when the client sent one
//! (RFC 6842). They are addressed per RFC 2131 4.1: to `ciaddr` when the
//! client has one, else broadcast when the client set the broadcast flag
//! (and always for a NAK), else unicast to `yiaddr` at the client's MAC.
//! Their Ethernet source is [`DhcpConfig::server_mac`].
//!
//! The switch queues a reply to the port the request came from, untagged
//! like an [injected](crate::SwitchHandle::inject) frame: it originates at
//! the switch, so in a cut session it is never colored, never triggers a
//! hold and is never logged as channel state (a guest snapshotted between
//! its request and the reply just retransmits). A held port keeps the reply
//! queued until it is released.
//!
//! What is not there: dynamic pools, relays, DHCPv6, ARP answers for the
//! server address (without a host side at that address a guest's unicast
//! renewal gets no ARP reply; it then rebinds by broadcast at T2, which is
//! answered).

mod frame;
mod reply;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::HashMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::core::{MacAddr, PortId};

pub use frame::{
    build as build_udp_frame, is_server_bound, parse as parse_udp_frame, Addressing, FrameError,
    UdpFrame, CLIENT_PORT, SERVER_PORT,
};

/// Default server address: the host side of the cluster subnet.
pub const DEFAULT_SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// Default lease time: one day.
pub const DEFAULT_LEASE_SECS: u32 = 86_400;
/// Default Ethernet address of the server: locally administered, unicast.
pub const DEFAULT_SERVER_MAC: MacAddr = MacAddr([0x02, 0x76, 0x6d, 0x63, 0x00, 0x01]);
/// Most DNS servers option 6 holds (255 bytes of addresses).
pub const MAX_DNS_SERVERS: usize = 63;
/// Longest host name accepted in a lease (DNS limit).
pub const MAX_HOSTNAME_LEN: usize = 253;

/// Settings of the switch's DHCP server ([`SwitchConfig::dhcp`](crate::SwitchConfig::dhcp)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DhcpConfig {
    /// Server identifier (option 54) and source of replies.
    pub server_ip: Ipv4Addr,
    /// Prefix length of the subnet; leases must lie in the server's subnet.
    pub prefix_len: u8,
    /// Default gateway handed out (option 3); none by default.
    pub router: Option<Ipv4Addr>,
    /// DNS servers handed out (option 6); none by default.
    pub dns: Vec<Ipv4Addr>,
    /// Lease time in seconds (option 51).
    pub lease_secs: u32,
    /// Ethernet source address of replies.
    pub server_mac: MacAddr,
}

impl Default for DhcpConfig {
    /// The cluster subnet `10.77.0.0/24`, server `10.77.0.1`, one-day leases.
    fn default() -> Self {
        DhcpConfig {
            server_ip: DEFAULT_SERVER_IP,
            prefix_len: 24,
            router: None,
            dns: Vec::new(),
            lease_secs: DEFAULT_LEASE_SECS,
            server_mac: DEFAULT_SERVER_MAC,
        }
    }
}

impl DhcpConfig {
    /// The subnet mask of [`prefix_len`](Self::prefix_len).
    pub fn netmask(&self) -> Ipv4Addr {
        let bits = u32::MAX
            .checked_shl(32 - u32::from(self.prefix_len.min(32)))
            .unwrap_or(0);
        Ipv4Addr::from(bits)
    }

    /// The directed broadcast address of the subnet.
    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.server_ip) | !u32::from(self.netmask()))
    }

    fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.server_ip) & u32::from(self.netmask()))
    }

    /// Checks the settings themselves.
    pub fn validate(&self) -> Result<(), DhcpError> {
        if !(1..=30).contains(&self.prefix_len) {
            return Err(DhcpError::BadPrefix(self.prefix_len));
        }
        if self.server_mac.is_multicast() || self.server_mac.is_zero() {
            return Err(DhcpError::BadServerMac(self.server_mac));
        }
        if self.dns.len() > MAX_DNS_SERVERS {
            return Err(DhcpError::TooManyDnsServers(self.dns.len()));
        }
        Ok(())
    }
}

/// One static lease: what the VM with this MAC is told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DhcpLease {
    /// The VM NIC's MAC (`chaddr` of its requests).
    pub mac: MacAddr,
    /// Its address.
    pub ip: Ipv4Addr,
    /// Its host name (option 12), the VM's name.
    pub hostname: String,
}

/// Errors of the DHCP configuration and lease registration.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DhcpError {
    /// A lease was registered on a switch started without DHCP.
    #[error("the switch was started without DHCP; set SwitchConfig::dhcp to register leases")]
    Disabled,
    /// The prefix length is not usable.
    #[error("DHCP prefix length /{0} is not usable: give 1 to 30")]
    BadPrefix(u8),
    /// The server MAC is multicast or zero.
    #[error("DHCP server MAC {0} must be a unicast, non-zero address (e.g. 02:76:6d:63:00:01)")]
    BadServerMac(MacAddr),
    /// More DNS servers than option 6 holds.
    #[error("{0} DHCP DNS servers configured; option 6 holds at most 63")]
    TooManyDnsServers(usize),
    /// The lease's MAC is multicast or zero.
    #[error("cannot lease to MAC {0}: a NIC has a unicast, non-zero address")]
    BadClientMac(MacAddr),
    /// The lease's address is outside the subnet, or its network, broadcast
    /// or server address.
    #[error("cannot lease {ip}: it must be a host address of {network}/{prefix} other than the server's {server}")]
    AddressNotLeasable {
        /// The address asked for.
        ip: Ipv4Addr,
        /// The subnet.
        network: Ipv4Addr,
        /// Its prefix length.
        prefix: u8,
        /// The server address.
        server: Ipv4Addr,
    },
    /// Another MAC already has this address.
    #[error("cannot lease {ip} to {mac}: it is leased to {other}; give each VM its own address")]
    AddressTaken {
        /// The address.
        ip: Ipv4Addr,
        /// The MAC it was asked for.
        mac: MacAddr,
        /// The MAC that has it.
        other: MacAddr,
    },
    /// The host name cannot be sent in option 12.
    #[error("host name {0:?} cannot be sent by DHCP: use 1 to 253 characters among letters, digits, '-', '_' and '.'")]
    BadHostname(String),
}

/// Why a frame for a DHCP server got no reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoreReason {
    /// Bad Ethernet/IPv4/UDP framing.
    Frame(FrameError),
    /// The UDP payload is not a decodable DHCP request.
    Malformed,
    /// Not Ethernet `htype`/`hlen`, or relayed (`giaddr` set).
    Unsupported,
    /// No lease for the client's MAC.
    UnknownClient,
    /// The client's MAC is leased on another port.
    WrongPort,
    /// A REQUEST for another server's offer.
    OtherServer,
    /// A message the server takes note of without answering (DECLINE,
    /// RELEASE), or of a type a server never answers.
    NoAnswer,
}

/// What [`DhcpServer::handle`] made of a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Not a frame for a DHCP server: switch it as usual.
    NotDhcp,
    /// For a DHCP server, not answered; do not forward it.
    Ignored(IgnoreReason),
    /// For a DHCP server; send this Ethernet frame back to the port, do not
    /// forward the request.
    Reply(Vec<u8>),
}

impl Outcome {
    /// The reply frame, if any.
    pub fn into_reply(self) -> Option<Vec<u8>> {
        match self {
            Outcome::Reply(f) => Some(f),
            Outcome::NotDhcp | Outcome::Ignored(_) => None,
        }
    }
}

/// The DHCP server: configuration and lease table. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct DhcpServer {
    config: DhcpConfig,
    /// Leases by client MAC, with the port they were registered on.
    leases: HashMap<MacAddr, (PortId, DhcpLease)>,
}

impl DhcpServer {
    /// A server without leases.
    pub fn new(config: DhcpConfig) -> Result<Self, DhcpError> {
        config.validate()?;
        Ok(DhcpServer {
            config,
            leases: HashMap::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DhcpConfig {
        &self.config
    }

    /// Registers (or replaces) the lease of `lease.mac`, answered only to
    /// requests received on `port`.
    pub fn set_lease(&mut self, port: PortId, lease: DhcpLease) -> Result<(), DhcpError> {
        let c = &self.config;
        if lease.mac.is_multicast() || lease.mac.is_zero() {
            return Err(DhcpError::BadClientMac(lease.mac));
        }
        let in_subnet = u32::from(lease.ip) & u32::from(c.netmask()) == u32::from(c.network());
        if !in_subnet || [c.network(), c.broadcast(), c.server_ip].contains(&lease.ip) {
            return Err(DhcpError::AddressNotLeasable {
                ip: lease.ip,
                network: c.network(),
                prefix: c.prefix_len,
                server: c.server_ip,
            });
        }
        if let Some((_, other)) = self
            .leases
            .values()
            .find(|(_, l)| l.ip == lease.ip && l.mac != lease.mac)
        {
            return Err(DhcpError::AddressTaken {
                ip: lease.ip,
                mac: lease.mac,
                other: other.mac,
            });
        }
        let h = &lease.hostname;
        let name_ok = (1..=MAX_HOSTNAME_LEN).contains(&h.len())
            && h.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !name_ok {
            return Err(DhcpError::BadHostname(h.clone()));
        }
        log::debug!(
            "dhcp: {port}: {} -> {} ({})",
            lease.mac,
            lease.ip,
            lease.hostname
        );
        self.leases.insert(lease.mac, (port, lease));
        Ok(())
    }

    /// Removes the lease of `mac`; returns whether there was one.
    pub fn remove_lease(&mut self, mac: MacAddr) -> bool {
        self.leases.remove(&mac).is_some()
    }

    /// Removes every lease registered on `port`.
    pub fn remove_port(&mut self, port: PortId) {
        self.leases.retain(|_, (p, _)| *p != port);
    }

    /// The lease of `mac` and the port it is answered on.
    pub fn lease(&self, mac: MacAddr) -> Option<(PortId, &DhcpLease)> {
        self.leases.get(&mac).map(|(p, l)| (*p, l))
    }

    /// Handles an Ethernet frame received on `port`. Never panics, whatever
    /// the bytes. See the [module docs](self) for what is answered.
    pub fn handle(&self, port: PortId, frame: &[u8]) -> Outcome {
        if !is_server_bound(frame) {
            return Outcome::NotDhcp;
        }
        let udp = match frame::parse(frame) {
            Ok(u) => u,
            Err(e) => {
                log::debug!("dhcp: {port}: dropping a malformed frame to port 67: {e:?}");
                return Outcome::Ignored(IgnoreReason::Frame(e));
            }
        };
        match self.answer(port, &udp) {
            Ok(reply) => Outcome::Reply(reply),
            Err(why) => Outcome::Ignored(why),
        }
    }

    /// [`handle`](Self::handle), keeping only the reply.
    pub fn reply(&self, port: PortId, frame: &[u8]) -> Option<Vec<u8>> {
        self.handle(port, frame).into_reply()
    }
}
