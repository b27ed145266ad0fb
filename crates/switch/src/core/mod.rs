//! The pure switching core: ports, MAC learning, forwarding, tx queues,
//! counters. No I/O happens here.
//!
//! Every frame the switch handles goes through [`SwitchCore::receive`], which
//! counts it, learns its source MAC, decides where it goes ([`SwitchCore::route`],
//! a pure function of the frame and the MAC table) and appends it to the tx
//! queue of each destination port. The I/O layer then takes frames out with
//! [`SwitchCore::pop_tx`] and reports what it wrote with
//! [`SwitchCore::record_tx`].
//!
//! Queue policy, per destination port:
//! - held ([`SwitchCore::hold`]): queued (up to the bound) and counted as
//!   `held`; [`pop_tx`](SwitchCore::pop_tx) returns nothing until
//!   [`release`](SwitchCore::release).
//! - connected (the switch holds a connection to the port's peer) and not
//!   held: queued (up to the bound).
//! - neither: dropped. A port therefore never keeps a queue while it is
//!   disconnected and not held: a disconnect, or a release while
//!   disconnected, discards the queue and counts the frames as drops.
//!
//! Queue entries are [`QueuedFrame`]s: the frame as an `Arc<[u8]>` (so
//! flooding shares one copy) and its [`FrameTag`], what the switch recorded
//! when it received it (sender, color in a cut session, time).
//!
//! During a cut session ([`begin_session`](SwitchCore::begin_session)) the
//! core also applies the rules of the [packet mediator](crate::mediator):
//! [`enqueue`](SwitchCore::enqueue) auto-holds pre ports that get post
//! frames, [`pop_tx`](SwitchCore::pop_tx) logs channel state. The core has
//! no clock: the I/O layer tells it the time with
//! [`set_now`](SwitchCore::set_now), and tags and logs use the last value.

mod dhcp;
pub(crate) mod frozen;
mod mac;
mod remote;
#[cfg(test)]
mod remote_tests;
mod session;
#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod tests;

pub use mac::MacAddr;
pub use remote::RemoteColor;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::mediator::{FrameTag, Session};

/// Shortest frame the switch forwards: an Ethernet header (dst, src, type).
pub const MIN_FRAME_LEN: usize = 14;

/// Default cap on learned MAC addresses; beyond it new addresses are not learned.
pub const DEFAULT_MAX_MACS: usize = 65536;

/// Identifier of a switch port. Ids are never reused within one switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PortId(u32);

impl PortId {
    /// The numeric id.
    pub fn as_u32(self) -> u32 {
        self.0
    }

    pub(crate) fn from_raw(raw: u32) -> Self {
        PortId(raw)
    }
}

impl fmt::Display for PortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "port#{}", self.0)
    }
}

/// Frame and byte counters of one port, or of the whole switch.
///
/// Byte counts are Ethernet frame bytes, without the 4-byte length prefix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Frames received from the port's peer (including runts).
    pub rx_frames: u64,
    /// Bytes of the frames counted in `rx_frames`.
    pub rx_bytes: u64,
    /// Frames completely written to the port's peer socket.
    pub tx_frames: u64,
    /// Bytes of the frames counted in `tx_frames`.
    pub tx_bytes: u64,
    /// Frames dropped: runts received on this port, and frames for this port
    /// that did not fit its queue, arrived while it was disconnected and not
    /// held, or were lost with a closed connection.
    pub drops: u64,
    /// Frames queued for this port while it was held.
    pub held: u64,
    /// Connections closed because the peer broke the framing protocol.
    pub protocol_errors: u64,
    /// How many times the switch connected to the port's peer (the first
    /// connection and every reconnection, e.g. to a restarted QEMU).
    pub connections: u64,
    /// Frames handed to this port that were logged as channel state of a
    /// cluster snapshot (see [`crate::mediator`]).
    #[serde(default)]
    pub logged: u64,
    /// Frames for a DHCP server (IPv4 UDP to port 67) received from the
    /// port and taken out of forwarding by the switch's DHCP server
    /// ([`crate::dhcp`]); 0 when DHCP is off.
    #[serde(default)]
    pub dhcp_requests: u64,
    /// DHCP replies the switch queued for the port.
    #[serde(default)]
    pub dhcp_replies: u64,
}

