//! A synchronous client for QMP, the QEMU Machine Protocol.
//!
//! QMP is JSON over a stream socket. QEMU greets with
//! `{"QMP": {"version": ...}}`; the client must send `qmp_capabilities`
//! before anything else. After that each command gets exactly one reply
//! (`{"return": ...}` or `{"error": {"class", "desc"}}`) carrying the
//! command's `id`, and asynchronous events (`{"event": NAME, "data": ...,
//! "timestamp": {"seconds", "microseconds"}}`) may arrive at any point,
//! including between a command and its reply. This client keeps such
//! events in a queue ([`QmpClient::take_events`], [`QmpClient::wait_event`])
//! so no event is lost while waiting for a reply: vmcsnap measures pauses
//! from the `STOP`/`RESUME` event timestamps.
//!
//! [`ga`] is the client of QMP's sibling inside the guest, the QEMU Guest
//! Agent (same JSON, no greeting, a delimiter to resynchronise).

pub mod ga;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use thiserror::Error;

/// Errors of the QMP client.
#[derive(Debug, Error)]
pub enum QmpError {
    /// Could not connect before the deadline.
    #[error("cannot connect to QMP socket {path}: {source} (is the QEMU process still running?)")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The last connect error.
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("QMP I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// QEMU closed the connection (it exited or crashed).
    #[error("QEMU closed the QMP connection (the QEMU process exited)")]
    Closed,
    /// QEMU sent something that is not QMP.
    #[error("QMP protocol error: {0}")]
    Protocol(String),
    /// The command was rejected by QEMU.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// Nothing arrived in time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
}

/// How many events [`QmpClient::recent_events`] keeps.
pub const HISTORY: usize = 64;

/// An asynchronous QMP event.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    /// Event name, e.g. `STOP`.
    pub name: String,
    /// Event data (`null` if absent).
    pub data: Value,
    /// QEMU's timestamp in microseconds since the Unix epoch.
    pub timestamp_us: u64,
}

/// QEMU's version from the greeting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QemuVersion {
    /// Major.
    pub major: u64,
    /// Minor.
    pub minor: u64,
    /// Micro.
    pub micro: u64,
}

impl std::fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

/// A connected, negotiated QMP session.
pub struct QmpClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    events: VecDeque<QmpEvent>,
    /// The newest [`HISTORY`] events received, whether or not taken since
    /// (what a failure's post-mortem shows).
    history: VecDeque<QmpEvent>,
    next_id: u64,
    version: QemuVersion,
    timeout: Duration,
    /// Bytes of a line whose end has not arrived yet (kept across timeouts).
    partial: Vec<u8>,
}

