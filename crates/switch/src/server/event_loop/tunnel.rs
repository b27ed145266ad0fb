//! Tunnel ports in the event loop: one connected UDP socket per tunnel,
//! one datagram per frame (see [`crate::tunnel`]).
//!
//! Sending: frames the core queued for the tunnel port are popped, given
//! a header (the color their sender had at reception, [`SwitchCore::wire_tag`])
//! and sent; a full socket buffer puts the frame back and waits for
//! writable. Receiving: each datagram is decoded (refused ones are
//! counted by reason), checked against the [`SeqWindow`] (duplicates and
//! stale ones dropped and counted) and its frame switched with the
//! header's color ([`SwitchCore::receive_remote`]). Keepalives go out every
//! [`TUNNEL_KEEPALIVE`].

use std::net::SocketAddr;

use mio::net::UdpSocket;

use super::*;
use crate::core::RemoteColor;
use crate::mediator::Color;
use crate::server::{TunnelConfig, TUNNEL_KEEPALIVE, TUNNEL_PEER_ALIVE_MS};
use crate::stats::{PeerCut, TunnelCounters, TunnelPortStats};
use crate::tunnel::{self, Header, Kind, SeqVerdict, SeqWindow};

/// Datagrams read from one tunnel before giving the others a turn.
const READ_DATAGRAMS: usize = 256;
/// Receive errors in a row before a tunnel waits for its next event.
const MAX_RECV_ERRORS: u32 = 8;

pub(super) struct TunnelIo {
    config: TunnelConfig,
    local: SocketAddr,
    socket: UdpSocket,
    incarnation: u64,
    next_seq: u64,
    window: SeqWindow,
    next_keepalive: Instant,
    last_rx: Option<Instant>,
    /// The newest post keepalive: (epoch, incarnation, seq).
    peer_mark: Option<(u64, u64, u64)>,
    counters: TunnelCounters,
    out: Vec<u8>,
}

impl TunnelIo {
    fn new(config: TunnelConfig, local: SocketAddr, socket: UdpSocket, incarnation: u64) -> Self {
        TunnelIo {
            config,
            local,
            socket,
            incarnation,
            next_seq: 1,
            window: SeqWindow::new(),
            next_keepalive: Instant::now(),
            last_rx: None,
            peer_mark: None,
            counters: TunnelCounters::default(),
            out: Vec::with_capacity(tunnel::MAX_DATAGRAM_LEN),
        }
    }

    /// Sends one datagram; the sequence number is used up only if it went.
    fn send(&mut self, kind: Kind, tag: Option<(Color, u64)>, payload: &[u8]) -> io::Result<()> {
        let header = Header {
            kind,
            tag,
            incarnation: self.incarnation,
            seq: self.next_seq,
        };
        self.out.clear();
        tunnel::encode(&header, payload, &mut self.out);
        self.socket.send(&self.out)?;
        self.next_seq += 1;
        self.counters.datagrams_sent += 1;
        if kind == Kind::Keepalive {
            self.counters.keepalives_sent += 1;
        }
        Ok(())
    }

    fn send_keepalive(&mut self, now: Instant, tag: Option<(Color, u64)>) {
        self.next_keepalive = now + TUNNEL_KEEPALIVE;
        match self.send(Kind::Keepalive, tag, &[]) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                self.counters.send_errors += 1;
                log::debug!("tunnel {:?}: keepalive not sent: {e}", self.config.name);
            }
        }
    }

    /// Keeps the earliest post keepalive of an epoch: what the other
    /// switch sent before it may be channel state; what it sent after it
    /// (post frames, more keepalives) is not waited for.
    fn note_peer_mark(&mut self, epoch: u64, incarnation: u64, seq: u64) {
        let newer = match self.peer_mark {
            Some((e, i, s)) if e == epoch && i == incarnation => seq < s,
            _ => true,
        };
        if newer {
            self.peer_mark = Some((epoch, incarnation, seq));
        }
    }

    pub(super) fn stats(&self, now: Instant) -> TunnelPortStats {
        let seq = self.window.counts();
        let mut counters = self.counters;
        counters.lost = seq.lost;
        counters.restarts = seq.restarts;
        let alive = Duration::from_millis(TUNNEL_PEER_ALIVE_MS);
        let peer_cut = self.peer_mark.and_then(|(epoch, incarnation, seq)| {
            let missing = self.window.missing_below(incarnation, seq)?;
            Some(PeerCut { epoch, missing })
        });
        TunnelPortStats {
            local: self.local,
            remote: self.config.remote,
            peer_alive: self.last_rx.is_some_and(|t| now.duration_since(t) < alive),
            peer_cut,
            counters,
        }
    }
}

