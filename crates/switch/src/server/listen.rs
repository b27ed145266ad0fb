//! Creating and removing port listening sockets.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use mio::net::UnixListener;
use socket2::{Domain, SockAddr, Socket, Type};

use crate::error::{Result, SwitchError, MAX_SOCKET_PATH_LEN};

/// Identity (device, inode) of a socket file, used to avoid unlinking a file
/// that someone else put at the path after us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    /// The identity with these `st_dev` and `st_ino`.
    pub(crate) fn from_parts(dev: u64, ino: u64) -> Self {
        FileId { dev, ino }
    }

    /// `(st_dev, st_ino)`.
    pub(crate) fn parts(self) -> (u64, u64) {
        (self.dev, self.ino)
    }
}

/// Identity of whatever is at `path` now (without following symlinks).
pub(crate) fn file_id(path: &Path) -> Option<FileId> {
    fs::symlink_metadata(path).ok().map(|m| FileId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

/// Checks that `path` can be a unix socket address.
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

fn listen_err(path: &Path) -> impl FnOnce(io::Error) -> SwitchError + '_ {
    move |source| SwitchError::Listen {
        path: path.to_owned(),
        source,
    }
}

/// Removes a stale socket file at `path`. Fails if the path holds something
/// other than a socket, or a socket that a live process accepts on.
fn remove_stale(path: &Path, addr: &SockAddr) -> Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(listen_err(path)(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(SwitchError::NotASocket {
            path: path.to_owned(),
        });
    }
    // Probe without blocking: a full backlog must not stall the event loop.
    let probe = Socket::new(Domain::UNIX, Type::STREAM, None).map_err(listen_err(path))?;
    probe.set_nonblocking(true).map_err(listen_err(path))?;
    match probe.connect(addr) {
        Ok(()) => {
            return Err(SwitchError::SocketInUse {
                path: path.to_owned(),
            })
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINPROGRESS)) => {
            return Err(SwitchError::SocketInUse {
                path: path.to_owned(),
            })
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(_) => {} // ECONNREFUSED: nobody listens, the file is stale.
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(listen_err(path)(e)),
    }
}

/// Binds a non-blocking listening socket at `path` with mode 0600, removing
/// a stale socket file first. The mode is set before `listen`, so no client
/// can connect while the file still has the umask's mode.
pub(crate) fn bind(path: &Path) -> Result<(UnixListener, FileId)> {
    check_path(path)?;
    let addr = SockAddr::unix(path).map_err(listen_err(path))?;
    remove_stale(path, &addr)?;
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None).map_err(listen_err(path))?;
    sock.bind(&addr).map_err(listen_err(path))?;
    let id = file_id(path);
    let setup = (|| {
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
        sock.listen(1024)?;
        sock.set_nonblocking(true)
    })();
    match (setup, id) {
        (Ok(()), Some(id)) => {
            let std_listener: std::os::unix::net::UnixListener = sock.into();
            Ok((UnixListener::from_std(std_listener), id))
        }
        (res, id) => {
            if let Some(id) = id {
                unlink_if_same(path, id);
            }
            let e = res
                .err()
                .unwrap_or_else(|| io::Error::other("socket file vanished after bind"));
            Err(listen_err(path)(e))
        }
    }
}

/// Unlinks `path` if it is still the socket file we created.
pub(crate) fn unlink_if_same(path: &Path, id: FileId) {
    if file_id(path) == Some(id) {
        if let Err(e) = fs::remove_file(path) {
            log::warn!("cannot remove socket file {}: {e}", path.display());
        }
    }
}
