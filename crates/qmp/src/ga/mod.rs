//! A synchronous client for the QEMU Guest Agent (qemu-guest-agent, QGA).
//!
//! The agent runs inside the guest and listens on the virtio-serial port
//! `org.qemu.guest_agent.0`, which QEMU exposes on a unix socket. Its
//! protocol is QMP's JSON without a greeting, capabilities or events: one
//! `{"execute": ..., "arguments": ...}` per request, one `{"return": ...}`
//! or `{"error": ...}` line per reply, in order.
//!
//! The serial port outlives host connections, so a new client may find the
//! agent mid-way through a previous client's request, or replies to it
//! still queued. [`GuestAgent::connect`] therefore resynchronises first, as
//! QGA's documentation asks: it sends a 0xFF byte (the agent then drops any
//! partial request), then `guest-sync-delimited` with a fresh id, skips
//! everything up to the agent's 0xFF delimiter and waits for the reply that
//! carries its id. A request that timed out leaves its reply in flight, so
//! the next request resynchronises again.
//!
//! A guest without the agent never answers (QEMU accepts the connection
//! and holds the bytes): every read has a deadline, and the error then says
//! to check the guest's qemu-guest-agent. The public API is typed:
//! [`GuestAgent::exec`] runs a program and returns its decoded output,
//! [`GuestAgent::read_file`] reads a guest file, [`GuestAgent::get_time_ns`]
//! and [`GuestAgent::set_time_ns`] read and set its clock, and [`read_tcp_counters`]
//! reads the guest's TCP counters ([`TcpCounters`]) from
//! `/proc/net/{snmp,netstat}` without spawning a process.

mod proc_net;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

pub use proc_net::{parse_retrans_segs, parse_tcp_counters, ProcNetError, TcpCounters};

/// The byte QGA puts before the reply to `guest-sync-delimited`, and that
/// makes it drop a partial request.
const DELIMITER: u8 = 0xFF;
/// How much `guest-file-read` asks for at once (QGA's limit is 48 MiB).
const FILE_CHUNK: u64 = 64 * 1024;
/// How often RetransSegs may change while the counters are read before
/// the reading is taken as it is (the lab guest's bound, guest/init).
const COUNTER_TRIES: usize = 10;

/// Errors of the guest agent client.
#[derive(Debug, Error)]
pub enum GaError {
    /// The socket could not be connected to.
    #[error("cannot connect to the guest agent socket {path}: {source} (is the VM's QEMU running, with a guest agent port?)")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The last connect error.
        source: std::io::Error,
    },
    /// Nothing came back in time.
    #[error("the guest agent does not answer on {path} ({what}, waited {waited:?}): is qemu-guest-agent installed and running in the guest?")]
    NoAnswer {
        /// The socket.
        path: PathBuf,
        /// What was waited for.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// Reading or writing the socket failed.
    #[error("guest agent socket I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// QEMU closed the socket.
    #[error("QEMU closed the guest agent socket {0} (the QEMU process exited?)")]
    Closed(PathBuf),
    /// The agent sent something that is not its protocol.
    #[error("guest agent protocol error: {0}")]
    Protocol(String),
    /// The agent rejected a command.
    #[error("guest agent command {command} failed: {class}: {desc} (commands may be disabled by the guest's qemu-guest-agent configuration)")]
    Command {
        /// The command.
        command: String,
        /// QGA's error class.
        class: String,
        /// QGA's description.
        desc: String,
    },
    /// A program run with [`GuestAgent::exec`] did not exit in time.
    #[error("{program} started by the guest agent did not exit within {waited:?}")]
    ExecTimeout {
        /// The program.
        program: String,
        /// How long.
        waited: Duration,
    },
    /// The guest's counter files did not parse.
    #[error("the guest's TCP counters: {0}")]
    Counters(#[from] ProcNetError),
}

/// What a program run in the guest did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecOutput {
    /// Its exit code, if it exited normally.
    pub exit_code: Option<i32>,
    /// The signal that ended it, if any.
    pub signal: Option<i32>,
    /// Its standard output (decoded).
    pub stdout: Vec<u8>,
    /// Its standard error (decoded).
    pub stderr: Vec<u8>,
    /// The agent cut the output (it keeps at most 16 MiB).
    pub truncated: bool,
}

impl ExecOutput {
    /// Exited with code 0.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }
}