fn socket_error(config: &TunnelConfig, what: &'static str, source: io::Error) -> SwitchError {
    SwitchError::TunnelSocket {
        name: config.name.clone(),
        local: config.local,
        remote: config.remote,
        what,
        source,
    }
}

/// A non-blocking UDP socket bound at `config.local`, connected to
/// `config.remote`.
fn open_socket(config: &TunnelConfig) -> Result<(UdpSocket, SocketAddr)> {
    let fail = |what, source| socket_error(config, what, source);
    let socket = UdpSocket::bind(config.local).map_err(|e| fail("bind", e))?;
    socket
        .connect(config.remote)
        .map_err(|e| fail("connect", e))?;
    let local = socket.local_addr().map_err(|e| fail("local_addr", e))?;
    Ok((socket, local))
}

impl EventLoop {
    pub(super) fn add_tunnel(&mut self, config: TunnelConfig) -> Result<PortId> {
        self.check_unique_name(&config.name)?;
        let (mut socket, local) = open_socket(&config)?;
        // Larger than any earlier incarnation of this process's tunnels, so
        // a tunnel added again is not taken for the old one's repeats.
        let ms = unix_us() / 1000;
        self.last_incarnation = ms.max(self.last_incarnation + 1);
        let port = self.core.add_tunnel_port(config.name.clone());
        let interest = Interest::READABLE | Interest::WRITABLE;
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut socket, conn_token(port), interest)
        {
            self.core.remove_port(port);
            return Err(socket_error(&config, "register", e));
        }
        log::debug!("{port}: tunnel {local} -> {}", config.remote);
        let mut io = TunnelIo::new(config, local, socket, self.last_incarnation);
        self.core.client_connected(port);
        let tag = self.keepalive_tag(port);
        io.send_keepalive(Instant::now(), tag);
        self.tunnels.insert(port, io);
        Ok(port)
    }

    pub(super) fn remove_tunnel(&mut self, port: PortId) {
        if let Some(mut io) = self.tunnels.remove(&port) {
            let _ = self.poll.registry().deregister(&mut io.socket);
            self.core.remove_port(port);
        }
    }

    /// How long `poll` may sleep before a keepalive is due.
    pub(super) fn keepalive_timeout(&self, now: Instant) -> Option<Duration> {
        self.tunnels
            .values()
            .map(|t| t.next_keepalive.saturating_duration_since(now))
            .min()
    }

    /// Sends the keepalives that are due.
    pub(super) fn keepalives_due(&mut self, now: Instant) {
        let due: Vec<PortId> = self
            .tunnels
            .iter()
            .filter(|(_, t)| t.next_keepalive <= now)
            .map(|(&p, _)| p)
            .collect();
        for port in due {
            self.keepalive(port, now);
        }
    }

    fn keepalive(&mut self, port: PortId, now: Instant) {
        let tag = self.keepalive_tag(port);
        if let Some(t) = self.tunnels.get_mut(&port) {
            t.send_keepalive(now, tag);
        }
    }

    /// A keepalive tells the other switch where this one's cut session
    /// stands: post once every session port is cut and no frame waits for
    /// the tunnel (so every pre frame of the epoch went out before it),
    /// pre while the session runs, untagged without one.
    fn keepalive_tag(&self, port: PortId) -> Option<(Color, u64)> {
        let epoch = self.core.session_epoch()?;
        let queued = self.core.port(port).map_or(0, |v| v.queued_frames);
        if self.core.session_all_post().is_some() && queued == 0 {
            Some((Color::Post, epoch))
        } else {
            Some((Color::Pre, epoch))
        }
    }

    /// Once the last session port is cut, sends every tunnel's queue and
    /// then a post keepalive at once, instead of at the next tick.
    pub(super) fn mark_tunnels_if_all_post(&mut self) {
        if self.core.session_all_post().is_none() {
            return;
        }
        let ports: Vec<PortId> = self.tunnels.keys().copied().collect();
        for port in ports {
            self.flush_tunnel(port);
            self.keepalive(port, Instant::now());
        }
    }

    /// Reads and switches datagrams from the tunnel, up to
    /// [`READ_DATAGRAMS`] (then it gets another turn).
    pub(super) fn read_tunnel(&mut self, port: PortId) {
        // The buffer (64 KiB) holds any UDP datagram: none is truncated.
        let mut buf = std::mem::take(&mut self.read_buf);
        if self.read_datagrams(port, &mut buf) {
            self.pending_read.push(port);
        }
        self.read_buf = buf;
    }

    /// Returns true if the budget ran out before the socket was empty.
    fn read_datagrams(&mut self, port: PortId, buf: &mut [u8]) -> bool {
        let mut errors = 0;
        for _ in 0..READ_DATAGRAMS {
            let Some(t) = self.tunnels.get_mut(&port) else {
                return false;
            };
            let n = match t.socket.recv(buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if errors < MAX_RECV_ERRORS => {
                    // E.g. ECONNREFUSED: an earlier datagram found nobody
                    // at the remote address. The error is consumed, and
                    // datagrams may wait behind it.
                    errors += 1;
                    log::debug!("{port}: tunnel receive: {e}");
                    continue;
                }
                Err(e) => {
                    log::warn!(
                        "{port}: tunnel receive keeps failing, waiting for the next event: {e}"
                    );
                    return false;
                }
            };
            self.tunnel_datagram(port, &buf[..n]);
        }
        true
    }

    fn tunnel_datagram(&mut self, port: PortId, datagram: &[u8]) {
        let Some(t) = self.tunnels.get_mut(&port) else {
            return;
        };
        let (header, payload) = match tunnel::decode(datagram) {
            Ok(d) => d,
            Err(e) => {
                t.counters.refused.count(&e);
                log::debug!("{port}: {e}");
                return;
            }
        };
        t.counters.datagrams_received += 1;
        match t.window.observe(header.incarnation, header.seq) {
            SeqVerdict::Duplicate => t.counters.duplicates += 1,
            SeqVerdict::Stale => t.counters.stale += 1,
            v => {
                if v == SeqVerdict::Late {
                    t.counters.late += 1;
                }
                t.last_rx = Some(Instant::now());
                match header.kind {
                    Kind::Keepalive => {
                        t.counters.keepalives_received += 1;
                        if let Some((Color::Post, epoch)) = header.tag {
                            t.note_peer_mark(epoch, header.incarnation, header.seq);
                        }
                    }
                    Kind::Frame => self.switch_remote(port, payload, header.tag),
                }
            }
        }
    }

    fn switch_remote(&mut self, port: PortId, frame: &[u8], tag: Option<(Color, u64)>) {
        let now = unix_us();
        self.core.set_now(now);
        if let Some(c) = self.capture.as_mut() {
            let name = || self.core.port(port).map(|v| v.name.to_string());
            c.record(port, name, now, Direction::Outbound, frame);
        }
        let (decision, colored) = self.core.receive_remote(port, frame, tag);
        if let Some(t) = self.tunnels.get_mut(&port) {
            t.counters.frames_received += 1;
            if colored == RemoteColor::OtherEpoch {
                t.counters.other_epoch += 1;
            }
        }
        self.dirty.extend(decision.targets());
    }

    /// Sends the tunnel port's queue, a datagram per frame, as far as the
    /// socket takes without blocking.
    pub(super) fn flush_tunnel(&mut self, port: PortId) {
        let now = unix_us();
        self.core.set_now(now);
        while let Some(frame) = self.core.pop_tx(port) {
            let Some(t) = self.tunnels.get_mut(&port) else {
                return;
            };
            if tunnel::HEADER_LEN + frame.len() > t.config.max_datagram_len {
                t.counters.too_large += 1;
                self.core.record_drops(port, 1);
                continue;
            }
            let tag = self.core.wire_tag(&frame);
            match t.send(Kind::Frame, tag, &frame) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.core.requeue_front(port, vec![frame]);
                    return; // writable comes later
                }
                Err(e) => {
                    log::debug!("{port}: tunnel send: {e}");
                    t.counters.send_errors += 1;
                    self.core.record_drops(port, 1);
                    continue;
                }
            }
            if let Some(c) = self.capture.as_mut() {
                let name = || self.core.port(port).map(|v| v.name.to_string());
                c.record(port, name, now, Direction::Inbound, &frame.data);
            }
            self.core.record_tx(port, frame.len());
        }
    }

    pub(super) fn tunnel_stats(&self, port: PortId) -> Option<TunnelPortStats> {
        self.tunnels.get(&port).map(|t| t.stats(Instant::now()))
    }
}
