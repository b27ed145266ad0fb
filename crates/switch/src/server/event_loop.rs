//! The event-loop thread: owns the sockets and the [`SwitchCore`].
//!
//! Each port has at most one connection, to its peer (QEMU listening at
//! the port's socket path). A port without one is *dialing*: the loop
//! tries to connect at `next_dial` (see [`dial`]), and sleeps in `poll`
//! until the earliest such time when nothing else happens.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mio::net::UnixStream;
use mio::{Events, Interest, Poll, Token};
use socket2::SockAddr;

mod dial;
mod handover;
mod session;
#[cfg(test)]
mod tests;
mod tunnel;

use super::conn::Conn;
use super::peer;
use super::{Command, ConnectionState, DrainState, SwitchConfig};
use crate::core::{PortId, SwitchCore};
use crate::error::{Result, SwitchError};
use crate::pcap::{Captures, Direction};
use crate::stats::{PortStats, SwitchStats};

pub(crate) const WAKER: Token = Token(usize::MAX);
/// Bytes read from one connection before giving the others a turn.
pub(crate) const READ_BUDGET: usize = 256 << 10;
/// Bytes moved from a port's queue into its write batch at a time.
pub(crate) const WRITE_BATCH: usize = 256 << 10;

fn conn_token(p: PortId) -> Token {
    Token(p.as_u32() as usize)
}

struct PortIo {
    /// Where the peer listens.
    path: PathBuf,
    addr: SockAddr,
    /// The connection to the peer; `None` while dialing.
    conn: Option<Conn>,
    /// While dialing: when to try next.
    next_dial: Instant,
    /// While dialing: the error of the last attempt (raw OS error), so that
    /// a streak of identical failures is logged once.
    last_dial_error: Option<i32>,
}

