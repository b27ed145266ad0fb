//! Checking and adopting the file descriptors a frozen switch left to the
//! new process. The only unsafe code of the handover lives here: asking
//! whether a descriptor number is open, borrowing it to inspect it, and
//! taking ownership of it.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use socket2::{Domain, SockRef, Type};

use crate::error::{Result, SwitchError};

/// What an inherited descriptor must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A listening unix stream socket.
    Listener,
    /// A connected (accepted) unix stream socket.
    Connection,
}

/// One inherited descriptor to check and adopt.
#[derive(Debug)]
pub(crate) struct Expected<'a> {
    pub(crate) fd: RawFd,
    pub(crate) kind: Kind,
    /// The path the socket must be bound to (an accepted socket reports its
    /// listener's address).
    pub(crate) path: &'a Path,
    /// Human-readable role for error messages.
    pub(crate) role: String,
}

/// Checks every descriptor, then (only if all are fine) takes ownership of
/// all of them, in order. On error nothing was taken or closed.
///
/// The caller guarantees what [`Switch::thaw`](crate::Switch::thaw)
/// documents: the numbers name descriptors inherited for the switch, which
/// nothing else in this process owns. Numbers must be distinct (checked by
/// the state validation).
pub(crate) fn adopt_all(expected: &[Expected<'_>]) -> Result<Vec<OwnedFd>> {
    for e in expected {
        check(e).map_err(|problem| SwitchError::InheritedFd {
            fd: e.fd,
            role: e.role.clone(),
            problem,
        })?;
    }
    Ok(expected
        .iter()
        .map(|e| {
            // SAFETY: `e.fd` is open (checked above, nothing closed it since:
            // the state's descriptors belong to the switch being thawed, per
            // the contract of `Switch::thaw`), is not owned by any other
            // object in this process (same contract), and appears only once
            // in `expected` (validated), so exactly one OwnedFd owns it.
            unsafe { OwnedFd::from_raw_fd(e.fd) }
        })
        .collect())
}

/// Whether `e.fd` is an open unix stream socket of the expected kind, bound
/// to the expected path; the problem in words if not.
fn check(e: &Expected<'_>) -> std::result::Result<(), String> {
    if e.fd < 0 {
        return Err("is not a valid descriptor number".into());
    }
    // SAFETY: F_GETFD takes no pointer argument and only reads the
    // descriptor's flags; on a number that is not open it fails with EBADF.
    if unsafe { libc::fcntl(e.fd, libc::F_GETFD) } < 0 {
        return Err(format!("is not open ({})", io::Error::last_os_error()));
    }
    // SAFETY: the descriptor is open (checked just above) and the borrow
    // does not outlive this function, during which nothing closes it.
    let fd = unsafe { BorrowedFd::borrow_raw(e.fd) };
    let sock = SockRef::from(&fd);
    fn what(q: &'static str) -> impl Fn(io::Error) -> String {
        move |err| format!("cannot be queried for its {q} ({err})")
    }
    match sock.domain() {
        Ok(Domain::UNIX) => {}
        Ok(d) => return Err(format!("is a socket of domain {d:?}, not a unix socket")),
        Err(err) if err.raw_os_error() == Some(libc::ENOTSOCK) => {
            return Err("is not a socket".into())
        }
        Err(err) => return Err(what("domain")(err)),
    }
    let ty = sock.r#type().map_err(what("type"))?;
    if ty != Type::STREAM {
        return Err(format!(
            "is a unix socket of type {ty:?}, not a stream socket"
        ));
    }
    let listening = sock.is_listener().map_err(what("listening state"))?;
    match (e.kind, listening) {
        (Kind::Listener, false) => {
            return Err("is a unix stream socket that is not listening".into())
        }
        (Kind::Connection, true) => return Err("is a listening socket, not a connection".into()),
        _ => {}
    }
    let addr = sock.local_addr().map_err(what("address"))?;
    match addr.as_pathname() {
        Some(p) if p == e.path => Ok(()),
        Some(p) => Err(format!("is bound to {p:?}, not to {:?}", e.path)),
        None => Err(format!("is not bound to a path (expected {:?})", e.path)),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, IntoRawFd};
    use std::os::unix::net::{UnixListener, UnixStream};

    use super::*;

    fn problem(fd: RawFd, kind: Kind, path: &Path) -> String {
        let e = Expected {
            fd,
            kind,
            path,
            role: "test".into(),
        };
        match adopt_all(&[e]) {
            Err(SwitchError::InheritedFd { problem, .. }) => problem,
            other => panic!("expected an InheritedFd error, got {other:?}"),
        }
    }

    #[test]
    fn rejects_wrong_descriptors_without_closing_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = UnixStream::connect(&path).unwrap();
        let (conn, _) = listener.accept().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();

        assert!(problem(-1, Kind::Listener, &path).contains("not a valid"));
        assert!(problem(file.as_raw_fd(), Kind::Listener, &path).contains("not a socket"));
        let l = listener.as_raw_fd();
        assert!(problem(l, Kind::Connection, &path).contains("listening socket, not a connection"));
        assert!(problem(conn.as_raw_fd(), Kind::Listener, &path).contains("not listening"));
        assert!(
            problem(client.as_raw_fd(), Kind::Connection, &path).contains("not bound to a path")
        );
        let other = dir.path().join("other.sock");
        assert!(problem(l, Kind::Listener, &other).contains("is bound to"));
        // Far above any descriptor limit, so never open (a number freed by
        // closing could be reused at once by a concurrent test).
        assert!(problem(1 << 30, Kind::Connection, &path).contains("not open"));
        // Nothing was closed by the failed checks.
        assert!(listener.local_addr().is_ok() && conn.peer_addr().is_ok());
    }

    #[test]
    fn adopts_matching_descriptors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let _client = UnixStream::connect(&path).unwrap();
        let (conn, _) = listener.accept().unwrap();
        let expected = [
            Expected {
                fd: listener.into_raw_fd(),
                kind: Kind::Listener,
                path: &path,
                role: "l".into(),
            },
            Expected {
                fd: conn.into_raw_fd(),
                kind: Kind::Connection,
                path: &path,
                role: "c".into(),
            },
        ];
        let fds = adopt_all(&expected).unwrap();
        assert_eq!(fds.len(), 2);
        assert_eq!(fds[0].as_raw_fd(), expected[0].fd);
    }
}
