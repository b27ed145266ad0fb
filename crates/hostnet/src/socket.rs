//! The relay's listening socket: checked path, stale file replaced, a live
//! owner refused.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::error::{HostNetError, Result};

/// Longest unix socket path (`sun_path` is 108 bytes with the NUL).
pub const MAX_SOCKET_PATH_LEN: usize = 107;

/// Binds a non-blocking listener at `path`, replacing a stale socket file.
pub(crate) fn listen(path: &Path) -> Result<UnixListener> {
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_SOCKET_PATH_LEN || bytes.contains(&0) {
        return Err(HostNetError::InvalidSocketPath { path: path.into() });
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            return Err(HostNetError::NotASocket { path: path.into() })
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => return Err(HostNetError::SocketInUse { path: path.into() }),
            Err(_) => {
                log::info!("replacing the stale socket {path:?}");
                std::fs::remove_file(path).map_err(|e| {
                    HostNetError::io(format!("cannot remove the stale socket {path:?}"), e)
                })?;
            }
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(HostNetError::io(format!("cannot examine {path:?}"), e)),
    }
    let l = UnixListener::bind(path)
        .map_err(|e| HostNetError::io(format!("cannot listen on {path:?}"), e))?;
    l.set_nonblocking(true)
        .map_err(|e| HostNetError::io(format!("cannot make {path:?} non-blocking"), e))?;
    Ok(l)
}

/// Removes `path` if it is a socket (never anything else).
pub(crate) fn remove_if_socket(path: &Path) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(path);
    }
}
