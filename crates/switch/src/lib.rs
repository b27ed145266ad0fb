//! The virtual Ethernet switch of vmcsnap.
//!
//! Every VM NIC is a QEMU
//! `-netdev stream,server=on,addr.type=unix,addr.path=<sock>`: QEMU listens
//! on one unix socket per VM, and the switch connects to it as a client,
//! one connection per port ([`SwitchHandle::add_port`]). Frames travel as a
//! 4-byte big-endian length followed by the Ethernet frame ([`framing`]).
//!
//! # Who listens, who dials
//!
//! QEMU is the server because a QEMU 7.2 stream *client* never reconnects:
//! if the switch's process died, every VM would lose its network for good.
//! A `server=on` netdev instead accepts a new connection whenever the
//! previous one closed. So the switch dials, and dials again whenever a
//! port has no connection, every 20 ms, forever:
//!
//! - a switch killed outright (its agent `kill -9`ed) leaves its QEMUs
//!   listening; a new switch that adds the same ports is connected to them
//!   again (frames the old switch held are lost);
//! - a restarted QEMU (warm rejuvenation, a restore into a fresh QEMU)
//!   unlinks and re-binds the same path; the switch sees the old
//!   connection's EOF and connects to the new QEMU on its own;
//! - the switch holds at most one connection per port: QEMU serves one
//!   client at a time and leaves any other in its listen backlog.
//!
//! The socket files are QEMU's: the switch never binds, changes or unlinks
//! them. A port's `connected` state and `connections` counter
//! ([`SwitchHandle::connection_state`], [`SwitchHandle::wait_connected`],
//! [`PortStats`]) tell when a new QEMU is connected. While a port has no
//! connection, frames for it are dropped and counted (unless it is held:
//! then they are queued, see [`core`] for the queue policy).
//!
//! # Design
//!
//! The switch is the one place every frame between VMs passes, so holding
//! a VM's traffic during its snapshot, coloring frames and logging the
//! channel state of a cluster snapshot all happen here. It is split in
//! layers:
//!
//! - [`framing`]: an incremental decoder and an encoder of the wire format.
//! - [`core`]: [`SwitchCore`], a pure state machine without I/O. It learns
//!   source MACs, makes the forwarding decision ([`SwitchCore::route`]),
//!   keeps a bounded tx queue per port (which is what makes holding a port
//!   natural: a held port's queue simply is not drained) and all counters.
//!   Queue entries carry a tag (sender, color, reception time). It has no
//!   clock: the event loop passes the time in. It is unit-tested without
//!   sockets.
//! - [`mediator`]: the packet mediator for consistent cluster snapshots
//!   (HotSnap-style coloring, log and resend). During a *cut session* each
//!   VM's port is pre or post its cut; the core holds a pre port that would
//!   get a post frame (and reports it, so the agent snapshots that VM at
//!   once), and logs each pre frame handed to a post port as channel state.
//!   The module holds the session types and pure rules; the core applies
//!   them when it queues and dequeues frames.
//! - [`server`]: one event-loop thread (mio, non-blocking sockets) that owns
//!   the connections to the peers (and dials the ports that have none),
//!   feeds received frames to the core and drains each port's queue into
//!   its socket as far as the socket takes without blocking. It never blocks on a write: a paused VM whose QEMU
//!   stops reading only fills its own queue. [`SwitchHandle`] controls it
//!   from other threads, including the cut protocol
//!   ([`SwitchHandle::begin_cut_session`], [`prepare_cut`](SwitchHandle::prepare_cut),
//!   [`cut`](SwitchHandle::cut), [`release`](SwitchHandle::release),
//!   [`end_cut_session`](SwitchHandle::end_cut_session)).
//!
//! - [`dhcp`]: a DHCPv4 server with static leases (one per VM), answering
//!   guests that configure their NIC by DHCP ([`SwitchConfig::dhcp`],
//!   [`SwitchHandle::set_dhcp_lease`]).
//!
//! - [`pcap`]: optional packet capture, one pcapng file per port
//!   ([`SwitchConfig::capture_dir`]).
//!
//! - [`tunnel`]: the datagram format of a tunnel to another host's
//!   switch. [`SwitchHandle::add_tunnel`] makes that switch one more port
//!   (one UDP datagram per frame); frames from it take the color their
//!   header carries, so the mediator's rules hold across hosts.
//!
//! Beside them, [`handover`] freezes the running switch
//! ([`SwitchHandle::freeze`]) and thaws it in a new process image after the
//! agent `execve`s itself ([`Switch::thaw`]), keeping every connection and
//! every frame; a port that was dialing at the freeze dials again after the
//! thaw.
//!
//! When a connection ends, half a frame read from it is discarded (a new
//! connection starts a fresh stream, on QEMU's side too), a frame partly
//! written to it is lost and counted in `drops`, and frames queued for the
//! port stay queued only if it is held.
//!
//! # Example
//!
//! ```no_run
//! use std::path::Path;
//! let switch = vmcsnap_switch::Switch::start()?;
//! // QEMU: -netdev stream,id=net0,server=on,addr.type=unix,addr.path=/run/vmcsnap/vm1.sock
//! let vm1 = switch.add_port("vm1", Path::new("/run/vmcsnap/vm1.sock"))?;
//! let state = switch.wait_connected(vm1, 1, std::time::Duration::from_secs(5))?;
//! assert!(state.connected);
//! switch.hold(vm1)?; // while vm1 is snapshotted
//! switch.release(vm1)?;
//! println!("{:?}", switch.stats()?);
//! switch.stop();
//! # Ok::<(), vmcsnap_switch::SwitchError>(())
//! ```
//!
//! A cluster snapshot (see [`mediator`] for the rules):
//!
//! ```no_run
//! # use std::{path::Path, time::Duration};
//! # let switch = vmcsnap_switch::Switch::start()?;
//! # let vms = [switch.add_port("vm1", Path::new("/run/vmcsnap/vm1.sock"))?];
//! let (tx, triggers) = std::sync::mpsc::channel();
//! switch.begin_cut_session(1, &vms, tx)?;
//! for &vm in &vms { // in any order; a port on `triggers` goes next
//!     let prep = switch.prepare_cut(vm, Duration::from_millis(50))?;
//!     // QMP stop
//!     let cut = switch.cut(vm)?;
//!     // transient snapshot, QMP cont
//!     switch.release(vm)?;
//! }
//! // wait (bounded) for session_stats().pending_pre_frames == 0
//! let log = switch.end_cut_session()?; // the channel state, to store with the snapshot
//! # Ok::<(), vmcsnap_switch::SwitchError>(())
//! ```

