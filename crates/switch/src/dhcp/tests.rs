//! Unit tests of the DHCP server with real DHCP messages built by `dhcproto`.

use std::net::Ipv4Addr;

use dhcproto::v4::{
    Decodable, Decoder, DhcpOption, Encodable, Encoder, Flags, HType, Message, MessageType, Opcode,
    OptionCode,
};
use vmcsnap_testkit::Rng;

use super::*;

const SERVER: Ipv4Addr = DEFAULT_SERVER_IP;
const ALPHA_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const BETA_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);

fn vm_mac(n: u8) -> MacAddr {
    MacAddr([0x52, 0x54, 0x00, 0x77, 0x00, n])
}

fn port(n: u32) -> PortId {
    PortId::from_raw(n)
}

/// Leases: alpha (vm_mac(2), 10.77.0.2) on port 0, beta (vm_mac(3)) on port 1.
fn server_with(config: DhcpConfig) -> DhcpServer {
    let mut s = DhcpServer::new(config).unwrap();
    for (p, n, ip, name) in [(0, 2, ALPHA_IP, "alpha"), (1, 3, BETA_IP, "beta")] {
        let lease = DhcpLease {
            mac: vm_mac(n),
            ip,
            hostname: name.into(),
        };
        s.set_lease(port(p), lease).unwrap();
    }
    s
}

fn server() -> DhcpServer {
    server_with(DhcpConfig::default())
}

/// A broadcast DHCPDISCOVER frame from `mac` (for the core's tests).
pub(crate) fn discover_frame(mac: MacAddr) -> Vec<u8> {
    bcast(&msg(MessageType::Discover, mac))
}

/// The message type of a reply frame (for the core's tests).
pub(crate) fn reply_kind(frame: &[u8]) -> Option<MessageType> {
    decode_reply(frame).kind()
}

/// A client message of type `kind` from `mac`.
fn msg(kind: MessageType, mac: MacAddr) -> Message {
    let mut m = Message::new_with_id(
        0x1234_5678,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &mac.0,
    );
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    m
}

fn encode(m: &Message) -> Vec<u8> {
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf)).unwrap();
    buf
}

/// `m` in a frame from the client (port 68) to port 67.
fn frame_to(m: &Message, dst_mac: MacAddr, src_ip: Ipv4Addr, dst_ip: Ipv4Addr) -> Vec<u8> {
    let src_mac = MacAddr(m.chaddr().try_into().unwrap());
    let a = Addressing {
        src_mac,
        dst_mac,
        src_ip,
        dst_ip,
    };
    build_udp_frame(&a, CLIENT_PORT, SERVER_PORT, &encode(m))
}

/// `m` broadcast from 0.0.0.0, as a client without address sends it.
fn bcast(m: &Message) -> Vec<u8> {
    frame_to(
        m,
        MacAddr::BROADCAST,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::BROADCAST,
    )
}

/// A decoded reply: Ethernet destination, the UDP frame fields, the message.
struct Reply {
    dst_mac: MacAddr,
    src_mac: MacAddr,
    src_ip: Ipv4Addr,
    dst_ip: Ipv4Addr,
    msg: Message,
}

impl Reply {
    fn kind(&self) -> Option<MessageType> {
        self.msg.opts().msg_type()
    }

    fn opt(&self, code: OptionCode) -> Option<&DhcpOption> {
        self.msg.opts().get(code)
    }
}

fn decode_reply(frame: &[u8]) -> Reply {
    let udp = parse_udp_frame(frame).expect("a valid reply frame");
    assert_eq!(udp.src_port, SERVER_PORT);
    assert_eq!(u16::from_be_bytes([frame[36], frame[37]]), CLIENT_PORT);
    assert!(udp.payload.len() >= 300, "BOOTP minimum size");
    let msg = Message::decode(&mut Decoder::new(udp.payload)).unwrap();
    assert_eq!(msg.opcode(), Opcode::BootReply);
    assert_eq!(msg.htype(), HType::Eth);
    assert_eq!(msg.xid(), 0x1234_5678);
    Reply {
        dst_mac: MacAddr(frame[0..6].try_into().unwrap()),
        src_mac: udp.src_mac,
        src_ip: udp.src_ip,
        dst_ip: udp.dst_ip,
        msg,
    }
}

fn answer(s: &DhcpServer, p: u32, frame: &[u8]) -> Reply {
    match s.handle(port(p), frame) {
        Outcome::Reply(f) => decode_reply(&f),
        other => panic!("expected a reply, got {other:?}"),
    }
}

