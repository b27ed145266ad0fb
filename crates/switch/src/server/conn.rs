//! The connection of a port to its peer: its socket, decoder and write batch.

use std::collections::VecDeque;
use std::io;

use mio::net::UnixStream;
use socket2::SockRef;

use crate::core::QueuedFrame;
use crate::framing::{self, Decoder, HEADER_LEN};

/// One record in an [`OutBuf`].
#[derive(Debug)]
struct Record {
    /// Offset in `buf` where the record ends.
    end: usize,
    /// Length of the Ethernet frame (without the length prefix).
    len: usize,
    /// The frame; `None` for the remainder of a frame partly written before
    /// a handover, which is started by definition and never taken back, and
    /// for a cut probe.
    frame: Option<QueuedFrame>,
    /// A cut probe (see [`crate::mediator::probe`]): not a frame of the
    /// network, so not counted as forwarded.
    probe: bool,
}

/// Encoded frames taken from the port's queue and being written.
///
/// Frames are only moved here from the core's queue when the buffer is
/// empty, so at most one batch is outside the core at a time.
#[derive(Debug, Default)]
pub(crate) struct OutBuf {
    buf: Vec<u8>,
    pos: usize,
    /// Records in `buf`, in order.
    frames: VecDeque<Record>,
}

impl OutBuf {
    pub(crate) fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    /// Unwritten bytes (including length prefixes).
    pub(crate) fn pending_bytes(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Frames not yet completely written.
    pub(crate) fn pending_frames(&self) -> usize {
        self.frames.len()
    }

    /// Whether a frame of the network (not a probe) is partly written.
    pub(crate) fn frame_pending(&self) -> bool {
        self.frames.iter().any(|r| !r.probe)
    }

    /// Appends one frame. Frames reaching the switch were checked on ingress,
    /// so encoding cannot fail; an oversized one would be skipped.
    pub(crate) fn push(&mut self, frame: QueuedFrame) -> Result<(), framing::FrameError> {
        if self.is_empty() {
            self.buf.clear();
            self.pos = 0;
        }
        framing::encode(&frame, &mut self.buf)?;
        self.frames.push_back(Record {
            end: self.buf.len(),
            len: frame.len(),
            frame: Some(frame),
            probe: false,
        });
        Ok(())
    }

    /// Appends a cut probe (see [`crate::mediator::probe`]). Only into an
    /// empty buffer: the caller checked that nothing is on its way.
    pub(crate) fn push_probe(&mut self, probe: &[u8]) -> Result<(), framing::FrameError> {
        debug_assert!(
            self.is_empty(),
            "a probe goes behind everything already written"
        );
        self.buf.clear();
        self.pos = 0;
        framing::encode(probe, &mut self.buf)?;
        self.frames.push_back(Record {
            end: self.buf.len(),
            len: probe.len(),
            frame: None,
            probe: true,
        });
        Ok(())
    }

    /// A buffer holding only `remainder`, the unwritten end of the record of
    /// a `frame_len`-byte frame (see [`partial`](Self::partial)).
    pub(crate) fn resume(remainder: Vec<u8>, frame_len: usize) -> Self {
        let mut out = OutBuf::default();
        if !remainder.is_empty() {
            let end = remainder.len();
            out.buf = remainder;
            out.frames.push_back(Record {
                end,
                len: frame_len,
                frame: None,
                probe: false,
            });
        }
        out
    }

    /// The unwritten bytes and frame length of the partly written frame,
    /// once [`take_unstarted`](Self::take_unstarted) has left only it.
    pub(crate) fn partial(&self) -> Option<(Vec<u8>, usize)> {
        debug_assert!(self.frames.len() <= 1, "call take_unstarted first");
        let rec = self.frames.front()?;
        Some((self.buf[self.pos..rec.end].to_vec(), rec.len))
    }

    /// Marks `n` more bytes written; calls `done` with the frame length of
    /// every frame (not probe) whose record is now complete.
    pub(crate) fn advance(&mut self, n: usize, mut done: impl FnMut(usize)) {
        self.pos += n;
        while let Some(rec) = self.frames.front() {
            if rec.end > self.pos {
                break;
            }
            if !rec.probe {
                done(rec.len);
            }
            self.frames.pop_front();
        }
    }

    /// Removes the frames of which no byte has been written yet and returns
    /// them in order. A partly written frame stays.
    pub(crate) fn take_unstarted(&mut self) -> Vec<QueuedFrame> {
        let mut taken = Vec::new();
        while let Some(rec) = self.frames.back() {
            let Some(frame) = &rec.frame else { break };
            let start = rec.end - rec.len - HEADER_LEN;
            if start < self.pos {
                break;
            }
            let frame = frame.clone();
            self.buf.truncate(start);
            self.frames.pop_back();
            taken.push(frame);
        }
        taken.reverse();
        taken
    }

    /// Sends buffered bytes without blocking and without raising SIGPIPE.
    pub(crate) fn send(&self, stream: &UnixStream) -> io::Result<usize> {
        SockRef::from(stream).send_with_flags(&self.buf[self.pos..], libc::MSG_NOSIGNAL)
    }
}

/// A port's connection to its peer.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) stream: UnixStream,
    pub(crate) decoder: Decoder,
    pub(crate) out: OutBuf,
}

