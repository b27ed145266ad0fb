//! The running switch: an event-loop thread and the handle that controls it.
//!
//! [`Switch::start`] creates a `mio::Poll` and spawns one thread that owns
//! every socket and the [`SwitchCore`](crate::core::SwitchCore). Each port's
//! peer (QEMU) listens at the port's socket path; the thread connects to
//! it, at most once at a time, and connects again whenever the connection
//! is gone ([`SwitchHandle::add_port`]). A
//! [`SwitchHandle`] sends commands to it over a channel and wakes it with a
//! `mio::Waker`; each command carries a reply channel, so every handle call
//! returns once the loop has carried it out.
//!
//! All sockets are non-blocking and the loop never waits on a single peer:
//! a peer that stops reading (a paused VM) only fills its own port's queue,
//! up to [`SwitchConfig::max_queue_bytes`], after which frames for it are
//! dropped and counted.
//!
//! [`SwitchHandle::freeze`] ends the loop without closing a socket, and
//! [`Switch::thaw`] starts one from the frozen state, possibly in a new
//! process image (see [`crate::handover`]).

mod conn;
mod cut;
mod dhcp;
mod event_loop;
mod link;
mod peer;
mod settle;
mod tunnel;

pub use link::ConnectionState;
pub use settle::SettleReport;
pub use tunnel::{TunnelConfig, MAX_UDP_PAYLOAD, TUNNEL_KEEPALIVE, TUNNEL_PEER_ALIVE_MS};

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use mio::{Poll, Waker};

use crate::core::{PortId, DEFAULT_MAX_MACS};
use crate::error::{Result, SwitchError};
use crate::handover::{self, FrozenState, FrozenSwitch};
use crate::mediator::{CutReport, PrepareReport, SessionLog, SessionStats, DEFAULT_MAX_LOG_BYTES};
use crate::stats::SwitchStats;
use event_loop::{EventLoop, WAKER};
pub(crate) use peer::check_path as check_socket_path;

/// See [`SwitchHandle::drain_state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrainState {
    /// Whether the switch holds a connection to the port's peer.
    pub connected: bool,
    /// Bytes of a partly written frame still to write (0 when none).
    pub partial_bytes: usize,
    /// Kernel buffer memory of what the peer has not read yet (SIOCOUTQ:
    /// allocation size, not payload bytes; zero exactly when all was read).
    pub unread_bytes: usize,
}

impl DrainState {
    /// Nothing is on its way to the peer.
    pub fn is_drained(&self) -> bool {
        self.partial_bytes == 0 && self.unread_bytes == 0
    }
}

/// What [`SwitchHandle::inject`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct InjectReport {
    /// Frames queued for the port (held ones included).
    pub queued: u64,
    /// Frames dropped (the port's queue was full, or it was neither
    /// connected nor held).
    pub dropped: u64,
}

/// Default bound of each port's tx queue: 16 MiB of frame bytes.
pub const DEFAULT_MAX_QUEUE_BYTES: usize = 16 << 20;

/// Tunables of a switch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchConfig {
    /// Most frame bytes queued for one port; a frame that would exceed it is
    /// dropped and counted in that port's `drops`. On top of it, up to one
    /// write batch (256 KiB plus one frame) may be waiting in the port's
    /// connection. Keep it well above 256 KiB: frames read from one peer
    /// in one go (up to 256 KiB) are queued before any is written.
    pub max_queue_bytes: usize,
    /// Most MAC addresses learned; unknown addresses beyond it are flooded.
    pub max_macs: usize,
    /// Most frame bytes a cut session logs (see [`crate::mediator`]);
    /// frames beyond it are delivered unlogged and counted in
    /// [`SessionStats::log_overflow`].
    pub max_log_bytes: usize,
    /// Capture every frame of every port into `<dir>/<port name>.pcapng`
    /// (see [`crate::pcap`]); `None` (default): no capture.
    pub capture_dir: Option<PathBuf>,
    /// Answer DHCP for the cluster subnet with static leases registered per
    /// port ([`SwitchHandle::set_dhcp_lease`]); `None` (default): DHCP
    /// frames are switched like any other. See [`crate::dhcp`].
    pub dhcp: Option<crate::dhcp::DhcpConfig>,
}