/// One entry of a tx queue: a frame and what the switch knows about it.
///
/// Dereferences to the frame bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedFrame {
    /// The Ethernet frame, shared between the copies of a flood.
    pub data: Arc<[u8]>,
    /// Sender, color and reception time.
    pub tag: FrameTag,
}

impl QueuedFrame {
    /// A frame without sender (injected) and color.
    pub fn untagged(data: Arc<[u8]>) -> Self {
        QueuedFrame {
            data,
            tag: FrameTag::default(),
        }
    }
}

impl Deref for QueuedFrame {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.data
    }
}

/// Why [`SwitchCore::route`] dropped a frame at ingress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Shorter than [`MIN_FRAME_LEN`].
    Runt,
    /// The ingress port does not exist.
    UnknownIngress,
}

/// Forwarding decision for one frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not forwarded anywhere.
    Drop(DropReason),
    /// The destination was learned on the ingress port: nothing to do.
    Filter,
    /// Sent to the port the destination MAC was learned on.
    Unicast(PortId),
    /// Broadcast, multicast or unknown unicast: sent to every other port that
    /// is connected or held (possibly none).
    Flood(Vec<PortId>),
    /// Taken out of forwarding by the switch's DHCP server
    /// ([`crate::dhcp`]); the reply, if there is one, was queued for this
    /// port (the ingress).
    Answered(Option<PortId>),
}

impl Decision {
    /// Destination ports of this decision.
    pub fn targets(&self) -> &[PortId] {
        match self {
            Decision::Unicast(p) => std::slice::from_ref(p),
            Decision::Flood(ps) => ps,
            Decision::Answered(Some(p)) => std::slice::from_ref(p),
            Decision::Drop(_) | Decision::Filter | Decision::Answered(None) => &[],
        }
    }
}

/// What [`SwitchCore::enqueue`] did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Queued for transmission.
    Queued,
    /// Queued; the port is held.
    Held,
    /// Dropped (queue full, or port disconnected and not held) and counted.
    Dropped,
    /// No such port; nothing counted.
    NoPort,
}

/// Point-in-time view of one port, see [`SwitchCore::port`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortView<'a> {
    /// Port name given to [`SwitchCore::add_port`].
    pub name: &'a str,
    /// Whether a peer is connected.
    pub connected: bool,
    /// Whether the port is held.
    pub holding: bool,
    /// Frames waiting in the tx queue.
    pub queued_frames: usize,
    /// Frame bytes waiting in the tx queue.
    pub queued_bytes: usize,
    /// The port's counters.
    pub counters: Counters,
}

#[derive(Debug)]
struct Port {
    name: String,
    connected: bool,
    holding: bool,
    queue: VecDeque<QueuedFrame>,
    queued_bytes: usize,
    counters: Counters,
    /// A tunnel to another host's switch ([`SwitchCore::add_tunnel_port`]).
    tunnel: bool,
}

/// The switching state machine. See the [module docs](self).
#[derive(Debug)]
pub struct SwitchCore {
    ports: BTreeMap<PortId, Port>,
    macs: HashMap<MacAddr, PortId>,
    next_id: u32,
    max_queue_bytes: usize,
    max_macs: usize,
    totals: Counters,
    /// Unix time in µs, as last told by [`set_now`](Self::set_now).
    now_us: u64,
    /// Sequence number the next queued frame gets.
    next_seq: u64,
    /// The active cut session.
    session: Option<Session>,
    /// Serial of the last session begun (0: none yet).
    last_session_serial: u64,
    /// The DHCP server, when on (see [`crate::dhcp`]).
    dhcp: Option<crate::dhcp::DhcpServer>,
}

impl SwitchCore {
    /// A core whose per-port tx queues hold at most `max_queue_bytes` frame bytes.
    pub fn new(max_queue_bytes: usize) -> Self {
        SwitchCore {
            ports: BTreeMap::new(),
            macs: HashMap::new(),
            next_id: 0,
            max_queue_bytes,
            max_macs: DEFAULT_MAX_MACS,
            totals: Counters::default(),
            now_us: 0,
            next_seq: 0,
            session: None,
            last_session_serial: 0,
            dhcp: None,
        }
    }