#[test]
fn discover_gets_an_offer_of_the_lease() {
    let s = server();
    let r = answer(&s, 0, &bcast(&msg(MessageType::Discover, vm_mac(2))));
    assert_eq!(r.kind(), Some(MessageType::Offer));
    assert_eq!(r.msg.yiaddr(), ALPHA_IP);
    assert_eq!(r.msg.ciaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(r.msg.chaddr(), &vm_mac(2).0);
    let mask = Ipv4Addr::new(255, 255, 255, 0);
    assert_eq!(
        r.opt(OptionCode::SubnetMask),
        Some(&DhcpOption::SubnetMask(mask))
    );
    let bcast_addr = Ipv4Addr::new(10, 77, 0, 255);
    assert_eq!(
        r.opt(OptionCode::BroadcastAddr),
        Some(&DhcpOption::BroadcastAddr(bcast_addr))
    );
    assert_eq!(
        r.opt(OptionCode::ServerIdentifier),
        Some(&DhcpOption::ServerIdentifier(SERVER))
    );
    assert_eq!(
        r.opt(OptionCode::AddressLeaseTime),
        Some(&DhcpOption::AddressLeaseTime(86_400))
    );
    assert_eq!(
        r.opt(OptionCode::Renewal),
        Some(&DhcpOption::Renewal(43_200))
    );
    assert_eq!(
        r.opt(OptionCode::Rebinding),
        Some(&DhcpOption::Rebinding(75_600))
    );
    assert_eq!(
        r.opt(OptionCode::Hostname),
        Some(&DhcpOption::Hostname("alpha".into()))
    );
    assert_eq!(r.opt(OptionCode::Router), None, "no router by default");
    assert_eq!(
        r.opt(OptionCode::DomainNameServer),
        None,
        "no DNS by default"
    );
    // No broadcast flag: unicast to the offered address at the client's MAC.
    assert_eq!((r.dst_mac, r.dst_ip), (vm_mac(2), ALPHA_IP));
    assert_eq!((r.src_mac, r.src_ip), (DEFAULT_SERVER_MAC, SERVER));

    // Broadcast flag: broadcast.
    let mut m = msg(MessageType::Discover, vm_mac(3));
    m.set_flags(Flags::default().set_broadcast());
    let r = answer(&s, 1, &bcast(&m));
    assert_eq!(r.msg.yiaddr(), BETA_IP);
    assert!(r.msg.flags().broadcast());
    assert_eq!(
        (r.dst_mac, r.dst_ip),
        (MacAddr::BROADCAST, Ipv4Addr::BROADCAST)
    );
}

#[test]
fn configured_router_dns_lease_time_and_client_id_are_sent() {
    let config = DhcpConfig {
        router: Some(SERVER),
        dns: vec![Ipv4Addr::new(10, 77, 0, 53), Ipv4Addr::new(9, 9, 9, 9)],
        lease_secs: 600,
        server_mac: MacAddr([0x02, 0, 0, 0, 0, 0x99]),
        ..DhcpConfig::default()
    };
    let s = server_with(config.clone());
    let mut m = msg(MessageType::Discover, vm_mac(2));
    let client_id = vec![1, 0x52, 0x54, 0x00, 0x77, 0x00, 0x02];
    m.opts_mut()
        .insert(DhcpOption::ClientIdentifier(client_id.clone()));
    let r = answer(&s, 0, &bcast(&m));
    assert_eq!(
        r.opt(OptionCode::Router),
        Some(&DhcpOption::Router(vec![SERVER]))
    );
    assert_eq!(
        r.opt(OptionCode::DomainNameServer),
        Some(&DhcpOption::DomainNameServer(config.dns))
    );
    assert_eq!(
        r.opt(OptionCode::AddressLeaseTime),
        Some(&DhcpOption::AddressLeaseTime(600))
    );
    assert_eq!(
        r.opt(OptionCode::ClientIdentifier),
        Some(&DhcpOption::ClientIdentifier(client_id))
    );
    assert_eq!(r.src_mac, MacAddr([0x02, 0, 0, 0, 0, 0x99]));
}

fn selecting(mac: MacAddr, requested: Ipv4Addr, server_id: Ipv4Addr) -> Message {
    let mut m = msg(MessageType::Request, mac);
    m.opts_mut()
        .insert(DhcpOption::RequestedIpAddress(requested));
    m.opts_mut().insert(DhcpOption::ServerIdentifier(server_id));
    m
}

#[test]
fn request_of_the_lease_is_acked_in_every_state() {
    let s = server();
    // SELECTING.
    let r = answer(&s, 0, &bcast(&selecting(vm_mac(2), ALPHA_IP, SERVER)));
    assert_eq!(r.kind(), Some(MessageType::Ack));
    assert_eq!(r.msg.yiaddr(), ALPHA_IP);
    assert_eq!(
        r.opt(OptionCode::AddressLeaseTime),
        Some(&DhcpOption::AddressLeaseTime(86_400))
    );
    assert_eq!(
        r.opt(OptionCode::Hostname),
        Some(&DhcpOption::Hostname("alpha".into()))
    );
    assert_eq!((r.dst_mac, r.dst_ip), (vm_mac(2), ALPHA_IP));

    // INIT-REBOOT: option 50, no server identifier.
    let mut m = msg(MessageType::Request, vm_mac(2));
    m.opts_mut()
        .insert(DhcpOption::RequestedIpAddress(ALPHA_IP));
    let r = answer(&s, 0, &bcast(&m));
    assert_eq!(
        (r.kind(), r.msg.yiaddr()),
        (Some(MessageType::Ack), ALPHA_IP)
    );

    // RENEWING: ciaddr set, unicast to the server's IP at a MAC that is not
    // the switch's (a host side): still intercepted and answered to ciaddr.
    let mut m = msg(MessageType::Request, vm_mac(2));
    m.set_ciaddr(ALPHA_IP);
    let host_mac = MacAddr([0x52, 0x54, 0x00, 0x77, 0x00, 0x01]);
    let r = answer(&s, 0, &frame_to(&m, host_mac, ALPHA_IP, SERVER));
    assert_eq!(r.kind(), Some(MessageType::Ack));
    assert_eq!((r.msg.ciaddr(), r.msg.yiaddr()), (ALPHA_IP, ALPHA_IP));
    assert_eq!((r.dst_mac, r.dst_ip), (vm_mac(2), ALPHA_IP));

    // REBINDING: ciaddr set, broadcast; the answer still goes to ciaddr.
    let r = answer(
        &s,
        0,
        &frame_to(&m, MacAddr::BROADCAST, ALPHA_IP, Ipv4Addr::BROADCAST),
    );
    assert_eq!(r.kind(), Some(MessageType::Ack));
    assert_eq!((r.dst_mac, r.dst_ip), (vm_mac(2), ALPHA_IP));
}

#[test]
fn request_of_another_address_is_naked() {
    let s = server();
    let check_nak = |frame: Vec<u8>| {
        let r = answer(&s, 0, &frame);
        assert_eq!(r.kind(), Some(MessageType::Nak));
        assert_eq!(r.msg.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(r.opt(OptionCode::AddressLeaseTime), None);
        assert_eq!(
            r.opt(OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(SERVER))
        );
        assert_eq!(
            (r.dst_mac, r.dst_ip),
            (MacAddr::BROADCAST, Ipv4Addr::BROADCAST)
        );
    };
    let other = Ipv4Addr::new(10, 77, 0, 99);
    check_nak(bcast(&selecting(vm_mac(2), other, SERVER)));
    let mut init_reboot = msg(MessageType::Request, vm_mac(2));
    init_reboot
        .opts_mut()
        .insert(DhcpOption::RequestedIpAddress(Ipv4Addr::new(
            192, 168, 1, 7,
        )));
    check_nak(bcast(&init_reboot));
    let mut renewing = msg(MessageType::Request, vm_mac(2));
    renewing.set_ciaddr(BETA_IP);
    check_nak(frame_to(&renewing, DEFAULT_SERVER_MAC, BETA_IP, SERVER));
}

#[test]
fn unanswered_requests_are_still_intercepted() {
    let s = server();
    let ignored = |p: u32, frame: &[u8], why: IgnoreReason| {
        assert_eq!(s.handle(port(p), frame), Outcome::Ignored(why));
        assert_eq!(s.reply(port(p), frame), None);
    };
    // Unknown MAC.
    ignored(
        0,
        &bcast(&msg(MessageType::Discover, vm_mac(9))),
        IgnoreReason::UnknownClient,
    );
    // Known MAC on the wrong port.
    ignored(
        1,
        &bcast(&msg(MessageType::Discover, vm_mac(2))),
        IgnoreReason::WrongPort,
    );
    // The client chose another server's offer.
    let other_server = bcast(&selecting(
        vm_mac(2),
        ALPHA_IP,
        Ipv4Addr::new(10, 77, 0, 254),
    ));
    ignored(0, &other_server, IgnoreReason::OtherServer);
    // DECLINE and RELEASE are noted, not answered; a REQUEST naming nothing neither.
    for kind in [
        MessageType::Decline,
        MessageType::Release,
        MessageType::Offer,
    ] {
        ignored(0, &bcast(&msg(kind, vm_mac(2))), IgnoreReason::NoAnswer);
    }
    ignored(
        0,
        &bcast(&msg(MessageType::Request, vm_mac(2))),
        IgnoreReason::Malformed,
    );
    // Relayed.
    let mut relayed = msg(MessageType::Discover, vm_mac(2));
    relayed.set_giaddr(Ipv4Addr::new(10, 77, 0, 200));
    ignored(0, &bcast(&relayed), IgnoreReason::Unsupported);
    // A BOOTREPLY sent to port 67.
    let mut reply = msg(MessageType::Discover, vm_mac(2));
    reply.set_opcode(Opcode::BootReply);
    ignored(0, &bcast(&reply), IgnoreReason::Unsupported);
    // No message type option.
    let mut untyped = msg(MessageType::Discover, vm_mac(2));
    untyped.opts_mut().remove(OptionCode::MessageType);
    ignored(0, &bcast(&untyped), IgnoreReason::Malformed);
}

#[test]
fn inform_gets_an_ack_without_lease() {
    let s = server();
    let mut m = msg(MessageType::Inform, vm_mac(2));
    m.set_ciaddr(ALPHA_IP);
    let r = answer(&s, 0, &frame_to(&m, DEFAULT_SERVER_MAC, ALPHA_IP, SERVER));
    assert_eq!(r.kind(), Some(MessageType::Ack));
    assert_eq!(r.msg.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(r.opt(OptionCode::AddressLeaseTime), None);
    assert_eq!(
        r.opt(OptionCode::SubnetMask),
        Some(&DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)))
    );
    assert_eq!((r.dst_mac, r.dst_ip), (vm_mac(2), ALPHA_IP));
}

#[test]
fn non_dhcp_frames_are_not_intercepted() {
    let s = server();
    let m = msg(MessageType::Discover, vm_mac(2));
    let a = Addressing {
        src_mac: vm_mac(2),
        dst_mac: MacAddr::BROADCAST,
        src_ip: ALPHA_IP,
        dst_ip: Ipv4Addr::BROADCAST,
    };
    // A DHCP message to the client port, DNS, and a server's own reply.
    for (sp, dp) in [(67, 68), (5353, 53), (68, 69)] {
        assert_eq!(
            s.handle(port(0), &build_udp_frame(&a, sp, dp, &encode(&m))),
            Outcome::NotDhcp
        );
    }
    let mut arp = bcast(&m);
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    assert_eq!(s.handle(port(0), &arp), Outcome::NotDhcp);
    let mut tcp = bcast(&m);
    tcp[23] = 6;
    assert_eq!(s.handle(port(0), &tcp), Outcome::NotDhcp);
    for short in [&[][..], &[0xff; 13][..], &[0; 60][..]] {
        assert_eq!(s.handle(port(0), short), Outcome::NotDhcp);
    }
}

#[test]
fn truncated_and_corrupt_frames_get_no_answer() {
    let s = server();
    let good = bcast(&msg(MessageType::Discover, vm_mac(2)));
    assert!(s.reply(port(0), &good).is_some());
    for cut in 0..good.len() {
        assert_eq!(s.reply(port(0), &good[..cut]), None, "cut at {cut}");
    }
    let mut bad_udp = good.clone();
    bad_udp[100] ^= 0xff;
    assert_eq!(
        s.handle(port(0), &bad_udp),
        Outcome::Ignored(IgnoreReason::Frame(FrameError::UdpChecksum))
    );
    let mut bad_ip = good.clone();
    bad_ip[22] = 1; // TTL
    assert_eq!(
        s.handle(port(0), &bad_ip),
        Outcome::Ignored(IgnoreReason::Frame(FrameError::IpChecksum))
    );
    // Valid framing, garbage payload: short, no magic cookie, huge hlen.
    let a = Addressing {
        src_mac: vm_mac(2),
        dst_mac: MacAddr::BROADCAST,
        src_ip: Ipv4Addr::UNSPECIFIED,
        dst_ip: Ipv4Addr::BROADCAST,
    };
    let payload = encode(&msg(MessageType::Discover, vm_mac(2)));
    let mut no_magic = payload.clone();
    no_magic[236] = 0;
    let mut huge_hlen = payload.clone();
    huge_hlen[2] = 200;
    for p in [
        &payload[..100],
        &no_magic[..],
        &huge_hlen[..],
        &[0xff; 600][..],
    ] {
        let f = build_udp_frame(&a, CLIENT_PORT, SERVER_PORT, p);
        assert!(matches!(s.handle(port(0), &f), Outcome::Ignored(_)));
    }
}

/// Regression (fuzzing, issue 20): a discover with option 81 (Client FQDN)
/// of length 1 panicked the switch in builds with debug assertions
/// (dhcproto 0.15 `debug_assert!`s the lengths of a few options instead of
/// checking them). Such messages are now ignored as malformed before
/// dhcproto sees them; a well-formed option of each kind still gets an
/// answer.
#[test]
fn options_dhcproto_would_assert_on_are_ignored_not_a_panic() {
    let s = server();
    let a = Addressing {
        src_mac: vm_mac(2),
        dst_mac: MacAddr::BROADCAST,
        src_ip: Ipv4Addr::UNSPECIFIED,
        dst_ip: Ipv4Addr::BROADCAST,
    };
    let with_option = |opt: &[u8]| {
        let mut p = encode(&msg(MessageType::Discover, vm_mac(2)));
        p.truncate(240); // fixed fields and magic cookie
        p.extend_from_slice(&[53, 1, 1]); // DHCPDISCOVER
        p.extend_from_slice(opt);
        p.push(255);
        build_udp_frame(&a, CLIENT_PORT, SERVER_PORT, &p)
    };
    for bad in [
        &[81, 1, 0][..],
        &[81, 0][..],
        &[80, 1, 0][..],
        &[94, 2, 1, 2][..],
        &[151, 0][..],
        &[152, 3, 0, 0, 0][..],
        &[155, 5, 0, 0, 0, 0, 0][..],
        &[80, 0, 80, 0][..], // joined by dhcproto (RFC 3396)
    ] {
        assert_eq!(
            s.handle(port(0), &with_option(bad)),
            Outcome::Ignored(IgnoreReason::Malformed),
            "{bad:?}"
        );
    }
    for good in [
        &[80, 0][..],
        &[94, 3, 1, 2, 3][..],
        &[81, 3, 0, 0, 0][..],
        &[0, 80, 0][..],
    ] {
        assert_eq!(
            s.reply(port(0), &with_option(good)).map(|f| reply_kind(&f)),
            Some(Some(MessageType::Offer)),
            "{good:?}"
        );
    }
}

/// The handler on thousands of random and mutated frames: never a panic;
/// a reply, when there is one, is a valid frame.
#[test]
fn random_bytes_never_panic() {
    let s = server();
    let mut rng = Rng(0x5eed_d4c9);
    let seeds = [
        bcast(&msg(MessageType::Discover, vm_mac(2))),
        bcast(&selecting(vm_mac(2), ALPHA_IP, SERVER)),
    ];
    let a = Addressing {
        src_mac: vm_mac(2),
        dst_mac: MacAddr::BROADCAST,
        src_ip: Ipv4Addr::UNSPECIFIED,
        dst_ip: Ipv4Addr::BROADCAST,
    };
    let mut replies = 0;
    for i in 0..6000 {
        let frame = match i % 3 {
            // Pure noise, often with IPv4/UDP-to-67 headers planted.
            0 => {
                let mut f: Vec<u8> = (0..rng.below(700)).map(|_| rng.next() as u8).collect();
                if f.len() > 40 && rng.below(2) == 0 {
                    f[12..14].copy_from_slice(&[8, 0]);
                    f[14] = 0x45;
                    f[23] = 17;
                    f[20..22].fill(0);
                    f[36..38].copy_from_slice(&67u16.to_be_bytes());
                }
                f
            }
            // A valid request with a few bytes changed (checksums then fail).
            1 => {
                let mut f = seeds[rng.below(2)].clone();
                for _ in 0..=rng.below(4) {
                    let at = rng.below(f.len());
                    f[at] = rng.next() as u8;
                }
                f
            }
            // A mutated DHCP payload in valid framing: reaches the decoder.
            _ => {
                let mut p = parse_udp_frame(&seeds[rng.below(2)])
                    .unwrap()
                    .payload
                    .to_vec();
                for _ in 0..=rng.below(8) {
                    let at = rng.below(p.len());
                    p[at] = rng.next() as u8;
                }
                p.truncate(rng.below(p.len() + 1).max(rng.below(p.len() + 1)));
                build_udp_frame(&a, CLIENT_PORT, SERVER_PORT, &p)
            }
        };
        if let Some(r) = s.reply(port(0), &frame) {
            parse_udp_frame(&r).expect("replies are valid frames");
            replies += 1;
        }
    }
    assert!(replies > 0, "some mutated requests stay valid");
}

#[test]
fn leases_and_config_are_validated() {
    let mut s = server();
    let lease = |n: u8, ip: [u8; 4], name: &str| DhcpLease {
        mac: vm_mac(n),
        ip: Ipv4Addr::from(ip),
        hostname: name.into(),
    };
    let not_leasable =
        |r: Result<(), DhcpError>| matches!(r, Err(DhcpError::AddressNotLeasable { .. }));
    assert!(not_leasable(
        s.set_lease(port(2), lease(4, [10, 77, 1, 4], "c"))
    ));
    assert!(
        not_leasable(s.set_lease(port(2), lease(4, [10, 77, 0, 1], "c"))),
        "server address"
    );
    assert!(not_leasable(
        s.set_lease(port(2), lease(4, [10, 77, 0, 0], "c"))
    ));
    assert!(not_leasable(
        s.set_lease(port(2), lease(4, [10, 77, 0, 255], "c"))
    ));
    assert_eq!(
        s.set_lease(port(2), lease(4, [10, 77, 0, 2], "c")),
        Err(DhcpError::AddressTaken {
            ip: ALPHA_IP,
            mac: vm_mac(4),
            other: vm_mac(2)
        })
    );
    for bad in ["", "a b", "x\n", &"a".repeat(254)] {
        assert!(matches!(
            s.set_lease(port(2), lease(4, [10, 77, 0, 4], bad)),
            Err(DhcpError::BadHostname(_))
        ));
    }
    let multicast = DhcpLease {
        mac: MacAddr([1, 0, 0x5e, 0, 0, 1]),
        ..lease(4, [10, 77, 0, 4], "c")
    };
    assert!(matches!(
        s.set_lease(port(2), multicast),
        Err(DhcpError::BadClientMac(_))
    ));
    // Re-registering a MAC replaces its lease and may move it to another port.
    s.set_lease(port(5), lease(2, [10, 77, 0, 2], "alpha-2"))
        .unwrap();
    assert_eq!(
        s.lease(vm_mac(2)).map(|(p, l)| (p, l.hostname.as_str())),
        Some((port(5), "alpha-2"))
    );
    let discover = bcast(&msg(MessageType::Discover, vm_mac(2)));
    assert_eq!(
        s.handle(port(0), &discover),
        Outcome::Ignored(IgnoreReason::WrongPort)
    );
    assert!(s.reply(port(5), &discover).is_some());
    s.remove_port(port(5));
    assert_eq!(
        s.handle(port(5), &discover),
        Outcome::Ignored(IgnoreReason::UnknownClient)
    );
    assert!(s.remove_lease(vm_mac(3)));
    assert!(!s.remove_lease(vm_mac(3)));

    for (bad, want) in [
        (
            DhcpConfig {
                prefix_len: 31,
                ..DhcpConfig::default()
            },
            DhcpError::BadPrefix(31),
        ),
        (
            DhcpConfig {
                prefix_len: 0,
                ..DhcpConfig::default()
            },
            DhcpError::BadPrefix(0),
        ),
        (
            DhcpConfig {
                server_mac: MacAddr::BROADCAST,
                ..DhcpConfig::default()
            },
            DhcpError::BadServerMac(MacAddr::BROADCAST),
        ),
        (
            DhcpConfig {
                dns: vec![SERVER; 64],
                ..DhcpConfig::default()
            },
            DhcpError::TooManyDnsServers(64),
        ),
    ] {
        assert_eq!(DhcpServer::new(bad).err(), Some(want));
    }
    let wide = DhcpConfig {
        server_ip: Ipv4Addr::new(172, 16, 0, 1),
        prefix_len: 12,
        ..DhcpConfig::default()
    };
    assert_eq!(wide.netmask(), Ipv4Addr::new(255, 240, 0, 0));
    assert_eq!(wide.broadcast(), Ipv4Addr::new(172, 31, 255, 255));
}
