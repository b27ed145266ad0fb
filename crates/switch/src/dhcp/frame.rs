//! Ethernet II / IPv4 / UDP framing of DHCP messages: recognising a frame
//! for a DHCP server, validating it, and building reply frames.
//!
//! Only what DHCP needs: no VLAN tags, no IP options in replies, no
//! fragments (a DHCP message fits one frame; a fragment is never answered).
//! Every length is checked against the bytes present and both checksums are
//! verified (a UDP checksum of zero means "none" in IPv4 and is accepted),
//! so arbitrary bytes give an error, never a panic.

use std::net::Ipv4Addr;

use crate::core::MacAddr;

/// EtherType of IPv4.
const ETHERTYPE_IPV4: u16 = 0x0800;
/// IP protocol number of UDP.
const PROTO_UDP: u8 = 17;
/// Ethernet II header length.
const ETH_LEN: usize = 14;
/// IPv4 header length without options.
const IPV4_LEN: usize = 20;
/// UDP header length.
const UDP_LEN: usize = 8;

/// UDP port of DHCP servers.
pub const SERVER_PORT: u16 = 67;
/// UDP port of DHCP clients.
pub const CLIENT_PORT: u16 = 68;

/// Why a frame bound for a DHCP server could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// A header or the datagram is longer than the bytes present, or a
    /// length field is below its minimum.
    Truncated,
    /// The IPv4 header checksum is wrong.
    IpChecksum,
    /// The UDP checksum is wrong.
    UdpChecksum,
}

/// A validated IPv4 UDP datagram in an Ethernet frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpFrame<'a> {
    /// Ethernet source address.
    pub src_mac: MacAddr,
    /// IPv4 source address.
    pub src_ip: Ipv4Addr,
    /// IPv4 destination address.
    pub dst_ip: Ipv4Addr,
    /// UDP source port.
    pub src_port: u16,
    /// The UDP payload (the DHCP message).
    pub payload: &'a [u8],
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn ip_at(b: &[u8], at: usize) -> Option<Ipv4Addr> {
    let o: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(Ipv4Addr::from(o))
}

/// Whether `frame` is an unfragmented (or first-fragment) IPv4 UDP datagram
/// to port 67, judged from the headers alone. These are the frames the
/// switch's DHCP server takes out of the forwarding path.
pub fn is_server_bound(frame: &[u8]) -> bool {
    udp_dst_port(frame) == Some(SERVER_PORT)
}

fn udp_dst_port(frame: &[u8]) -> Option<u16> {
    if be16(frame, 12)? != ETHERTYPE_IPV4 {
        return None;
    }
    let ip = frame.get(ETH_LEN..)?;
    let ver_ihl = *ip.first()?;
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    if ver_ihl >> 4 != 4 || ihl < IPV4_LEN || *ip.get(9)? != PROTO_UDP {
        return None;
    }
    let fragment_offset = be16(ip, 6)? & 0x1fff;
    if fragment_offset != 0 {
        return None; // no UDP header in this fragment
    }
    be16(ip, ihl + 2)
}

/// Parses and validates an Ethernet/IPv4/UDP frame. Ethernet padding after
/// the IP datagram is ignored. More fragments (MF) are reported as
/// truncated: the datagram is not all there.
pub fn parse(frame: &[u8]) -> Result<UdpFrame<'_>, FrameError> {
    use FrameError::Truncated;
    if frame.len() < ETH_LEN + IPV4_LEN || be16(frame, 12) != Some(ETHERTYPE_IPV4) {
        return Err(Truncated);
    }
    let ip_all = &frame[ETH_LEN..];
    let ihl = usize::from(ip_all[0] & 0x0f) * 4;
    let total = usize::from(be16(ip_all, 2).ok_or(Truncated)?);
    if ip_all[0] >> 4 != 4 || ihl < IPV4_LEN || total < ihl + UDP_LEN || total > ip_all.len() {
        return Err(Truncated);
    }
    let ip = &ip_all[..total];
    if ip[9] != PROTO_UDP || be16(ip, 6).ok_or(Truncated)? & 0x3fff != 0 {
        return Err(Truncated); // not UDP, or a fragment
    }
    if checksum(&[&ip[..ihl]]) != 0 {
        return Err(FrameError::IpChecksum);
    }
    let src_ip = ip_at(ip, 12).ok_or(Truncated)?;
    let dst_ip = ip_at(ip, 16).ok_or(Truncated)?;
    let udp_all = &ip[ihl..];
    let udp_len = usize::from(be16(udp_all, 4).ok_or(Truncated)?);
    if udp_len < UDP_LEN || udp_len > udp_all.len() {
        return Err(Truncated);
    }
    let udp = &udp_all[..udp_len];
    if be16(udp, 6) != Some(0) && udp_checksum(src_ip, dst_ip, udp) != 0 {
        return Err(FrameError::UdpChecksum);
    }
    Ok(UdpFrame {
        src_mac: MacAddr::source(frame),
        src_ip,
        dst_ip,
        src_port: be16(udp, 0).ok_or(Truncated)?,
        payload: &udp[UDP_LEN..],
    })
}

/// The addressing of a frame built by [`build`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addressing {
    /// Ethernet source.
    pub src_mac: MacAddr,
    /// Ethernet destination.
    pub dst_mac: MacAddr,
    /// IPv4 source.
    pub src_ip: Ipv4Addr,
    /// IPv4 destination.
    pub dst_ip: Ipv4Addr,
}

/// Builds an Ethernet frame holding `payload` as a UDP datagram from port
/// 67 to port 68 (a DHCP reply), with both checksums filled in.
pub(crate) fn build_reply(a: &Addressing, payload: &[u8]) -> Vec<u8> {
    build(a, SERVER_PORT, CLIENT_PORT, payload)
}

