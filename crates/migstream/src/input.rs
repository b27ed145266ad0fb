//! A buffered byte source that knows its stream offset.
//!
//! Every read names what it is reading, so that a stream ending early
//! becomes [`StreamError::Truncated`] with the offset and the item, and an
//! I/O error carries the offset too. Reads never allocate based on a
//! length read from the stream: fixed-size items go to caller buffers, and
//! [`Input::read_to_end_limited`] grows only as bytes actually arrive.

use std::io::{ErrorKind, Read};

use crate::error::StreamError;

/// Size of the read buffer: a few pages, so that small records cost no
/// system call each.
const BUF_SIZE: usize = 64 * 1024;

/// A buffered reader over `R` that tracks the absolute stream offset.
pub(crate) struct Input<R> {
    inner: R,
    buf: Box<[u8]>,
    /// Start of the unread bytes in `buf`.
    pos: usize,
    /// End of the valid bytes in `buf`.
    len: usize,
    /// Stream offset of `buf[pos]`.
    offset: u64,
    /// The source returned end of file.
    eof: bool,
}

impl<R: Read> Input<R> {
    pub(crate) fn new(inner: R) -> Self {
        Input {
            inner,
            buf: vec![0; BUF_SIZE].into_boxed_slice(),
            pos: 0,
            len: 0,
            offset: 0,
            eof: false,
        }
    }

    /// Stream offset of the next unread byte.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    pub(crate) fn into_inner(self) -> R {
        self.inner
    }

    /// Refills the buffer if it is empty. Returns false at end of stream.
    fn fill(&mut self) -> Result<bool, StreamError> {
        if self.pos < self.len {
            return Ok(true);
        }
        if self.eof {
            return Ok(false);
        }
        self.pos = 0;
        self.len = 0;
        loop {
            match self.inner.read(&mut self.buf) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.len = n;
                    return Ok(true);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(StreamError::Io {
                        offset: self.offset,
                        source,
                    })
                }
            }
        }
    }

    /// The next byte without consuming it, or `None` at end of stream.
    pub(crate) fn peek_u8(&mut self) -> Result<Option<u8>, StreamError> {
        Ok(if self.fill()? {
            Some(self.buf[self.pos])
        } else {
            None
        })
    }

    /// Fills `out` completely. `start` is the offset of the item `out` is
    /// part of, named by `what` in a truncation error.
    pub(crate) fn read_exact_at(
        &mut self,
        out: &mut [u8],
        start: u64,
        what: &'static str,
    ) -> Result<(), StreamError> {
        let mut done = 0;
        while done < out.len() {
            if !self.fill()? {
                return Err(StreamError::Truncated {
                    offset: start,
                    end: self.offset,
                    expected: what,
                });
            }
            let n = (self.len - self.pos).min(out.len() - done);
            out[done..done + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            self.offset += n as u64;
            done += n;
        }
        Ok(())
    }

    /// Fills `out` completely; `what` starts at the current offset.
    pub(crate) fn read_exact(
        &mut self,
        out: &mut [u8],
        what: &'static str,
    ) -> Result<(), StreamError> {
        let start = self.offset;
        self.read_exact_at(out, start, what)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, StreamError> {
        let mut b = [0; 1];
        self.read_exact(&mut b, what)?;
        Ok(b[0])
    }

    pub(crate) fn be16(&mut self, what: &'static str) -> Result<u16, StreamError> {
        let mut b = [0; 2];
        self.read_exact(&mut b, what)?;
        Ok(u16::from_be_bytes(b))
    }

    pub(crate) fn be32(&mut self, what: &'static str) -> Result<u32, StreamError> {
        let mut b = [0; 4];
        self.read_exact(&mut b, what)?;
        Ok(u32::from_be_bytes(b))
    }

    pub(crate) fn be64(&mut self, what: &'static str) -> Result<u64, StreamError> {
        let mut b = [0; 8];
        self.read_exact(&mut b, what)?;
        Ok(u64::from_be_bytes(b))
    }

    /// Reads a `u8 len | bytes` string (an idstr) into `out`, returning its
    /// length. At most 255 bytes, so no allocation.
    pub(crate) fn short_str<'b>(
        &mut self,
        out: &'b mut [u8; 256],
        what: &'static str,
    ) -> Result<&'b [u8], StreamError> {
        let start = self.offset;
        let len = self.u8(what)? as usize;
        self.read_exact_at(&mut out[..len], start, what)?;
        Ok(&out[..len])
    }

    /// Appends everything up to the end of the stream to `out`, failing
    /// with `Ok(false)` (and stopping) once `out` would exceed `limit`
    /// bytes. Memory grows with the bytes received, never ahead of them.
    pub(crate) fn read_to_end_limited(
        &mut self,
        out: &mut Vec<u8>,
        limit: usize,
    ) -> Result<bool, StreamError> {
        while self.fill()? {
            let n = self.len - self.pos;
            if out.len() + n > limit {
                return Ok(false);
            }
            out.extend_from_slice(&self.buf[self.pos..self.len]);
            self.pos = self.len;
            self.offset += n as u64;
        }
        Ok(true)
    }
}
