//! The tunnel between two hosts' switches: one UDP datagram per Ethernet
//! frame, behind a header that carries what the packet mediator needs to
//! keep a cluster snapshot's cut exact across hosts (the sender's color and
//! the cut session's epoch), and a sequence number that lets the receiver
//! drop duplicates and count losses.
//!
//! This module is the wire format and the receiver's sequence check, free
//! of I/O. A switch uses it for its tunnel ports
//! ([`SwitchHandle::add_tunnel`](crate::SwitchHandle::add_tunnel); the
//! I/O is in the event loop, the color rules in
//! [`SwitchCore::receive_remote`](crate::SwitchCore::receive_remote) and
//! [`SwitchCore::wire_tag`](crate::SwitchCore::wire_tag)).
//!
//! # Datagram layout (all integers big-endian)
//!
//! ```text
//!  0        4     5      6       7       8            16            24          32
//!  +--------+-----+------+-------+-------+------------+-------------+-----------+---------
//!  | "VMTN" | ver | kind | color | flags |   epoch    | incarnation |    seq    | payload
//!  +--------+-----+------+-------+-------+------------+-------------+-----------+---------
//!    magic    1   0 frame 0 untagged  0    u64: the     u64: when     u64: per    frame:
//!                 1 keep- 1 pre            cut          the sender    datagram    one Ethernet
//!                   alive 2 post           session's    started (ms   of this     frame, 14..
//!                                          epoch; 0     since the     incarnation MAX_FRAME_LEN
//!                                          when         epoch), grows from 1      bytes;
//!                                          untagged     on restart                keepalive: none
//! ```
//!
//! - **color** is the sender's color when its switch received the frame
//!   (the [`crate::mediator`] rules): *untagged* if the sender is in no cut
//!   session, else *pre* (not cut yet) or *post* (cut). The receiving
//!   switch applies the rules as for a local sender of that color: a post
//!   frame for a pre port holds the port and triggers its cut; a pre frame
//!   handed to a post port is logged as channel state.
//!   On a keepalive, the color is the sending switch's own state in its
//!   cut session: pre while some session port is not cut, post once all
//!   are and every pre frame went out before it (the receiver then knows
//!   which datagrams may still carry channel state, see
//!   [`SeqWindow::missing_below`]); untagged without a session.
//! - **epoch** names the cut session the color belongs to, so a frame of an
//!   earlier session (delayed in the network) is never taken for one of the
//!   current session.
//! - **incarnation** and **seq**: the sending end of a tunnel numbers its
//!   datagrams from 1, and starts again from 1 with a larger incarnation
//!   when it restarts. [`SeqWindow`] drops a repeated datagram (UDP may
//!   duplicate: a frame delivered twice would break "no frame
//!   duplicated") and one of an older incarnation, and counts gaps (lost
//!   datagrams, which a guest's TCP sees as a lossy network) and late
//!   arrivals.
//! - **flags** are 0; a receiver refuses anything else, so a later version
//!   that needs them bumps `ver`.
//!
//! No checksum of its own: UDP's covers the datagram.

use thiserror::Error;

use crate::framing::MAX_FRAME_LEN;
use crate::mediator::Color;

mod seq;
#[cfg(test)]
mod tests;

pub use seq::{SeqCounts, SeqVerdict, SeqWindow, WINDOW};

/// The first four bytes of every datagram.
pub const MAGIC: [u8; 4] = *b"VMTN";
/// The layout described above.
pub const VERSION: u8 = 1;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 32;
/// The shortest frame a tunnel carries (an Ethernet header).
pub const MIN_FRAME_LEN: usize = 14;
/// The largest datagram a tunnel sends.
pub const MAX_DATAGRAM_LEN: usize = HEADER_LEN + MAX_FRAME_LEN;

/// What a datagram carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One Ethernet frame.
    Frame,
    /// Nothing: tells the peer the tunnel is alive.
    Keepalive,
}

/// A datagram's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What follows.
    pub kind: Kind,
    /// The sender's color and its cut session's epoch; `None`: untagged.
    pub tag: Option<(Color, u64)>,
    /// The sending end's start (ms since the epoch; larger after a
    /// restart).
    pub incarnation: u64,
    /// The sending end's datagram counter in this incarnation, from 1.
    pub seq: u64,
}

