//! The control channel of a page source ([`super::page_source`]): a unix
//! socket, `control.sock` in its directory, on which the page-source process
//! answers whichever agent connects (the restore's own, or the next one
//! after a crash).
//!
//! A cluster restore needs it: START (the Coordinator's order of starts)
//! holds the source's background push for the start's quiet time just
//! before the guest's `cont`, and the report counts what the source had read
//! when the guest started. One JSON line per request, one per answer:
//!
//! ```text
//!  agent ─▶ {"req":"counters"}          source ─▶ {"bytes_read":B,"pages_read":P}
//!  agent ─▶ {"req":"hold","ms":N}       source ─▶ (the same, after holding
//!                                                   the background N ms from now)
//!  agent ─▶ {"req":"start","ms":N}      source ─▶ (the same, after ending the
//!                                                   hold until START and holding
//!                                                   the background N ms from now)
//! ```
//!
//! A cluster restore's source holds its background push from its start
//! until START ([`super::page_source::SourcePlan::hold_until_start`]): a VM
//! that waits for START leaves the CPUs and the disk to the VMs still
//! loading their working sets, whose loads the restore line waits for.
//!
//! A source whose agent went away loses nothing: it serves on and accepts
//! the next agent's connection.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmcsnap_migstream::postcopy::BackgroundHold;

/// The socket's name in the page source's directory.
pub const SOCKET: &str = "control.sock";

/// How long a client waits for the source to listen, or to answer.
const PATIENCE: Duration = Duration::from_secs(10);

/// What went wrong on the control channel.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket could not be reached or broke.
    #[error("the page source's control socket {}: {source} (is the page source still running? see page-source.log next to it)", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The answer does not parse.
    #[error("the page source's control socket {}: a bad answer {line:?}", path.display())]
    BadAnswer {
        /// The socket.
        path: PathBuf,
        /// What came.
        line: String,
    },
}

/// A request on the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "req", rename_all = "lowercase")]
pub enum Request {
    /// What the source has read so far.
    Counters,
    /// Serve demand faults only for `ms` from now, then the counters.
    Hold {
        /// How long.
        ms: u64,
    },
    /// START: the hold until START ends; demand faults only for `ms` from
    /// now (the start's quiet time), then the counters. Unlike `Hold` it
    /// shortens a longer hold.
    Start {
        /// How long.
        ms: u64,
    },
}

/// What the source has read from the image so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Memory-image bytes.
    pub bytes_read: u64,
    /// Pages.
    pub pages_read: u64,
    /// Whether it has pushed any page in the background yet.
    #[serde(default)]
    pub background_begun: bool,
}

/// The answer to a line that is not a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    /// Why the line was not understood.
    pub error: String,
}

/// The source's side: its counters and the hold of its background push.
#[derive(Clone)]
pub struct Served {
    /// Bytes read (shared with the page reader).
    pub bytes: Arc<AtomicU64>,
    /// Pages read.
    pub pages: Arc<AtomicU64>,
    /// The sender has pushed a page in the background.
    pub background_begun: Arc<AtomicBool>,
    /// The sender's hold.
    pub hold: BackgroundHold,
}

impl Served {
    fn counters(&self) -> Counters {
        Counters {
            bytes_read: self.bytes.load(Ordering::Relaxed),
            pages_read: self.pages.load(Ordering::Relaxed),
            background_begun: self.background_begun.load(Ordering::Relaxed),
        }
    }

    fn answer(&self, req: Request) -> Counters {
        let at = |ms| Instant::now() + Duration::from_millis(ms);
        match req {
            Request::Counters => {}
            Request::Hold { ms } => hold_at_least(&self.hold, at(ms)),
            Request::Start { ms } => self.hold.hold_until(at(ms)),
        }
        self.counters()
    }
}

/// Holds the background push until `until`, or longer if it already is.
pub fn hold_at_least(hold: &BackgroundHold, until: Instant) {
    if hold.until().is_none_or(|h| h < until) {
        hold.hold_until(until);
    }
}

/// Listens on `dir/control.sock` and answers there, one agent at a time, in
/// a thread of its own for as long as the process lives.
pub fn listen(dir: &Path, served: Served) -> Result<(), ControlError> {
    let path = dir.join(SOCKET);
    let _ = std::fs::remove_file(&path);
    let io = |source| ControlError::Io {
        path: path.clone(),
        source,
    };
    let listener = UnixListener::bind(&path).map_err(io)?;
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                serve_one(conn, &served);
            }
        })
        .map_err(io)?;
    Ok(())
}

fn serve_one(conn: UnixStream, served: &Served) {
    let Ok(mut out) = conn.try_clone() else {
        return;
    };
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { return };
        let answer = match serde_json::from_str::<Request>(&line) {
            Ok(req) => serde_json::to_string(&served.answer(req)).expect("serialises"),
            Err(e) => serde_json::to_string(&Refused {
                error: e.to_string(),
            })
            .expect("serialises"),
        };
        if out.write_all(format!("{answer}\n").as_bytes()).is_err() {
            return;
        }
    }
}

/// The agent's side of a page source's channel (connected on first use).
pub struct Control {
    path: PathBuf,
    conn: Option<(BufReader<UnixStream>, UnixStream)>,
    patience: Duration,
}