impl PortIo {
    /// A port dialing at once, or resuming `conn`.
    fn new(path: PathBuf, addr: SockAddr, conn: Option<Conn>) -> Self {
        PortIo {
            path,
            addr,
            conn,
            next_dial: Instant::now(),
            last_dial_error: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Close {
    Eof,
    IoError,
    ProtocolError,
    Removed,
}

pub(crate) struct EventLoop {
    poll: Poll,
    commands: Receiver<Command>,
    core: SwitchCore,
    ports: HashMap<PortId, PortIo>,
    /// Ports that may have frames to write.
    dirty: BTreeSet<PortId>,
    /// Connections with unread data left after their read budget.
    pending_read: Vec<PortId>,
    read_buf: Vec<u8>,
    /// Log bound of cut sessions.
    max_log_bytes: usize,
    /// Where the active cut session reports triggered ports.
    triggers: Option<Sender<PortId>>,
    /// Packet capture (see [`crate::pcap`]), if configured.
    capture: Option<Captures>,
    /// Tunnel ports (not in `ports`), see [`tunnel`].
    tunnels: HashMap<PortId, tunnel::TunnelIo>,
    /// Incarnation of the tunnel added last.
    last_incarnation: u64,
}

/// Current unix time in µs.
fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Frames and bytes read by [`EventLoop::read_conn`].
#[derive(Debug, Default, Clone, Copy)]
struct ReadCount {
    frames: u64,
    bytes: u64,
}

impl EventLoop {
    pub(crate) fn new(poll: Poll, commands: Receiver<Command>, config: &SwitchConfig) -> Self {
        let mut core = SwitchCore::new(config.max_queue_bytes);
        core.set_max_macs(config.max_macs);
        super::dhcp::enable(&mut core, config);
        EventLoop {
            poll,
            commands,
            core,
            ports: HashMap::new(),
            dirty: BTreeSet::new(),
            pending_read: Vec::new(),
            read_buf: vec![0; 64 << 10],
            max_log_bytes: config.max_log_bytes,
            triggers: None,
            capture: config.capture_dir.clone().map(Captures::new),
            tunnels: HashMap::new(),
            last_incarnation: 0,
        }
    }

    /// Runs until a stop command or until every handle is gone.
    pub(crate) fn run(mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            let timeout = if self.pending_read.is_empty() {
                let now = Instant::now();
                let dial = self.dial_timeout(now);
                let keepalive = self.keepalive_timeout(now);
                dial.into_iter().chain(keepalive).min()
            } else {
                Some(Duration::ZERO)
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!("switch event loop: poll failed, stopping: {e}");
                break;
            }
            for ev in events.iter() {
                let token = ev.token();
                if token == WAKER {
                    continue;
                }
                let port = PortId::from_raw(token.0 as u32);
                if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                    self.read(port);
                }
                if ev.is_writable() {
                    self.dirty.insert(port);
                }
            }
            let mut pending = std::mem::take(&mut self.pending_read);
            pending.sort_unstable();
            pending.dedup();
            for port in pending {
                self.read(port);
            }
            if !self.handle_commands() {
                break;
            }
            self.dial_due(Instant::now());
            self.keepalives_due(Instant::now());
            self.send_triggers();
            self.flush_dirty();
        }
        self.shutdown();
    }

    /// Returns false when the loop must stop.
    fn handle_commands(&mut self) -> bool {
        loop {
            let cmd = match self.commands.try_recv() {
                Ok(cmd) => cmd,
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            };
            self.core.set_now(unix_us());
            match cmd {
                Command::AddPort { name, path, reply } => {
                    let _ = reply.send(self.add_port(name, path));
                }
                Command::AddTunnel { config, reply } => {
                    let _ = reply.send(self.add_tunnel(config));
                }
                Command::RemovePort { port, reply } => {
                    let _ = reply.send(self.remove_port(port));
                }
                Command::Hold { port, reply } => {
                    let _ = reply.send(self.hold(port));
                }
                Command::Release { port, reply } => {
                    let _ = reply.send(self.release(port));
                }
                Command::Stats { reply } => {
                    let _ = reply.send(self.stats());
                }
                Command::Inject {
                    port,
                    frames,
                    reply,
                } => {
                    let _ = reply.send(self.inject(port, frames));
                }
                Command::Drain { port, reply } => {
                    let _ = reply.send(self.drain_state(port));
                }
                Command::Connection { port, reply } => {
                    let _ = reply.send(self.connection_state(port));
                }
                Command::Freeze { reply } => {
                    if let Some(epoch) = self.core.session_epoch() {
                        let _ = reply.send(Err(SwitchError::FreezeDuringCutSession { epoch }));
                        continue;
                    }
                    if !self.tunnels.is_empty() {
                        let tunnels = self.tunnels.len();
                        let _ = reply.send(Err(SwitchError::FreezeWithTunnels { tunnels }));
                        continue;
                    }
                    // Nothing is flushed after this: the sockets are handed over as they are.
                    let _ = reply.send(Ok(self.freeze()));
                    return false;
                }
                Command::BeginCutSession {
                    epoch,
                    ports,
                    triggers,
                    reply,
                } => {
                    let _ = reply.send(self.begin_cut_session(epoch, &ports, triggers));
                }
                Command::PrepareCut { port, reply } => {
                    let _ = reply.send(self.prepare_cut(port));
                }
                Command::Probe { port, reply } => {
                    let _ = reply.send(self.probe(port));
                }
                Command::PrepareDone {
                    port,
                    report,
                    reply,
                } => {
                    let _ = reply.send(self.prepare_done(port, report));
                }
                Command::Cut { port, reply } => {
                    let _ = reply.send(self.cut(port));
                }
                Command::SessionStats { reply } => {
                    let _ = reply.send(self.core.session_stats());
                }
                Command::EndCutSession { reply } => {
                    let _ = reply.send(self.end_cut_session());
                }
                Command::AbortCutSession { reply } => {
                    let _ = reply.send(self.abort_cut_session());
                }
                Command::DhcpLease(cmd) => cmd.apply(&mut self.core),
                Command::Stop => return false,
            }
        }
    }

    fn inject(&mut self, port: PortId, frames: Vec<Vec<u8>>) -> Result<super::InjectReport> {
        self.known(port)?;
        let mut r = super::InjectReport::default();
        for f in frames {
            match self.core.enqueue(port, std::sync::Arc::from(f)) {
                crate::core::Enqueued::Queued | crate::core::Enqueued::Held => r.queued += 1,
                _ => r.dropped += 1,
            }
        }
        self.dirty.insert(port);
        Ok(r)
    }

    fn known(&self, port: PortId) -> Result<()> {
        if self.ports.contains_key(&port) || self.tunnels.contains_key(&port) {
            Ok(())
        } else {
            Err(SwitchError::UnknownPort(port))
        }
    }

    fn check_unique_name(&self, name: &str) -> Result<()> {
        match self
            .core
            .port_ids()
            .find(|&p| self.core.port(p).is_some_and(|v| v.name == name))
        {
            Some(port) => Err(SwitchError::DuplicateName {
                name: name.to_owned(),
                port,
            }),
            None => Ok(()),
        }
    }

    fn add_port(&mut self, name: String, path: PathBuf) -> Result<PortId> {
        let addr = peer::address(&path)?;
        self.check_unique_name(&name)?;
        // Two connections to one peer would leave one in its backlog for
        // good: refuse another spelling of a path already in use too.
        let existing = peer::file_id(&path);
        if let Some((&port, _)) = self.ports.iter().find(|(_, io)| {
            io.path == path || (existing.is_some() && peer::file_id(&io.path) == existing)
        }) {
            return Err(SwitchError::DuplicatePath { path, port });
        }
        let port = self.core.add_port(name);
        log::debug!("{port}: dialing {}", path.display());
        self.ports.insert(port, PortIo::new(path, addr, None));
        // A peer already listening is connected before add_port returns.
        self.dial(port, Instant::now());
        Ok(port)
    }

    fn remove_port(&mut self, port: PortId) -> Result<()> {
        self.known(port)?;
        self.close_conn(port, Close::Removed);
        self.ports.remove(&port);
        if let Some(c) = self.capture.as_mut() {
            c.close(port);
        }
        self.remove_tunnel(port);
        self.core.remove_port(port);
        Ok(())
    }

    fn drain_state(&self, port: PortId) -> Result<DrainState> {
        self.known(port)?;
        let Some(conn) = self.ports.get(&port).and_then(|io| io.conn.as_ref()) else {
            return Ok(DrainState::default());
        };
        // A batch holds whole frames; after a hold only a started one remains.
        let partial_bytes = if conn.out.pending_frames() > 0 {
            conn.out.pending_bytes()
        } else {
            0
        };
        let unread_bytes = crate::sockq::unsent_bytes(&conn.stream).unwrap_or(0);
        Ok(DrainState {
            connected: true,
            partial_bytes,
            unread_bytes,
        })
    }

    fn hold(&mut self, port: PortId) -> Result<()> {
        self.known(port)?;
        self.core.hold(port);
        self.take_back_unstarted(port);
        Ok(())
    }

    /// Takes back frames of the current batch that were not started, so
    /// only a frame already partly written can still reach the peer.
    fn take_back_unstarted(&mut self, port: PortId) {
        if let Some(conn) = self.ports.get_mut(&port).and_then(|io| io.conn.as_mut()) {
            let unstarted = conn.out.take_unstarted();
            self.core.requeue_front(port, unstarted);
        }
    }

    fn release(&mut self, port: PortId) -> Result<()> {
        self.known(port)?;
        if self.core.release_blocked(port) {
            return Err(SwitchError::HeldByCutSession(port));
        }
        self.core.release(port);
        self.dirty.insert(port);
        Ok(())
    }

    fn stats(&self) -> SwitchStats {
        let ports: Vec<PortStats> = self
            .core
            .port_ids()
            .filter_map(|id| {
                let v = self.core.port(id)?;
                let io = self.ports.get(&id);
                let tunnel = self.tunnel_stats(id);
                if io.is_none() && tunnel.is_none() {
                    return None;
                }
                let (out_frames, out_bytes) = io
                    .and_then(|io| io.conn.as_ref())
                    .map_or((0, 0), |c| (c.out.pending_frames(), c.out.pending_bytes()));
                Some(PortStats {
                    id,
                    name: v.name.to_owned(),
                    socket_path: io.map(|io| io.path.clone()).unwrap_or_default(),
                    connected: v.connected,
                    holding: v.holding,
                    queued_frames: (v.queued_frames + out_frames) as u64,
                    queued_bytes: (v.queued_bytes + out_bytes) as u64,
                    counters: v.counters,
                    tunnel,
                })
            })
            .collect();
        let queued_bytes = ports.iter().map(|p| p.queued_bytes).sum();
        let mut tunnels = crate::stats::TunnelCounters::default();
        for t in ports.iter().filter_map(|p| p.tunnel.as_ref()) {
            tunnels.add(&t.counters);
        }
        SwitchStats {
            ports,
            totals: self.core.totals(),
            queued_bytes,
            tunnels,
        }
    }

    fn close_conn(&mut self, port: PortId, why: Close) {
        let Some(io) = self.ports.get_mut(&port) else {
            return;
        };
        let Some(mut conn) = io.conn.take() else {
            return;
        };
        // Dropping `conn` closes the socket; its decoder goes with it, so
        // half a frame read from this connection is discarded (the peer
        // starts a new connection with a fresh stream too). Dial again
        // after a pause: a peer that closes at once costs no busy loop.
        io.next_dial = Instant::now() + dial::RETRY;
        io.last_dial_error = None;
        let _ = self.poll.registry().deregister(&mut conn.stream);
        let unstarted = conn.out.take_unstarted();
        if conn.out.frame_pending() {
            self.core.record_drops(port, 1); // a partly written frame is lost
        }
        self.core.requeue_front(port, unstarted);
        match why {
            Close::Removed => {}
            Close::ProtocolError => {
                self.core.record_protocol_error(port);
                self.core.client_disconnected(port);
            }
            Close::Eof | Close::IoError => self.core.client_disconnected(port),
        }
        log::debug!("{port}: connection closed ({why:?})");
    }

    /// Reads and switches frames from the port's connection, up to the read
    /// budget.
    fn read(&mut self, port: PortId) {
        if self.tunnels.contains_key(&port) {
            return self.read_tunnel(port);
        }
        self.read_conn(port, Some(READ_BUDGET));
    }

    /// Reads and switches frames from the port's connection: up to `budget`
    /// bytes (then the port gets another turn later), or with `None` until
    /// the socket has nothing more. Returns the complete frames switched.
    fn read_conn(&mut self, port: PortId, budget: Option<usize>) -> ReadCount {
        let mut count = ReadCount::default();
        let Some(conn) = self.ports.get_mut(&port).and_then(|io| io.conn.as_mut()) else {
            return count;
        };
        let mut budget = budget;
        let closed = loop {
            let n = match conn.stream.read(&mut self.read_buf) {
                Ok(0) => break Some(Close::Eof),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::debug!("{port}: read failed: {e}");
                    break Some(Close::IoError);
                }
            };
            conn.decoder.feed(&self.read_buf[..n]);
            let now = unix_us();
            self.core.set_now(now);
            let bad = loop {
                match conn.decoder.next_frame() {
                    Ok(Some(frame)) => {
                        count.frames += 1;
                        count.bytes += frame.len() as u64;
                        if let Some(c) = self.capture.as_mut() {
                            c.record(
                                port,
                                || self.core.port(port).map(|v| v.name.to_string()),
                                now,
                                Direction::Outbound,
                                frame,
                            );
                        }
                        let decision = self.core.receive(port, frame);
                        self.dirty.extend(decision.targets());
                    }
                    Ok(None) => break false,
                    Err(e) => {
                        log::warn!("{port}: protocol error, closing the connection: {e}");
                        break true;
                    }
                }
            };
            if bad {
                break Some(Close::ProtocolError);
            }
            if let Some(b) = budget.as_mut() {
                *b = b.saturating_sub(n);
                if *b == 0 {
                    self.pending_read.push(port);
                    break None;
                }
            }
        };
        if let Some(why) = closed {
            self.close_conn(port, why);
        }
        count
    }

