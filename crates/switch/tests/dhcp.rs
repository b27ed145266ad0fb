//! The switch's DHCP server over real unix sockets, with fake QEMU peers
//! (see `common`). Kept small: the protocol cases are unit-tested in
//! `src/dhcp/tests.rs`.

mod common;

use std::net::Ipv4Addr;

use common::*;
use dhcproto::v4::{
    Decodable, Decoder, DhcpOption, Encodable, Encoder, Message, MessageType, OptionCode,
};
use vmcsnap_switch::dhcp::{
    build_udp_frame, parse_udp_frame, Addressing, CLIENT_PORT, SERVER_PORT,
};
use vmcsnap_switch::{DhcpConfig, DhcpError, MacAddr, Switch, SwitchConfig, SwitchError};

fn request(kind: MessageType, mac: [u8; 6], xid: u32, requested: Option<Ipv4Addr>) -> Vec<u8> {
    let unspecified = Ipv4Addr::UNSPECIFIED;
    let mut m = Message::new_with_id(
        xid,
        unspecified,
        unspecified,
        unspecified,
        unspecified,
        &mac,
    );
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    if let Some(ip) = requested {
        m.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
    }
    let mut payload = Vec::new();
    m.encode(&mut Encoder::new(&mut payload)).unwrap();
    let a = Addressing {
        src_mac: MacAddr(mac),
        dst_mac: MacAddr::BROADCAST,
        src_ip: unspecified,
        dst_ip: Ipv4Addr::BROADCAST,
    };
    build_udp_frame(&a, CLIENT_PORT, SERVER_PORT, &payload)
}

fn decode(frame: &[u8]) -> Message {
    let udp = parse_udp_frame(frame).expect("a valid UDP frame");
    Message::decode(&mut Decoder::new(udp.payload)).unwrap()
}

#[test]
fn vms_get_their_leases_and_requests_are_not_forwarded() {
    let config = SwitchConfig {
        dhcp: Some(DhcpConfig::default()),
        ..SwitchConfig::default()
    };
    let mut r = Rig::with_switch(Switch::start_with(config).unwrap(), 2);
    let ip = Ipv4Addr::new(10, 77, 0, 2);
    r.sw.set_dhcp_lease(r.ports[0], MacAddr(mac(0)), ip, "alpha")
        .unwrap();

    r.clients[0].send(&request(MessageType::Discover, mac(0), 7, None));
    let offer = decode(&r.clients[0].recv());
    assert_eq!(
        (offer.opts().msg_type(), offer.xid(), offer.yiaddr()),
        (Some(MessageType::Offer), 7, ip)
    );
    assert_eq!(
        offer.opts().get(OptionCode::Hostname),
        Some(&DhcpOption::Hostname("alpha".into()))
    );

    r.clients[0].send(&request(MessageType::Request, mac(0), 8, Some(ip)));
    let ack = decode(&r.clients[0].recv());
    assert_eq!(
        (ack.opts().msg_type(), ack.xid(), ack.yiaddr()),
        (Some(MessageType::Ack), 8, ip)
    );

    // A MAC without a lease gets nothing.
    r.clients[1].send(&request(MessageType::Discover, mac(1), 9, None));
    // Markers: the next frame each client gets is the other's marker, so no
    // DHCP request was flooded and client 1 got no answer.
    r.clients[0].send(&eth(BCAST, mac(0), 100, 60));
    r.clients[1].send(&eth(BCAST, mac(1), 101, 60));
    assert_eq!(seq_of(&r.clients[1].recv()), 100);
    assert_eq!(seq_of(&r.clients[0].recv()), 101);

    let s = r.stats();
    let (p0, p1) = (port(&s, r.ports[0]), port(&s, r.ports[1]));
    assert_eq!(
        (p0.counters.dhcp_requests, p0.counters.dhcp_replies),
        (2, 2)
    );
    assert_eq!(
        (p1.counters.dhcp_requests, p1.counters.dhcp_replies),
        (1, 0)
    );
    assert_eq!((s.totals.dhcp_requests, s.totals.dhcp_replies), (3, 2));
}

#[test]
fn lease_registration_errors() {
    let mut r = Rig::new(1);
    let ip = Ipv4Addr::new(10, 77, 0, 2);
    let err =
        r.sw.set_dhcp_lease(r.ports[0], MacAddr(mac(0)), ip, "alpha")
            .unwrap_err();
    assert!(
        matches!(err, SwitchError::Dhcp(DhcpError::Disabled)),
        "{err}"
    );
    r.sw.stop();

    let config = SwitchConfig {
        dhcp: Some(DhcpConfig::default()),
        ..SwitchConfig::default()
    };
    r = Rig::with_switch(Switch::start_with(config).unwrap(), 1);
    let gone =
        r.sw.add_port("gone", &r.dir.path().join("gone.sock"))
            .unwrap();
    r.sw.remove_port(gone).unwrap();
    let err =
        r.sw.set_dhcp_lease(gone, MacAddr(mac(0)), ip, "alpha")
            .unwrap_err();
    assert!(
        matches!(err, SwitchError::UnknownPort(p) if p == gone),
        "{err}"
    );
    let outside = Ipv4Addr::new(192, 168, 0, 2);
    let err =
        r.sw.set_dhcp_lease(r.ports[0], MacAddr(mac(0)), outside, "alpha")
            .unwrap_err();
    assert!(
        matches!(err, SwitchError::Dhcp(DhcpError::AddressNotLeasable { .. })),
        "{err}"
    );
    assert!(!r.sw.remove_dhcp_lease(r.ports[0], MacAddr(mac(0))).unwrap());
    r.sw.set_dhcp_lease(r.ports[0], MacAddr(mac(0)), ip, "alpha")
        .unwrap();
    assert!(r.sw.remove_dhcp_lease(r.ports[0], MacAddr(mac(0))).unwrap());

    let bad = SwitchConfig {
        dhcp: Some(DhcpConfig {
            prefix_len: 32,
            ..DhcpConfig::default()
        }),
        ..SwitchConfig::default()
    };
    let err = Switch::start_with(bad).unwrap_err();
    assert!(
        matches!(err, SwitchError::Dhcp(DhcpError::BadPrefix(32))),
        "{err}"
    );
}