impl Conn {
    pub(crate) fn new(stream: UnixStream) -> Self {
        Conn {
            stream,
            decoder: Decoder::new(),
            out: OutBuf::default(),
        }
    }

    /// A connection taken over from a frozen switch: `rx_pending` is the
    /// decoder's partial input, `out` the rest of a partly written frame.
    pub(crate) fn resume(stream: UnixStream, rx_pending: &[u8], out: OutBuf) -> Self {
        let mut decoder = Decoder::new();
        decoder.feed(rx_pending);
        Conn {
            stream,
            decoder,
            out,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn f(n: u8, len: usize) -> QueuedFrame {
        QueuedFrame::untagged(Arc::from(vec![n; len]))
    }

    #[test]
    fn advance_reports_completed_frames() {
        let mut out = OutBuf::default();
        out.push(f(1, 10)).unwrap();
        out.push(f(2, 20)).unwrap();
        let mut done = Vec::new();
        out.advance(13, |len| done.push(len));
        assert!(done.is_empty());
        out.advance(1, |len| done.push(len));
        assert_eq!(done, vec![10]);
        assert_eq!(out.pending_bytes(), 24);
        out.advance(24, |len| done.push(len));
        assert_eq!(done, vec![10, 20]);
        assert!(out.is_empty());
    }

    #[test]
    fn take_unstarted_keeps_partial_frame() {
        let mut out = OutBuf::default();
        for i in 0..4 {
            out.push(f(i, 10)).unwrap();
        }
        out.advance(14 + 3, |_| {}); // frame 0 done, frame 1 started
        let taken: Vec<u8> = out.take_unstarted().iter().map(|fr| fr[0]).collect();
        assert_eq!(taken, vec![2, 3]);
        assert_eq!((out.pending_frames(), out.pending_bytes()), (1, 11));
        out.advance(11, |_| {});
        assert!(out.is_empty());
        assert!(out.take_unstarted().is_empty());
    }

    #[test]
    fn a_probe_is_written_but_not_counted_nor_taken_back() {
        let mut out = OutBuf::default();
        out.push_probe(&[9u8; 60]).unwrap();
        assert_eq!((out.pending_frames(), out.pending_bytes()), (1, 64));
        assert!(
            out.take_unstarted().is_empty(),
            "a probe is never requeued as a frame"
        );
        let mut done = Vec::new();
        out.advance(64, |len| done.push(len));
        assert!(done.is_empty(), "a probe is not a forwarded frame");
        assert!(out.is_empty());
        out.push(f(1, 10)).unwrap();
        out.advance(14, |len| done.push(len));
        assert_eq!(done, vec![10]);
    }

    #[test]
    fn partial_frame_survives_resume() {
        let mut out = OutBuf::default();
        for i in 0..3 {
            out.push(f(i, 10)).unwrap();
        }
        out.advance(14 + 5, |_| {}); // frame 1: header and 1 byte written
        let taken: Vec<u8> = out.take_unstarted().iter().map(|fr| fr[0]).collect();
        assert_eq!(taken, vec![2]);
        let (rest, len) = out.partial().unwrap();
        assert_eq!((rest, len), (vec![1u8; 9], 10));

        let mut resumed = OutBuf::resume(vec![1u8; 9], 10);
        assert_eq!((resumed.pending_frames(), resumed.pending_bytes()), (1, 9));
        assert!(
            resumed.take_unstarted().is_empty(),
            "a remainder is started"
        );
        resumed.push(f(2, 10)).unwrap();
        assert_eq!(resumed.take_unstarted().len(), 1);
        let mut done = Vec::new();
        resumed.advance(4, |len| done.push(len));
        resumed.advance(5, |len| done.push(len));
        assert_eq!(done, vec![10]);
        assert!(resumed.is_empty() && resumed.partial().is_none());
        assert!(OutBuf::resume(Vec::new(), 10).is_empty());
    }
}
