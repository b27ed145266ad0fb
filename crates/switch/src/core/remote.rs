//! Tunnel ports: a port that stands for another host's switch (see
//! [`crate::tunnel`]).
//!
//! A local port's frames are tagged with the color of that port, its VM.
//! A tunnel port stands for many remote VMs, each with a color of its own,
//! so its frames are tagged with the color the datagram's header carries
//! ([`SwitchCore::receive_remote`]); from there on the mediator's rules
//! apply to them exactly as to a local sender's. The other way, the header
//! of a frame sent into a tunnel carries the color its sender had when
//! this switch received it ([`SwitchCore::wire_tag`]).

use super::*;
use crate::mediator::Color;

/// How [`SwitchCore::receive_remote`] colored a frame from a tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteColor {
    /// The header was untagged: the remote sender is in no cut session.
    Untagged,
    /// The header's color, of the active session's epoch.
    Session(Color),
    /// The header's epoch is not the active session's (or none is
    /// active): the frame is treated as untagged.
    OtherEpoch,
}

impl SwitchCore {
    /// Adds a tunnel port, disconnected and not held. It differs from
    /// [`add_port`](Self::add_port) in one thing: frames from a tunnel are
    /// never routed into another tunnel.
    pub fn add_tunnel_port(&mut self, name: impl Into<String>) -> PortId {
        self.add_port_of_kind(name.into(), true)
    }

    /// Whether `id` is a tunnel port.
    pub fn is_tunnel(&self, id: PortId) -> bool {
        self.ports.get(&id).is_some_and(|p| p.tunnel)
    }

    /// [`receive`](Self::receive) for a frame that came through a tunnel
    /// port, whose header tagged it with its sender's color and cut epoch
    /// (`None`: untagged). The frame takes that color if the epoch is the
    /// active session's, else it is untagged.
    pub fn receive_remote(
        &mut self,
        ingress: PortId,
        frame: &[u8],
        header: Option<(Color, u64)>,
    ) -> (Decision, RemoteColor) {
        if !self.ports.contains_key(&ingress) {
            return (
                Decision::Drop(DropReason::UnknownIngress),
                RemoteColor::Untagged,
            );
        }
        let active = self.session_epoch();
        let colored = match header {
            None => RemoteColor::Untagged,
            Some((color, epoch)) if Some(epoch) == active => RemoteColor::Session(color),
            Some(_) => RemoteColor::OtherEpoch,
        };
        let mut tag = self.ingress_tag(ingress);
        tag.color = match colored {
            RemoteColor::Session(c) => Some(c),
            RemoteColor::Untagged | RemoteColor::OtherEpoch => None,
        };
        (self.receive_as(ingress, frame, tag), colored)
    }

    /// The epoch of the active session once every one of its ports is cut
    /// and sends post frames: from then on this switch sends no pre frame
    /// of that epoch (what a tunnel's keepalives tell the other switch).
    pub fn session_all_post(&self) -> Option<u64> {
        self.session
            .as_ref()
            .filter(|s| s.all_post())
            .map(|s| s.epoch())
    }

    /// The color and epoch for the header of a queued frame sent into a
    /// tunnel: the color its sender had when this switch received it (pre
    /// for a session sender's frame received before the session began), of
    /// the session it was received in, even if that session has ended
    /// since. `None`: untagged.
    pub fn wire_tag(&self, frame: &QueuedFrame) -> Option<(Color, u64)> {
        let tag = &frame.tag;
        let now = self
            .session
            .as_ref()
            .and_then(|s| s.color_of(tag).map(|c| (c, s.epoch())));
        now.or(tag.color.map(|c| (c, tag.epoch)))
    }
}
