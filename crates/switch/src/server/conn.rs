//! One client connection of a port: its socket, decoder and write batch.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use mio::net::UnixStream;
use socket2::SockRef;

use crate::framing::{self, Decoder, HEADER_LEN};

/// Encoded frames taken from the port's queue and being written.
///
/// Frames are only moved here from the core's queue when the buffer is
/// empty, so at most one batch is outside the core at a time.
#[derive(Debug, Default)]
pub(crate) struct OutBuf {
    buf: Vec<u8>,
    pos: usize,
    /// Frames in `buf`, with the offset where each one's record ends.
    frames: VecDeque<(usize, Arc<[u8]>)>,
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

    /// Appends one frame. Frames reaching the switch were checked on ingress,
    /// so encoding cannot fail; an oversized one would be skipped.
    pub(crate) fn push(&mut self, frame: Arc<[u8]>) -> Result<(), framing::FrameError> {
        if self.is_empty() {
            self.buf.clear();
            self.pos = 0;
        }
        framing::encode(&frame, &mut self.buf)?;
        self.frames.push_back((self.buf.len(), frame));
        Ok(())
    }

    /// Marks `n` more bytes written; calls `done` for every frame whose
    /// record is now complete.
    pub(crate) fn advance(&mut self, n: usize, mut done: impl FnMut(&Arc<[u8]>)) {
        self.pos += n;
        while let Some((end, _)) = self.frames.front() {
            if *end > self.pos {
                break;
            }
            let (_, frame) = self.frames.pop_front().expect("front exists");
            done(&frame);
        }
    }

    /// Removes the frames of which no byte has been written yet and returns
    /// them in order. A partly written frame stays.
    pub(crate) fn take_unstarted(&mut self) -> Vec<Arc<[u8]>> {
        let mut taken = Vec::new();
        while let Some((end, frame)) = self.frames.back() {
            let start = end - frame.len() - HEADER_LEN;
            if start < self.pos {
                break;
            }
            self.buf.truncate(start);
            taken.push(self.frames.pop_back().expect("back exists").1);
        }
        taken.reverse();
        taken
    }

    /// Sends buffered bytes without blocking and without raising SIGPIPE.
    pub(crate) fn send(&self, stream: &UnixStream) -> io::Result<usize> {
        SockRef::from(stream).send_with_flags(&self.buf[self.pos..], libc::MSG_NOSIGNAL)
    }
}

/// A connected client.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(n: u8, len: usize) -> Arc<[u8]> {
        Arc::from(vec![n; len])
    }

    #[test]
    fn advance_reports_completed_frames() {
        let mut out = OutBuf::default();
        out.push(f(1, 10)).unwrap();
        out.push(f(2, 20)).unwrap();
        let mut done = Vec::new();
        out.advance(13, |fr| done.push(fr[0]));
        assert!(done.is_empty());
        out.advance(1, |fr| done.push(fr[0]));
        assert_eq!(done, vec![1]);
        assert_eq!(out.pending_bytes(), 24);
        out.advance(24, |fr| done.push(fr[0]));
        assert_eq!(done, vec![1, 2]);
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
}
