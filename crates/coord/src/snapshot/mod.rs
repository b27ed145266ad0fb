//! The cluster-snapshot protocol: messages, the initiator's and the peer's
//! state machines, and blocking drivers for both.
//!
//! The state machines ([`Initiator`], [`Peer`]) are sans-IO: they take an
//! input and the current [`Instant`](std::time::Instant) and return what to
//! send or do, and tell when they next need a tick
//! ([`Initiator::next_wakeup`], [`Peer::next_wakeup`]). They can be tested
//! and driven without threads. [`run_initiator`] and [`run_peer`] drive them
//! with a [`Transport`](crate::transport::Transport) and an inbox channel.
//!
//! The rules, in short (details on each type and in
//! `docs/cluster-protocol.md`):
//!
//! - Every handler is idempotent; duplicates are answered, never acted on twice.
//! - The initiator re-sends `SNAPSHOT` every `retry` to peers missing
//!   `TRANSIENT_SNAP_FIN`; peers re-send their FINs every `retry` until the
//!   matching `ALL_*` (or `ABORT`) arrives; the initiator re-sends an `ALL_*`
//!   to a peer when it gets that peer's FIN again.
//! - The initiator aborts when a peer reports `FAILED` or when a deadline
//!   passes; peers abandon on `ABORT` (ignored after `Complete`).
//! - Messages of another epoch are ignored and counted.

mod driver;
mod initiator;
mod msg;
mod peer;

pub use driver::{run_initiator, run_peer, InitiatorOutcome, PeerInput, PeerOutcome, PeerWorker};
pub use initiator::{Initiator, InitiatorEvent, InitiatorEventKind, InitiatorState};
pub use msg::{Ignored, Msg, MsgError, Timeouts};
pub use peer::{Peer, PeerAction, PeerState};
