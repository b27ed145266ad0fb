//! The packet mediator: consistent snapshots of a whole VM cluster
//! (HotSnap-style packet coloring, log and resend).
//!
//! A cluster snapshot cuts each VM at a moment of its own: its pause. For
//! the set of per-VM snapshots to be a consistent cut of the cluster, no VM
//! may have received a frame that its sender sent after the sender's cut
//! (such a frame would be an effect without its cause), and every frame sent
//! before its sender's cut but received after its receiver's cut (the
//! *channel state*) must be recorded, so that a restore can hand it to the
//! receiver again. The switch sees every frame between VMs, so it enforces
//! both.
//!
//! # Sessions and colors
//!
//! A *cut session* ([`SwitchHandle::begin_cut_session`](crate::SwitchHandle::begin_cut_session))
//! has an epoch and a set of ports. Each port of the session is **pre** (not
//! cut yet) or **post** (cut); ports not in the session are *outside*. Every
//! frame is tagged, when the switch receives it, with the color its sender
//! has at that moment (outside senders give untagged frames, which never
//! trigger anything nor are logged). Frames already queued when the session
//! begins count as pre-tagged if their sender is in the session: they were
//! sent before any cut.
//!
//! 1. **No post frame reaches a pre port.** When a post-tagged frame is
//!    queued for a pre port (unicast or flood copy), the switch holds that
//!    port (an *auto hold*: queue order is kept, so earlier frames wait too)
//!    and reports the port, once per session, on the session's `triggers`
//!    channel: the agent then snapshots that VM at once.
//! 2. **Channel state is logged.** A pre-tagged frame handed to a post port
//!    (taken from its queue for writing) is recorded in the session log, and
//!    delivered as usual. Its [`LogReason`] is [`HeldAtCut`](LogReason::HeldAtCut)
//!    if it was already queued when the receiver was cut, else
//!    [`InFlight`](LogReason::InFlight). The decision is made when the frame
//!    is taken from the queue, so only frames really handed over count; a
//!    frame taken back into the queue (a hold, a replaced connection) leaves
//!    the log again until it is handed over for good.
//! 3. **Check.** A post-tagged frame handed to a pre port is counted as a
//!    `violation`. Rule 1 makes this impossible; the counter must stay 0.
//!
//! # One cut
//!
//! ```text
//!  agent                      switch, port B                       VM B
//!  ─────                      ──────────────                       ────
//!  prepare_cut(B, bound) ──▶  hold B (a partly written frame        reads what
//!                             completes); poll until SIOCOUTQ == 0  was written
//!                             (B read everything), then until B     to it, hands
//!                             read two cut probes in turn (B's      it to the
//!                             QEMU handed everything to the guest,  guest
//!                             see [`probe`]); at most `bound`
//!  QMP stop ──────────────────────────────────────────────────────▶ paused
//!  cut(B) ───────────────▶    read all B already wrote: pre frames
//!                             B := post ................ the cut ..........
//!  transient snapshot of B, then cont ────────────────────────────▶ runs again
//!                             frames B sends now are post
//!  release(B) ───────────▶    B's queue goes out; pre-tagged frames
//!                             in it are logged (held-at-cut), and so
//!                             are pre frames queued later (in-flight)
//! ```
//!
//! If B's socket holds half a frame at the cut, that frame was sent before
//! the pause: it is still tagged pre when it completes, and B's frames turn
//! post right after it.
//!
//! The session ends with [`end_cut_session`](crate::SwitchHandle::end_cut_session),
//! which returns the [`SessionLog`] and releases every hold the session made
//! (prepare holds and auto holds), or with
//! [`abort_cut_session`](crate::SwitchHandle::abort_cut_session), which does
//! the same but discards the log. Neither drops a frame. Before ending, the
//! agent waits (with a bound) for [`SessionStats::pending_pre_frames`] to
//! reach 0: pre-tagged frames still queued for post ports would otherwise be
//! delivered unlogged (counted in [`SessionStats::unlogged_at_end`]).
//!
//! The log keeps at most [`SwitchConfig::max_log_bytes`](crate::SwitchConfig::max_log_bytes)
//! frame bytes; frames beyond it are still delivered, and counted in
//! [`SessionStats::log_overflow`] (the snapshot is then incomplete).
//!
//! This module holds the session types and the pure mediation logic; the
//! core applies it to its queues ([`SwitchCore::begin_session`](crate::SwitchCore::begin_session)
//! and the other session methods), and the event loop adds the I/O (draining
//! a peer at its cut, polling `SIOCOUTQ`, sending triggers).

