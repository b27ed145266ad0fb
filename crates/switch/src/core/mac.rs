//! Ethernet MAC addresses.

use std::fmt;

/// A 48-bit Ethernet MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The broadcast address ff:ff:ff:ff:ff:ff.
    pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);

    /// Destination address of an Ethernet frame (bytes 0..6).
    ///
    /// # Panics
    /// If `frame` is shorter than 6 bytes.
    pub fn destination(frame: &[u8]) -> MacAddr {
        MacAddr(frame[0..6].try_into().expect("6-byte slice"))
    }

    /// Source address of an Ethernet frame (bytes 6..12).
    ///
    /// # Panics
    /// If `frame` is shorter than 12 bytes.
    pub fn source(frame: &[u8]) -> MacAddr {
        MacAddr(frame[6..12].try_into().expect("6-byte slice"))
    }

    /// Whether the group bit is set (multicast, including broadcast).
    pub fn is_multicast(self) -> bool {
        self.0[0] & 1 == 1
    }

    /// Whether this is the broadcast address.
    pub fn is_broadcast(self) -> bool {
        self == Self::BROADCAST
    }

    /// Whether this is 00:00:00:00:00:00.
    pub fn is_zero(self) -> bool {
        self.0 == [0; 6]
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}