/// The reply of `guest-exec-status` (QGA's `GuestExecStatus`).
#[derive(Debug, Deserialize)]
struct ExecStatus {
    exited: bool,
    exitcode: Option<i32>,
    signal: Option<i32>,
    #[serde(rename = "out-data")]
    out_data: Option<String>,
    #[serde(rename = "err-data")]
    err_data: Option<String>,
    #[serde(rename = "out-truncated", default)]
    out_truncated: bool,
    #[serde(rename = "err-truncated", default)]
    err_truncated: bool,
}

/// The reply of `guest-exec` (QGA's `GuestExec`).
#[derive(Debug, Deserialize)]
struct ExecStarted {
    pid: i64,
}

/// The reply of `guest-file-read` (QGA's `GuestFileRead`).
#[derive(Debug, Deserialize)]
struct FileRead {
    count: u64,
    #[serde(rename = "buf-b64")]
    buf_b64: String,
    eof: bool,
}

/// A connected, synchronised guest agent session.
pub struct GuestAgent {
    stream: UnixStream,
    path: PathBuf,
    /// Bytes read but not consumed yet.
    buf: Vec<u8>,
    timeout: Duration,
    /// No request may wait past this (see [`read_tcp_counters`]).
    cap: Option<Instant>,
    /// A reply may still be in flight: resynchronise before the next request.
    stale: bool,
    next_sync: u64,
    /// When the last request was sent (for [`GaError::NoAnswer`]).
    sent_at: Instant,
}

