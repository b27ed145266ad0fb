//! The return path (§4): messages from the destination to the source,
//! `be16 type | be16 len | payload`, on the same socket in the other
//! direction.
//!
//! [`parse_message`] is a pure function over a byte buffer (fuzzed by
//! `fuzz/fuzz_targets/parse_return_path.rs`); the reader thread that
//! feeds it and turns page requests into [`PageId`]s for the sender is
//! crate-internal.

use std::io::{self, Read};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::Sender;
use std::time::Instant;

use thiserror::Error;

use super::error::PostcopyError;
use super::{DestBlock, PageId};

/// Message types (`enum mig_rp_message_type`, §4.2).
pub mod rp_type {
    /// The destination is done with the return path: be32 value, 0 = OK.
    pub const SHUT: u16 = 1;
    /// Answer to PING: be32 echoed value.
    pub const PONG: u16 = 2;
    /// Page request naming its block: be64 start, be32 len, u8 n, idstr.
    pub const REQ_PAGES_ID: u16 = 3;
    /// Page request in the block of the last REQ_PAGES_ID: be64 start, be32 len.
    pub const REQ_PAGES: u16 = 4;
    /// Postcopy recovery only.
    pub const RECV_BITMAP: u16 = 5;
    /// Postcopy recovery only.
    pub const RESUME_ACK: u16 = 6;
}

/// The longest valid message: header plus a REQ_PAGES_ID with a 255-byte
/// block name. The parser never needs more than this many bytes to decide.
pub const MAX_MESSAGE_LEN: usize = 4 + 12 + 1 + 255;

/// A return-path message the source understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RpMessage {
    /// SHUT(value): the destination will send nothing more; 0 = success.
    Shut(u32),
    /// PONG(value), the answer to PING(value).
    Pong(u32),
    /// Page request naming its block (REQ_PAGES_ID).
    ReqPagesId {
        /// Byte offset in the block.
        start: u64,
        /// Length in bytes (the block's page size).
        len: u32,
        /// The block's idstr.
        block: String,
    },
    /// Page request in the block of the previous REQ_PAGES_ID (REQ_PAGES).
    ReqPages {
        /// Byte offset in the block.
        start: u64,
        /// Length in bytes.
        len: u32,
    },
}

/// Why return-path bytes are not a valid message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RpError {
    /// The type is 0 or not defined by QEMU 7.2.
    #[error("unknown message type {ty:#06x} (length {len}); QEMU 7.2 sends types 1..=6")]
    UnknownType {
        /// The type field.
        ty: u16,
        /// The length field.
        len: u16,
    },
    /// The length does not fit the type.
    #[error("{name} message with bad length {len} (expected {expected})")]
    BadLength {
        /// The message name.
        name: &'static str,
        /// The length field.
        len: u16,
        /// What was expected.
        expected: String,
    },
    /// A message valid in QEMU but not in a fresh postcopy migration.
    #[error(
        "unexpected {name} message: it belongs to postcopy recovery, which this source does not do"
    )]
    Unexpected {
        /// The message name.
        name: &'static str,
    },
    /// The block name of a REQ_PAGES_ID is not UTF-8 (QEMU's are ASCII).
    #[error("REQ_PAGES_ID block name is not UTF-8")]
    BadBlockName,
    /// A REQ_PAGES came before any REQ_PAGES_ID named a block.
    #[error("REQ_PAGES before any REQ_PAGES_ID named a block")]
    NoBlockYet,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Parses the message at the start of `buf`.