pub mod probe;
mod session;

use serde::{Deserialize, Serialize};

use crate::core::PortId;
use crate::handover::hex;

pub(crate) use session::{classify_pop, LogRef, PopAction, Receiver, Session};

/// Default bound of a session log: 64 MiB of frame bytes.
pub const DEFAULT_MAX_LOG_BYTES: usize = 64 << 20;

/// Whether a session port (or the frame it sent) is before or after its cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Color {
    /// Not cut yet.
    Pre,
    /// Cut.
    Post,
}

/// Why a frame is in the session log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogReason {
    /// It was already queued for the receiver when the receiver was cut
    /// (it waited across the cut, typically while the port was held).
    HeldAtCut,
    /// It was queued for the receiver after the receiver's cut.
    InFlight,
}

/// One frame of the channel state: sent before its sender's cut, handed to
/// its receiver after the receiver's cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedFrame {
    /// Name of the sender's port.
    pub sender: String,
    /// Name of the receiver's port.
    pub receiver: String,
    /// The sender's port.
    pub sender_port: PortId,
    /// The receiver's port.
    pub receiver_port: PortId,
    /// When the switch received the frame (unix time, µs).
    pub received_unix_us: u64,
    /// When the switch handed it to the receiver's connection (unix time, µs).
    pub delivered_unix_us: u64,
    /// Why it is logged.
    pub reason: LogReason,
    /// The Ethernet frame (hex in human-readable formats).
    #[serde(with = "hex")]
    pub data: Vec<u8>,
}

/// Traffic from one port to another during a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairCount {
    /// Sender port name.
    pub from: String,
    /// Receiver port name.
    pub to: String,
    /// Frames routed from `from` to `to` (unicast and flood copies,
    /// including copies then dropped for a full queue).
    pub frames: u64,
    /// Bytes of those frames.
    pub bytes: u64,
    /// Of `frames`, those sent to a learned MAC (not flooded): traffic
    /// between VMs that talk, not ARP broadcasts.
    #[serde(default)]
    pub unicast_frames: u64,
}

/// State of one port of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionPort {
    /// The port.
    pub port: PortId,
    /// Its name.
    pub name: String,
    /// [`Color::Post`] once [`cut`](crate::SwitchHandle::cut).
    pub color: Color,
    /// When it was cut (unix time, µs).
    pub cut_unix_us: Option<u64>,
    /// Whether a post-tagged frame was queued for it while it was pre.
    pub auto_held: bool,
    /// Cut with half a frame pending from its peer: its frames are still
    /// tagged pre until that frame completes.
    #[serde(default)]
    pub partial_pending: bool,
    /// Whether it was reported on the triggers channel.
    #[serde(default)]
    pub triggered: bool,
    /// Whether the session holds it (a prepare hold or an auto hold not
    /// released yet).
    #[serde(default)]
    pub session_hold: bool,
}

/// What happened during a session. Frame counters (`forwarded`, `held`,
/// `dropped`) cover the whole switch during the session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStats {
    /// The session's epoch.
    pub epoch: u64,
    /// Frames completely written to peers.
    pub forwarded: u64,
    /// Frames queued for held ports.
    pub held: u64,
    /// Frames logged (channel state).
    pub logged: u64,
    /// Bytes of the logged frames.
    pub logged_bytes: u64,
    /// Frames dropped (must be 0 for a usable snapshot).
    pub dropped: u64,
    /// Post-tagged frames handed to pre ports (must be 0).
    pub violations: u64,
    /// Ports reported on the triggers channel.
    pub triggers: u64,
    /// `prepare_cut` calls that hit their bound before the peer read everything.
    pub bound_hits: u64,
    /// Sum of the unread bytes (`SIOCOUTQ`) left when `prepare_cut` returned.
    pub unread_bytes_at_cut: u64,
    /// `prepare_cut` calls that returned before the peer had read every
    /// cut probe: its QEMU may have held frames the guest had not taken.
    #[serde(default)]
    pub unsettled_cuts: u64,
    /// Pre-tagged frames still queued for post ports (to be logged when
    /// handed over).
    pub pending_pre_frames: u64,
    /// Frames that should have been logged but exceeded the log bound.
    pub log_overflow: u64,
    /// Pre-tagged frames still queued for post ports when the session ended
    /// (delivered without being logged). Only set in a [`SessionLog`].
    pub unlogged_at_end: u64,
    /// Traffic per (sender, receiver) pair, by increasing port ids.
    pub pairs: Vec<PairCount>,
    /// The session's ports, by increasing id.
    pub ports: Vec<SessionPort>,
}

