//! Handing a running switch over to a new process image (`execve`) without
//! closing a connection or losing a frame.
//!
//! The agent that hosts the switch restarts itself by `execve` of its own
//! binary (possibly a newer build) in the same process, while the QEMU
//! processes keep running and keep their connections. The switch therefore
//! survives as two things: its connections to the QEMUs, inherited across
//! `exec` as open file descriptors, and a [`FrozenState`] that the agent
//! writes to a file.
//!
//! (A switch that dies without a handover, say killed with `SIGKILL`, loses
//! its state but not the VMs' network for good: its connections close, each
//! QEMU, the listening side, accepts a new one, and a new switch that adds
//! the same ports dials them again. Only the frames the old switch held are
//! lost.)
//!
//! # Protocol
//!
//! In the old image:
//!
//! 1. [`SwitchHandle::freeze`](crate::SwitchHandle::freeze) stops the event
//!    loop between two iterations, without closing anything, and returns a
//!    [`FrozenSwitch`]: the connections as [`OwnedFd`]s and the
//!    state that refers to them by number. From then on nothing reads or
//!    writes those sockets until the thaw, so the only bytes in flight in
//!    userspace are the ones the state holds.
//! 2. Serialize [`FrozenSwitch::state`] (any serde format; byte strings are
//!    hex in human-readable ones) to a file.
//! 3. [`FrozenSwitch::keep_across_exec`] clears `FD_CLOEXEC` on the connections.
//!    Do it right before `exec`: a child spawned in between would inherit
//!    them too.
//! 4. `exec`, keeping the `FrozenSwitch` alive (an `exec` never returns on
//!    success, so its descriptors are never closed). If `exec` fails,
//!    [`FrozenSwitch::resume`] brings the switch back in the old image.
//!
//! In the new image: read the state and call
//! [`Switch::thaw`](crate::Switch::thaw), which checks that every
//! descriptor named in the state is open and is a connected unix stream
//! socket whose peer is bound to the port's path, takes ownership of them,
//! sets `FD_CLOEXEC` again and starts the event loop where the old one
//! stopped.
//!
//! # What the state carries
//!
//! Per port: id (ids stay the same), name, the peer's socket path, the
//! connection to the peer if the port had one (a port that was dialing is
//! thawed dialing), the holding flag, the counters, the tx queue (frames of
//! which no byte was written, head first), and for the connection:
//!
//! - `tx_partial`: the unwritten rest of a frame whose record was partly
//!   written (raw bytes, length prefix included if unwritten). The thawed
//!   switch writes it before anything else, also on a held port, so the
//!   peer's stream stays in sync; the frame is counted in `tx_frames` when
//!   its last byte is written.
//! - `rx_pending`: bytes read from the peer that are not yet a complete
//!   frame (the decoder's input). The thawed switch prepends them to what it
//!   reads next; without them the stream would be desynchronised.
//!
//! And the MAC table, the totals and the next port id. Frames in the
//! kernel's socket buffers (unread by either side) are untouched: the
//! descriptors survive. A QEMU that starts listening during the handover
//! is dialed after the thaw. [`SwitchConfig`] is not part of the state:
//! pass it to `thaw` again.
//!
//! Dropping a `FrozenSwitch` without thawing it closes every connection
//! (the QEMUs see EOF and wait for a new one; the socket files are QEMU's
//! and stay).

mod fds;
pub(crate) mod hex;

use std::collections::HashSet;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use socket2::SockRef;

use crate::core::{Counters, MacAddr, PortId};
use crate::error::{Result, SwitchError};
use crate::framing::{check_len, Decoder, HEADER_LEN, MAX_FRAME_LEN};
use crate::server::{self, SwitchConfig, SwitchHandle};

pub(crate) use fds::adopt_all;

/// Version of the [`FrozenState`] layout; [`Switch::thaw`](crate::Switch::thaw)
/// rejects any other.
///
/// Version 2: the switch dials its peers; ports have no listening socket
/// (version 1's `listener_fd` and `socket_file` are gone).
pub const FORMAT_VERSION: u32 = 2;