///
/// `Ok(None)`: `buf` is a valid but incomplete prefix, read more (never
/// once `buf` holds [`MAX_MESSAGE_LEN`] bytes). `Ok(Some((msg, n)))`: the
/// message took the first `n` bytes. Errors are decided from the 4-byte
/// header where possible, so garbage is reported without waiting for a
/// payload that may never come.
pub fn parse_message(buf: &[u8]) -> Result<Option<(RpMessage, usize)>, RpError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let (ty, len) = (be16(buf), be16(&buf[2..]));
    let bad = |name, expected: &str| RpError::BadLength {
        name,
        len,
        expected: expected.into(),
    };
    let fixed = |name, want: u16| {
        if len == want {
            Ok(())
        } else {
            Err(bad(name, &want.to_string()))
        }
    };
    match ty {
        rp_type::SHUT => fixed("SHUT", 4)?,
        rp_type::PONG => fixed("PONG", 4)?,
        rp_type::REQ_PAGES => fixed("REQ_PAGES", 12)?,
        rp_type::REQ_PAGES_ID => {
            if !(13..=13 + 255).contains(&len) {
                return Err(bad("REQ_PAGES_ID", "13 + name length, at most 268"));
            }
        }
        rp_type::RECV_BITMAP => {
            return Err(RpError::Unexpected {
                name: "RECV_BITMAP",
            })
        }
        rp_type::RESUME_ACK => return Err(RpError::Unexpected { name: "RESUME_ACK" }),
        _ => return Err(RpError::UnknownType { ty, len }),
    }
    let total = 4 + usize::from(len);
    if buf.len() < total {
        return Ok(None);
    }
    let p = &buf[4..total];
    let msg = match ty {
        rp_type::SHUT => RpMessage::Shut(be32(p)),
        rp_type::PONG => RpMessage::Pong(be32(p)),
        rp_type::REQ_PAGES => RpMessage::ReqPages {
            start: be64(p),
            len: be32(&p[8..]),
        },
        _ => {
            let n = usize::from(p[12]);
            if 13 + n != p.len() {
                return Err(bad(
                    "REQ_PAGES_ID",
                    &format!("13 + name length {n} = {}", 13 + n),
                ));
            }
            let block = std::str::from_utf8(&p[13..])
                .map_err(|_| RpError::BadBlockName)?
                .to_owned();
            RpMessage::ReqPagesId {
                start: be64(p),
                len: be32(&p[8..]),
                block,
            }
        }
    };
    Ok(Some((msg, total)))
}

/// Appends `msg` as QEMU's destination would send it (for tests and fake
/// destinations). The block name of a REQ_PAGES_ID must be ≤ 255 bytes.
pub fn encode_message(msg: &RpMessage, out: &mut Vec<u8>) {
    let mut p = Vec::new();
    let ty = match msg {
        RpMessage::Shut(v) => {
            p.extend_from_slice(&v.to_be_bytes());
            rp_type::SHUT
        }
        RpMessage::Pong(v) => {
            p.extend_from_slice(&v.to_be_bytes());
            rp_type::PONG
        }
        RpMessage::ReqPagesId { start, len, block } => {
            p.extend_from_slice(&start.to_be_bytes());
            p.extend_from_slice(&len.to_be_bytes());
            p.push(block.len() as u8);
            p.extend_from_slice(block.as_bytes());
            rp_type::REQ_PAGES_ID
        }
        RpMessage::ReqPages { start, len } => {
            p.extend_from_slice(&start.to_be_bytes());
            p.extend_from_slice(&len.to_be_bytes());
            rp_type::REQ_PAGES
        }
    };
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&(p.len() as u16).to_be_bytes());
    out.extend_from_slice(&p);
}

/// What the reader thread tells the sender.
#[derive(Debug)]
pub(crate) enum FromDest {
    /// Pages `first.page .. first.page + count` of `first.block` were requested.
    Request {
        first: PageId,
        count: u32,
        at: Instant,
    },
    Pong(u32),
    /// SHUT; the thread has ended.
    Shut(u32),
    /// End of file or a read error; the thread has ended.
    Closed(Option<io::Error>),
    /// Garbage or a bad request; the thread shut the socket down and ended.
    Failed(PostcopyError),
}

fn hex(bytes: &[u8]) -> String {
    let shown = &bytes[..bytes.len().min(16)];
    let mut s: Vec<String> = shown.iter().map(|b| format!("{b:02x}")).collect();
    if bytes.len() > shown.len() {
        s.push("…".into());
    }
    s.join(" ")
}

/// Turns a page request into pages of `blocks`.
fn resolve(
    blocks: &[DestBlock],
    page_size: u64,
    block_name: &str,
    start: u64,
    len: u32,
) -> Result<(PageId, u32), PostcopyError> {
    let out = |reason: String| PostcopyError::RequestOutOfRange {
        block: block_name.to_owned(),
        start,
        len: len.into(),
        reason,
    };
    let Some(index) = blocks.iter().position(|b| b.name == block_name) else {
        return Err(out("no such block".into()));
    };
    let len = u64::from(len);
    // `is_multiple_of` needs Rust 1.87; the workspace supports 1.75.
    #[allow(clippy::manual_is_multiple_of)]
    let misaligned = start % page_size != 0 || len % page_size != 0;
    if len == 0 || misaligned {
        return Err(out(format!(
            "not a whole number of {page_size:#x}-byte pages"
        )));
    }
    let used = blocks[index].used_length;
    if start >= used || len > used - start {
        return Err(out(format!("beyond the block's length {used:#x}")));
    }
    Ok((
        PageId {
            block: index as u32,
            page: (start / page_size) as u32,
        },
        (len / page_size) as u32,
    ))
}

