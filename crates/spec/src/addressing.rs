//! Address assignment: VM number `i` (0-based, spec order) gets
//! `10.77.0.(i+2)/24` and MAC `52:54:00:77:XX:YY` with `XXYY = i+2`.
//!
//! The subnet never leaves the switch (no host tap or bridge), so one fixed
//! private /24 per cluster is safe.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// The first three octets of every cluster's subnet.
pub const SUBNET_PREFIX: [u8; 3] = [10, 77, 0];

/// A VM's place on the cluster network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmAddress {
    /// IPv4 address.
    pub ip: Ipv4Addr,
    /// Prefix length of the subnet.
    pub prefix: u8,
    /// Ethernet address.
    pub mac: [u8; 6],
}

impl VmAddress {
    /// `A.B.C.D/NN`, as the guest's init expects it.
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.ip, self.prefix)
    }

    /// `52:54:00:...` as QEMU's `mac=` expects it.
    pub fn mac_string(&self) -> String {
        self.mac
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// The address of the VM at `index` in spec order.
pub fn for_index(index: usize) -> VmAddress {
    let host = index + 2;
    assert!(host < 255, "index {index} beyond the /24");
    let [a, b, c] = SUBNET_PREFIX;
    VmAddress {
        ip: Ipv4Addr::new(a, b, c, host as u8),
        prefix: 24,
        mac: [0x52, 0x54, 0x00, 0x77, (host >> 8) as u8, host as u8],
    }
}
