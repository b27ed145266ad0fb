//! Ethernet MAC addresses.

use std::fmt;
use std::str::FromStr;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

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

impl FromStr for MacAddr {
    type Err = String;

    /// Parses `aa:bb:cc:dd:ee:ff` (hex digits in either case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a MAC address like 52:54:00:12:34:56");
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let part = parts.next().ok_or_else(bad)?;
            if part.len() != 2 || !part.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *b = u8::from_str_radix(part, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(MacAddr(out))
    }
}

/// As `"aa:bb:cc:dd:ee:ff"` in human-readable formats, 6 bytes otherwise.
impl Serialize for MacAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(de::Error::custom)
        } else {
            <[u8; 6]>::deserialize(d).map(MacAddr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip() {
        let mac: MacAddr = "52:54:00:AB:cd:0f".parse().unwrap();
        assert_eq!(mac, MacAddr([0x52, 0x54, 0, 0xab, 0xcd, 0x0f]));
        assert_eq!(mac.to_string().parse::<MacAddr>().unwrap(), mac);
        for bad in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:0f:00",
            "5:54:00:ab:cd:0f",
            "zz:54:00:ab:cd:0f",
            "+f:54:00:ab:cd:0f",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad:?}");
        }
    }
}
