//! Coordination of a cluster snapshot and of a cluster restore: the
//! coordinated non-blocking snapshot protocol of HotSnap and the restore
//! protocol of HotRestore (module [`restore`]), hardened for lossy networks
//! and failing nodes.
//!
//! # Overview
//!
//! A cluster snapshot is taken by one **initiator** (in vmcsnap the agent's
//! cluster snapshot manager, a node of its own) and one **peer** per VM
//! (the [`NodeId`] of a peer is the VM's name). The initiator sends
//! `SNAPSHOT` to every peer; each peer takes its *transient snapshot* (the
//! VM is paused for a few milliseconds: device state saved, memory
//! write-protected, VM resumed), answers `TRANSIENT_SNAP_FIN` and colors its
//! packets "post". Once every peer has answered, the initiator broadcasts
//! `ALL_TRANSIENT_SNAP_FIN` (coloring ends); each peer then finishes its
//! *full snapshot* (memory copied in the background) and answers
//! `FULL_SNAP_FIN`; once every peer has answered, the initiator broadcasts
//! `ALL_FULL_SNAP_FIN`: the cluster snapshot is complete.
//!
//! Beyond the paper the protocol handles message loss (every handler is
//! idempotent, FINs are retransmitted until acknowledged), failing peers
//! (`FAILED`, or silence past a deadline, makes the initiator broadcast
//! `ABORT`; peers then discard their snapshot and their VM keeps running)
//! and epochs (every message carries one; messages of another epoch are
//! ignored and counted). `docs/cluster-protocol.md` has the state tables.
//!
//! # Module layout
//!
//! - [`transport`]: the [`Transport`](transport::Transport) trait a driver
//!   sends through, the [`Envelope`](transport::Envelope) every message
//!   travels in, and [`InProcessNetwork`](transport::InProcessNetwork), an
//!   in-process network with fault injection (used by tests and by an agent
//!   whose VMs all live on one host).
//! - [`snapshot`]: the snapshot protocol.
//!   - [`Msg`](snapshot::Msg): the messages (serde, one JSON object per line).
//!   - [`Initiator`](snapshot::Initiator) and [`Peer`](snapshot::Peer): sans-IO
//!     state machines. They take inputs with the current [`Instant`](std::time::Instant)
//!     and return what to send / do; they never sleep, spawn or touch a socket.
//!   - [`run_initiator`](snapshot::run_initiator) and
//!     [`run_peer`](snapshot::run_peer): blocking drivers that connect a state
//!     machine to a transport, an inbox channel and (for a peer) a
//!     [`PeerWorker`](snapshot::PeerWorker) that does the real work.
//! - [`restore`]: HotRestore's cluster-restore protocol, built the same way:
//!   a [`Coordinator`](restore::Coordinator) whose Checker starts each VM
//!   after the VMs it sends to (the restore line), one
//!   [`Cohort`](restore::Cohort) per VM, and the drivers
//!   [`run_coordinator`](restore::run_coordinator) and
//!   [`run_cohort`](restore::run_cohort).
//!
//! # Example
//!
//! ```
//! use std::sync::mpsc;
//! use std::thread;
//! use vmcsnap_coord::snapshot::*;
//! use vmcsnap_coord::transport::*;
//!
//! // A worker whose "snapshots" finish at once.
//! struct Quick(mpsc::Sender<PeerInput>);
//! impl PeerWorker for Quick {
//!     fn start_snapshot(&mut self) {
//!         self.0.send(PeerInput::TransientDone).unwrap();
//!         self.0.send(PeerInput::FullDone).unwrap();
//!     }
//!     fn end_coloring(&mut self) {}
//!     fn complete(&mut self) {}
//!     fn abandon(&mut self, _reason: &str) {}
//! }
//!
//! let net = InProcessNetwork::<Msg>::new();
//! let (itx, irx) = mpsc::channel();
//! let init_ep = net.join("manager", move |e| { let _ = itx.send(e); });
//! let (ptx, prx) = mpsc::channel();
//! let ptx2 = ptx.clone();
//! let peer_ep = net.join("vm1", move |e| { let _ = ptx2.send(PeerInput::Message(e)); });
//!
//! let t = Timeouts { retry: std::time::Duration::from_millis(10), ..Timeouts::default() };
//! let peer = Peer::new(1, "vm1".into(), "manager".into(), t.clone());
//! let h = thread::spawn(move || run_peer(peer, &peer_ep, &prx, &mut Quick(ptx)));
//! let mut init = Initiator::new(1, "manager".into(), vec!["vm1".into()], t);
//! let outcome = run_initiator(&mut init, &init_ep, &irx, &mut |_ev| {});
//! assert_eq!(outcome, InitiatorOutcome::Completed);
//! assert_eq!(h.join().unwrap(), PeerOutcome::Completed);
//! ```
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod fin_timers;
mod inbox;
pub mod restore;
pub mod snapshot;
pub mod testing;
pub mod transport;

/// The name of a node: a VM's name for a peer, any unique name for the
/// initiator.
pub type NodeId = String;

#[cfg(test)]
mod tests_fuzz;
