//! Errors of the switch's control API.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

use crate::core::PortId;

/// Longest socket path a unix socket address can hold (`sun_path` is 108
/// bytes including the terminating NUL).
pub const MAX_SOCKET_PATH_LEN: usize = 107;

/// Error returned by [`Switch`](crate::Switch) and
/// [`SwitchHandle`](crate::SwitchHandle).
#[derive(Debug, Error)]
pub enum SwitchError {
    /// The socket path does not fit in a unix socket address.
    #[error(
        "socket path {path:?} is {len} bytes, but unix socket paths are limited to 107 bytes; \
         put port sockets in a directory with a shorter path (or use a relative path)"
    )]
    SocketPathTooLong {
        /// The offending path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The socket path is empty or contains a NUL byte.
    #[error("socket path {path:?} is not usable for a unix socket: it must be non-empty and contain no NUL byte")]
    InvalidSocketPath {
        /// The offending path.
        path: PathBuf,
    },
    /// Another port of this switch already uses the name.
    #[error("port name {name:?} is already used by {port}; give each port a unique name")]
    DuplicateName {
        /// The name.
        name: String,
        /// The port that has it.
        port: PortId,
    },
    /// Another port of this switch already dials the socket path (or
    /// another spelling of the same socket file).
    #[error("socket {path:?} is already the peer of {port} of this switch (one connection per QEMU); remove that port first or choose another path")]
    DuplicatePath {
        /// The path.
        path: PathBuf,
        /// The port that dials it.
        port: PortId,
    },
    /// No port with this id exists.
    #[error("{0} does not exist (never added, or already removed)")]
    UnknownPort(PortId),
    /// The event loop could not be set up.
    #[error("cannot start the switch event loop: {0}; the process may be out of file descriptors or threads")]
    Start(#[source] io::Error),
    /// A [`FrozenState`](crate::handover::FrozenState) given to
    /// [`Switch::thaw`](crate::Switch::thaw) is not self-consistent.
    #[error(
        "cannot thaw the switch: the frozen state is invalid: {0}; \
         thaw only states produced by SwitchHandle::freeze of a compatible vmcsnap-switch"
    )]
    InvalidFrozenState(String),
    /// A file descriptor named in a frozen state is not usable.
    #[error(
        "cannot thaw the switch: fd {fd} ({role}) {problem}; the fds of a frozen switch \
         must be inherited across exec (call FrozenSwitch::keep_across_exec right before \
         exec) and not be closed or reused before Switch::thaw"
    )]
    InheritedFd {
        /// The descriptor number given in the state.
        fd: i32,
        /// What the state says it is, e.g. `connection of port "vm1" (port#0)`.
        role: String,
        /// What is wrong with it, e.g. `is not open`.
        problem: String,
    },
    /// A socket of a frozen switch could not be made inheritable.
    #[error("cannot clear FD_CLOEXEC on fd {fd} of the frozen switch: {source}")]
    KeepAcrossExec {
        /// The descriptor.
        fd: i32,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A cut session is already active.
    #[error(
        "a cluster snapshot cut session (epoch {epoch}) is already active; wait for it to \
         end (end_cut_session) or abort it (abort_cut_session) before beginning another"
    )]
    CutSessionActive {
        /// Epoch of the active session.
        epoch: u64,
    },
    /// No cut session is active.
    #[error("no cluster snapshot cut session is active; call begin_cut_session first")]
    NoCutSession,
    /// The port is not part of the active cut session.
    #[error("{port} is not part of the cluster snapshot cut session (epoch {epoch}); list it in begin_cut_session")]
    NotInCutSession {
        /// The port.
        port: PortId,
        /// Epoch of the active session.
        epoch: u64,
    },
    /// The port was already cut in the active session.
    #[error("{port} was already cut in the cluster snapshot cut session (epoch {epoch}); each port is cut once per session")]
    AlreadyCut {
        /// The port.
        port: PortId,
        /// Epoch of the active session.
        epoch: u64,
    },
    /// Releasing the port would hand it frames sent after another VM's cut.
    #[error(
        "{0} stays held: frames sent after another VM's cut are queued for it and it is not \
         cut yet; cut it (prepare_cut, cut) before releasing it, or abort the cut session"
    )]
    HeldByCutSession(PortId),
    /// Freezing (handover) is not possible during a cut session.
    #[error(
        "cannot freeze the switch while a cluster snapshot cut session (epoch {epoch}) is \
         active; finish (end_cut_session) or abort (abort_cut_session) the cluster snapshot first"
    )]
    FreezeDuringCutSession {
        /// Epoch of the active session.
        epoch: u64,
    },
    /// A tunnel's UDP socket could not be set up.
    #[error(
        "cannot set up tunnel {name:?} from {local} to {remote}: {what}: {source}; \
         choose a free local address of this host (and a remote address of the form ip:port)"
    )]
    TunnelSocket {
        /// The tunnel port's name.
        name: String,
        /// The local address.
        local: std::net::SocketAddr,
        /// The remote address.
        remote: std::net::SocketAddr,
        /// The step that failed (bind, connect, register).
        what: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A tunnel's datagram bound is out of range.
    #[error(
        "tunnel {name:?}: max_datagram_len {len} is out of range: it must be {min}..={max} \
         (a header and the shortest frame, at most one UDP datagram)"
    )]
    TunnelDatagramLen {
        /// The tunnel port's name.
        name: String,
        /// The bound given.
        len: usize,
        /// The smallest allowed.
        min: usize,
        /// The largest allowed.
        max: usize,
    },
    /// A tunnel port was named as a member of a cut session.
    #[error(
        "{0} is a tunnel to another host's switch, not a VM: list only VM ports in \
         begin_cut_session (frames through a tunnel carry their sender's color themselves)"
    )]
    TunnelInCutSession(PortId),
    /// Freezing (handover) does not carry tunnels.
    #[error(
        "cannot freeze the switch: it has {tunnels} tunnel port(s), which a handover does not \
         carry; remove them (remove_port) before freezing and add them again after the thaw"
    )]
    FreezeWithTunnels {
        /// How many tunnel ports the switch has.
        tunnels: usize,
    },
    /// The DHCP configuration or a lease is not usable (see [`crate::dhcp`]).
    #[error(transparent)]
    Dhcp(#[from] crate::dhcp::DhcpError),
    /// The switch was stopped (or its event loop died); the handle is unusable.
    #[error("the switch is stopped; start a new one with Switch::start")]
    Stopped,
}

/// Result type of the switch API.
pub type Result<T, E = SwitchError> = std::result::Result<T, E>;