    /// Sets the core's clock (unix time in µs), used for the timestamps of
    /// frame tags and logged frames from now on.
    pub fn set_now(&mut self, unix_us: u64) {
        self.now_us = unix_us;
    }

    /// Caps the MAC table at `max_macs` entries (default [`DEFAULT_MAX_MACS`]).
    pub fn set_max_macs(&mut self, max_macs: usize) {
        self.max_macs = max_macs;
    }

    /// Adds a disconnected, not held port.
    pub fn add_port(&mut self, name: impl Into<String>) -> PortId {
        self.add_port_of_kind(name.into(), false)
    }

    fn add_port_of_kind(&mut self, name: String, tunnel: bool) -> PortId {
        let id = PortId(self.next_id);
        self.next_id += 1;
        let port = Port {
            name,
            connected: false,
            holding: false,
            queue: VecDeque::new(),
            queued_bytes: 0,
            counters: Counters::default(),
            tunnel,
        };
        self.ports.insert(id, port);
        id
    }

    /// Removes a port, its queue and the MAC addresses learned on it.
    /// Returns false if there is no such port.
    pub fn remove_port(&mut self, id: PortId) -> bool {
        self.macs.retain(|_, p| *p != id);
        self.dhcp_port_removed(id);
        self.ports.remove(&id).is_some()
    }

