//! Line framing, and the client side of one call.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::{Reply, Request, Response};

/// Longest accepted line (a console tail or status fits easily).
pub const MAX_LINE: usize = 16 << 20;

/// The control protocol's version, exchanged first on every connection
/// ([`Hello`]): one more whenever a request, a reply or a result changes
/// shape. Version 1 is the protocol before versions were exchanged
/// (untyped results); an agent of version 1 answers a hello with "unknown
/// variant `hello`". Version 3 took the testing faults off the wire (the
/// agent of a `fault-injection` build takes them from its run directory).
pub const PROTOCOL_VERSION: u32 = 3;

/// The first line a client sends: `{"op":"hello","version":N}` (an `op`,
/// so that an agent from before versions refuses it as an unknown request
/// instead of misreading it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename = "hello")]
pub struct Hello {
    /// The client's [`PROTOCOL_VERSION`].
    pub version: u32,
}

/// Errors of the control channel.
#[derive(Debug, Error)]
pub enum ControlError {
    /// No agent listens on the socket.
    #[error("no vmcsnap agent at {path}: {source} (start one with `vmcsnap up SPEC` or `vmcsnap agent start`)")]
    NoAgent {
        /// The socket.
        path: PathBuf,
        /// Why connecting failed.
        source: std::io::Error,
    },
    /// The channel broke.
    #[error("control channel I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A line that is not a valid message.
    #[error("control protocol error: {0}")]
    Protocol(String),
    /// The agent closed the connection without a final reply.
    #[error(
        "the agent closed the connection before answering (did it crash? see its log in the run \
         directory). `vmcsnap status` starts a new agent, which adopts the VMs and finishes or \
         undoes what the old one had begun; then check whether the operation took effect"
    )]
    Hangup,
    /// The agent ran the request and it failed.
    #[error("{0}")]
    Failed(String),
    /// Client and agent are different vmcsnap versions.
    #[error("this vmcsnap speaks control protocol version {client} and the agent version {agent}: they are different vmcsnap builds; restart the agent with this vmcsnap (`vmcsnap agent restart`: its VMs keep running), or use the vmcsnap that started it")]
    VersionMismatch {
        /// The client's version.
        client: u32,
        /// The agent's version.
        agent: u32,
    },
}

pub(crate) fn read_line(r: &mut impl BufRead) -> Result<Option<Vec<u8>>, ControlError> {
    let mut buf = Vec::new();
    let n = r.take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.len() > MAX_LINE {
        return Err(ControlError::Protocol(format!(
            "line longer than {MAX_LINE} bytes"
        )));
    }
    if buf.last() != Some(&b'\n') {
        return Err(ControlError::Hangup);
    }
    Ok(Some(buf))
}

/// Reads one request line (no hello: see [`accept_request`]).
pub fn read_request(r: &mut impl BufRead) -> Result<Request, ControlError> {
    let line = read_line(r)?.ok_or(ControlError::Hangup)?;
    parse_request(&line)
}

fn parse_request(line: &[u8]) -> Result<Request, ControlError> {
    serde_json::from_slice(line).map_err(|e| ControlError::Protocol(format!("bad request: {e}")))
}

/// Agent side: reads the client's [`Hello`], answers it with this agent's
/// version, then reads the one request of the connection. A client of
/// another version gets [`ControlError::VersionMismatch`] (the agent sends
/// it as the failure). A request without a hello is from a client of
/// version 1: only `restart-agent` is served then (every version can
/// restart an agent onto the executable now installed).
pub fn accept_request<S: Read + Write>(r: &mut BufReader<S>) -> Result<Request, ControlError> {
    let line = read_line(r)?.ok_or(ControlError::Hangup)?;
    if let Ok(Hello { version }) = serde_json::from_slice(&line) {
        write_reply(
            r.get_mut(),
            &Reply::Hello {
                version: PROTOCOL_VERSION,
            },
        )?;
        if version != PROTOCOL_VERSION {
            return Err(ControlError::VersionMismatch {
                client: version,
                agent: PROTOCOL_VERSION,
            });
        }
        return read_request(r);
    }
    let unversioned = ControlError::VersionMismatch {
        client: 1,
        agent: PROTOCOL_VERSION,
    };
    match parse_request(&line) {
        Ok(Request::RestartAgent) => Ok(Request::RestartAgent),
        Ok(_) => Err(unversioned),
        // Not a request of ours, but a request: a client of another version.
        Err(e) => match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&line)
        {
            Ok(m) if m.contains_key("op") => Err(unversioned),
            _ => Err(e),
        },
    }
}

