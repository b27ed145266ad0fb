//! Wire framing of QEMU `-netdev stream` sockets.
//!
//! Both directions carry a sequence of records, each a 4-byte big-endian
//! length followed by that many bytes of Ethernet frame (no vnet header).
//! QEMU drops the connection when it receives a record longer than
//! [`MAX_FRAME_LEN`], so the switch never sends one and treats one it
//! receives as a protocol error on that port. A zero length is rejected too:
//! it cannot carry an Ethernet frame and only shows up on a corrupt stream.
//!
//! [`Decoder`] is incremental: feed it whatever a `read` returned (partial
//! length prefixes and partial frames are kept across calls) and pop complete
//! frames with [`Decoder::next_frame`].

use thiserror::Error;

/// Size of the big-endian length prefix in front of every frame.
pub const HEADER_LEN: usize = 4;

/// Largest frame QEMU accepts on a stream netdev (`NET_BUFSIZE`, 4096 + 65536).
pub const MAX_FRAME_LEN: usize = 4096 + 65536;

/// A length prefix that cannot be valid on a QEMU stream socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum FrameError {
    /// The length prefix is larger than the allowed maximum.
    #[error(
        "frame length {len} exceeds the maximum of {max} bytes; QEMU would drop the connection"
    )]
    TooLong {
        /// Length announced (or requested) for the frame.
        len: usize,
        /// Maximum allowed length.
        max: usize,
    },
    /// The length prefix is zero.
    #[error("zero-length frame; the stream is corrupt or not a QEMU stream netdev")]
    Empty,
}

/// Checks a frame length against the protocol limits.
pub fn check_len(len: usize, max: usize) -> Result<(), FrameError> {
    if len == 0 {
        Err(FrameError::Empty)
    } else if len > max {
        Err(FrameError::TooLong { len, max })
    } else {
        Ok(())
    }
}

/// Returns the length prefix for a frame of `len` bytes.
pub fn encode_header(len: usize) -> Result<[u8; HEADER_LEN], FrameError> {
    check_len(len, MAX_FRAME_LEN)?;
    Ok((len as u32).to_be_bytes())
}

