//! The relay between the tap and the switch, on one thread with `poll`.
//!
//! It plays the part of QEMU's `-netdev stream,server=on`: it listens on a
//! unix socket, serves one connection at a time (the listener is not polled
//! while a connection is up, so later connections wait in the backlog) and
//! accepts again once the connection closes. Frames from the switch are
//! decoded ([`vmcsnap_switch::framing`]) and written to the tap; frames read
//! from the tap are length-prefixed and queued for the switch.
//!
//! Nothing blocks: the tap and the sockets are non-blocking, the output to
//! the switch goes through a buffer of at most [`OUT_BUFFER_CAP`] bytes, and
//! a frame that finds no connection, a full buffer or a tap that refuses it
//! is dropped and counted (like a NIC's drop counters; TCP in the namespace
//! retransmits). A malformed stream (zero or oversized length) closes the
//! connection, as QEMU does.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vmcsnap_switch::framing::{self, Decoder, MAX_FRAME_LEN};

/// Most bytes queued towards the switch before tap frames are dropped.
pub const OUT_BUFFER_CAP: usize = 1 << 20;

/// Tap frames read per wakeup before the other sources get a turn.
const TAP_BURST: usize = 64;

/// Counters of the relay, readable while it runs.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    connections: AtomicU64,
    to_switch: AtomicU64,
    from_switch: AtomicU64,
    dropped_no_switch: AtomicU64,
    dropped_backlog: AtomicU64,
    dropped_to_tap: AtomicU64,
    protocol_errors: AtomicU64,
}

