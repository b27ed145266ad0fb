//! The one error type of host access, with messages that say what to do.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

/// Error returned by every function of this crate.
#[derive(Debug, Error)]
pub enum HostNetError {
    /// The caller lacks CAP_NET_ADMIN / CAP_SYS_ADMIN.
    #[error("{what}: permission denied; host access needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run vmcsnap as root")]
    NotRoot {
        /// What was being done.
        what: String,
    },
    /// `/dev/net/tun` is missing.
    #[error("/dev/net/tun does not exist: load the tun module (`modprobe tun`) or, in a container, pass the device in (--device /dev/net/tun)")]
    TunMissing,
    /// A network namespace name iproute2 would not accept.
    #[error("network namespace name {name:?} is invalid: it must be 1 to {max} bytes, not `.` or `..`, without `/` or NUL")]
    InvalidNetnsName {
        /// The name.
        name: String,
        /// Longest accepted name.
        max: usize,
    },
    /// An interface name the kernel would not accept.
    #[error("interface name {name:?} is invalid: it must be 1 to 15 bytes, not `.` or `..`, without `/`, `:`, whitespace or NUL")]
    InvalidIfname {
        /// The name.
        name: String,
    },
    /// The socket path cannot be a unix socket address.
    #[error("socket path {path:?} is not usable: unix socket paths must be 1 to 107 bytes without NUL; use a shorter run directory")]
    InvalidSocketPath {
        /// The path.
        path: PathBuf,
    },
    /// Something other than a socket is at the socket path.
    #[error("{path:?} exists and is not a socket; not deleting it: remove it yourself or choose another socket path")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// A live process listens on the socket path.
    #[error("socket {path:?} is in use: another process accepts connections on it (another agent on the same run directory?); stop it first")]
    SocketInUse {
        /// The path.
        path: PathBuf,
    },
    /// The named network namespace does not exist.
    #[error("network namespace {name:?} does not exist (no /run/netns/{name})")]
    NetnsMissing {
        /// The name.
        name: String,
    },
    /// In host mode, an interface of the same name exists that is not a TAP.
    #[error("interface {name:?} already exists in the host's network stack and is not a TUN/TAP device; not deleting it: choose another interface name")]
    InterfaceExists {
        /// The name.
        name: String,
    },
    /// The command given to `exec_in_netns` could not be started.
    #[error("cannot run {program:?}: {source}; is it installed and on PATH?")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: io::Error,
    },
    /// `exec_in_netns` was given no command.
    #[error("no command given: name the program to run inside the network namespace")]
    NoCommand,
    /// The relay thread could not be started.
    #[error("cannot start a thread ({what}): {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// The cause.
        source: io::Error,
    },
    /// Any other system call failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: io::Error,
    },
}

impl HostNetError {
    /// Wraps an I/O error, turning EPERM/EACCES into [`HostNetError::NotRoot`].
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        let what = what.into();
        match source.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => HostNetError::NotRoot { what },
            _ => HostNetError::Io { what, source },
        }
    }

    /// [`HostNetError::io`] of the calling thread's `errno`.
    pub(crate) fn last_os(what: impl Into<String>) -> Self {
        Self::io(what, io::Error::last_os_error())
    }
}

/// `Result` of this crate.
pub type Result<T> = std::result::Result<T, HostNetError>;