impl Control {
    /// For the page source serving from `dir`.
    pub fn new(dir: &Path) -> Control {
        Control {
            path: dir.join(SOCKET),
            conn: None,
            patience: PATIENCE,
        }
    }

    fn io(&self) -> impl FnOnce(std::io::Error) -> ControlError {
        let path = self.path.clone();
        move |source| ControlError::Io { path, source }
    }

    fn connect(&mut self) -> Result<&mut (BufReader<UnixStream>, UnixStream), ControlError> {
        if self.conn.is_none() {
            // The source binds the socket as it starts: it may not yet. A
            // socket nobody listens on is a source that has ended.
            let t = Instant::now();
            let s = loop {
                match UnixStream::connect(&self.path) {
                    Ok(s) => break s,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::NotFound
                            && t.elapsed() < self.patience =>
                    {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => return Err(self.io()(e)),
                }
            };
            s.set_read_timeout(Some(self.patience)).map_err(self.io())?;
            let w = s.try_clone().map_err(self.io())?;
            self.conn = Some((BufReader::new(s), w));
        }
        Ok(self.conn.as_mut().expect("connected above"))
    }

    /// Asks `req`; returns the source's counters.
    pub fn ask(&mut self, req: Request) -> Result<Counters, ControlError> {
        let r = self.ask_once(req);
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    fn ask_once(&mut self, req: Request) -> Result<Counters, ControlError> {
        let line = serde_json::to_string(&req).expect("serialises") + "\n";
        let io = self.io();
        let path = self.path.clone();
        let (r, w) = self.connect()?;
        let mut answer = String::new();
        let read = w
            .write_all(line.as_bytes())
            .and_then(|()| r.read_line(&mut answer));
        match read {
            Ok(0) => Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(_) => serde_json::from_str(&answer).map_err(|_| ControlError::BadAnswer {
                path,
                line: answer.trim_end().to_string(),
            }),
            Err(e) => Err(io(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_reads_the_counters_and_holds_the_push() {
        let d = tempfile::tempdir().unwrap();
        let served = Served {
            bytes: Arc::new(AtomicU64::new(4096)),
            pages: Arc::new(AtomicU64::new(1)),
            background_begun: Arc::default(),
            hold: BackgroundHold::default(),
        };
        listen(d.path(), served.clone()).unwrap();
        let mut c = Control::new(d.path());
        let want = Counters {
            bytes_read: 4096,
            pages_read: 1,
            background_begun: false,
        };
        assert_eq!(c.ask(Request::Counters).unwrap(), want);
        assert_eq!(served.hold.until(), None);
        let before = Instant::now();
        served.pages.store(7, Ordering::Relaxed);
        let got = c.ask(Request::Hold { ms: 60_000 }).unwrap();
        assert_eq!(got.pages_read, 7);
        let until = served.hold.until().expect("held");
        assert!(until >= before + Duration::from_secs(60), "{until:?}");
        // A shorter hold does not shorten a longer one.
        c.ask(Request::Hold { ms: 1 }).unwrap();
        assert_eq!(served.hold.until(), Some(until));
        // A second agent (the next one, after a crash) is answered too.
        drop(c);
        let mut next = Control::new(d.path());
        assert_eq!(next.ask(Request::Counters).unwrap().pages_read, 7);
    }

    #[test]
    fn start_ends_the_hold_until_start_and_holds_for_the_quiet_time() {
        let d = tempfile::tempdir().unwrap();
        let served = Served {
            bytes: Arc::default(),
            pages: Arc::default(),
            background_begun: Arc::default(),
            hold: BackgroundHold::default(),
        };
        // A cluster restore's source: held until START.
        let far = Instant::now() + super::super::page_source::HOLD_UNTIL_START_MAX;
        served.hold.hold_until(far);
        listen(d.path(), served.clone()).unwrap();
        let mut c = Control::new(d.path());
        let before = Instant::now();
        c.ask(Request::Start { ms: 1000 }).unwrap();
        let until = served.hold.until().expect("held for the quiet time");
        assert!(until < far, "START ended the hold until START: {until:?}");
        assert!(until >= before + Duration::from_millis(1000), "{until:?}");
        assert!(until <= Instant::now() + Duration::from_millis(1000));
        // Without a quiet time the push goes on at once.
        assert!(!c.ask(Request::Start { ms: 0 }).unwrap().background_begun);
        assert!(served.hold.until().unwrap() <= Instant::now());
        // The answer tells whether the source had pushed in the background.
        served.background_begun.store(true, Ordering::Relaxed);
        assert!(c.ask(Request::Counters).unwrap().background_begun);
    }

    #[test]
    fn an_ended_source_is_an_error_at_once() {
        let d = tempfile::tempdir().unwrap();
        // Bound, then closed: the socket file stays, nobody listens.
        drop(UnixListener::bind(d.path().join(SOCKET)).unwrap());
        let mut c = Control::new(d.path());
        let t = Instant::now();
        assert!(c.ask(Request::Counters).is_err());
        assert!(t.elapsed() < PATIENCE, "waited {:?}", t.elapsed());
    }

    #[test]
    fn no_source_is_an_error_naming_the_socket() {
        let d = tempfile::tempdir().unwrap();
        let mut c = Control::new(d.path());
        c.patience = Duration::from_millis(50);
        let e = c.ask(Request::Counters).unwrap_err().to_string();
        assert!(e.contains(SOCKET), "{e}");
    }
}
