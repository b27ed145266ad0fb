//! Ethernet/ARP/IPv4/ICMP frames built and parsed by hand for the tests.

use std::net::Ipv4Addr;

pub const BROADCAST: [u8; 6] = [0xff; 6];
pub const ETH_ARP: u16 = 0x0806;
pub const ETH_IPV4: u16 = 0x0800;

fn eth(dst: [u8; 6], src: [u8; 6], ty: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ty.to_be_bytes());
    f.extend_from_slice(payload);
    f.resize(f.len().max(60), 0);
    f
}

/// An ARP request or reply (`op` 1 or 2).
pub fn arp(op: u16, sha: [u8; 6], spa: Ipv4Addr, tha: [u8; 6], tpa: Ipv4Addr) -> Vec<u8> {
    let mut p = vec![0, 1, 8, 0, 6, 4];
    p.extend_from_slice(&op.to_be_bytes());
    p.extend_from_slice(&sha);
    p.extend_from_slice(&spa.octets());
    p.extend_from_slice(&tha);
    p.extend_from_slice(&tpa.octets());
    let dst = if op == 1 { BROADCAST } else { tha };
    eth(dst, sha, ETH_ARP, &p)
}

/// An ARP packet's fields.
#[derive(Debug, PartialEq, Eq)]
pub struct Arp {
    pub eth_dst: [u8; 6],
    pub op: u16,
    pub sha: [u8; 6],
    pub spa: Ipv4Addr,
    pub tpa: Ipv4Addr,
}

pub fn parse_arp(f: &[u8]) -> Option<Arp> {
    if f.len() < 42
        || u16::from_be_bytes([f[12], f[13]]) != ETH_ARP
        || f[14..20] != [0, 1, 8, 0, 6, 4]
    {
        return None;
    }
    let ip = |o: usize| Ipv4Addr::new(f[o], f[o + 1], f[o + 2], f[o + 3]);
    Some(Arp {
        eth_dst: f[0..6].try_into().unwrap(),
        op: u16::from_be_bytes([f[20], f[21]]),
        sha: f[22..28].try_into().unwrap(),
        spa: ip(28),
        tpa: ip(38),
    })
}

/// The Internet checksum (RFC 1071).
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += u32::from(w);
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An ICMP echo (`ty` 8 request, 0 reply) in IPv4 in Ethernet.
#[allow(clippy::too_many_arguments)]
pub fn icmp_echo(
    ty: u8,
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    id: u16,
    seq: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut icmp = vec![ty, 0, 0, 0];
    icmp.extend_from_slice(&id.to_be_bytes());
    icmp.extend_from_slice(&seq.to_be_bytes());
    icmp.extend_from_slice(payload);
    let c = checksum(&icmp);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let total = (20 + icmp.len()) as u16;
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, 64, 1, 0, 0]);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend_from_slice(&icmp);
    eth(dst_mac, src_mac, ETH_IPV4, &ip)
}

/// An ICMP echo's fields, if `f` is one with valid checksums.
#[derive(Debug, PartialEq, Eq)]
pub struct Echo {
    pub eth_src: [u8; 6],
    pub ty: u8,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub id: u16,
    pub seq: u16,
    pub payload: Vec<u8>,
}

pub fn parse_echo(f: &[u8]) -> Option<Echo> {
    if f.len() < 34 || u16::from_be_bytes([f[12], f[13]]) != ETH_IPV4 {
        return None;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if ip[0] >> 4 != 4 || ihl < 20 || total < ihl + 8 || total > ip.len() || ip[9] != 1 {
        return None;
    }
    if checksum(&ip[..ihl]) != 0 {
        return None;
    }
    let icmp = &ip[ihl..total];
    if checksum(icmp) != 0 || icmp[1] != 0 || (icmp[0] != 0 && icmp[0] != 8) {
        return None;
    }
    let addr = |o: usize| Ipv4Addr::new(ip[o], ip[o + 1], ip[o + 2], ip[o + 3]);
    Some(Echo {
        eth_src: f[6..12].try_into().unwrap(),
        ty: icmp[0],
        src: addr(12),
        dst: addr(16),
        id: u16::from_be_bytes([icmp[4], icmp[5]]),
        seq: u16::from_be_bytes([icmp[6], icmp[7]]),
        payload: icmp[8..].to_vec(),
    })
}
