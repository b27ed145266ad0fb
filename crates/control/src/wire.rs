//! Line framing, and the client side of one call.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::{Reply, Request, Response};

/// Longest accepted line (a console tail or status fits easily).
pub const MAX_LINE: usize = 16 << 20;

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
    #[error("the agent closed the connection before answering (did it crash? see its log in the run directory)")]
    Hangup,
    /// The agent ran the request and it failed.
    #[error("{0}")]
    Failed(String),
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

/// Reads the one request of a connection (agent side).
pub fn read_request(r: &mut impl BufRead) -> Result<Request, ControlError> {
    let line = read_line(r)?.ok_or(ControlError::Hangup)?;
    serde_json::from_slice(&line).map_err(|e| ControlError::Protocol(format!("bad request: {e}")))
}

/// Writes one reply line (agent side).
pub fn write_reply(w: &mut impl Write, reply: &Reply) -> Result<(), ControlError> {
    let mut line = serde_json::to_vec(reply).expect("replies serialise");
    line.push(b'\n');
    w.write_all(&line)?;
    w.flush()?;
    Ok(())
}

/// Sends `request` to the agent at `socket`, passes progress lines to
/// `progress`, and returns the result (or the agent's error).
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
    exchange(stream, socket, request, timeout, progress)
}

/// [`call`] on a connected stream.
fn exchange(
    stream: UnixStream,
    socket: &Path,
    request: &Request,
    timeout: Option<Duration>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, ControlError> {
    stream.set_read_timeout(timeout)?;
    let mut line = serde_json::to_vec(request).expect("requests serialise");
    line.push(b'\n');
    let mut reader = BufReader::new(stream);
    let first = reader
        .get_mut()
        .write_all(&line)
        .map_err(ControlError::from)
        .and_then(|()| read_line(&mut reader));
    let mut next = match first {
        Ok(Some(line)) => line,
        Ok(None) | Err(ControlError::Hangup | ControlError::Io(_)) if agent_gone(socket) => {
            return Err(ControlError::NoAgent {
                path: socket.to_path_buf(),
                source: std::io::Error::other(
                    "the agent went away before answering (an idle agent exits; one that crashed left its log in the run directory)",
                ),
            })
        }
        Ok(None) => return Err(ControlError::Hangup),
        Err(e) => return Err(e),
    };
    loop {
        let reply: Reply = serde_json::from_slice(&next)
            .map_err(|e| ControlError::Protocol(format!("bad reply: {e}")))?;
        match reply {
            Reply::Progress { message } => progress(&message),
            Reply::Done { result } => return Ok(*result),
            Reply::Failed { error } => return Err(ControlError::Failed(error)),
            Reply::Exiting => {
                return Err(ControlError::NoAgent {
                    path: socket.to_path_buf(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::ConnectionRefused,
                        "the agent was exiting (idle) and did not read the request",
                    ),
                })
            }
        }
        next = read_line(&mut reader)?.ok_or(ControlError::Hangup)?;
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
            assert_eq!(read_request(&mut r).unwrap(), Request::Status);
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
        assert!(
            matches!(e, ControlError::Hangup | ControlError::Io(_)),
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
        let e = exchange(pending, &path, &Request::Status, None, &mut |_| {}).unwrap_err();
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