/// Builds an Ethernet frame holding `payload` as an IPv4 UDP datagram from
/// `src_port` to `dst_port`, with both checksums filled in (for tests and
/// fuzzing of DHCP clients and servers).
///
/// `payload` should be shorter than 65,000 bytes (a DHCP message is a few
/// hundred); longer payloads are cut short.
pub fn build(a: &Addressing, src_port: u16, dst_port: u16, payload: &[u8]) -> Vec<u8> {
    let payload = &payload[..payload.len().min(65_000)];
    let udp_len = (UDP_LEN + payload.len()) as u16;
    let total = IPV4_LEN as u16 + udp_len;
    let mut f = Vec::with_capacity(ETH_LEN + usize::from(total));
    f.extend_from_slice(&a.dst_mac.0);
    f.extend_from_slice(&a.src_mac.0);
    f.extend_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
    let ip_start = f.len();
    f.extend_from_slice(&[0x45, 0x10]); // IPv4, IHL 5; TOS: low delay (as dhcpd)
    f.extend_from_slice(&total.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0]); // id 0, no flags, offset 0
    f.extend_from_slice(&[64, PROTO_UDP, 0, 0]); // TTL, protocol, checksum
    f.extend_from_slice(&a.src_ip.octets());
    f.extend_from_slice(&a.dst_ip.octets());
    let ip_sum = checksum(&[&f[ip_start..]]);
    f[ip_start + 10..ip_start + 12].copy_from_slice(&ip_sum.to_be_bytes());
    let udp_start = f.len();
    f.extend_from_slice(&src_port.to_be_bytes());
    f.extend_from_slice(&dst_port.to_be_bytes());
    f.extend_from_slice(&udp_len.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    let sum = match udp_checksum(a.src_ip, a.dst_ip, &f[udp_start..]) {
        0 => 0xffff, // 0 would mean "no checksum"
        s => s,
    };
    f[udp_start + 6..udp_start + 8].copy_from_slice(&sum.to_be_bytes());
    f
}

/// The UDP checksum of `udp` (header and payload): 0 when the checksum
/// field in it is right, or the value to put there when that field is 0.
fn udp_checksum(src: Ipv4Addr, dst: Ipv4Addr, udp: &[u8]) -> u16 {
    let len = (udp.len() as u16).to_be_bytes();
    let pseudo = [0, PROTO_UDP, len[0], len[1]];
    checksum(&[&src.octets(), &dst.octets(), &pseudo, udp])
}

/// The Internet checksum (RFC 1071) of the concatenated `parts`; each part
/// but the last must have an even length.
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        let mut words = part.chunks_exact(2);
        for w in &mut words {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        if let [last] = words.remainder() {
            sum += u32::from(*last) << 8;
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let a = Addressing {
            src_mac: MacAddr([2, 0, 0, 0, 0, 1]),
            dst_mac: MacAddr::BROADCAST,
            src_ip: Ipv4Addr::new(10, 77, 0, 1),
            dst_ip: Ipv4Addr::BROADCAST,
        };
        build_reply(&a, b"hello, odd length")
    }

    #[test]
    fn built_frames_parse_back() {
        let f = sample();
        let u = parse(&f).unwrap();
        assert_eq!(u.payload, b"hello, odd length");
        assert_eq!(u.src_ip, Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(u.dst_ip, Ipv4Addr::BROADCAST);
        assert_eq!(u.src_port, SERVER_PORT);
        assert_eq!(u.src_mac, MacAddr([2, 0, 0, 0, 0, 1]));
        assert!(!is_server_bound(&f), "the reply goes to port 68");
        // Ethernet padding after the datagram is fine.
        let mut padded = f.clone();
        padded.extend_from_slice(&[0; 20]);
        assert_eq!(parse(&padded).unwrap().payload, b"hello, odd length");
    }

    #[test]
    fn corrupt_frames_are_rejected() {
        let f = sample();
        for cut in 0..f.len() {
            assert!(parse(&f[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad_ip = f.clone();
        bad_ip[ETH_LEN + 8] ^= 1; // TTL
        assert_eq!(parse(&bad_ip), Err(FrameError::IpChecksum));
        let mut bad_udp = f.clone();
        *bad_udp.last_mut().unwrap() ^= 0x40;
        assert_eq!(parse(&bad_udp), Err(FrameError::UdpChecksum));
        let mut no_sum = bad_udp.clone();
        no_sum[ETH_LEN + IPV4_LEN + 6..ETH_LEN + IPV4_LEN + 8].fill(0);
        assert!(parse(&no_sum).is_ok(), "UDP checksum 0 means none");
        let mut fragment = f.clone();
        fragment[ETH_LEN + 6] = 0x20; // MF
        assert_eq!(parse(&fragment), Err(FrameError::Truncated));
    }

    #[test]
    fn server_bound_needs_ipv4_udp_port_67_first_fragment() {
        let mut f = sample();
        let port = ETH_LEN + IPV4_LEN + 2;
        f[port..port + 2].copy_from_slice(&67u16.to_be_bytes());
        assert!(is_server_bound(&f));
        assert!(is_server_bound(&f[..port + 2]), "headers are enough");
        assert!(!is_server_bound(&f[..port + 1]));
        let mut tcp = f.clone();
        tcp[ETH_LEN + 9] = 6;
        assert!(!is_server_bound(&tcp));
        let mut later_fragment = f.clone();
        later_fragment[ETH_LEN + 7] = 1;
        assert!(!is_server_bound(&later_fragment));
        let mut arp = f.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        assert!(!is_server_bound(&arp));
        let mut v6ish = f;
        v6ish[ETH_LEN] = 0x65;
        assert!(!is_server_bound(&v6ish));
    }
}