/// Writes one reply line (agent side).
pub fn write_reply(w: &mut impl Write, reply: &Reply) -> Result<(), ControlError> {
    let mut line = serde_json::to_vec(reply).expect("replies serialise");
    line.push(b'\n');
    w.write_all(&line)?;
    w.flush()?;
    Ok(())
}

/// Sends `request` to the agent at `socket` (after a [`Hello`]), passes
/// progress lines to `progress`, and returns the result (or the agent's
/// error; an agent of another version is [`ControlError::VersionMismatch`]).
///
/// An agent that goes away without answering at all (an idle agent exits
/// while a client is still in its listen backlog, which the closing
/// listener resets; or it crashed) and no longer accepts connections is
/// [`ControlError::NoAgent`]: the request was not served, and there is no
/// agent now.
pub fn call(
    socket: &Path,
    request: &Request,
    timeout: Option<Duration>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, ControlError> {
    let stream = UnixStream::connect(socket).map_err(|e| ControlError::NoAgent {
        path: socket.to_path_buf(),
        source: e,
    })?;
    stream.set_read_timeout(timeout)?;
    exchange(stream, socket, request, progress)
}

/// [`call`] on a connected unix stream.
fn exchange(
    stream: UnixStream,
    socket: &Path,
    request: &Request,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, ControlError> {
    let no_agent = |why: &str, kind| ControlError::NoAgent {
        path: socket.to_path_buf(),
        source: std::io::Error::new(kind, why),
    };
    match converse(stream, request, progress) {
        Ok(r) => Ok(r),
        // A reset means our request was still unread when the agent's end
        // closed (an agent killed or exiting with us in its backlog, or
        // before it read the line): it was never run, whatever listens now.
        Err(Broke::Silent(ControlError::Io(e)))
            if e.kind() == std::io::ErrorKind::ConnectionReset =>
        {
            Err(no_agent(
                "the agent went away before reading the request (it was exiting or was killed); the request was not run",
                std::io::ErrorKind::ConnectionReset,
            ))
        }
        Err(Broke::Silent(ControlError::Hangup | ControlError::Io(_))) if agent_gone(socket) => {
            Err(no_agent(
                "the agent went away before answering (an idle agent exits; one that crashed left its log in the run directory)",
                std::io::ErrorKind::Other,
            ))
        }
        Err(Broke::Exiting) => Err(no_agent(
            "the agent was exiting (idle) and did not read the request",
            std::io::ErrorKind::ConnectionRefused,
        )),
        Err(Broke::Silent(e) | Broke::After(e)) => Err(e),
    }
}

/// Sends `request` (after a [`Hello`]) on any byte stream, a unix socket
/// today and a TLS connection across hosts later (issue 33): the same
/// line-framed messages either way. Returns the result, or the agent's
/// error.
pub fn call_on<S: Read + Write>(
    stream: S,
    request: &Request,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, ControlError> {
    converse(stream, request, progress).map_err(|b| match b {
        Broke::Silent(e) | Broke::After(e) => e,
        Broke::Exiting => ControlError::Failed(
            "the agent was exiting (idle) and did not read the request: send it again".into(),
        ),
    })
}

/// How a conversation failed.
enum Broke {
    /// Before the agent said anything.
    Silent(ControlError),
    /// The agent was exiting and did not read the request.
    Exiting,
    /// After the agent's hello.
    After(ControlError),
}

/// One request's conversation: hello and request out, hello, progress
/// lines and the final reply in.
fn converse<S: Read + Write>(
    stream: S,
    request: &Request,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, Broke> {
    let mut out = serde_json::to_vec(&Hello {
        version: PROTOCOL_VERSION,
    })
    .expect("hello serialises");
    out.push(b'\n');
    out.extend(serde_json::to_vec(request).expect("requests serialise"));
    out.push(b'\n');
    let mut reader = BufReader::new(stream);
    let sent = reader
        .get_mut()
        .write_all(&out)
        .and_then(|()| reader.get_mut().flush());
    let first = sent
        .map_err(ControlError::from)
        .and_then(|()| read_line(&mut reader))
        .and_then(|l| l.ok_or(ControlError::Hangup))
        .and_then(|l| parse_reply(&l))
        .map_err(Broke::Silent)?;
    match first {
        Reply::Hello { version } if version == PROTOCOL_VERSION => {}
        Reply::Hello { version } => {
            return Err(Broke::After(ControlError::VersionMismatch {
                client: PROTOCOL_VERSION,
                agent: version,
            }))
        }
        // An agent from before versions: it refused the hello as a request.
        Reply::Failed { error } if error.contains("unknown variant `hello`") => {
            return Err(Broke::After(ControlError::VersionMismatch {
                client: PROTOCOL_VERSION,
                agent: 1,
            }))
        }
        Reply::Failed { error } => return Err(Broke::After(ControlError::Failed(error))),
        Reply::Exiting => return Err(Broke::Exiting),
        other => {
            return Err(Broke::After(ControlError::Protocol(format!(
                "the agent answered {other:?} before its hello"
            ))))
        }
    }
    loop {
        let line = read_line(&mut reader)
            .and_then(|l| l.ok_or(ControlError::Hangup))
            .map_err(Broke::After)?;
        match parse_reply(&line).map_err(Broke::After)? {
            Reply::Progress { message } => progress(&message),
            Reply::Done { result } => return Ok(*result),
            Reply::Failed { error } => return Err(Broke::After(ControlError::Failed(error))),
            Reply::Exiting => return Err(Broke::Exiting),
            Reply::Hello { .. } => {
                return Err(Broke::After(ControlError::Protocol(
                    "a second hello from the agent".into(),
                )))
            }
        }
    }
}

fn parse_reply(line: &[u8]) -> Result<Reply, ControlError> {
    serde_json::from_slice(line).map_err(|e| ControlError::Protocol(format!("bad reply: {e}")))
}

/// `vmcsnap agent restart` against an agent of any version: sends
/// `restart-agent` without a hello (every agent serves it: it execs the
/// executable now installed, so that client and agent match again) and
/// returns the generation of the image that answered.
pub fn restart_agent(socket: &Path, progress: &mut dyn FnMut(&str)) -> Result<u64, ControlError> {
    let stream = UnixStream::connect(socket).map_err(|e| ControlError::NoAgent {
        path: socket.to_path_buf(),
        source: e,
    })?;
    let mut line = serde_json::to_vec(&Request::RestartAgent).expect("requests serialise");
    line.push(b'\n');
    let mut reader = BufReader::new(stream);
    reader.get_mut().write_all(&line)?;
    loop {
        let line = read_line(&mut reader)?.ok_or(ControlError::Hangup)?;
        // Read loosely: a version-1 agent's result is `{"pid", "generation"}`,
        // a later one's a typed `restart-agent` response.
        let v: serde_json::Value = serde_json::from_slice(&line)
            .map_err(|e| ControlError::Protocol(format!("bad reply: {e}")))?;
        match v["kind"].as_str() {
            Some("progress") => progress(v["message"].as_str().unwrap_or_default()),
            Some("done") => {
                let r = &v["result"];
                let info = if r["data"].is_object() { &r["data"] } else { r };
                return Ok(info["generation"].as_u64().unwrap_or(0));
            }
            Some("failed") => {
                return Err(ControlError::Failed(
                    v["error"].as_str().unwrap_or_default().to_string(),
                ))
            }
            _ => return Err(ControlError::Protocol(format!("unexpected reply {v}"))),
        }
    }
}

/// Whether nothing accepts connections at `socket` any more (its file is
/// gone, or nothing listens on it).
fn agent_gone(socket: &Path) -> bool {
    matches!(
        UnixStream::connect(socket).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused)
    )
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn request_round_trip_and_unknown_op_rejected() {
        let req = Request::Console {
            vm: "a".into(),
            tail_bytes: 10,
        };
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(text, r#"{"op":"console","vm":"a","tail_bytes":10}"#);
        let back = read_request(&mut format!("{text}\n").as_bytes()).unwrap();
        assert_eq!(back, req);
        let e = read_request(&mut &b"{\"op\":\"explode\"}\n"[..]).unwrap_err();
        assert!(e.to_string().contains("bad request"), "{e}");
    }

    #[test]
    fn call_streams_progress_then_result() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            assert_eq!(accept_request(&mut r).unwrap(), Request::Status);
            let mut w = s;
            write_reply(
                &mut w,
                &Reply::Progress {
                    message: "booting".into(),
                },
            )
            .unwrap();
            write_reply(
                &mut w,
                &Reply::done(Response::Stop(crate::Stopped { vm: "x".into() })),
            )
            .unwrap();
        });
        let mut seen = vec![];
        let v = call(&path, &Request::Status, None, &mut |m| {
            seen.push(m.to_string())
        })
        .unwrap();
        assert_eq!(seen, vec!["booting"]);
        assert_eq!(v, Response::Stop(crate::Stopped { vm: "x".into() }));
    }

    #[test]
    fn failure_and_hangup_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            write_reply(
                &mut &s,
                &Reply::Failed {
                    error: "bad spec".into(),
                },
            )
            .unwrap();
            let (s, _) = l.accept().unwrap();
            drop(s);
            // The agent lives on (it only dropped this connection).
            let _ = l.accept();
        });
        let e = call(&path, &Request::Down, None, &mut |_| {}).unwrap_err();
        assert_eq!(e.to_string(), "bad spec");
        let e = call(&path, &Request::Down, None, &mut |_| {}).unwrap_err();
        // Dropped unread: a reset (not run), or a broken pipe if the
        // drop came before our write.
        assert!(
            matches!(
                e,
                ControlError::Hangup | ControlError::Io(_) | ControlError::NoAgent { .. }
            ),
            "{e}"
        );
    }

    /// Regression (CI): `status` connected while an idle agent was exiting;
    /// the listener closed with the connection still in its backlog, and the
    /// reset came out as "control channel I/O error: Connection reset by
    /// peer" instead of "no vmcsnap agent".
    #[test]
    fn an_agent_that_exits_with_the_client_in_its_backlog_is_no_agent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let l = UnixListener::bind(&path).unwrap();
        let pending = UnixStream::connect(&path).unwrap(); // never accepted
        drop(l); // the agent exits: its listener closes, then its socket file goes
        std::fs::remove_file(&path).unwrap();
        let e = exchange(pending, &path, &Request::Status, &mut |_| {}).unwrap_err();
        assert!(matches!(e, ControlError::NoAgent { .. }), "{e:?}");
        assert!(e.to_string().contains("went away before answering"), "{e}");
        assert!(e.to_string().contains("vmcsnap up"), "{e}");
    }

    /// Regression (issue 29): 12 CLI calls at once against an agent that
    /// exits once idle; one that reached the socket just before it was
    /// removed was dropped unanswered. The exiting agent now answers such a
    /// connection `Exiting`, which means "not sent": NotFound/Refused kind.
    #[test]
    fn an_exiting_agent_turns_a_request_away_as_not_sent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut line = serde_json::to_vec(&Reply::Exiting).unwrap();
            line.push(b'\n');
            (&s).write_all(&line).unwrap();
        });
        let e = call(&path, &Request::Status, None, &mut |_| {}).unwrap_err();
        let ControlError::NoAgent { source, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    }

    /// Regression (CI, rejuvenate.rs): `status` reached a killed agent's
    /// listener in the ~200 ms its threads took to exit; the reset came
    /// out as "control channel I/O error: Connection reset by peer" because
    /// something listened again at the socket by the time the client
    /// looked. A reset before any reply means the request was never read.
    #[test]
    fn a_reset_before_any_reply_is_a_request_not_sent_even_if_an_agent_listens_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let old = UnixListener::bind(&path).unwrap();
        let pending = UnixStream::connect(&path).unwrap(); // never accepted
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let path2 = path.clone();
        let t = std::thread::spawn(move || {
            rx.recv().unwrap();
            std::thread::sleep(Duration::from_millis(100));
            drop(old); // the old agent's last thread exits
            std::fs::remove_file(&path2).unwrap();
            let _new = UnixListener::bind(&path2).unwrap(); // a new agent
            std::thread::sleep(Duration::from_millis(500));
        });
        tx.send(()).unwrap();
        let e = exchange(pending, &path, &Request::Status, &mut |_| {}).unwrap_err();
        t.join().unwrap();
        let ControlError::NoAgent { source, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
        assert!(e.to_string().contains("not run"), "{e}");
    }

    /// The agent side as the agent runs it: accept, then a failure line.
    fn serve_once(l: UnixListener) -> std::thread::JoinHandle<Result<Request, String>> {
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(&s);
            let got = accept_request(&mut r).map_err(|e| e.to_string());
            if let Err(e) = &got {
                write_reply(&mut &s, &Reply::Failed { error: e.clone() }).unwrap();
            }
            got
        })
    }

    fn assert_clear_mismatch(e: &str, client: u32, agent: u32) {
        assert!(
            e.contains(&format!(
                "protocol version {client} and the agent version {agent}"
            )) && e.contains("vmcsnap agent restart"),
            "{e}"
        );
    }

    /// An old client (protocol 1: no hello, its request first) against
    /// this agent: one clear error naming both versions and what to do,
    /// which an old client prints as it is (a failed reply).
    #[test]
    fn an_old_client_gets_a_clear_version_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let agent = serve_once(UnixListener::bind(&path).unwrap());
        let mut s = UnixStream::connect(&path).unwrap();
        s.write_all(b"{\"op\":\"status\"}\n").unwrap();
        let mut line = String::new();
        BufReader::new(&s).read_line(&mut line).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["kind"], "failed", "{line}");
        assert_clear_mismatch(v["error"].as_str().unwrap(), 1, PROTOCOL_VERSION);
        assert!(agent.join().unwrap().is_err());
    }

    /// This client against an agent from before versions (it answers the
    /// hello as the unknown request it is to it: the version-1 agent read a
    /// request with `read_request` and sent the error back).
    #[test]
    fn a_new_client_against_an_old_agent_gets_a_clear_version_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let e = read_request(&mut BufReader::new(&s)).unwrap_err();
            let error = e.to_string();
            assert!(error.contains("unknown variant `hello`"), "{error}");
            write_reply(&mut &s, &Reply::Failed { error }).unwrap();
        });
        let e = call(&path, &Request::Status, None, &mut |_| {}).unwrap_err();
        assert!(
            matches!(
                e,
                ControlError::VersionMismatch {
                    client: PROTOCOL_VERSION,
                    agent: 1
                }
            ),
            "{e:?}"
        );
        assert_clear_mismatch(&e.to_string(), PROTOCOL_VERSION, 1);
    }

    /// Both sides versioned, different versions: each side says the same.
    #[test]
    fn versions_that_differ_are_named_on_both_sides() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        // A newer agent.
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            write_reply(
                &mut &s,
                &Reply::Hello {
                    version: PROTOCOL_VERSION + 1,
                },
            )
            .unwrap();
        });
        let e = call(&path, &Request::Status, None, &mut |_| {}).unwrap_err();
        assert_clear_mismatch(&e.to_string(), PROTOCOL_VERSION, PROTOCOL_VERSION + 1);
        // A newer client against this agent.
        let path = dir.path().join("b.sock");
        let agent = serve_once(UnixListener::bind(&path).unwrap());
        let mut s = UnixStream::connect(&path).unwrap();
        let hello = Hello {
            version: PROTOCOL_VERSION + 1,
        };
        s.write_all(
            format!(
                "{}\n{{\"op\":\"status\"}}\n",
                serde_json::to_string(&hello).unwrap()
            )
            .as_bytes(),
        )
        .unwrap();
        let mut r = BufReader::new(&s);
        let first = read_line(&mut r).unwrap().unwrap();
        assert_eq!(
            parse_reply(&first).unwrap(),
            Reply::Hello {
                version: PROTOCOL_VERSION
            }
        );
        let second = read_line(&mut r).unwrap().unwrap();
        let Reply::Failed { error } = parse_reply(&second).unwrap() else {
            panic!("not failed")
        };
        assert_clear_mismatch(&error, PROTOCOL_VERSION + 1, PROTOCOL_VERSION);
        assert!(agent.join().unwrap().is_err());
    }

    /// `restart-agent` crosses versions: sent without a hello, this agent
    /// serves it, and the client reads a version-1 agent's answer too.
    #[test]
    fn restart_agent_is_served_across_versions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let agent = serve_once(UnixListener::bind(&path).unwrap());
        let s = UnixStream::connect(&path).unwrap();
        (&s).write_all(b"{\"op\":\"restart-agent\"}\n").unwrap();
        assert_eq!(agent.join().unwrap(), Ok(Request::RestartAgent));
        // A version-1 agent's answer.
        let l = UnixListener::bind(dir.path().join("b.sock")).unwrap();
        std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            assert_eq!(
                read_request(&mut BufReader::new(&s)).unwrap(),
                Request::RestartAgent
            );
            (&s).write_all(b"{\"kind\":\"done\",\"result\":{\"pid\":7,\"generation\":3}}\n")
                .unwrap();
        });
        assert_eq!(
            restart_agent(&dir.path().join("b.sock"), &mut |_| {}).unwrap(),
            3
        );
    }

    /// The same messages on any byte stream (a TLS connection later).
    #[test]
    fn call_on_runs_over_any_stream() {
        let (a, b) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let mut r = BufReader::new(&b);
            assert_eq!(accept_request(&mut r).unwrap(), Request::Down);
            write_reply(
                &mut &b,
                &Reply::done(Response::Down(crate::ClusterDown {
                    cluster: "c".into(),
                })),
            )
            .unwrap();
        });
        let r = call_on(&a, &Request::Down, &mut |_| {}).unwrap();
        assert_eq!(
            r,
            Response::Down(crate::ClusterDown {
                cluster: "c".into()
            })
        );
    }

    #[test]
    fn missing_agent_says_how_to_start_one() {
        let e = call(
            Path::new("/nonexistent/agent.sock"),
            &Request::Ping,
            None,
            &mut |_| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("vmcsnap up"), "{e}");
    }

    #[test]
    fn oversized_line_is_rejected_without_buffering_forever() {
        let big = vec![b'x'; MAX_LINE + 10];
        let e = read_request(&mut &big[..]).unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
    }
}