/// Everything a frozen switch needs to resume, with its connections referred
/// to by descriptor number. See the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrozenState {
    /// Layout version, [`FORMAT_VERSION`] when written by this crate.
    pub version: u32,
    /// Id the next added port gets (ids are never reused).
    pub next_port_id: u32,
    /// The ports, by increasing id.
    pub ports: Vec<FrozenPort>,
    /// The MAC table: where each learned address was last seen.
    pub macs: Vec<FrozenMac>,
    /// Counters summed over every port the switch ever had.
    pub totals: Counters,
}

/// One port of a [`FrozenState`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrozenPort {
    /// Port id, kept across the thaw.
    pub id: PortId,
    /// Port name.
    pub name: String,
    /// Path the port's peer (QEMU) listens on, which the switch dials.
    pub socket_path: PathBuf,
    /// Whether the port is held.
    pub holding: bool,
    /// Frames waiting for the port, none of their bytes written, head first.
    #[serde(with = "hex::seq")]
    pub queue: Vec<Vec<u8>>,
    /// The port's counters.
    pub counters: Counters,
    /// The connection to the peer; `None` if the port was dialing (it dials
    /// again once thawed).
    pub connection: Option<FrozenConnection>,
}

/// The connection of a [`FrozenPort`] to its peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrozenConnection {
    /// Descriptor of the connected socket (the switch's end).
    pub fd: RawFd,
    /// Bytes read from the peer that do not complete a frame yet.
    #[serde(with = "hex")]
    pub rx_pending: Vec<u8>,
    /// The rest of a partly written frame, to be written first.
    pub tx_partial: Option<PartialFrame>,
}

/// The unwritten rest of a frame record of which some bytes were written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialFrame {
    /// Raw bytes still to write (the end of the length prefix and frame).
    #[serde(with = "hex")]
    pub remainder: Vec<u8>,
    /// Length of the whole Ethernet frame, for the `tx_bytes` counter.
    pub frame_len: usize,
}

/// One entry of the MAC table of a [`FrozenState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrozenMac {
    /// The station address.
    pub mac: MacAddr,
    /// The port it was last seen on.
    pub port: PortId,
}

fn invalid(msg: String) -> SwitchError {
    SwitchError::InvalidFrozenState(msg)
}

impl FrozenState {
    /// Checks that the state is self-consistent (version, unique ids, names,
    /// paths and descriptor numbers, valid frame lengths, at most a partial
    /// frame pending on each side of a connection, MAC entries naming
    /// existing ports). Does not look at the descriptors themselves;
    /// [`Switch::thaw`](crate::Switch::thaw) does both.
    pub fn validate(&self) -> Result<()> {
        if self.version != FORMAT_VERSION {
            return Err(invalid(format!(
                "layout version {} (this build reads version {FORMAT_VERSION})",
                self.version
            )));
        }
        let (mut ids, mut names, mut paths, mut fds) = (
            HashSet::new(),
            HashSet::new(),
            HashSet::new(),
            HashSet::new(),
        );
        for p in &self.ports {
            let at = format!("port {:?} ({})", p.name, p.id);
            if p.id.as_u32() >= self.next_port_id {
                return Err(invalid(format!(
                    "{at}: id not below next_port_id {}",
                    self.next_port_id
                )));
            }
            crate::server::check_socket_path(&p.socket_path)
                .map_err(|e| invalid(format!("{at}: {e}")))?;
            if !ids.insert(p.id) || !names.insert(&p.name) || !paths.insert(&p.socket_path) {
                return Err(invalid(format!("{at}: id, name or socket path used twice")));
            }
            if let Some(fd) = p.connection.as_ref().map(|c| c.fd) {
                if !fds.insert(fd) {
                    return Err(invalid(format!("{at}: fd {fd} used twice")));
                }
            }
            for f in &p.queue {
                check_len(f.len(), MAX_FRAME_LEN)
                    .map_err(|e| invalid(format!("{at}: queued {e}")))?;
            }
            if let Some(c) = &p.connection {
                validate_connection(c).map_err(|e| invalid(format!("{at}: {e}")))?;
            }
        }
        let mut macs = HashSet::new();
        for m in &self.macs {
            if !ids.contains(&m.port) || !macs.insert(m.mac) {
                return Err(invalid(format!(
                    "MAC entry {} -> {}: unknown port or address listed twice",
                    m.mac, m.port
                )));
            }
        }
        Ok(())
    }

