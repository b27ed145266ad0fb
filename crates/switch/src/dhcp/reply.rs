//! The DHCP decisions (RFC 2131 section 4.3) and the reply messages.

use std::net::Ipv4Addr;

use dhcproto::v4::{
    Decodable, Decoder, DhcpOption, Encodable, Encoder, HType, Message, MessageType, Opcode,
    OptionCode, MAGIC, MIN_PACKET_SIZE,
};

use super::frame::{self, Addressing, UdpFrame};
use super::{DhcpLease, DhcpServer, IgnoreReason};
use crate::core::{MacAddr, PortId};

/// Offset of the magic cookie in a DHCP message.
const MAGIC_AT: usize = 236;

/// Options whose length dhcproto 0.15 asserts (`debug_assert!`, so a panic
/// in a build with debug assertions) instead of checking: code and the
/// allowed lengths (Rapid Commit, Client FQDN, Client Network Interface,
/// the Bulk Leasequery status code and times).
const ASSERTED_LENGTHS: [(u8, std::ops::RangeInclusive<u8>); 8] = [
    (80, 0..=0),
    (81, 3..=255),
    (94, 3..=3),
    (151, 1..=255),
    (152, 4..=4),
    (153, 4..=4),
    (154, 4..=4),
    (155, 4..=4),
];

/// Whether dhcproto can decode the options of `payload` (a DHCP message
/// with its magic cookie) without tripping one of its assertions: every
/// option of [`ASSERTED_LENGTHS`] has an allowed length and is not
/// repeated right after itself (dhcproto joins such repeats, RFC 3396).
/// A message that fails is ignored as malformed; a guest must not be able
/// to panic the switch.
fn options_decodable(payload: &[u8]) -> bool {
    let mut at = MAGIC_AT + 4;
    let mut prev = None;
    while let Some(&code) = payload.get(at) {
        match code {
            0 => {
                prev = None;
                at += 1;
                continue;
            }
            255 => break,
            _ => {}
        }
        let Some(&len) = payload.get(at + 1) else {
            break; // truncated: dhcproto reports it
        };
        if let Some((_, allowed)) = ASSERTED_LENGTHS.iter().find(|(c, _)| *c == code) {
            if !allowed.contains(&len) || prev == Some(code) {
                return false;
            }
        }
        prev = Some(code);
        at += 2 + usize::from(len);
    }
    true
}

/// What to send back.
enum Verdict {
    Offer,
    Ack,
    Nak,
    InformAck,
}

impl DhcpServer {
    /// The reply frame to a validated datagram for port 67, or why there is none.
    pub(super) fn answer(&self, port: PortId, udp: &UdpFrame<'_>) -> Result<Vec<u8>, IgnoreReason> {
        if udp.payload.get(MAGIC_AT..MAGIC_AT + 4) != Some(&MAGIC[..]) {
            return Err(IgnoreReason::Malformed);
        }
        if !options_decodable(udp.payload) {
            return Err(IgnoreReason::Malformed);
        }
        let msg =
            Message::decode(&mut Decoder::new(udp.payload)).map_err(|_| IgnoreReason::Malformed)?;
        // `hlen` is checked before `chaddr()`, which slices by it.
        if msg.opcode() != Opcode::BootRequest || msg.htype() != HType::Eth || msg.hlen() != 6 {
            return Err(IgnoreReason::Unsupported);
        }
        if !msg.giaddr().is_unspecified() {
            return Err(IgnoreReason::Unsupported);
        }
        let Some(kind) = msg.opts().msg_type() else {
            return Err(IgnoreReason::Malformed);
        };
        let mac = MacAddr(
            msg.chaddr()
                .try_into()
                .map_err(|_| IgnoreReason::Unsupported)?,
        );
        let Some((lease_port, lease)) = self.lease(mac) else {
            log::debug!("dhcp: {port}: no lease for {mac}, not answering its {kind:?}");
            return Err(IgnoreReason::UnknownClient);
        };
        if lease_port != port {
            log::warn!(
                "dhcp: {port}: {kind:?} from {mac}, whose lease is on {lease_port}; not answering"
            );
            return Err(IgnoreReason::WrongPort);
        }
        let verdict = self.decide(kind, &msg, lease)?;
        log::debug!(
            "dhcp: {port}: {kind:?} from {mac} ({}) answered",
            lease.hostname
        );
        self.reply_frame(verdict, &msg, lease, mac)
    }