impl GuestAgent {
    /// Connects to the guest agent socket `path` (retrying until `timeout`
    /// if it does not exist yet) and synchronises with the agent; each
    /// later request waits up to `timeout` too.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, GaError> {
        Self::connect_until(path, timeout, None)
    }

    fn connect_until(
        path: &Path,
        timeout: Duration,
        cap: Option<Instant>,
    ) -> Result<Self, GaError> {
        let deadline = cap.unwrap_or_else(|| Instant::now() + timeout);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() < deadline
                        && matches!(
                            e.kind(),
                            ErrorKind::NotFound | ErrorKind::ConnectionRefused
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(GaError::Connect {
                        path: path.to_path_buf(),
                        source: e,
                    })
                }
            }
        };
        // A sync id nobody else is likely to use: stale replies carry others.
        let seed = std::process::id() as u64
            ^ std::time::SystemTime::UNIX_EPOCH
                .elapsed()
                .unwrap_or_default()
                .subsec_nanos() as u64;
        let mut ga = GuestAgent {
            stream,
            path: path.to_path_buf(),
            buf: Vec::new(),
            timeout,
            cap,
            stale: true,
            next_sync: seed % 1_000_000_000 + 1,
            sent_at: Instant::now(),
        };
        ga.sync()?;
        Ok(ga)
    }

    /// Sets how long each later request waits for its reply.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// `guest-ping`: succeeds if the agent answers.
    pub fn ping(&mut self) -> Result<(), GaError> {
        self.call("guest-ping", Value::Null).map(|_| ())
    }

    /// `guest-get-time`: the guest's wall clock, in nanoseconds since the
    /// Unix epoch.
    pub fn get_time_ns(&mut self) -> Result<i64, GaError> {
        self.call_typed("guest-get-time", Value::Null)
    }

    /// `guest-set-time` to `ns` (nanoseconds since the Unix epoch), as
    /// `virsh domtime --sync` does with the host's time: the agent sets the
    /// guest's system clock, then its RTC with `/sbin/hwclock -w`. A guest
    /// without hwclock fails the command (before or after setting the
    /// system clock, depending on the agent's version): read the clock back
    /// with [`GuestAgent::get_time_ns`] to know.
    pub fn set_time_ns(&mut self, ns: i64) -> Result<(), GaError> {
        self.call("guest-set-time", json!({ "time": ns }))
            .map(|_| ())
    }

    /// Runs `program` with `args` in the guest (`guest-exec`, no shell) and
    /// waits, polling `guest-exec-status`, until it exits; its output comes
    /// back decoded.
    pub fn exec(&mut self, program: &str, args: &[&str]) -> Result<ExecOutput, GaError> {
        let started = Instant::now();
        let deadline = self.deadline();
        let args = json!({ "path": program, "arg": args, "capture-output": true });
        let ExecStarted { pid } = self.call_typed("guest-exec", args)?;
        let mut pause = Duration::from_millis(5);
        loop {
            let st: ExecStatus = self.call_typed("guest-exec-status", json!({ "pid": pid }))?;
            if st.exited {
                return Ok(ExecOutput {
                    exit_code: st.exitcode,
                    signal: st.signal,
                    stdout: decode(st.out_data.as_deref(), "out-data")?,
                    stderr: decode(st.err_data.as_deref(), "err-data")?,
                    truncated: st.out_truncated || st.err_truncated,
                });
            }
            if Instant::now() + pause > deadline {
                return Err(GaError::ExecTimeout {
                    program: program.to_string(),
                    waited: started.elapsed(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// Reads a whole guest file with `guest-file-open/read/close`.
    pub fn read_file(&mut self, guest_path: &str) -> Result<Vec<u8>, GaError> {
        let handle: i64 = self.call_typed(
            "guest-file-open",
            json!({ "path": guest_path, "mode": "r" }),
        )?;
        let result = self.read_handle(handle);
        // Close even after a failed read; a failed close leaks one handle
        // in the agent, which is not worth failing a good read for.
        if let Err(e) = self.call("guest-file-close", json!({ "handle": handle })) {
            tracing::debug!("closing {guest_path} in the guest: {e}");
        }
        result
    }

    fn read_handle(&mut self, handle: i64) -> Result<Vec<u8>, GaError> {
        let mut out = Vec::new();
        loop {
            let r: FileRead = self.call_typed(
                "guest-file-read",
                json!({ "handle": handle, "count": FILE_CHUNK }),
            )?;
            let data = decode(Some(&r.buf_b64), "buf-b64")?;
            if data.len() as u64 != r.count {
                return Err(GaError::Protocol(format!(
                    "guest-file-read said {} bytes but sent {}",
                    r.count,
                    data.len()
                )));
            }
            out.extend_from_slice(&data);
            if r.eof || r.count == 0 {
                return Ok(out);
            }
        }
    }

    /// The guest's TCP counters now, read like the lab guest reads them:
    /// RetransSegs before and after the `TcpExt` counters, again until it
    /// did not change in between (the guest may stall between the files).
    pub fn tcp_counters(&mut self) -> Result<TcpCounters, GaError> {
        let mut snmp = self.read_text("/proc/net/snmp")?;
        for _ in 0..COUNTER_TRIES {
            let netstat = self.read_text("/proc/net/netstat")?;
            let snmp_after = self.read_text("/proc/net/snmp")?;
            if parse_retrans_segs(&snmp)? == parse_retrans_segs(&snmp_after)? {
                return Ok(parse_tcp_counters(&snmp_after, &netstat)?);
            }
            snmp = snmp_after;
        }
        let netstat = self.read_text("/proc/net/netstat")?;
        Ok(parse_tcp_counters(&snmp, &netstat)?)
    }

    fn read_text(&mut self, guest_path: &str) -> Result<String, GaError> {
        Ok(String::from_utf8_lossy(&self.read_file(guest_path)?).into_owned())
    }

    fn deadline(&self) -> Instant {
        let t = Instant::now() + self.timeout;
        self.cap.map_or(t, |c| c.min(t))
    }

    fn call_typed<T: DeserializeOwned>(
        &mut self,
        command: &str,
        args: Value,
    ) -> Result<T, GaError> {
        let ret = self.call(command, args)?;
        serde_json::from_value(ret.clone())
            .map_err(|e| GaError::Protocol(format!("unexpected reply to {command} ({e}): {ret}")))
    }

    /// Sends `command` and returns its `return` value.
    fn call(&mut self, command: &str, args: Value) -> Result<Value, GaError> {
        if self.stale {
            self.sync()?;
        }
        let mut msg = json!({ "execute": command });
        if !args.is_null() {
            msg["arguments"] = args;
        }
        self.send(&msg, false)?;
        self.stale = true;
        let deadline = self.deadline();
        let reply = loop {
            let line = self.read_line(deadline, command)?;
            if !line.iter().all(u8::is_ascii_whitespace) {
                break line;
            }
        };
        self.stale = false;
        let reply: Value = serde_json::from_slice(&reply).map_err(|e| {
            GaError::Protocol(format!(
                "invalid JSON from the guest agent ({e}): {}",
                String::from_utf8_lossy(&reply).trim_end()
            ))
        })?;
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
            return Err(GaError::Command {
                command: command.to_string(),
                class: s("class"),
                desc: s("desc"),
            });
        }
        Err(GaError::Protocol(format!(
            "unexpected reply to {command}: {reply}"
        )))
    }

    /// Resynchronises: 0xFF, `guest-sync-delimited` with a fresh id, then
    /// skip to the agent's delimiter and the reply with that id.
    fn sync(&mut self) -> Result<(), GaError> {
        let id = self.next_sync;
        self.next_sync += 1;
        self.send(
            &json!({ "execute": "guest-sync-delimited", "arguments": { "id": id } }),
            true,
        )?;
        let deadline = self.deadline();
        let what = "guest-sync-delimited";
        loop {
            // Everything before a delimiter is stale.
            loop {
                if let Some(i) = self.buf.iter().position(|&b| b == DELIMITER) {
                    self.buf.drain(..=i);
                    break;
                }
                self.buf.clear();
                self.fill(deadline, what)?;
            }
            // The reply follows, unless another delimiter comes first.
            let line = loop {
                if let Some(i) = self.buf.iter().position(|&b| b == b'\n' || b == DELIMITER) {
                    if self.buf[i] == DELIMITER {
                        break None;
                    }
                    break Some(self.buf.drain(..=i).collect::<Vec<u8>>());
                }
                self.fill(deadline, what)?;
            };
            let Some(line) = line else { continue };
            let reply: Option<Value> = serde_json::from_slice(&line).ok();
            if reply
                .as_ref()
                .and_then(|r| r.get("return"))
                .and_then(Value::as_u64)
                == Some(id)
            {
                self.stale = false;
                return Ok(());
            }
            tracing::debug!(
                "guest agent {}: skipping stale reply {}",
                self.path.display(),
                String::from_utf8_lossy(&line).trim_end()
            );
        }
    }

    fn send(&mut self, msg: &Value, delimit: bool) -> Result<(), GaError> {
        let mut bytes = Vec::new();
        if delimit {
            bytes.push(DELIMITER);
        }
        serde_json::to_writer(&mut bytes, msg).expect("json serialises");
        bytes.push(b'\n');
        self.sent_at = Instant::now();
        self.stream.write_all(&bytes).map_err(|e| self.io_error(e))
    }

    /// One line (with its newline) from the buffer or the socket.
    fn read_line(&mut self, deadline: Instant, what: &str) -> Result<Vec<u8>, GaError> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                return Ok(self.buf.drain(..=i).collect());
            }
            self.fill(deadline, what)?;
        }
    }

    /// Reads what is there (at least one byte) into the buffer.
    fn fill(&mut self, deadline: Instant, what: &str) -> Result<(), GaError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.no_answer(what));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut chunk = [0u8; 8192];
        match self.stream.read(&mut chunk) {
            Ok(0) => Err(GaError::Closed(self.path.clone())),
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(())
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(self.no_answer(what))
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(self.io_error(e)),
        }
    }

    fn no_answer(&self, what: &str) -> GaError {
        GaError::NoAnswer {
            path: self.path.clone(),
            what: format!("waiting for the reply to {what}"),
            waited: self.sent_at.elapsed(),
        }
    }

    fn io_error(&self, e: std::io::Error) -> GaError {
        match e.kind() {
            ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof => {
                GaError::Closed(self.path.clone())
            }
            _ => GaError::Io(e),
        }
    }
}

/// Connects to the guest agent on `socket` and reads the guest's TCP
/// counters, all within `timeout` (connecting, synchronising and every
/// request).
pub fn read_tcp_counters(socket: &Path, timeout: Duration) -> Result<TcpCounters, GaError> {
    let cap = Instant::now() + timeout;
    let mut ga = GuestAgent::connect_until(socket, timeout, Some(cap))?;
    ga.tcp_counters()
}

fn decode(data: Option<&str>, field: &str) -> Result<Vec<u8>, GaError> {
    match data {
        None => Ok(Vec::new()),
        Some(s) => BASE64.decode(s).map_err(|e| {
            GaError::Protocol(format!("{field} from the guest agent is not base64 ({e})"))
        }),
    }
}

#[cfg(test)]
mod tests;
