//! The port's peer address: validating it and dialing it.
//!
//! A port's peer is a QEMU `-netdev stream,server=on,addr.type=unix,...`
//! listening at the port's socket path. The switch only ever connects to
//! that path: it never binds, never unlinks and never changes the file,
//! which belongs to QEMU (QEMU unlinks and re-binds it when it starts).
//!
//! Connecting a unix stream socket never waits for the peer to accept: the
//! kernel completes the connection as soon as it has a place in the
//! listener's backlog, or fails at once. A non-blocking connect therefore
//! either succeeds or fails immediately; the failures that mean "the peer
//! is not listening yet" ([`is_not_yet`]) are retried by the event loop.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use mio::net::UnixStream;
use socket2::{Domain, SockAddr, Socket, Type};

use crate::error::{Result, SwitchError, MAX_SOCKET_PATH_LEN};

/// Identity (device, inode) of a file, to recognise two spellings of the
/// same socket path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
}

/// Identity of whatever is at `path` now (without following symlinks).
pub(crate) fn file_id(path: &Path) -> Option<FileId> {
    fs::symlink_metadata(path).ok().map(|m| FileId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

/// Checks that `path` can be a unix socket address: non-empty, without a
/// NUL byte, at most [`MAX_SOCKET_PATH_LEN`] bytes.
pub(crate) fn check_path(path: &Path) -> Result<()> {
    let bytes = path.as_os_str().as_encoded_bytes();
    if bytes.is_empty() || bytes.contains(&0) {
        return Err(SwitchError::InvalidSocketPath {
            path: path.to_owned(),
        });
    }
    if bytes.len() > MAX_SOCKET_PATH_LEN {
        return Err(SwitchError::SocketPathTooLong {
            path: path.to_owned(),
            len: bytes.len(),
        });
    }
    Ok(())
}

/// The socket address of a path that passed [`check_path`].
pub(crate) fn address(path: &Path) -> Result<SockAddr> {
    check_path(path)?;
    SockAddr::unix(path).map_err(|_| SwitchError::InvalidSocketPath {
        path: path.to_owned(),
    })
}

/// Whether a failed connect only means that nobody accepts at the address
/// yet: no file (`ENOENT`, QEMU not started), a file nobody listens on
/// (`ECONNREFUSED`: QEMU gone, or the path is not a socket), or a full
/// listen backlog (`EAGAIN`). Linux never reports `EINPROGRESS` for unix
/// sockets; should it, the socket is dropped and the connect retried.
pub(crate) fn is_not_yet(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT | libc::ECONNREFUSED | libc::EAGAIN | libc::EINPROGRESS)
    )
}

/// Connects a new non-blocking, close-on-exec unix stream socket to `addr`.
pub(crate) fn dial(addr: &SockAddr) -> io::Result<UnixStream> {
    // socket2 creates sockets with SOCK_CLOEXEC: a QEMU spawned by the
    // agent must not inherit another VM's connection.
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    sock.set_nonblocking(true)?;
    sock.connect(addr)?;
    let std_stream: std::os::unix::net::UnixStream = sock.into();
    Ok(UnixStream::from_std(std_stream))
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn paths_are_checked() {
        assert!(matches!(
            check_path(Path::new("")),
            Err(SwitchError::InvalidSocketPath { .. })
        ));
        use std::os::unix::ffi::OsStrExt;
        let nul = std::ffi::OsStr::from_bytes(b"a\0b");
        assert!(matches!(
            check_path(Path::new(nul)),
            Err(SwitchError::InvalidSocketPath { .. })
        ));
        let long = "x".repeat(MAX_SOCKET_PATH_LEN + 1);
        assert!(matches!(
            check_path(Path::new(&long)),
            Err(SwitchError::SocketPathTooLong { len, .. }) if len == MAX_SOCKET_PATH_LEN + 1
        ));
        assert!(address(Path::new(&long[1..])).is_ok());
    }

    #[test]
    fn dial_reports_absent_and_dead_peers_as_not_yet() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sock");
        let addr = address(&path).unwrap();
        let e = dial(&addr).unwrap_err();
        assert!(is_not_yet(&e), "no file: {e}");
        drop(UnixListener::bind(&path).unwrap()); // a stale socket file
        let e = dial(&addr).unwrap_err();
        assert!(is_not_yet(&e), "nobody listening: {e}");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"not a socket").unwrap();
        let e = dial(&addr).unwrap_err();
        assert!(is_not_yet(&e), "a regular file: {e}");
        std::fs::remove_file(&path).unwrap();

        let listener = UnixListener::bind(&path).unwrap();
        let stream = dial(&addr).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        assert_eq!(
            stream.peer_addr().unwrap().as_pathname(),
            Some(path.as_path())
        );
        assert!(!is_not_yet(&io::Error::from_raw_os_error(libc::EMFILE)));
    }
}