    fn flush_dirty(&mut self) {
        while let Some(port) = self.dirty.pop_first() {
            self.flush(port);
        }
    }

    /// Writes as much of the port's queue as the socket takes without blocking.
    fn flush(&mut self, port: PortId) {
        if self.tunnels.contains_key(&port) {
            return self.flush_tunnel(port);
        }
        let Some(conn) = self.ports.get_mut(&port).and_then(|io| io.conn.as_mut()) else {
            return;
        };
        let now = unix_us();
        self.core.set_now(now);
        let failed = loop {
            if conn.out.is_empty() {
                while conn.out.pending_bytes() < WRITE_BATCH {
                    let Some(frame) = self.core.pop_tx(port) else {
                        break;
                    };
                    if let Some(c) = self.capture.as_mut() {
                        c.record(
                            port,
                            || self.core.port(port).map(|v| v.name.to_string()),
                            now,
                            Direction::Inbound,
                            &frame.data,
                        );
                    }
                    if conn.out.push(frame).is_err() {
                        self.core.record_drops(port, 1);
                    }
                }
                if conn.out.is_empty() {
                    break false;
                }
            }
            match conn.out.send(&conn.stream) {
                Ok(n) => conn.out.advance(n, |len| self.core.record_tx(port, len)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!("{port}: write failed: {e}");
                    break true;
                }
            }
        };
        if failed {
            self.close_conn(port, Close::IoError);
        }
    }

    fn shutdown(&mut self) {
        let ports: Vec<PortId> = self
            .ports
            .keys()
            .chain(self.tunnels.keys())
            .copied()
            .collect();
        for port in ports {
            let _ = self.remove_port(port);
        }
        log::debug!("switch event loop stopped");
    }
}