impl Default for SwitchConfig {
    fn default() -> Self {
        SwitchConfig {
            max_queue_bytes: DEFAULT_MAX_QUEUE_BYTES,
            max_macs: DEFAULT_MAX_MACS,
            max_log_bytes: DEFAULT_MAX_LOG_BYTES,
            capture_dir: None,
            dhcp: None,
        }
    }
}

/// Entry point: starts switches.
#[derive(Debug)]
pub struct Switch;

impl Switch {
    /// Starts a switch with the default [`SwitchConfig`].
    pub fn start() -> Result<SwitchHandle> {
        Self::start_with(SwitchConfig::default())
    }

    /// Starts a switch: spawns its event-loop thread and returns a handle.
    pub fn start_with(config: SwitchConfig) -> Result<SwitchHandle> {
        dhcp::validate(&config)?;
        spawn(|poll, rx| Ok(EventLoop::new(poll, rx, &config)))
    }

    /// Rebuilds, in a new process image, a switch frozen by
    /// [`SwitchHandle::freeze`] before `exec`, from its state and the
    /// descriptors it names (inherited across `exec`), and starts it where
    /// it stopped. See [`handover`](crate::handover#protocol) for the protocol.
    ///
    /// First the state is validated ([`FrozenState::validate`]) and every
    /// descriptor is checked: it must be open, a connected (not listening)
    /// unix stream socket, and its peer bound to the port's socket path. If anything is wrong this returns
    /// [`SwitchError::InvalidFrozenState`] or [`SwitchError::InheritedFd`]
    /// and has taken and closed nothing. Otherwise the switch takes
    /// ownership of the descriptors (an error from then on, such as
    /// [`SwitchError::Start`], closes them) and sets `FD_CLOEXEC` on them.
    ///
    /// The descriptors must be the ones the frozen switch left, owned by
    /// nothing else in this process: the switch will close them (on
    /// `remove_port`, `stop`, or when a connection ends), so a number that
    /// some other object owns would be closed twice. Ports frozen without a
    /// connection dial their peer again at once.
    pub fn thaw(state: FrozenState, config: SwitchConfig) -> Result<SwitchHandle> {
        dhcp::validate(&config)?;
        state.validate()?;
        let fds = handover::adopt_all(&state.expected_fds())?;
        spawn_thawed(state, fds, config)
    }
}

/// Starts the event loop of a thawed switch; `fds` are in the order of
/// `FrozenState::expected_fds` and owned by the new switch.
pub(crate) fn spawn_thawed(
    state: FrozenState,
    fds: Vec<OwnedFd>,
    config: SwitchConfig,
) -> Result<SwitchHandle> {
    handover::prepare_adopted(&fds, &state)?;
    spawn(|poll, rx| EventLoop::thaw(poll, rx, &config, state, fds))
}

/// Creates the poll, waker and command channel, builds the event loop with
/// `make` and spawns its thread.
fn spawn(make: impl FnOnce(Poll, Receiver<Command>) -> Result<EventLoop>) -> Result<SwitchHandle> {
    let poll = Poll::new().map_err(SwitchError::Start)?;
    let waker = Waker::new(poll.registry(), WAKER).map_err(SwitchError::Start)?;
    let (commands, rx) = mpsc::channel();
    let event_loop = make(poll, rx)?;
    let thread = std::thread::Builder::new()
        .name("vmcsnap-switch".into())
        .spawn(move || event_loop.run())
        .map_err(SwitchError::Start)?;
    let inner = Inner {
        commands,
        waker,
        thread: Mutex::new(Some(thread)),
    };
    Ok(SwitchHandle {
        inner: Arc::new(inner),
    })
}