// Only `sockq` (one ioctl) and `handover::fds` (adopting inherited
// descriptors) need unsafe; they allow it locally.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod core;
pub mod dhcp;
pub mod error;
pub mod framing;
pub mod handover;
pub mod mediator;
pub mod pcap;
pub mod server;
mod sockq;
pub mod stats;
pub mod testing;
#[cfg(test)]
mod testing_tests;
pub mod tunnel;

pub use crate::core::{Counters, Decision, MacAddr, PortId, QueuedFrame, SwitchCore};
pub use dhcp::{DhcpConfig, DhcpError, DhcpLease};
pub use error::{SwitchError, MAX_SOCKET_PATH_LEN};
pub use framing::MAX_FRAME_LEN;
pub use handover::{FrozenState, FrozenSwitch};
pub use mediator::{
    Color, CutReport, LogReason, LoggedFrame, PairCount, PrepareReport, SessionLog, SessionPort,
    SessionStats, DEFAULT_MAX_LOG_BYTES,
};
pub use server::{
    ConnectionState, DrainState, InjectReport, SettleReport, Switch, SwitchConfig, SwitchHandle,
    TunnelConfig, DEFAULT_MAX_QUEUE_BYTES,
};
pub use stats::{PeerCut, PortStats, RefusedCounts, SwitchStats, TunnelCounters, TunnelPortStats};