/// The reader thread's body: reads `stream` until SHUT, end of file, an
/// error, or garbage (then it shuts the socket down so a sender blocked in
/// `write` wakes up). Every outcome is sent to `tx`.
pub(crate) fn reader_thread(
    mut stream: UnixStream,
    blocks: Vec<DestBlock>,
    page_size: u64,
    tx: Sender<Vec<FromDest>>,
) {
    let mut buf = vec![0u8; 4096];
    let (mut filled, mut offset) = (0usize, 0u64);
    let mut current_block: Option<String> = None;
    // Everything parsed from one read goes to the sender in one batch, so
    // a burst of faults is seen (and served) before any cluster neighbour.
    let mut batch = Vec::new();
    let fail = |stream: &UnixStream, mut batch: Vec<FromDest>, e: PostcopyError| {
        let _ = stream.shutdown(Shutdown::Both);
        batch.push(FromDest::Failed(e));
        let _ = tx.send(batch);
    };
    loop {
        // Parse every complete message in the buffer.
        let mut at = 0;
        loop {
            match parse_message(&buf[at..filled]) {
                Ok(None) => break,
                Err(error) => {
                    let bytes = hex(&buf[at..filled]);
                    let offset = offset + at as u64;
                    return fail(
                        &stream,
                        batch,
                        PostcopyError::ReturnPath {
                            offset,
                            bytes,
                            error,
                        },
                    );
                }
                Ok(Some((msg, n))) => {
                    let msg_offset = offset + at as u64;
                    let msg_bytes = hex(&buf[at..at + n]);
                    at += n;
                    let (name, start, len) = match msg {
                        RpMessage::Shut(v) => {
                            batch.push(FromDest::Shut(v));
                            let _ = tx.send(batch);
                            return;
                        }
                        RpMessage::Pong(v) => {
                            batch.push(FromDest::Pong(v));
                            continue;
                        }
                        RpMessage::ReqPagesId { start, len, block } => {
                            current_block = Some(block);
                            (current_block.as_deref().unwrap_or_default(), start, len)
                        }
                        RpMessage::ReqPages { start, len } => match current_block.as_deref() {
                            Some(b) => (b, start, len),
                            None => {
                                let e = PostcopyError::ReturnPath {
                                    offset: msg_offset,
                                    bytes: msg_bytes,
                                    error: RpError::NoBlockYet,
                                };
                                return fail(&stream, batch, e);
                            }
                        },
                    };
                    let at_time = Instant::now();
                    match resolve(&blocks, page_size, name, start, len) {
                        Ok((first, count)) => {
                            batch.push(FromDest::Request {
                                first,
                                count,
                                at: at_time,
                            });
                        }
                        Err(e) => return fail(&stream, batch, e),
                    }
                }
            }
        }
        if !batch.is_empty() && tx.send(std::mem::take(&mut batch)).is_err() {
            return; // the sender is gone
        }
        buf.copy_within(at..filled, 0);
        filled -= at;
        offset += at as u64;
        debug_assert!(filled < MAX_MESSAGE_LEN);
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                let _ = tx.send(vec![FromDest::Closed(None)]);
                return;
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = tx.send(vec![FromDest::Closed(Some(e))]);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(msg: RpMessage) {
        let mut out = Vec::new();
        encode_message(&msg, &mut out);
        assert_eq!(parse_message(&out), Ok(Some((msg.clone(), out.len()))));
        for cut in 0..out.len() {
            assert_eq!(parse_message(&out[..cut]), Ok(None), "{msg:?} cut at {cut}");
        }
        out.extend_from_slice(&[0xff; 7]);
        let n = out.len() - 7;
        assert_eq!(parse_message(&out), Ok(Some((msg, n))));
    }

    #[test]
    fn round_trips() {
        roundtrip(RpMessage::Shut(0));
        roundtrip(RpMessage::Shut(1));
        roundtrip(RpMessage::Pong(3));
        roundtrip(RpMessage::ReqPagesId {
            start: 0x2350000,
            len: 0x1000,
            block: "pc.ram".into(),
        });
        roundtrip(RpMessage::ReqPagesId {
            start: 0,
            len: 0x1000,
            block: "x".repeat(255),
        });
        roundtrip(RpMessage::ReqPages {
            start: 0x2370000,
            len: 0x1000,
        });
    }

    #[test]
    fn qemu_bytes() {
        // §4.2, captured from QEMU.
        let b = [
            0x00, 0x03, 0x00, 0x13, 0, 0, 0, 0, 0x02, 0x35, 0, 0, 0, 0, 0x10, 0, 6, b'p', b'c',
            b'.', b'r', b'a', b'm',
        ];
        assert_eq!(
            parse_message(&b),
            Ok(Some((
                RpMessage::ReqPagesId {
                    start: 0x2350000,
                    len: 0x1000,
                    block: "pc.ram".into()
                },
                b.len()
            )))
        );
        assert_eq!(
            parse_message(&[0, 1, 0, 4, 0, 0, 0, 0]),
            Ok(Some((RpMessage::Shut(0), 8)))
        );
    }

    #[test]
    fn every_error() {
        let e = |b: &[u8]| parse_message(b).unwrap_err();
        assert_eq!(e(&[0, 0, 0, 4]), RpError::UnknownType { ty: 0, len: 4 });
        assert_eq!(e(&[0, 7, 0, 0]), RpError::UnknownType { ty: 7, len: 0 });
        assert_eq!(
            e(&[0xde, 0xad, 0xbe, 0xef]),
            RpError::UnknownType {
                ty: 0xdead,
                len: 0xbeef
            }
        );
        assert!(matches!(
            e(&[0, 1, 0, 5]),
            RpError::BadLength {
                name: "SHUT",
                len: 5,
                ..
            }
        ));
        assert!(matches!(
            e(&[0, 2, 0, 0]),
            RpError::BadLength {
                name: "PONG",
                len: 0,
                ..
            }
        ));
        assert!(matches!(
            e(&[0, 4, 0, 13]),
            RpError::BadLength {
                name: "REQ_PAGES",
                len: 13,
                ..
            }
        ));
        assert!(matches!(
            e(&[0, 3, 0, 12]),
            RpError::BadLength {
                name: "REQ_PAGES_ID",
                ..
            }
        ));
        assert!(matches!(
            e(&[0, 3, 1, 13]),
            RpError::BadLength {
                name: "REQ_PAGES_ID",
                ..
            }
        ));
        // Name length byte disagrees with the message length.
        let mut b = vec![0, 3, 0, 15];
        b.extend_from_slice(&[0; 12]);
        b.extend_from_slice(&[1, b'a', b'b']);
        assert!(matches!(
            e(&b),
            RpError::BadLength {
                name: "REQ_PAGES_ID",
                len: 15,
                ..
            }
        ));
        let mut b = vec![0, 3, 0, 14];
        b.extend_from_slice(&[0; 12]);
        b.extend_from_slice(&[1, 0xff]);
        assert_eq!(e(&b), RpError::BadBlockName);
        assert_eq!(
            e(&[0, 5, 0, 4]),
            RpError::Unexpected {
                name: "RECV_BITMAP"
            }
        );
        assert_eq!(e(&[0, 6, 0, 4]), RpError::Unexpected { name: "RESUME_ACK" });
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut buf = Vec::new();
        for _ in 0..200_000 {
            let len = (next() % 40) as usize;
            buf.clear();
            for _ in 0..len {
                let v = next();
                // Bias towards valid types and small lengths.
                buf.push(if v & 1 == 0 {
                    (v >> 8) as u8 % 8
                } else {
                    (v >> 8) as u8
                });
            }
            if let Ok(Some((_, n))) = parse_message(&buf) {
                assert!((4..=buf.len()).contains(&n));
                assert!(n <= MAX_MESSAGE_LEN);
            }
            if buf.len() >= MAX_MESSAGE_LEN {
                assert_ne!(parse_message(&buf), Ok(None));
            }
        }
        // A full-length buffer always decides.
        for _ in 0..20_000 {
            let b: Vec<u8> = (0..MAX_MESSAGE_LEN).map(|_| next() as u8 % 9).collect();
            assert_ne!(parse_message(&b), Ok(None));
        }
    }

    #[test]
    fn requests_resolve_to_pages() {
        let blocks = vec![
            DestBlock {
                name: "mem".into(),
                used_length: 0x10000,
            },
            DestBlock {
                name: "rom".into(),
                used_length: 0x1000,
            },
        ];
        assert_eq!(
            resolve(&blocks, 0x1000, "mem", 0x3000, 0x2000).unwrap(),
            (PageId { block: 0, page: 3 }, 2)
        );
        assert_eq!(
            resolve(&blocks, 0x1000, "rom", 0, 0x1000).unwrap(),
            (PageId { block: 1, page: 0 }, 1)
        );
        for (name, start, len) in [
            ("nope", 0, 0x1000),
            ("mem", 0x10000, 0x1000),
            ("mem", 0xf000, 0x2000),
            ("mem", 0x800, 0x1000),
            ("mem", 0, 0),
            ("rom", u64::MAX - 0xfff, 0x1000),
        ] {
            let e = resolve(&blocks, 0x1000, name, start, len).unwrap_err();
            assert!(
                matches!(e, PostcopyError::RequestOutOfRange { .. }),
                "{name} {start:#x} {len:#x}: {e}"
            );
        }
    }
}
