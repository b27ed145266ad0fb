//! A fake switch port, a netns guard and the test addresses.

#![allow(dead_code)]

pub mod frames;

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vmcsnap_hostnet::{destroy_netns, HOST_ADDRESS, HOST_MAC};
use vmcsnap_switch::framing::{self, Decoder};

use frames::*;

pub const VM_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 9);
pub const VM_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x77, 0x00, 0x09];

/// How long a test waits for a frame before it fails (it never passes by waiting).
pub const PATIENCE: Duration = Duration::from_secs(20);

/// A network namespace name unique to this test and process, destroyed on drop.
pub struct NetnsGuard(pub String);

impl NetnsGuard {
    pub fn new(label: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "vmcsnap-t{}-{}-{label}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let _ = destroy_netns(&name);
        NetnsGuard(name)
    }
}

impl Drop for NetnsGuard {
    fn drop(&mut self) {
        if let Err(e) = destroy_netns(&self.0) {
            eprintln!("cleanup of netns {}: {e}", self.0);
        }
    }
}

/// The switch's end of the host port.
pub struct FakeSwitch {
    pub stream: UnixStream,
    dec: Decoder,
}

impl FakeSwitch {
    pub fn connect(path: &Path) -> Self {
        let stream = UnixStream::connect(path).expect("connect to the relay");
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        FakeSwitch {
            stream,
            dec: Decoder::new(),
        }
    }

    pub fn send(&mut self, frame: &[u8]) {
        let mut wire = Vec::new();
        framing::encode(frame, &mut wire).unwrap();
        self.stream.write_all(&wire).unwrap();
    }

    /// The next frame, or None at EOF; panics after PATIENCE.
    pub fn next(&mut self) -> Option<Vec<u8>> {
        let deadline = Instant::now() + PATIENCE;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(f) = self
                .dec
                .next_frame()
                .expect("well-formed stream from the relay")
            {
                return Some(f.to_vec());
            }
            match self.stream.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => self.dec.feed(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("read from the relay: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "no frame from the relay within {PATIENCE:?}"
            );
        }
    }

    /// Frames until `pick` returns Some; answers the host's ARP requests
    /// for VM_IP on the way, skips everything else (IPv6 chatter).
    pub fn wait_for<T>(&mut self, mut pick: impl FnMut(&[u8]) -> Option<T>) -> T {
        loop {
            let f = self.next().expect("the relay closed the connection");
            if let Some(v) = pick(&f) {
                return v;
            }
            if let Some(a) = parse_arp(&f) {
                if a.op == 1 && a.tpa == VM_IP {
                    self.send(&arp(2, VM_MAC, VM_IP, a.sha, a.spa));
                }
            }
        }
    }

    /// ARP for the host and check the answer.
    pub fn arp_host(&mut self) {
        self.send(&arp(1, VM_MAC, VM_IP, [0; 6], HOST_ADDRESS));
        let reply = self.wait_for(|f| parse_arp(f).filter(|a| a.op == 2));
        assert_eq!(
            reply,
            Arp {
                eth_dst: VM_MAC,
                op: 2,
                sha: HOST_MAC,
                spa: HOST_ADDRESS,
                tpa: VM_IP
            },
            "ARP reply of the host interface"
        );
    }

    /// Ping the host and check the echo reply.
    pub fn ping_host(&mut self, seq: u16) {
        let payload: Vec<u8> = (0..48u8).map(|b| b ^ seq as u8).collect();
        self.send(&icmp_echo(
            8,
            VM_MAC,
            HOST_MAC,
            VM_IP,
            HOST_ADDRESS,
            0x4242,
            seq,
            &payload,
        ));
        let reply = self.wait_for(|f| parse_echo(f).filter(|e| e.ty == 0 && e.seq == seq));
        assert_eq!(
            reply,
            Echo {
                eth_src: HOST_MAC,
                ty: 0,
                src: HOST_ADDRESS,
                dst: VM_IP,
                id: 0x4242,
                seq,
                payload
            },
            "echo reply of the host interface"
        );
    }
}

/// Waits (up to PATIENCE) until `cond` holds.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