/// Appends the length prefix and `frame` to `out`.
pub fn encode(frame: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    let header = encode_header(frame.len())?;
    out.reserve(HEADER_LEN + frame.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(frame);
    Ok(())
}

/// Incremental decoder of length-prefixed frames.
///
/// After an error the decoder is poisoned: every later call to
/// [`next_frame`](Decoder::next_frame) returns the same error, since the
/// stream cannot be resynchronised.
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    pos: usize,
    max_len: usize,
    error: Option<FrameError>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    /// A decoder accepting frames up to [`MAX_FRAME_LEN`] bytes.
    pub fn new() -> Self {
        Self::with_max_len(MAX_FRAME_LEN)
    }

    /// A decoder accepting frames up to `max_len` bytes.
    pub fn with_max_len(max_len: usize) -> Self {
        Decoder {
            buf: Vec::new(),
            pos: 0,
            max_len,
            error: None,
        }
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.pos > 0 {
            // Drop consumed bytes before growing; only the unconsumed tail
            // (at most one partial record) is moved.
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Number of bytes fed but not yet returned as frames.
    pub fn buffered_len(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes fed but not yet returned as frames (at most one partial
    /// record once [`next_frame`](Self::next_frame) has returned `None`).
    /// Feeding them to a fresh decoder resumes the stream where this one is.
    pub fn pending_input(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    /// Pops the next complete frame, if one has been fed entirely.
    ///
    /// The returned slice borrows the decoder and is valid until the next
    /// call. An oversized or zero length is reported as soon as its prefix is
    /// complete, without waiting for the body.
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, FrameError> {
        if let Some(err) = self.error {
            return Err(err);
        }
        let avail = &self.buf[self.pos..];
        if avail.len() < HEADER_LEN {
            return Ok(None);
        }
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&avail[..HEADER_LEN]);
        let len = u32::from_be_bytes(header) as usize;
        if let Err(err) = check_len(len, self.max_len) {
            self.error = Some(err);
            return Err(err);
        }
        if avail.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let start = self.pos + HEADER_LEN;
        self.pos = start + len;
        Ok(Some(&self.buf[start..start + len]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames() -> Vec<Vec<u8>> {
        vec![
            vec![1u8; 60],
            (0..=255u8).collect(),
            vec![7u8; 1514],
            vec![9u8; MAX_FRAME_LEN],
        ]
    }

    fn drain(dec: &mut Decoder) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(f) = dec.next_frame().unwrap() {
            out.push(f.to_vec());
        }
        out
    }

    #[test]
    fn round_trip() {
        let mut wire = Vec::new();
        for f in frames() {
            encode(&f, &mut wire).unwrap();
        }
        let mut dec = Decoder::new();
        dec.feed(&wire);
        assert_eq!(drain(&mut dec), frames());
        assert_eq!(dec.buffered_len(), 0);
    }

    #[test]
    fn byte_by_byte() {
        let mut wire = Vec::new();
        for f in frames() {
            encode(&f, &mut wire).unwrap();
        }
        let mut dec = Decoder::new();
        let mut got = Vec::new();
        for b in &wire {
            dec.feed(std::slice::from_ref(b));
            got.extend(drain(&mut dec));
        }
        assert_eq!(got, frames());
    }

    #[test]
    fn header_is_big_endian() {
        let mut wire = Vec::new();
        encode(&[0xaa; 0x0102], &mut wire).unwrap();
        assert_eq!(&wire[..4], &[0, 0, 1, 2]);
    }

    #[test]
    fn oversize_is_rejected_on_both_sides() {
        let big = vec![0u8; MAX_FRAME_LEN + 1];
        let mut wire = Vec::new();
        assert_eq!(
            encode(&big, &mut wire),
            Err(FrameError::TooLong {
                len: MAX_FRAME_LEN + 1,
                max: MAX_FRAME_LEN
            })
        );
        assert!(wire.is_empty());

        let mut dec = Decoder::new();
        encode(&[1, 2, 3], &mut wire).unwrap();
        wire.extend_from_slice(&((MAX_FRAME_LEN + 1) as u32).to_be_bytes());
        dec.feed(&wire); // only the header of the oversized frame
        assert_eq!(dec.next_frame().unwrap(), Some(&[1u8, 2, 3][..]));
        let err = dec.next_frame().unwrap_err();
        assert!(matches!(err, FrameError::TooLong { .. }));
        dec.feed(&[0; 16]);
        assert_eq!(dec.next_frame().unwrap_err(), err, "decoder stays poisoned");
    }

    #[test]
    fn pending_input_resumes_in_a_new_decoder() {
        let mut wire = Vec::new();
        for f in frames() {
            encode(&f, &mut wire).unwrap();
        }
        let mut dec = Decoder::new();
        dec.feed(&wire[..HEADER_LEN + 60 + 100]); // frame 0 and part of frame 1
        assert_eq!(drain(&mut dec), vec![frames()[0].clone()]);
        assert_eq!(
            dec.pending_input(),
            &wire[HEADER_LEN + 60..HEADER_LEN + 60 + 100]
        );
        let mut resumed = Decoder::new();
        resumed.feed(dec.pending_input());
        resumed.feed(&wire[HEADER_LEN + 60 + 100..]);
        assert_eq!(drain(&mut resumed), frames()[1..].to_vec());
    }

    #[test]
    fn zero_length_is_rejected() {
        let mut dec = Decoder::new();
        dec.feed(&[0, 0, 0, 0]);
        assert_eq!(dec.next_frame(), Err(FrameError::Empty));
        assert_eq!(encode(&[], &mut Vec::new()), Err(FrameError::Empty));
    }

    #[test]
    fn custom_limit() {
        let mut dec = Decoder::with_max_len(10);
        dec.feed(&11u32.to_be_bytes());
        assert_eq!(
            dec.next_frame(),
            Err(FrameError::TooLong { len: 11, max: 10 })
        );
    }
}