/// A copy of the relay's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Switch connections accepted so far.
    pub connections: u64,
    /// Frames read from the tap and queued for the switch.
    pub frames_to_switch: u64,
    /// Frames received from the switch and written to the tap.
    pub frames_from_switch: u64,
    /// Tap frames dropped because no switch was connected.
    pub dropped_no_switch: u64,
    /// Tap frames dropped because the switch did not read fast enough.
    pub dropped_backlog: u64,
    /// Switch frames the tap refused (interface down, too large, ...).
    pub dropped_to_tap: u64,
    /// Connections closed because of a malformed stream.
    pub protocol_errors: u64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> RelayStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayStats {
            connections: g(&self.connections),
            frames_to_switch: g(&self.to_switch),
            frames_from_switch: g(&self.from_switch),
            dropped_no_switch: g(&self.dropped_no_switch),
            dropped_backlog: g(&self.dropped_backlog),
            dropped_to_tap: g(&self.dropped_to_tap),
            protocol_errors: g(&self.protocol_errors),
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

struct Conn {
    stream: UnixStream,
    decoder: Decoder,
    out: Vec<u8>,
}

/// The relay thread's state.
pub(crate) struct Relay {
    pub tap: OwnedFd,
    pub listener: UnixListener,
    pub stop: OwnedFd,
    pub counters: Arc<Counters>,
    pub ifname: String,
}

impl Relay {
    /// Runs until the stop pipe becomes readable (or the tap fails).
    pub(crate) fn run(self) {
        let mut conn: Option<Conn> = None;
        let mut frame = vec![0u8; MAX_FRAME_LEN];
        let mut rbuf = vec![0u8; 64 * 1024];
        loop {
            let mut fds = vec![
                pollfd(self.stop.as_raw_fd(), libc::POLLIN),
                pollfd(self.tap.as_raw_fd(), libc::POLLIN),
            ];
            match &conn {
                None => fds.push(pollfd(self.listener.as_raw_fd(), libc::POLLIN)),
                Some(c) => {
                    let out = if c.out.is_empty() { 0 } else { libc::POLLOUT };
                    fds.push(pollfd(c.stream.as_raw_fd(), libc::POLLIN | out));
                }
            }
            // SAFETY: `fds` is a valid array of pollfd of the given length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!(
                    "host access relay of {}: poll failed: {e}; relay stopped",
                    self.ifname
                );
                return;
            }
            if fds[0].revents != 0 {
                return;
            }
            if fds[1].revents != 0 && !self.pump_tap(&mut frame, &mut conn) {
                return;
            }
            let ready = fds[2].revents;
            if ready == 0 {
                continue;
            }
            match conn.as_mut() {
                None => self.accept(&mut conn),
                Some(c) => {
                    if !self.serve(c, &mut rbuf) {
                        conn = None;
                    }
                }
            }
        }
    }

    /// Reads a burst of tap frames; false when the tap is gone.
    fn pump_tap(&self, frame: &mut [u8], conn: &mut Option<Conn>) -> bool {
        for _ in 0..TAP_BURST {
            // SAFETY: `frame` is writable for its length.
            let n =
                unsafe { libc::read(self.tap.as_raw_fd(), frame.as_mut_ptr().cast(), frame.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        log::error!(
                            "host access relay: reading tap {} failed: {e}; relay stopped",
                            self.ifname
                        );
                        return false;
                    }
                }
            }
            let frame = &frame[..n as usize];
            let Some(c) = conn.as_mut() else {
                bump(&self.counters.dropped_no_switch);
                continue;
            };
            if c.out.len() + framing::HEADER_LEN + frame.len() > OUT_BUFFER_CAP {
                bump(&self.counters.dropped_backlog);
                continue;
            }
            match framing::encode(frame, &mut c.out) {
                Ok(()) => bump(&self.counters.to_switch),
                Err(e) => log::warn!("host access relay: tap frame not forwarded: {e}"),
            }
        }
        if let Some(c) = conn.as_mut() {
            if flush(c).is_err() {
                // The error shows up again as POLLERR/POLLHUP on the next poll.
                c.out.clear();
            }
        }
        true
    }

    fn accept(&self, conn: &mut Option<Conn>) {
        match self.listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = stream.set_nonblocking(true) {
                    log::warn!("host access relay: switch connection refused: {e}");
                    return;
                }
                bump(&self.counters.connections);
                log::debug!("host access relay of {}: switch connected", self.ifname);
                *conn = Some(Conn {
                    stream,
                    decoder: Decoder::new(),
                    out: Vec::new(),
                });
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => log::warn!("host access relay of {}: accept failed: {e}", self.ifname),
        }
    }

    /// Reads from and writes to the switch; false when the connection ends.
    fn serve(&self, c: &mut Conn, rbuf: &mut [u8]) -> bool {
        loop {
            match c.stream.read(rbuf) {
                Ok(0) => {
                    log::debug!("host access relay of {}: switch disconnected", self.ifname);
                    return false;
                }
                Ok(n) => {
                    c.decoder.feed(&rbuf[..n]);
                    loop {
                        match c.decoder.next_frame() {
                            Ok(Some(f)) => self.to_tap(f),
                            Ok(None) => break,
                            Err(e) => {
                                bump(&self.counters.protocol_errors);
                                log::warn!(
                                    "host access relay of {}: closing the switch connection: {e}",
                                    self.ifname
                                );
                                return false;
                            }
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!(
                        "host access relay of {}: switch connection failed: {e}",
                        self.ifname
                    );
                    return false;
                }
            }
        }
        flush(c).is_ok()
    }

    fn to_tap(&self, frame: &[u8]) {
        // SAFETY: `frame` is readable for its length.
        let n = unsafe { libc::write(self.tap.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            bump(&self.counters.dropped_to_tap);
            log::trace!(
                "tap {} refused a frame: {}",
                self.ifname,
                io::Error::last_os_error()
            );
        } else {
            bump(&self.counters.from_switch);
        }
    }
}

/// Writes as much of the output buffer as the socket takes.
fn flush(c: &mut Conn) -> io::Result<()> {
    let mut done = 0;
    let res = loop {
        if done == c.out.len() {
            break Ok(());
        }
        match c.stream.write(&c.out[done..]) {
            Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    c.out.drain(..done);
    res
}

fn pollfd(fd: i32, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}
