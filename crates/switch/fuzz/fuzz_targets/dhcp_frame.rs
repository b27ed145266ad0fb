//! Feeds arbitrary bytes, as an Ethernet frame received from a VM's port,
//! to the switch core with its DHCP server on (`SwitchCore::receive`, which
//! calls `vmcsnap_switch::dhcp::DhcpServer::handle`): nothing may panic,
//! and whatever the switch queues back to the port as a DHCP reply must be
//! a valid IPv4/UDP frame from port 67 to port 68.
//!
//! Input: `[mode, payload...]`, `mode % 2`: 0 = payload is the frame; 1 =
//! payload is the UDP payload of a well-formed frame to port 67 (checksums
//! right), so the DHCP decoder and the server's decisions see it.
#![no_main]

use std::net::Ipv4Addr;

use libfuzzer_sys::fuzz_target;
use vmcsnap_switch::dhcp::{
    build_udp_frame, parse_udp_frame, Addressing, CLIENT_PORT, SERVER_PORT,
};
use vmcsnap_switch::{Decision, DhcpConfig, DhcpLease, MacAddr, SwitchCore};

/// The MAC of the fuzzed port's VM (leased), as in `vmcsnap_spec::addressing`.
const VM_MAC: MacAddr = MacAddr([0x52, 0x54, 0x00, 0x77, 0x00, 0x02]);

fuzz_target!(|data: &[u8]| {
    let Some((&mode, payload)) = data.split_first() else {
        return;
    };
    let frame = if mode % 2 == 0 {
        payload.to_vec()
    } else {
        let a = Addressing {
            src_mac: VM_MAC,
            dst_mac: MacAddr::BROADCAST,
            src_ip: Ipv4Addr::UNSPECIFIED,
            dst_ip: Ipv4Addr::BROADCAST,
        };
        build_udp_frame(&a, CLIENT_PORT, SERVER_PORT, payload)
    };
    let mut core = SwitchCore::new(1 << 20);
    core.set_dhcp(Some(DhcpConfig::default())).unwrap();
    let port = core.add_port("vm0");
    core.client_connected(port);
    let lease = DhcpLease {
        mac: VM_MAC,
        ip: Ipv4Addr::new(10, 77, 0, 2),
        hostname: "vm0".into(),
    };
    core.set_dhcp_lease(port, lease).unwrap();
    if let Decision::Answered(Some(to)) = core.receive(port, &frame) {
        assert_eq!(to, port, "replies go back to the ingress");
        let reply = core.pop_tx(port).expect("the reply is queued");
        let udp = parse_udp_frame(&reply).expect("replies are valid frames");
        assert_eq!(udp.src_port, SERVER_PORT);
    }
});
