//! Helpers for socket-level tests: fake QEMU stream netdevs (listening, as
//! QEMU's `server=on`) and Ethernet frames.
#![allow(dead_code)]

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmcsnap_switch::{PortId, PortStats, SwitchHandle, SwitchStats};

/// Generous bound, only to keep a broken test from hanging.
pub const TIMEOUT: Duration = Duration::from_secs(30);

pub fn mac(n: u8) -> [u8; 6] {
    [0x52, 0x54, 0x00, 0x12, 0x34, n]
}

pub const BCAST: [u8; 6] = [0xff; 6];

/// An IPv4-looking Ethernet frame whose payload starts with `seq` (big-endian).
pub fn eth(dst: [u8; 6], src: [u8; 6], seq: u32, len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(len.max(18));
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&seq.to_be_bytes());
    f.resize(len.max(18), 0xa5);
    f
}

pub fn seq_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes(frame[14..18].try_into().unwrap())
}

pub fn src_of(frame: &[u8]) -> [u8; 6] {
    frame[6..12].try_into().unwrap()
}

/// Listens at `path` as a starting QEMU does: whatever file is there is
/// unlinked first.
pub fn listen(path: &Path) -> UnixListener {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => panic!("cannot unlink {path:?}: {e}"),
    }
    UnixListener::bind(path).expect("bind the peer socket")
}

/// Accepts the switch's next connection on `listener`, waiting at most
/// [`TIMEOUT`]; leaves the listener blocking.
pub fn accept(listener: &UnixListener) -> UnixStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "the switch never connected");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    listener.set_nonblocking(false).unwrap();
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(TIMEOUT)).unwrap();
    stream
}

/// Whether a connection waits in `listener`'s backlog (accepts it if so).
pub fn has_pending(listener: &UnixListener) -> bool {
    listener.set_nonblocking(true).unwrap();
    let pending = match listener.accept() {
        Ok(_) => true,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
        Err(e) => panic!("accept: {e}"),
    };
    listener.set_nonblocking(false).unwrap();
    pending
}

/// A fake QEMU `-netdev stream,server=on`: listens at the port's socket
/// path and serves the switch's connection. Dropping it closes both, as a
/// QEMU that exits (the socket file stays behind).
pub struct Client {
    pub listener: UnixListener,
    pub stream: UnixStream,
}

impl Client {
    /// Listens at `path` (see [`listen`]) and accepts the switch's connection.
    pub fn serve(path: &Path) -> Client {
        Client::accept_on(listen(path))
    }

    /// Accepts the switch's connection on an existing listener.
    pub fn accept_on(listener: UnixListener) -> Client {
        let stream = accept(&listener);
        Client { listener, stream }
    }

    /// Ends the current connection (if the switch has not already) and
    /// accepts the switch's next one on the same listener, as QEMU does
    /// when its client went away.
    pub fn accept_again(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let stream = accept(&self.listener);
        self.stream = stream;
    }

    pub fn send(&mut self, frame: &[u8]) {
        let mut buf = (frame.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(frame);
        self.stream.write_all(&buf).expect("send frame");
    }

    /// Next frame; panics on EOF or timeout.
    pub fn recv(&mut self) -> Vec<u8> {
        self.try_recv()
            .expect("connection closed while waiting for a frame")
    }

    /// Next frame, or None on EOF. Panics on timeout.
    pub fn try_recv(&mut self) -> Option<Vec<u8>> {
        let mut hdr = [0u8; 4];
        match self.stream.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return None,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("reading frame header: {e}"),
        }
        let len = u32::from_be_bytes(hdr) as usize;
        assert!(
            len > 0 && len <= vmcsnap_switch::MAX_FRAME_LEN,
            "bad length {len}"
        );
        let mut frame = vec![0u8; len];
        self.stream
            .read_exact(&mut frame)
            .expect("reading frame body");
        Some(frame)
    }

    /// Waits for the switch to close this connection. Panics if a frame comes instead.
    pub fn expect_eof(&mut self) {
        if let Some(f) = self.try_recv() {
            panic!("expected EOF, got a {}-byte frame", f.len());
        }
    }
}

/// Polls stats until `cond` holds; panics with the last stats after [`TIMEOUT`].
pub fn wait_for(sw: &SwitchHandle, what: &str, cond: impl Fn(&SwitchStats) -> bool) -> SwitchStats {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let stats = sw.stats().unwrap();
        if cond(&stats) {
            return stats;
        }
        if Instant::now() > deadline {
            panic!("timed out waiting for {what}; stats: {stats:#?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn port(stats: &SwitchStats, id: PortId) -> &PortStats {
    stats.port(id).expect("port in stats")
}

/// Waits until port `id` is connected and has seen `connections` connections.
pub fn wait_connected(sw: &SwitchHandle, id: PortId, connections: u64) {
    wait_for(sw, "connection to the peer", |s| {
        let p = port(s, id);
        p.connected && p.counters.connections == connections
    });
}

/// A switch with `n` ports named vm0.., each connected to its fake QEMU
/// (listening before the port is added, so add_port connects at once).
pub struct Rig {
    pub dir: tempfile::TempDir,
    pub sw: SwitchHandle,
    pub ports: Vec<PortId>,
    pub clients: Vec<Client>,
}

impl Rig {
    pub fn new(n: usize) -> Rig {
        Rig::with_switch(vmcsnap_switch::Switch::start().unwrap(), n)
    }

    pub fn with_switch(sw: SwitchHandle, n: usize) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let mut ports = Vec::new();
        let mut clients = Vec::new();
        for i in 0..n {
            let path = dir.path().join(format!("vm{i}.sock"));
            let listener = listen(&path);
            let id = sw.add_port(&format!("vm{i}"), &path).unwrap();
            assert!(
                sw.port_connected(id).unwrap(),
                "add_port connects to a listening peer"
            );
            clients.push(Client::accept_on(listener));
            wait_connected(&sw, id, 1);
            ports.push(id);
        }
        Rig {
            dir,
            sw,
            ports,
            clients,
        }
    }

    pub fn path(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("vm{i}.sock"))
    }

    pub fn stats(&self) -> SwitchStats {
        self.sw.stats().unwrap()
    }
}