    /// Ids of all ports, in increasing order.
    pub fn port_ids(&self) -> impl Iterator<Item = PortId> + '_ {
        self.ports.keys().copied()
    }

    /// Current state of a port.
    pub fn port(&self, id: PortId) -> Option<PortView<'_>> {
        self.ports.get(&id).map(|p| PortView {
            name: &p.name,
            connected: p.connected,
            holding: p.holding,
            queued_frames: p.queue.len(),
            queued_bytes: p.queued_bytes,
            counters: p.counters,
        })
    }

    /// Counters summed over every port the switch ever had.
    pub fn totals(&self) -> Counters {
        self.totals
    }

    /// Port on which `mac` was last seen as a source address.
    pub fn lookup(&self, mac: MacAddr) -> Option<PortId> {
        self.macs.get(&mac).copied()
    }

    /// Marks the port as connected to its peer (a new connection)
    /// and counts the connection.
    pub fn client_connected(&mut self, id: PortId) {
        if let Some(p) = self.ports.get_mut(&id) {
            p.connected = true;
            p.counters.connections += 1;
            self.totals.connections += 1;
        }
        if let Some(s) = self.session.as_mut() {
            s.connection_changed(id);
        }
    }

    /// Marks the port's peer as gone. Unless the port is held, its queue is
    /// discarded and counted as drops.
    pub fn client_disconnected(&mut self, id: PortId) {
        if let Some(p) = self.ports.get_mut(&id) {
            p.connected = false;
        }
        if let Some(s) = self.session.as_mut() {
            s.connection_changed(id);
        }
        self.discard_if_unreachable(id);
    }

    /// Holds a port: frames for it are queued but not handed out by
    /// [`pop_tx`](Self::pop_tx). Returns false if there is no such port.
    pub fn hold(&mut self, id: PortId) -> bool {
        self.ports.get_mut(&id).map(|p| p.holding = true).is_some()
    }

    /// Releases a held port; its queue is sent in order once connected (or
    /// discarded as drops if no peer is connected). Returns false if there
    /// is no such port.
    ///
    /// A port that [`release_blocked`](Self::release_blocked) stays held.
    pub fn release(&mut self, id: PortId) -> bool {
        if self.release_blocked(id) {
            return self.ports.contains_key(&id);
        }
        let found = self.ports.get_mut(&id).map(|p| p.holding = false).is_some();
        if let Some(s) = self.session.as_mut() {
            s.released(id);
        }
        self.discard_if_unreachable(id);
        found
    }

    /// Whether [`release`](Self::release) would keep the port held: in a
    /// cut session, it is not cut yet and post-cut frames are queued for it
    /// (releasing it would hand them to a VM before its cut).
    pub fn release_blocked(&self, id: PortId) -> bool {
        self.session.as_ref().is_some_and(|s| s.blocks_release(id))
    }

    /// Forwarding decision for `frame` received on `ingress`, from the
    /// current MAC table. Pure: learns and counts nothing.
    ///
    /// A frame from a tunnel never goes into another tunnel (split
    /// horizon: the hosts' switches are meshed, each reaches every other
    /// directly, so flooding from tunnel to tunnel would only loop).
    pub fn route(&self, ingress: PortId, frame: &[u8]) -> Decision {
        let Some(from) = self.ports.get(&ingress) else {
            return Decision::Drop(DropReason::UnknownIngress);
        };
        if frame.len() < MIN_FRAME_LEN {
            return Decision::Drop(DropReason::Runt);
        }
        let dst = MacAddr::destination(frame);
        if !dst.is_multicast() {
            match self.macs.get(&dst) {
                Some(&p) if p == ingress => return Decision::Filter,
                Some(&p) if from.tunnel && self.ports.get(&p).is_some_and(|t| t.tunnel) => {
                    return Decision::Filter
                }
                Some(&p) => return Decision::Unicast(p),
                None => {}
            }
        }
        let targets = self
            .ports
            .iter()
            .filter(|(&id, p)| id != ingress && (p.connected || p.holding))
            .filter(|(_, p)| !(from.tunnel && p.tunnel))
            .map(|(&id, _)| id)
            .collect();
        Decision::Flood(targets)
    }

    /// Handles a frame received on `ingress`: counts it, learns its source
    /// MAC, routes it and enqueues it on every destination port, tagged with
    /// its sender and the sender's color.
    pub fn receive(&mut self, ingress: PortId, frame: &[u8]) -> Decision {
        if !self.ports.contains_key(&ingress) {
            return Decision::Drop(DropReason::UnknownIngress);
        }
        let tag = self.ingress_tag(ingress);
        self.receive_as(ingress, frame, tag)
    }

    /// [`receive`](Self::receive) with the tag already taken.
    fn receive_as(&mut self, ingress: PortId, frame: &[u8], tag: FrameTag) -> Decision {
        if let Some(s) = self.session.as_mut() {
            s.frame_received(ingress);
        }
        let port = self.ports.get_mut(&ingress).expect("checked above");
        let len = frame.len() as u64;
        port.counters.rx_frames += 1;
        port.counters.rx_bytes += len;
        self.totals.rx_frames += 1;
        self.totals.rx_bytes += len;
        if frame.len() < MIN_FRAME_LEN {
            port.counters.drops += 1;
            self.totals.drops += 1;
            return Decision::Drop(DropReason::Runt);
        }
        self.learn(MacAddr::source(frame), ingress);
        if let Some(answered) = self.intercept_dhcp(ingress, frame) {
            return answered;
        }
        let decision = self.route(ingress, frame);
        let targets = decision.targets();
        if !targets.is_empty() {
            let shared: Arc<[u8]> = Arc::from(frame);
            let unicast = matches!(decision, Decision::Unicast(_));
            for &t in targets {
                self.count_pair(ingress, t, frame.len(), unicast);
                let entry = QueuedFrame {
                    data: shared.clone(),
                    tag,
                };
                self.enqueue_tagged(t, entry);
            }
        }
        decision
    }

    /// Appends an untagged frame to a port's tx queue, applying the queue
    /// policy of the [module docs](self). The entry point for injecting frames.
    pub fn enqueue(&mut self, id: PortId, frame: Arc<[u8]>) -> Enqueued {
        self.enqueue_tagged(id, QueuedFrame::untagged(frame))
    }

    /// Appends a frame to a port's tx queue, applying the queue policy of the
    /// [module docs](self) and, in a cut session, rule 1 of the
    /// [mediator](crate::mediator) (a post frame auto-holds a pre port).
    pub fn enqueue_tagged(&mut self, id: PortId, mut frame: QueuedFrame) -> Enqueued {
        let Some(p) = self.ports.get_mut(&id) else {
            return Enqueued::NoPort;
        };
        if let Some(s) = self.session.as_mut() {
            let color = s.color_of(&frame.tag);
            if s.on_enqueue(id, color) && !p.holding {
                p.holding = true;
                s.note_session_hold(id);
            }
        }
        let fits = p.queued_bytes + frame.len() <= self.max_queue_bytes;
        if !(p.connected || p.holding) || !fits {
            p.counters.drops += 1;
            self.totals.drops += 1;
            return Enqueued::Dropped;
        }
        frame.tag.seq = self.next_seq;
        frame.tag.log_ref = None;
        self.next_seq += 1;
        p.queued_bytes += frame.len();
        p.queue.push_back(frame);
        if p.holding {
            p.counters.held += 1;
            self.totals.held += 1;
            Enqueued::Held
        } else {
            Enqueued::Queued
        }
    }

    /// Takes the next frame to transmit, if the port is connected, not held,
    /// and has one queued. In a cut session this is where rules 2 and 3 of
    /// the [mediator](crate::mediator) apply: the frame is handed over now.
    pub fn pop_tx(&mut self, id: PortId) -> Option<QueuedFrame> {
        let p = self.ports.get_mut(&id)?;
        if !p.connected || p.holding {
            return None;
        }
        let mut frame = p.queue.pop_front()?;
        p.queued_bytes -= frame.len();
        if self.session.is_some() {
            self.mediate_pop(id, &mut frame);
        }
        Some(frame)
    }

    /// Puts frames taken with [`pop_tx`](Self::pop_tx) but not written back
    /// at the head of the queue, keeping their order. The queue bound is not
    /// applied (they were within it when queued). Frames the session logged
    /// leave the log again (they were not handed over after all). If the
    /// port is disconnected and not held they are dropped.
    pub fn requeue_front(&mut self, id: PortId, frames: Vec<QueuedFrame>) {
        let Some(p) = self.ports.get_mut(&id) else {
            return;
        };
        for mut frame in frames.into_iter().rev() {
            if let Some(r) = frame.tag.log_ref.take() {
                if self.session.as_mut().is_some_and(|s| s.unlog(r)) {
                    p.counters.logged = p.counters.logged.saturating_sub(1);
                    self.totals.logged = self.totals.logged.saturating_sub(1);
                }
            }
            p.queued_bytes += frame.len();
            p.queue.push_front(frame);
        }
        self.discard_if_unreachable(id);
    }

    /// Counts a frame of `len` bytes completely written to the port's peer.
    pub fn record_tx(&mut self, id: PortId, len: usize) {
        if let Some(p) = self.ports.get_mut(&id) {
            p.counters.tx_frames += 1;
            p.counters.tx_bytes += len as u64;
            self.totals.tx_frames += 1;
            self.totals.tx_bytes += len as u64;
        }
    }

    /// Counts `n` frames for this port lost by the I/O layer (e.g. a frame
    /// partly written when its connection closed).
    pub fn record_drops(&mut self, id: PortId, n: u64) {
        if let Some(p) = self.ports.get_mut(&id) {
            p.counters.drops += n;
            self.totals.drops += n;
        }
    }

    /// Counts a connection closed for a protocol error.
    pub fn record_protocol_error(&mut self, id: PortId) {
        if let Some(p) = self.ports.get_mut(&id) {
            p.counters.protocol_errors += 1;
            self.totals.protocol_errors += 1;
        }
    }

    fn learn(&mut self, src: MacAddr, port: PortId) {
        if src.is_multicast() || src.is_zero() {
            return; // not a valid station address
        }
        if self.macs.len() >= self.max_macs && !self.macs.contains_key(&src) {
            return;
        }
        self.macs.insert(src, port);
    }

    fn discard_if_unreachable(&mut self, id: PortId) {
        let Some(p) = self.ports.get_mut(&id) else {
            return;
        };
        if p.connected || p.holding || p.queue.is_empty() {
            return;
        }
        let n = p.queue.len() as u64;
        p.queue.clear();
        p.queued_bytes = 0;
        p.counters.drops += n;
        self.totals.drops += n;
    }
}
