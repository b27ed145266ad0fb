//! Host access end to end, as root: a namespace of the test's own, the
//! relay, and the test playing the switch on the relay's socket.

mod common;

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::UdpSocket;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use common::frames::*;
use common::*;
use vmcsnap_hostnet::netns::netns_path;
use vmcsnap_hostnet::*;

fn config(ns: &str, dir: &Path) -> HostAccessConfig {
    HostAccessConfig::for_netns(ns, dir.join("host.sock"))
}

fn sock(h: &HostAccess) -> PathBuf {
    h.config().socket_path.clone()
}

/// `ip -o addr` inside the namespace, through exec_in_netns.
fn ip_addr_in(ns: &str, dir: &Path) -> String {
    let out = dir.join("ip-addr.txt");
    let argv: Vec<OsString> = ["sh", "-c", &format!("ip -o addr > {}", out.display())]
        .iter()
        .map(OsString::from)
        .collect();
    let status = exec_in_netns(ns, &argv).unwrap();
    assert!(status.success(), "ip -o addr in {ns}: {status}");
    std::fs::read_to_string(out).unwrap()
}

fn argv(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

#[test]
fn arp_and_ping_through_the_relay_and_after_a_reconnect() {
    let ns = NetnsGuard::new("ping");
    let dir = tempfile::tempdir().unwrap();
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    assert!(netns_exists(&ns.0));

    let mut sw = FakeSwitch::connect(&sock(&h));
    sw.arp_host();
    sw.ping_host(1);
    drop(sw);

    let mut sw = FakeSwitch::connect(&sock(&h));
    sw.arp_host();
    sw.ping_host(2);
    let st = h.stats();
    assert_eq!(st.connections, 2);
    assert!(
        st.frames_from_switch >= 4 && st.frames_to_switch >= 4,
        "{st:?}"
    );
    assert_eq!(st.protocol_errors, 0);

    let addrs = ip_addr_in(&ns.0, dir.path());
    assert!(
        addrs
            .lines()
            .any(|l| l.contains("vmcs0") && l.contains("inet 10.77.0.1/24")),
        "{addrs}"
    );
    assert!(
        addrs
            .lines()
            .any(|l| l.contains("lo") && l.contains("inet 127.0.0.1/8")),
        "lo is up: {addrs}"
    );
    // exec reports the command's exit code.
    assert_eq!(
        exec_in_netns(&ns.0, &argv(&["sh", "-c", "exit 7"]))
            .unwrap()
            .code(),
        Some(7)
    );
    h.stop().unwrap();
}

#[test]
fn a_second_connection_waits_in_the_backlog_until_the_first_closes() {
    let ns = NetnsGuard::new("backlog");
    let dir = tempfile::tempdir().unwrap();
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    let mut first = FakeSwitch::connect(&sock(&h));
    let mut second = FakeSwitch::connect(&sock(&h));
    second.send(&arp(1, VM_MAC, VM_IP, [0; 6], HOST_ADDRESS));
    first.arp_host();
    assert_eq!(
        h.stats().connections,
        1,
        "the second connection is not accepted while the first is up"
    );
    drop(first);
    // Once accepted, the request the second switch sent early is answered.
    let reply = second.wait_for(|f| parse_arp(f).filter(|a| a.op == 2));
    assert_eq!(reply.sha, HOST_MAC);
    second.ping_host(3);
    assert_eq!(h.stats().connections, 2);
    h.stop().unwrap();
}

#[test]
fn tap_frames_without_a_switch_are_dropped_then_flow_once_one_connects() {
    let ns = NetnsGuard::new("drop");
    let dir = tempfile::tempdir().unwrap();
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    let send_udp = |ns: &str| {
        in_netns(Some(ns), || {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            // Resolving 10.77.0.9 makes the kernel ARP out of the tap.
            let _ = s.send_to(b"hello", (VM_IP, 9));
            Ok(())
        })
        .unwrap()
    };
    send_udp(&ns.0);
    eventually(
        "the ARP request without a switch is counted as dropped",
        || h.stats().dropped_no_switch > 0,
    );
    assert_eq!(h.stats().frames_to_switch, 0);

    let mut sw = FakeSwitch::connect(&sock(&h));
    send_udp(&ns.0);
    let req = sw.wait_for(|f| parse_arp(f).filter(|a| a.op == 1 && a.tpa == VM_IP));
    assert_eq!(
        req,
        Arp {
            eth_dst: BROADCAST,
            op: 1,
            sha: HOST_MAC,
            spa: HOST_ADDRESS,
            tpa: VM_IP
        }
    );
    // Answer it: the queued UDP datagram follows.
    sw.send(&arp(2, VM_MAC, VM_IP, HOST_MAC, HOST_ADDRESS));
    let udp = sw.wait_for(|f| {
        (f.len() >= 47 && u16::from_be_bytes([f[12], f[13]]) == ETH_IPV4 && f[23] == 17)
            .then(|| f.to_vec())
    });
    assert_eq!(&udp[0..6], &VM_MAC);
    assert_eq!(&udp[42..47], b"hello");
    h.stop().unwrap();
}

#[test]
fn a_malformed_stream_closes_the_connection_and_the_relay_accepts_again() {
    let ns = NetnsGuard::new("malformed");
    let dir = tempfile::tempdir().unwrap();
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    for header in [0u32, (vmcsnap_switch::framing::MAX_FRAME_LEN + 1) as u32] {
        let mut s = UnixStream::connect(sock(&h)).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        s.write_all(&header.to_be_bytes()).unwrap();
        // The relay closes; whatever it sent before (IPv6 chatter) ends in EOF.
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => {}
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
    assert_eq!(h.stats().protocol_errors, 2);
    let mut sw = FakeSwitch::connect(&sock(&h));
    sw.arp_host();
    h.stop().unwrap();
}

#[test]
fn start_recovers_from_what_a_crashed_owner_leaves() {
    let ns = NetnsGuard::new("crash");
    let dir = tempfile::tempdir().unwrap();
    // A creator killed between creating /run/netns/NAME and mounting onto it.
    std::fs::create_dir_all("/run/netns").unwrap();
    std::fs::File::create(netns_path(&ns.0)).unwrap();
    assert!(!netns_exists(&ns.0), "a plain file is not a namespace");
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    assert!(netns_exists(&ns.0));
    let ns_ino = std::fs::metadata(netns_path(&ns.0)).unwrap().ino();

    // A second owner of the same socket is refused while the first lives,
    // and the first one's interface keeps working.
    let err = HostAccess::start(config(&ns.0, dir.path())).unwrap_err();
    assert!(matches!(err, HostNetError::SocketInUse { .. }), "{err}");
    FakeSwitch::connect(&sock(&h)).arp_host();
    h.stop().unwrap();

    // What a dead owner leaves: the namespace, an interface of the name
    // (here a persistent tap, which survives its creator) and a socket file
    // nobody listens on.
    let st = exec_in_netns(
        &ns.0,
        &argv(&["ip", "tuntap", "add", "dev", DEFAULT_IFNAME, "mode", "tap"]),
    )
    .unwrap();
    assert!(st.success());
    assert!(interfaces(Some(&ns.0))
        .unwrap()
        .contains(&DEFAULT_IFNAME.to_string()));
    drop(UnixListener::bind(dir.path().join("host.sock")).unwrap());
    assert!(dir.path().join("host.sock").exists());

    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    assert_eq!(
        std::fs::metadata(netns_path(&ns.0)).unwrap().ino(),
        ns_ino,
        "the namespace is reused"
    );
    let mut sw = FakeSwitch::connect(&sock(&h));
    sw.arp_host();
    sw.ping_host(9);
    let addrs = ip_addr_in(&ns.0, dir.path());
    assert_eq!(
        addrs.lines().filter(|l| l.contains("10.77.0.1/24")).count(),
        1,
        "{addrs}"
    );
    h.stop().unwrap();
}

#[test]
fn stop_removes_the_tap_and_destroy_removes_the_namespace() {
    let ns = NetnsGuard::new("destroy");
    let dir = tempfile::tempdir().unwrap();
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    assert!(interfaces(Some(&ns.0))
        .unwrap()
        .contains(&DEFAULT_IFNAME.to_string()));
    let path = sock(&h);
    h.stop().unwrap();
    let ifs = interfaces(Some(&ns.0)).unwrap();
    assert!(!ifs.contains(&DEFAULT_IFNAME.to_string()), "{ifs:?}");
    assert!(ifs.contains(&"lo".to_string()));
    assert!(!path.exists(), "the socket file is removed");
    assert!(netns_exists(&ns.0), "stop keeps the namespace");

    destroy_netns(&ns.0).unwrap();
    assert!(!netns_path(&ns.0).exists());
    assert!(!netns_exists(&ns.0));
    let err = exec_in_netns(&ns.0, &argv(&["true"])).unwrap_err();
    assert!(matches!(err, HostNetError::NetnsMissing { .. }), "{err}");
    destroy_netns(&ns.0).unwrap(); // idempotent
}

#[test]
fn a_dropped_host_access_stops_too() {
    let ns = NetnsGuard::new("dropped");
    let dir = tempfile::tempdir().unwrap();
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    drop(h);
    assert!(!interfaces(Some(&ns.0))
        .unwrap()
        .contains(&DEFAULT_IFNAME.to_string()));
    let h = HostAccess::start(config(&ns.0, dir.path())).unwrap();
    FakeSwitch::connect(&sock(&h)).arp_host();
}

#[test]
fn bad_configurations_are_rejected_before_anything_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("vmcsnap-never-made", dir.path());
    cfg.ifname = "a-name-longer-than-15".into();
    assert!(matches!(
        HostAccess::start(cfg).unwrap_err(),
        HostNetError::InvalidIfname { .. }
    ));
    assert!(!netns_exists("vmcsnap-never-made"));
    let cfg = config("bad/name", dir.path());
    assert!(matches!(
        HostAccess::start(cfg).unwrap_err(),
        HostNetError::InvalidNetnsName { .. }
    ));
}