pub(crate) enum Command {
    AddPort {
        name: String,
        path: PathBuf,
        reply: Sender<Result<PortId>>,
    },
    AddTunnel {
        config: TunnelConfig,
        reply: Sender<Result<PortId>>,
    },
    RemovePort {
        port: PortId,
        reply: Sender<Result<()>>,
    },
    Hold {
        port: PortId,
        reply: Sender<Result<()>>,
    },
    Release {
        port: PortId,
        reply: Sender<Result<()>>,
    },
    Stats {
        reply: Sender<SwitchStats>,
    },
    Inject {
        port: PortId,
        frames: Vec<Vec<u8>>,
        reply: Sender<Result<InjectReport>>,
    },
    Drain {
        port: PortId,
        reply: Sender<Result<DrainState>>,
    },
    Connection {
        port: PortId,
        reply: Sender<Result<ConnectionState>>,
    },
    Freeze {
        reply: Sender<Result<FrozenSwitch>>,
    },
    BeginCutSession {
        epoch: u64,
        ports: Vec<PortId>,
        triggers: Sender<PortId>,
        reply: Sender<Result<()>>,
    },
    PrepareCut {
        port: PortId,
        reply: Sender<Result<()>>,
    },
    Probe {
        port: PortId,
        reply: Sender<Result<bool>>,
    },
    PrepareDone {
        port: PortId,
        report: PrepareReport,
        reply: Sender<Result<()>>,
    },
    Cut {
        port: PortId,
        reply: Sender<Result<CutReport>>,
    },
    SessionStats {
        reply: Sender<Option<SessionStats>>,
    },
    EndCutSession {
        reply: Sender<Result<SessionLog>>,
    },
    AbortCutSession {
        reply: Sender<Result<SessionStats>>,
    },
    /// See [`SwitchHandle::set_dhcp_lease`] (in `server/dhcp.rs`).
    DhcpLease(dhcp::LeaseCommand),
    Stop,
}