    /// RFC 2131 4.3: what a message of type `kind` from the owner of `lease` gets.
    fn decide(
        &self,
        kind: MessageType,
        msg: &Message,
        lease: &DhcpLease,
    ) -> Result<Verdict, IgnoreReason> {
        let opt_ip = |code| match msg.opts().get(code) {
            Some(DhcpOption::RequestedIpAddress(ip)) | Some(DhcpOption::ServerIdentifier(ip)) => {
                Some(*ip)
            }
            _ => None,
        };
        let requested = opt_ip(OptionCode::RequestedIpAddress);
        let server_id = opt_ip(OptionCode::ServerIdentifier);
        let ciaddr = Some(msg.ciaddr()).filter(|ip| !ip.is_unspecified());
        let ack_if = |ip: Option<Ipv4Addr>| match ip {
            Some(ip) if ip == lease.ip => Ok(Verdict::Ack),
            Some(_) => Ok(Verdict::Nak),
            None => Err(IgnoreReason::Malformed),
        };
        match kind {
            MessageType::Discover => Ok(Verdict::Offer),
            MessageType::Request => match server_id {
                // SELECTING: the client chose an offer, maybe not ours.
                Some(sid) if sid != self.config.server_ip => Err(IgnoreReason::OtherServer),
                // SELECTING and INIT-REBOOT ask with option 50,
                // RENEWING and REBINDING with ciaddr.
                _ => ack_if(requested.or(ciaddr)),
            },
            MessageType::Inform => Ok(Verdict::InformAck),
            MessageType::Decline => {
                log::warn!(
                    "dhcp: {} ({}) declined {}: the guest found the address in use",
                    lease.mac,
                    lease.hostname,
                    requested.unwrap_or(lease.ip)
                );
                Err(IgnoreReason::NoAnswer)
            }
            _ => Err(IgnoreReason::NoAnswer), // RELEASE, and types servers send
        }
    }

    fn reply_frame(
        &self,
        verdict: Verdict,
        req: &Message,
        lease: &DhcpLease,
        mac: MacAddr,
    ) -> Result<Vec<u8>, IgnoreReason> {
        let c = &self.config;
        let mut m = Message::default();
        m.set_opcode(Opcode::BootReply)
            .set_htype(HType::Eth)
            .set_chaddr(&mac.0)
            .set_xid(req.xid())
            .set_flags(req.flags());
        let opts = m.opts_mut();
        opts.insert(DhcpOption::ServerIdentifier(c.server_ip));
        if let Some(DhcpOption::ClientIdentifier(id)) = req.opts().get(OptionCode::ClientIdentifier)
        {
            opts.insert(DhcpOption::ClientIdentifier(id.clone()));
        }
        let kind = match verdict {
            Verdict::Offer => MessageType::Offer,
            Verdict::Ack | Verdict::InformAck => MessageType::Ack,
            Verdict::Nak => MessageType::Nak,
        };
        opts.insert(DhcpOption::MessageType(kind));
        if !matches!(verdict, Verdict::Nak) {
            opts.insert(DhcpOption::SubnetMask(c.netmask()));
            opts.insert(DhcpOption::BroadcastAddr(c.broadcast()));
            opts.insert(DhcpOption::Hostname(lease.hostname.clone()));
            if let Some(r) = c.router {
                opts.insert(DhcpOption::Router(vec![r]));
            }
            if !c.dns.is_empty() {
                opts.insert(DhcpOption::DomainNameServer(c.dns.clone()));
            }
        }
        if matches!(verdict, Verdict::Offer | Verdict::Ack) {
            let secs = c.lease_secs;
            opts.insert(DhcpOption::AddressLeaseTime(secs));
            if secs != u32::MAX {
                opts.insert(DhcpOption::Renewal(secs / 2));
                opts.insert(DhcpOption::Rebinding((u64::from(secs) * 7 / 8) as u32));
            }
            m.set_yiaddr(lease.ip);
        }
        let ciaddr = req.ciaddr();
        if matches!(verdict, Verdict::Ack | Verdict::InformAck) {
            m.set_ciaddr(ciaddr);
        }
        // RFC 2131 4.1 (giaddr is 0: relayed requests are not answered).
        let broadcast = (MacAddr::BROADCAST, Ipv4Addr::BROADCAST);
        let (dst_mac, dst_ip) = match verdict {
            Verdict::Nak => broadcast,
            _ if !ciaddr.is_unspecified() => (mac, ciaddr),
            _ if req.flags().broadcast() => broadcast,
            Verdict::InformAck => broadcast, // no address to send to
            _ => (mac, lease.ip),
        };
        let mut payload = Vec::with_capacity(MIN_PACKET_SIZE);
        if let Err(e) = m.encode(&mut Encoder::new(&mut payload)) {
            // Only over-long options fail, and the config and leases are bounded.
            log::error!("dhcp: cannot encode the reply to {mac}: {e}");
            return Err(IgnoreReason::NoAnswer);
        }
        // Some BOOTP-era clients drop messages under 300 bytes.
        if payload.len() < MIN_PACKET_SIZE {
            payload.resize(MIN_PACKET_SIZE, 0);
        }
        let addressing = Addressing {
            src_mac: c.server_mac,
            dst_mac,
            src_ip: c.server_ip,
            dst_ip,
        };
        Ok(frame::build_reply(&addressing, &payload))
    }
}