/// Why a datagram was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TunnelError {
    /// Shorter than the header.
    #[error("tunnel datagram of {0} bytes is shorter than its {HEADER_LEN}-byte header")]
    Short(usize),
    /// Not ours.
    #[error("tunnel datagram does not start with \"VMTN\" (got {0:02x?}): something else sends to the tunnel's port")]
    Magic([u8; 4]),
    /// Another layout.
    #[error("tunnel datagram of version {0}, this switch speaks {VERSION}: run the same vmcsnap on both hosts")]
    Version(u8),
    /// An unknown kind.
    #[error("tunnel datagram of unknown kind {0}")]
    Kind(u8),
    /// An unknown color.
    #[error("tunnel datagram with unknown color {0}")]
    Color(u8),
    /// Flags set.
    #[error("tunnel datagram with flags {0:#04x} set (must be 0 in version {VERSION})")]
    Flags(u8),
    /// An untagged datagram with an epoch.
    #[error("untagged tunnel datagram with epoch {0} (must be 0)")]
    UntaggedEpoch(u64),
    /// A frame of an impossible length, or a keepalive with a payload.
    #[error("tunnel {kind:?} with a payload of {len} bytes (frames: {MIN_FRAME_LEN}..={MAX_FRAME_LEN}, keepalives: 0)")]
    PayloadLen {
        /// The datagram's kind.
        kind: Kind,
        /// Its payload's length.
        len: usize,
    },
}

/// Appends the datagram of `header` and `payload` to `out`. Panics if the
/// pair is one [`decode`] refuses (a payload of the wrong length): the
/// switch only sends frames it accepted.
pub fn encode(header: &Header, payload: &[u8], out: &mut Vec<u8>) {
    check_payload(header.kind, payload.len()).expect("a payload the tunnel carries");
    let (color, epoch) = match header.tag {
        None => (0, 0),
        Some((Color::Pre, e)) => (1, e),
        Some((Color::Post, e)) => (2, e),
    };
    let kind = match header.kind {
        Kind::Frame => 0,
        Kind::Keepalive => 1,
    };
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, kind, color, 0]);
    out.extend_from_slice(&epoch.to_be_bytes());
    out.extend_from_slice(&header.incarnation.to_be_bytes());
    out.extend_from_slice(&header.seq.to_be_bytes());
    out.extend_from_slice(payload);
}

/// The header and payload of a received datagram, every field checked.
pub fn decode(datagram: &[u8]) -> Result<(Header, &[u8]), TunnelError> {
    if datagram.len() < HEADER_LEN {
        return Err(TunnelError::Short(datagram.len()));
    }
    let (head, payload) = datagram.split_at(HEADER_LEN);
    let magic: [u8; 4] = head[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(TunnelError::Magic(magic));
    }
    if head[4] != VERSION {
        return Err(TunnelError::Version(head[4]));
    }
    let kind = match head[5] {
        0 => Kind::Frame,
        1 => Kind::Keepalive,
        k => return Err(TunnelError::Kind(k)),
    };
    if head[7] != 0 {
        return Err(TunnelError::Flags(head[7]));
    }
    let epoch = u64::from_be_bytes(head[8..16].try_into().expect("8 bytes"));
    let tag = match head[6] {
        0 if epoch != 0 => return Err(TunnelError::UntaggedEpoch(epoch)),
        0 => None,
        1 => Some((Color::Pre, epoch)),
        2 => Some((Color::Post, epoch)),
        c => return Err(TunnelError::Color(c)),
    };
    check_payload(kind, payload.len())?;
    let incarnation = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
    let seq = u64::from_be_bytes(head[24..32].try_into().expect("8 bytes"));
    Ok((
        Header {
            kind,
            tag,
            incarnation,
            seq,
        },
        payload,
    ))
}

fn check_payload(kind: Kind, len: usize) -> Result<(), TunnelError> {
    let ok = match kind {
        Kind::Frame => (MIN_FRAME_LEN..=MAX_FRAME_LEN).contains(&len),
        Kind::Keepalive => len == 0,
    };
    if ok {
        Ok(())
    } else {
        Err(TunnelError::PayloadLen { kind, len })
    }
}