struct Inner {
    commands: Sender<Command>,
    waker: Waker,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Inner {
    fn stop(&self) {
        // The lock is held until the join ends, so a concurrent stop() also
        // returns only once the loop is gone.
        let mut guard = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        let Some(thread) = guard.take() else { return };
        if self.commands.send(Command::Stop).is_ok() {
            if let Err(e) = self.waker.wake() {
                log::error!("cannot wake the switch event loop to stop it: {e}");
                return; // joining could hang forever
            }
        }
        if thread.join().is_err() {
            log::error!("the switch event loop panicked");
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Controls a running switch. Cheap to clone; usable from any thread.
///
/// Dropping the last handle stops the switch like [`stop`](Self::stop).
#[derive(Clone)]
pub struct SwitchHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SwitchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwitchHandle").finish_non_exhaustive()
    }
}

impl SwitchHandle {
    fn request<T>(&self, make: impl FnOnce(Sender<T>) -> Command) -> Result<T> {
        let (reply, rx) = mpsc::channel();
        self.inner
            .commands
            .send(make(reply))
            .map_err(|_| SwitchError::Stopped)?;
        self.inner.waker.wake().map_err(|_| SwitchError::Stopped)?;
        rx.recv().map_err(|_| SwitchError::Stopped)
    }

    /// Adds a port whose peer, a QEMU
    /// `-netdev stream,server=on,addr.type=unix,addr.path=<socket_path>`,
    /// listens at `socket_path`: the switch connects to it.
    ///
    /// The switch never binds, changes or unlinks the path: the file is
    /// QEMU's. It connects right away, and while the port has no connection
    /// (nobody listens there yet, the QEMU is gone, or the connection
    /// ended) it tries again every 20 ms, forever, with at most one
    /// connection per port at any time. A restarted QEMU, which re-binds the
    /// same path, is thus connected again on its own; each successful
    /// connect counts in the port's `connections`. If a peer already listens
    /// at the path, the port is connected when this returns.
    ///
    /// A connection counts as connected once the kernel put it in QEMU's
    /// listen backlog: QEMU accepts it when it has no other client (QEMU
    /// serves one connection at a time), and reads what was written to it
    /// then. See [`connection_state`](Self::connection_state) to wait for
    /// a port to be connected.
    ///
    /// Fails with [`SwitchError::InvalidSocketPath`] or
    /// [`SwitchError::SocketPathTooLong`] for a path that cannot be a unix
    /// socket address, [`SwitchError::DuplicateName`] for a name already
    /// used, and [`SwitchError::DuplicatePath`] for a path (or another
    /// spelling of an existing socket file) another port dials.
    pub fn add_port(&self, name: &str, socket_path: &Path) -> Result<PortId> {
        let (name, path) = (name.to_owned(), socket_path.to_owned());
        self.request(|reply| Command::AddPort { name, path, reply })?
    }

    /// Removes a port: closes its connection (its peer sees EOF), stops
    /// dialing and discards its queue. The socket file is left alone (it is
    /// QEMU's).
    pub fn remove_port(&self, port: PortId) -> Result<()> {
        self.request(|reply| Command::RemovePort { port, reply })?
    }

    /// What is still on its way to a port's peer: the unwritten rest of a
    /// partly written frame, and bytes written to the socket that the peer
    /// has not read yet (`SIOCOUTQ` on the switch's end). Both are zero
    /// exactly when the peer has read everything the switch sent it over
    /// the current connection: hold the port, then wait for this before
    /// pausing or replacing its VM. A port without a connection (dialing)
    /// reports all zero and `connected: false`.
    pub fn drain_state(&self, port: PortId) -> Result<DrainState> {
        self.request(|reply| Command::Drain { port, reply })?
    }

    /// Holds a port: frames for it are queued (counted in `held`) and not
    /// written until [`release`](Self::release). A frame already partly
    /// written when the hold starts is completed, so the stream stays valid.
    /// Holding a held port does nothing.
    pub fn hold(&self, port: PortId) -> Result<()> {
        self.request(|reply| Command::Hold { port, reply })?
    }

    /// Releases a held port: its queued frames are written in order. If the
    /// port has no connection at that moment (its QEMU is gone or not
    /// listening yet, the switch is still dialing), they are dropped and
    /// counted in `drops`: to carry held frames over a QEMU restart, wait
    /// until the port is connected to the new QEMU
    /// ([`wait_connected`](Self::wait_connected)) before releasing it.
    ///
    /// During a cut session, releasing a port that is not cut yet while
    /// frames sent after another VM's cut are queued for it fails with
    /// [`SwitchError::HeldByCutSession`] (the port stays held).
    pub fn release(&self, port: PortId) -> Result<()> {
        self.request(|reply| Command::Release { port, reply })?
    }

    /// Queues `frames` (Ethernet frames) for the port's peer, after what
    /// is already queued, as if another port had sent them; counted like
    /// switched frames (a full queue, or a port neither connected nor held,
    /// drops them, counted). Used to replay the frames a cluster snapshot logged
    /// in flight to the VM they were going to.
    pub fn inject(&self, port: PortId, frames: Vec<Vec<u8>>) -> Result<InjectReport> {
        self.request(|reply| Command::Inject {
            port,
            frames,
            reply,
        })?
    }

    /// Snapshot of every port's state and counters.
    pub fn stats(&self) -> Result<SwitchStats> {
        self.request(|reply| Command::Stats { reply })
    }

    /// Stops the event loop without closing any connection, and returns the
    /// connections and everything needed to resume
    /// ([`FrozenSwitch`]), to hand the switch over to a new process image
    /// (see [`handover`](crate::handover#protocol)) or to [`FrozenSwitch::resume`] it.
    ///
    /// The loop stops between two iterations: every frame it has read is in
    /// the state (queued, or as a partial input), and a partly written frame
    /// is captured as its unwritten remainder. Once this returns, nothing
    /// reads or writes the connections, and nothing dials; a port that was
    /// dialing is frozen without a connection and dials again once thawed. Later calls on any handle of this switch
    /// return [`SwitchError::Stopped`].
    ///
    /// Fails with [`SwitchError::FreezeDuringCutSession`] (and the switch
    /// keeps running) while a cut session is active: session state is not
    /// part of the frozen state.
    pub fn freeze(&self) -> Result<FrozenSwitch> {
        let frozen = self.request(|reply| Command::Freeze { reply })??;
        self.inner.stop(); // joins the loop thread, which has already left its loop
        Ok(frozen)
    }

    /// Stops the switch: closes every connection (the peers see EOF and
    /// wait for a new one) and joins the event-loop thread; no file is
    /// touched. Later calls
    /// on any handle of this switch return [`SwitchError::Stopped`]. Calling
    /// it again does nothing.
    pub fn stop(&self) {
        self.inner.stop();
    }
}