    /// Descriptors named in the state, in the order of
    /// [`FrozenSwitch::into_parts`]: the connections, by port.
    pub(crate) fn expected_fds(&self) -> Vec<fds::Expected<'_>> {
        self.ports
            .iter()
            .filter_map(|p| {
                let c = p.connection.as_ref()?;
                Some(fds::Expected {
                    fd: c.fd,
                    path: &p.socket_path,
                    role: format!("connection of port {:?} ({})", p.name, p.id),
                })
            })
            .collect()
    }
}

fn validate_connection(c: &FrozenConnection) -> std::result::Result<(), String> {
    if let Some(t) = &c.tx_partial {
        check_len(t.frame_len, MAX_FRAME_LEN).map_err(|e| format!("partly written {e}"))?;
        if t.remainder.is_empty() || t.remainder.len() > t.frame_len + HEADER_LEN {
            return Err(format!(
                "partly written frame of {} bytes with {} bytes left to write",
                t.frame_len,
                t.remainder.len()
            ));
        }
    }
    let mut decoder = Decoder::new();
    decoder.feed(&c.rx_pending);
    match decoder.next_frame() {
        Ok(None) => Ok(()),
        Ok(Some(_)) => {
            Err("rx_pending holds a complete frame (only a partial one can be pending)".into())
        }
        Err(e) => Err(format!(
            "rx_pending starts with an invalid length prefix: {e}"
        )),
    }
}

/// A switch stopped by [`SwitchHandle::freeze`]: its connections, still
/// open, and its state. See the [module docs](self) for the handover protocol.
#[derive(Debug)]
pub struct FrozenSwitch {
    state: FrozenState,
    /// In the order of [`FrozenState::expected_fds`].
    fds: Vec<OwnedFd>,
}

impl FrozenSwitch {
    pub(crate) fn new(state: FrozenState, fds: Vec<OwnedFd>) -> Self {
        debug_assert!(state
            .expected_fds()
            .iter()
            .map(|e| e.fd)
            .eq(fds.iter().map(|fd| fd.as_raw_fd())));
        FrozenSwitch { state, fds }
    }

    /// The state, to write to a file before `exec`.
    pub fn state(&self) -> &FrozenState {
        &self.state
    }

    /// Clears `FD_CLOEXEC` on every connection, so that they stay open across
    /// `exec`. Call it right before `exec`: any process spawned after it
    /// inherits them too.
    pub fn keep_across_exec(&self) -> Result<()> {
        for fd in &self.fds {
            SockRef::from(fd)
                .set_cloexec(false)
                .map_err(|source| SwitchError::KeepAcrossExec {
                    fd: fd.as_raw_fd(),
                    source,
                })?;
        }
        Ok(())
    }

    /// Splits into the state and the connections (by port, as numbered in
    /// the state). Dropping the sockets
    /// closes them; to pass them to [`Switch::thaw`](crate::Switch::thaw) in
    /// this process, give up ownership with `IntoRawFd::into_raw_fd`.
    pub fn into_parts(self) -> (FrozenState, Vec<OwnedFd>) {
        (self.state, self.fds)
    }

    /// Thaws the switch in this process (e.g. when `exec` failed). Sets
    /// `FD_CLOEXEC` again.
    pub fn resume(self, config: SwitchConfig) -> Result<SwitchHandle> {
        self.state.validate()?;
        server::spawn_thawed(self.state, self.fds, config)
    }
}

/// Makes thawed descriptors (in the order of `expected_fds`) private to
/// this process again and non-blocking.
pub(crate) fn prepare_adopted(fds: &[OwnedFd], state: &FrozenState) -> Result<()> {
    for (fd, e) in fds.iter().zip(state.expected_fds()) {
        let sock = SockRef::from(fd);
        sock.set_cloexec(true)
            .and_then(|()| sock.set_nonblocking(true))
            .map_err(|err| SwitchError::InheritedFd {
                fd: e.fd,
                role: e.role,
                problem: format!("cannot be made close-on-exec and non-blocking ({err})"),
            })?;
    }
    Ok(())
}
