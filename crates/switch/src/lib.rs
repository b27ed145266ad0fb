//! The virtual Ethernet switch of vmcsnap.
//!
//! Every VM NIC is a QEMU `-netdev stream,server=off,addr.type=unix,addr.path=<sock>`
//! client connecting to one listening unix socket of the switch (one socket
//! per port). Frames travel as a 4-byte big-endian length followed by the
//! Ethernet frame ([`framing`]).
//!
//! # Design
//!
//! The switch is the one place every frame between VMs passes, so that later
//! features (packet coloring, holding a VM's traffic during its snapshot,
//! logging and replaying in-flight frames) can be added in one spot. It is
//! split in three layers:
//!
//! - [`framing`]: an incremental decoder and an encoder of the wire format.
//! - [`core`]: [`SwitchCore`], a pure state machine without I/O. It learns
//!   source MACs, makes the forwarding decision ([`SwitchCore::route`]),
//!   keeps a bounded tx queue per port (which is what makes holding a port
//!   natural: a held port's queue simply is not drained) and all counters.
//!   It is unit-tested without sockets.
//! - [`server`]: one event-loop thread (mio, non-blocking sockets) that owns
//!   the listening and client sockets, feeds received frames to the core and
//!   drains each port's queue into its socket as far as the socket takes
//!   without blocking. It never blocks on a write: a paused VM whose QEMU
//!   stops reading only fills its own queue. [`SwitchHandle`] controls it
//!   from other threads.
//!
//! Beside them, [`handover`] freezes the running switch
//! ([`SwitchHandle::freeze`]) and thaws it in a new process image after the
//! agent `execve`s itself ([`Switch::thaw`]), keeping every connection and
//! every frame.
//!
//! A QEMU client connects once and never reconnects; a new QEMU process for
//! the same VM (restart, restore) connects again to the same socket, and the
//! new connection replaces the old one (frames queued for the port go to the
//! new connection).
//!
//! # Example
//!
//! ```no_run
//! use std::path::Path;
//! let switch = vmcsnap_switch::Switch::start()?;
//! let vm1 = switch.add_port("vm1", Path::new("/run/vmcsnap/vm1.sock"))?;
//! switch.hold(vm1)?; // while vm1 is snapshotted
//! switch.release(vm1)?;
//! println!("{:?}", switch.stats()?);
//! switch.stop();
//! # Ok::<(), vmcsnap_switch::SwitchError>(())
//! ```

// Only `sockq` (one ioctl) and `handover::fds` (adopting inherited
// descriptors) need unsafe; they allow it locally.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod core;
pub mod error;
pub mod framing;
pub mod handover;
pub mod server;
mod sockq;
pub mod stats;

pub use crate::core::{Counters, Decision, MacAddr, PortId, SwitchCore};
pub use error::{SwitchError, MAX_SOCKET_PATH_LEN};
pub use framing::MAX_FRAME_LEN;
pub use handover::{FrozenState, FrozenSwitch};
pub use server::{DrainState, Switch, SwitchConfig, SwitchHandle, DEFAULT_MAX_QUEUE_BYTES};
pub use stats::{PortStats, SwitchStats};