impl QmpClient {
    /// Connects to `path`, retrying until `timeout` (QEMU creates the socket
    /// shortly after it starts), then negotiates capabilities.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(QmpError::Connect {
                        path: path.to_path_buf(),
                        source: e,
                    })
                }
            }
        };
        Self::from_stream(stream, timeout)
    }

    /// Negotiates on an already connected stream.
    pub fn from_stream(stream: UnixStream, timeout: Duration) -> Result<Self, QmpError> {
        let writer = stream.try_clone()?;
        let mut client = QmpClient {
            reader: BufReader::new(stream),
            writer,
            events: VecDeque::new(),
            history: VecDeque::new(),
            next_id: 1,
            version: QemuVersion {
                major: 0,
                minor: 0,
                micro: 0,
            },
            timeout,
            partial: Vec::new(),
        };
        // An event can come before the greeting: QEMU flushes output it had
        // buffered for a client that went away (seen after an agent was
        // killed) to the next one that connects. Such events are queued.
        let deadline = Instant::now() + timeout;
        let greeting = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = client.read_message(left, "the QMP greeting")?;
            if msg.get("event").is_some() && msg.get("QMP").is_none() {
                client.queue_event(msg)?;
                continue;
            }
            break msg;
        };
        let v = greeting.pointer("/QMP/version/qemu").ok_or_else(|| {
            QmpError::Protocol(format!("expected a QMP greeting, got {greeting}"))
        })?;
        let num = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        client.version = QemuVersion {
            major: num("major"),
            minor: num("minor"),
            micro: num("micro"),
        };
        client.execute("qmp_capabilities", Value::Null)?;
        Ok(client)
    }

    /// QEMU's version from the greeting.
    pub fn version(&self) -> QemuVersion {
        self.version
    }

    /// Sets how long [`execute`](Self::execute) waits for a reply.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs `command` with `args` (`Value::Null` for none) and returns its
    /// `return` value. Events arriving meanwhile are queued.
    pub fn execute(&mut self, command: &str, args: Value) -> Result<Value, QmpError> {
        let id = self.send(command, args, None)?;
        self.reply(command, id)
    }

    /// Runs `command` with `fd` passed along (SCM_RIGHTS), as QMP `getfd`
    /// and `add-fd` want; QEMU keeps its own copy of the descriptor.
    pub fn execute_with_fd(
        &mut self,
        command: &str,
        args: Value,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        let id = self.send(command, args, Some(fd))?;
        self.reply(command, id)
    }

    /// Sends every command at once, without waiting for a reply in between
    /// (QEMU runs them one after the other, in order), then reads the
    /// replies. Returns each command's result with the host's wall-clock
    /// time (Unix µs) its reply was read. A command that fails does not
    /// stop the later ones: pipeline only what may run regardless.
    pub fn execute_pipelined(
        &mut self,
        commands: Vec<(&str, Value)>,
    ) -> Vec<(Result<Value, QmpError>, u64)> {
        let mut ids = Vec::with_capacity(commands.len());
        let mut lines = Vec::new();
        for (command, args) in &commands {
            let id = self.next_id;
            self.next_id += 1;
            lines.extend(command_line(command, args.clone(), id));
            ids.push(id);
        }
        if let Err(e) = self.writer.write_all(&lines).map_err(closed_or_io) {
            let msg = e.to_string();
            return commands
                .iter()
                .map(|_| (Err(QmpError::Protocol(format!("sending: {msg}"))), 0))
                .collect();
        }
        commands
            .iter()
            .zip(ids)
            .map(|((command, _), id)| {
                let r = self.reply(command, id);
                (r, unix_us())
            })
            .collect()
    }

    /// Writes a command (with `fd` as ancillary data if given); returns its id.
    fn send(
        &mut self,
        command: &str,
        args: Value,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<u64, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let line = command_line(command, args, id);
        match fd {
            None => self.writer.write_all(&line).map_err(closed_or_io)?,
            Some(fd) => send_with_fd(&self.writer, &line, fd).map_err(closed_or_io)?,
        }
        Ok(id)
    }

    /// Reads until the reply to command `id` (events are queued).
    fn reply(&mut self, command: &str, id: u64) -> Result<Value, QmpError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let reply = self.read_message(left, &format!("the reply to {command}"))?;
            if reply.get("event").is_some() {
                self.queue_event(reply)?;
                continue;
            }
            if reply.get("id").and_then(Value::as_u64) != Some(id) {
                // A reply to an earlier command that timed out: skip it.
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let s = |k: &str| {
                    err.get(k)
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_string()
                };
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: s("class"),
                    desc: s("desc"),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected reply {reply}")));
        }
    }

    /// The newest [`HISTORY`] events this session received, oldest first,
    /// including those already taken or waited for. Reads none from the
    /// socket (see [`QmpClient::take_events`]).
    pub fn recent_events(&self) -> Vec<QmpEvent> {
        self.history.iter().cloned().collect()
    }

    /// Removes and returns all queued events, after reading any that are
    /// already waiting on the socket.
    pub fn take_events(&mut self) -> Result<Vec<QmpEvent>, QmpError> {
        self.poll_events(Duration::ZERO)?;
        Ok(self.events.drain(..).collect())
    }

    /// Waits up to `timeout` for the event `name`; returns it and keeps the
    /// other events queued.
    pub fn wait_event(&mut self, name: &str, timeout: Duration) -> Result<QmpEvent, QmpError> {
        self.wait_event_where(name, |_| true, timeout)
    }

    /// Waits up to `timeout` for the event `name` whose data satisfies
    /// `matches` (e.g. `MIGRATION` with status `active`); returns it and
    /// keeps the other events queued.
    pub fn wait_event_where(
        &mut self,
        name: &str,
        matches: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Result<QmpEvent, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(pos) = self
                .events
                .iter()
                .position(|e| e.name == name && matches(&e.data))
            {
                return Ok(self.events.remove(pos).expect("position is valid"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(QmpError::Timeout(timeout, format!("QMP event {name}")));
            }
            let msg = self.read_message(left, &format!("QMP event {name}"))?;
            if msg.get("event").is_some() {
                self.queue_event(msg)?;
            }
        }
    }

    fn poll_events(&mut self, timeout: Duration) -> Result<(), QmpError> {
        loop {
            if self.reader.buffer().is_empty() {
                self.reader.get_ref().set_nonblocking(true)?;
                let peek = self.reader.fill_buf().map(|b| b.len());
                self.reader.get_ref().set_nonblocking(false)?;
                match peek {
                    Ok(0) => return Err(QmpError::Closed),
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                    Err(e) => return Err(e.into()),
                }
            }
            let msg = self.read_message(timeout.max(Duration::from_millis(100)), "a QMP event")?;
            if msg.get("event").is_some() {
                self.queue_event(msg)?;
            }
        }
    }

    fn queue_event(&mut self, msg: Value) -> Result<(), QmpError> {
        let name = msg["event"]
            .as_str()
            .ok_or_else(|| QmpError::Protocol(format!("bad event {msg}")))?
            .to_string();
        let ts = &msg["timestamp"];
        let timestamp_us = ts["seconds"].as_u64().unwrap_or(0) * 1_000_000
            + ts["microseconds"].as_u64().unwrap_or(0);
        let event = QmpEvent {
            name,
            data: msg.get("data").cloned().unwrap_or(Value::Null),
            timestamp_us,
        };
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(event.clone());
        self.events.push_back(event);
        Ok(())
    }

    fn read_message(&mut self, timeout: Duration, what: &str) -> Result<Value, QmpError> {
        let t = if timeout.is_zero() {
            Duration::from_millis(1)
        } else {
            timeout
        };
        self.reader.get_ref().set_read_timeout(Some(t))?;
        match self.reader.read_until(b'\n', &mut self.partial) {
            Ok(0) => Err(QmpError::Closed),
            Ok(_) if !self.partial.ends_with(b"\n") => Err(QmpError::Closed),
            Ok(_) => {
                let line = std::mem::take(&mut self.partial);
                serde_json::from_slice(&line).map_err(|e| {
                    QmpError::Protocol(format!(
                        "invalid JSON from QEMU ({e}): {}",
                        String::from_utf8_lossy(&line).trim_end()
                    ))
                })
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(QmpError::Timeout(timeout, what.to_string()))
            }
            Err(e) => Err(closed_or_io(e)),
        }
    }
}

/// One QMP command as a line.
fn command_line(command: &str, args: Value, id: u64) -> Vec<u8> {
    let mut msg = json!({ "execute": command, "id": id });
    if !args.is_null() {
        msg["arguments"] = args;
    }
    let mut line = serde_json::to_vec(&msg).expect("json serialises");
    line.push(b'\n');
    line
}

/// Writes `bytes` with `fd` attached (SCM_RIGHTS) to the first of them.
fn send_with_fd(
    sock: &UnixStream,
    bytes: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the file descriptor"));
    }
    let n = sendmsg(
        sock,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    // The descriptor went with the first bytes; the rest follows plainly.
    let mut w = sock;
    w.write_all(&bytes[n..])
}

/// Microseconds since the Unix epoch.
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn closed_or_io(e: std::io::Error) -> QmpError {
    match e.kind() {
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof => {
            QmpError::Closed
        }
        _ => QmpError::Io(e),
    }
}

#[cfg(test)]
mod tests;
