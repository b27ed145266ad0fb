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

/// One inherited descriptor to check and adopt: the switch's end of a
/// connection to a port's peer.
#[derive(Debug)]
pub(crate) struct Expected<'a> {
    pub(crate) fd: RawFd,
    /// The path the peer listens on: the socket's peer address.
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

/// Whether `e.fd` is an open, non-listening unix stream socket whose peer
/// is bound to the expected path; the problem in words if not. The peer
/// address stays readable after the peer closed (the connection then shows
/// EOF once thawed, and the port dials again).
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
    if sock.is_listener().map_err(what("listening state"))? {
        return Err("is a listening socket, not a connection".into());
    }
    let addr = match sock.peer_addr() {
        Ok(addr) => addr,
        Err(err) if err.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err("is a unix stream socket that is not connected".into())
        }
        Err(err) => return Err(what("peer address")(err)),
    };
    match addr.as_pathname() {
        Some(p) if p == e.path => Ok(()),
        Some(p) => Err(format!("is connected to {p:?}, not to {:?}", e.path)),
        None => Err(format!(
            "is connected to a peer not bound to a path (expected {:?})",
            e.path
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, IntoRawFd};
    use std::os::unix::net::{UnixListener, UnixStream};

    use super::*;

    fn problem(fd: RawFd, path: &Path) -> String {
        let e = Expected {
            fd,
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
        let (accepted, _) = listener.accept().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let unconnected = socket2::Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        let (pair, _other) = UnixStream::pair().unwrap();

        assert!(problem(-1, &path).contains("not a valid"));
        assert!(problem(file.as_raw_fd(), &path).contains("not a socket"));
        let l = listener.as_raw_fd();
        assert!(problem(l, &path).contains("listening socket, not a connection"));
        assert!(problem(unconnected.as_raw_fd(), &path).contains("not connected"));
        // The listening side's end: its peer (the dialer) has no path.
        assert!(problem(accepted.as_raw_fd(), &path).contains("not bound to a path"));
        assert!(problem(pair.as_raw_fd(), &path).contains("not bound to a path"));
        let other = dir.path().join("other.sock");
        assert!(problem(client.as_raw_fd(), &other).contains("is connected to"));
        // Far above any descriptor limit, so never open (a number freed by
        // closing could be reused at once by a concurrent test).
        assert!(problem(1 << 30, &path).contains("not open"));
        // Nothing was closed by the failed checks.
        assert!(listener.local_addr().is_ok() && client.peer_addr().is_ok());
    }

    #[test]
    fn adopts_a_connection_even_after_its_peer_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = UnixStream::connect(&path).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let gone = UnixStream::connect(&path).unwrap();
        drop(listener.accept().unwrap());
        drop(listener);
        std::fs::remove_file(&path).unwrap(); // as a QEMU restarting would
        let expected = [
            Expected {
                fd: client.into_raw_fd(),
                path: &path,
                role: "live".into(),
            },
            Expected {
                fd: gone.into_raw_fd(),
                path: &path,
                role: "peer gone".into(),
            },
        ];
        let fds = adopt_all(&expected).unwrap();
        assert_eq!(fds.len(), 2);
        assert_eq!(fds[0].as_raw_fd(), expected[0].fd);
        drop(accepted);
    }
}