/// The result of a session: its stats and the channel state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionLog {
    /// Final stats.
    pub stats: SessionStats,
    /// Logged frames, in the order they were handed over.
    pub frames: Vec<LoggedFrame>,
}

/// Result of [`SwitchHandle::prepare_cut`](crate::SwitchHandle::prepare_cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PrepareReport {
    /// How long it waited for the peer to read everything.
    pub waited_us: u64,
    /// The bound elapsed before the peer had read everything.
    pub bound_hit: bool,
    /// `SIOCOUTQ` of the switch's end when it returned (0 when drained).
    pub unread_bytes: usize,
    /// Unwritten bytes of a partly written frame when it returned.
    pub partial_bytes: usize,
    /// Cut probes the peer read, in turn ([`probe`]).
    #[serde(default)]
    pub probes_read: u32,
    /// Fewer probes were read than asked for (a peer was connected): it
    /// may hold frames it read but had not handed to the guest.
    #[serde(default)]
    pub unsettled: bool,
    /// From the socket drained to the last probe read (or the return), µs:
    /// how long the guest took to take what its QEMU had read.
    #[serde(default)]
    pub settle_us: u64,
}

/// Result of [`SwitchHandle::cut`](crate::SwitchHandle::cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CutReport {
    /// Complete frames read from the peer at the cut (tagged pre).
    pub frames_drained: u64,
    /// Ethernet bytes of those frames.
    pub bytes_drained: u64,
    /// Half a frame was pending: it is tagged pre when it completes.
    pub partial_pending: bool,
}
/// What the switch recorded about a frame when it received it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FrameTag {
    /// Ingress port; `None` for injected frames.
    pub(crate) sender: Option<PortId>,
    /// Sender color; `None` when the sender was outside the session.
    pub(crate) color: Option<Color>,
    /// Serial of the session the color belongs to (0: none).
    pub(crate) session: u64,
    /// Epoch of that session (0: none), for the header of a tunnel
    /// datagram sent after the session ended.
    pub(crate) epoch: u64,
    pub(crate) received_unix_us: u64,
    /// Order of queueing (assigned by the core when queued).
    pub(crate) seq: u64,
    /// Set while the frame is in the session log.
    pub(crate) log_ref: Option<LogRef>,
}

impl FrameTag {
    /// The port the frame was received on (`None` for injected frames).
    pub fn sender(&self) -> Option<PortId> {
        self.sender
    }

    /// When the switch received the frame (unix time, µs).
    pub fn received_unix_us(&self) -> u64 {
        self.received_unix_us
    }

    /// Whether the frame is in the current session log.
    pub fn is_logged(&self) -> bool {
        self.log_ref.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_names() {
        assert_eq!(
            serde_json::to_string(&LogReason::HeldAtCut).unwrap(),
            r#""held-at-cut""#
        );
        assert_eq!(
            serde_json::to_string(&LogReason::InFlight).unwrap(),
            r#""in-flight""#
        );
        assert_eq!(serde_json::to_string(&Color::Post).unwrap(), r#""post""#);
        let f = LoggedFrame {
            sender: "a".into(),
            receiver: "b".into(),
            sender_port: PortId::from_raw(0),
            receiver_port: PortId::from_raw(1),
            received_unix_us: 1,
            delivered_unix_us: 2,
            reason: LogReason::InFlight,
            data: vec![0xde, 0xad],
        };
        let json = serde_json::to_string(&f).unwrap();
        assert!(json.contains(r#""data":"dead""#), "{json}");
        assert_eq!(serde_json::from_str::<LoggedFrame>(&json).unwrap(), f);
    }
}
