//! Test helpers for the postcopy source: a page source over memory, a
//! parser of the postcopy stream as a QEMU destination would see it
//! (written from the wire-format reference, independent of the crate's
//! encoder), and a fake destination built on it.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmcsnap_migstream::postcopy::return_path::{encode_message, RpMessage};
use vmcsnap_migstream::postcopy::{
    run_source, DestBlock, PageId, PageSource, PostcopyError, SourceConfig, SourceEvent,
    SourceReport,
};

/// Pages per block, per page; `None` is a zero page.
pub type Pages = Vec<Vec<Option<Box<[u8]>>>>;

/// A [`PageSource`] over memory, optionally failing on one page.
pub struct MemPages {
    pub pages: Arc<Pages>,
    pub fail_on: Option<PageId>,
}

impl MemPages {
    pub fn new(pages: Arc<Pages>) -> Self {
        MemPages {
            pages,
            fail_on: None,
        }
    }
}

impl PageSource for MemPages {
    fn read_page(&mut self, id: PageId, buf: &mut [u8]) -> io::Result<bool> {
        if self.fail_on == Some(id) {
            return Err(io::Error::other("injected failure"));
        }
        match &self.pages[id.block as usize][id.page as usize] {
            Some(p) => {
                buf.copy_from_slice(p);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// Synthetic pages for `blocks`: every third page zero, the others filled
/// with a pattern naming the page.
pub fn synthetic_pages(blocks: &[DestBlock]) -> Pages {
    blocks
        .iter()
        .enumerate()
        .map(|(b, blk)| {
            (0..blk.used_length / 4096)
                .map(|p| {
                    (p % 3 != 1).then(|| {
                        let mut v = vec![0u8; 4096];
                        for (i, x) in v.iter_mut().enumerate() {
                            *x = (b as u64 * 31 + p * 7 + i as u64 % 251) as u8 | 1;
                        }
                        v.into_boxed_slice()
                    })
                })
                .collect()
        })
        .collect()
}

/// One page record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub block: String,
    pub offset: u64,
    /// `None` for a ZERO record.
    pub data: Option<Vec<u8>>,
    /// The record carried the block name (no CONTINUE).
    pub named: bool,
}

/// One top-level item of a postcopy stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Header {
        machine: String,
    },
    Command {
        cmd: u16,
        payload: Vec<u8>,
    },
    Package {
        blob: Vec<u8>,
    },
    RamSetup {
        id: u32,
        blocks: Vec<(String, u64)>,
    },
    Section {
        kind: u8,
        id: u32,
        records: Vec<Record>,
    },
    Eof,
}

/// Reads a postcopy stream item by item, checking what QEMU would check.
pub struct StreamParser<R> {
    r: R,
    started: bool,
    last_block: Option<String>,
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl<R: Read> StreamParser<R> {
    pub fn new(r: R) -> Self {
        StreamParser {
            r,
            started: false,
            last_block: None,
        }
    }

    fn bytes(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0; n];
        self.r.read_exact(&mut v)?;
        Ok(v)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    fn be16(&mut self) -> io::Result<u16> {
        Ok(u16::from_be_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    fn be32(&mut self) -> io::Result<u32> {
        Ok(u32::from_be_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn be64(&mut self) -> io::Result<u64> {
        Ok(u64::from_be_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    fn str8(&mut self) -> io::Result<String> {
        let n = self.u8()?;
        String::from_utf8(self.bytes(n.into())?).map_err(|e| bad(e.to_string()))
    }
    fn footer(&mut self, id: u32) -> io::Result<()> {
        let (f, fid) = (self.u8()?, self.be32()?);
        if f != 0x7e || fid != id {
            return Err(bad(format!("bad footer {f:#x} {fid} for section {id}")));
        }
        Ok(())
    }

    /// The next item; `None` after EOF.
    pub fn next_item(&mut self) -> io::Result<Item> {
        if !self.started {
            self.started = true;
            let (magic, version) = (self.be32()?, self.be32()?);
            if magic != 0x5145_564d || version != 3 {
                return Err(bad(format!("bad header {magic:#x} {version}")));
            }
            if self.u8()? != 0x07 {
                return Err(bad("no configuration section".into()));
            }
            let n = self.be32()?;
            let machine = String::from_utf8(self.bytes(n as usize)?).unwrap();
            return Ok(Item::Header { machine });
        }
        match self.u8()? {
            0x00 => Ok(Item::Eof),
            0x08 => {
                let (cmd, len) = (self.be16()?, self.be16()?);
                let payload = self.bytes(len.into())?;
                if cmd == 7 {
                    assert_eq!(len, 4);
                    let l = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    return Ok(Item::Package {
                        blob: self.bytes(l as usize)?,
                    });
                }
                Ok(Item::Command { cmd, payload })
            }
            0x01 => {
                let id = self.be32()?;
                let (idstr, inst, ver) = (self.str8()?, self.be32()?, self.be32()?);
                if idstr != "ram" || inst != 0 || ver != 4 || id == 0 {
                    return Err(bad(format!("START {id} {idstr} {inst} {ver}")));
                }
                let total = self.be64()?;
                if total & 0xfff != 4 {
                    return Err(bad(format!("no MEM_SIZE: {total:#x}")));
                }
                let (mut left, mut blocks) = (total & !0xfff, Vec::new());
                while left > 0 {
                    let (name, len) = (self.str8()?, self.be64()?);
                    left = left
                        .checked_sub(len)
                        .ok_or_else(|| bad("block list overruns".into()))?;
                    blocks.push((name, len));
                }
                if self.be64()? != 0x10 {
                    return Err(bad("setup without EOS".into()));
                }
                self.footer(id)?;
                Ok(Item::RamSetup { id, blocks })
            }
            kind @ (0x02 | 0x03) => {
                let id = self.be32()?;
                let mut records = Vec::new();
                loop {
                    let hdr = self.be64()?;
                    let (offset, flags) = (hdr & !0xfff, hdr & 0xfff);
                    if flags == 0x10 {
                        break;
                    }
                    let named = flags & 0x20 == 0;
                    let block = if named {
                        let n = self.str8()?;
                        self.last_block = Some(n.clone());
                        n
                    } else {
                        self.last_block
                            .clone()
                            .ok_or_else(|| bad("CONTINUE without block".into()))?
                    };
                    let data = match flags & !0x20 {
                        0x02 => {
                            if self.u8()? != 0 {
                                return Err(bad("ZERO fill not 0".into()));
                            }
                            None
                        }
                        0x08 => Some(self.bytes(4096)?),
                        f => return Err(bad(format!("record flags {f:#x}"))),
                    };
                    records.push(Record {
                        block,
                        offset,
                        data,
                        named,
                    });
                }
                self.footer(id)?;
                Ok(Item::Section { kind, id, records })
            }
            t => Err(bad(format!("unexpected top-level byte {t:#x}"))),
        }
    }
}

/// The DISCARD ranges of a POSTCOPY_RAM_DISCARD payload: (block, start, len).
pub fn discard_ranges(payload: &[u8]) -> Vec<(String, u64, u64)> {
    assert_eq!(payload[0], 0, "discard version");
    let n = usize::from(payload[1]);
    let name = String::from_utf8(payload[2..2 + n].to_vec()).unwrap();
    assert_eq!(payload[2 + n], 0, "discard NUL");
    let rest = &payload[3 + n..];
    assert!(!rest.is_empty() && rest.len() / 16 * 16 == rest.len());
    rest.chunks(16)
        .map(|c| {
            (
                name.clone(),
                u64::from_be_bytes(c[..8].try_into().unwrap()),
                u64::from_be_bytes(c[8..].try_into().unwrap()),
            )
        })
        .collect()
}

/// The return-path side a fake destination writes to.
pub struct Rp(pub UnixStream);

impl Rp {
    pub fn send(&mut self, msg: RpMessage) {
        let mut out = Vec::new();
        encode_message(&msg, &mut out);
        let _ = self.0.write_all(&out);
    }
    /// Several messages in one write.
    pub fn send_all(&mut self, msgs: Vec<RpMessage>) {
        let mut out = Vec::new();
        for m in &msgs {
            encode_message(m, &mut out);
        }
        let _ = self.0.write_all(&out);
    }
    pub fn raw(&mut self, bytes: &[u8]) {
        let _ = self.0.write_all(bytes);
    }
}

/// Accepts one connection on `listener` and parses the stream, calling
/// `on_item` after every item (and answering PINGs with PONGs). Ends at
/// EOF, a parse error, or when `on_item` returns false; returns the items
/// and how the parse ended.
pub fn fake_destination(
    listener: UnixListener,
    mut on_item: impl FnMut(&Item, &mut Rp) -> bool + Send + 'static,
) -> JoinHandle<(Vec<Item>, Option<io::Error>)> {
    std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let mut rp = Rp(conn.try_clone().unwrap());
        let mut p = StreamParser::new(io::BufReader::new(conn));
        let mut items = Vec::new();
        loop {
            match p.next_item() {
                Ok(item) => {
                    if let Item::Command { cmd: 2, payload } = &item {
                        rp.send(RpMessage::Pong(u32::from_be_bytes(
                            payload[..4].try_into().unwrap(),
                        )));
                    }
                    let eof = item == Item::Eof;
                    let go_on = on_item(&item, &mut rp);
                    items.push(item);
                    if eof || !go_on {
                        return (items, None);
                    }
                }
                Err(e) => return (items, Some(e)),
            }
        }
    })
}

/// What a guarded run of the source gave.
pub struct Run {
    pub result: Result<SourceReport, PostcopyError>,
    pub events: Vec<SourceEvent>,
    pub took: Duration,
}

/// Runs [`run_source`] on a thread and fails the test if it does not
/// return within `guard` (a hang must fail, not block CI). `on_event`
/// sees every event as it happens.
pub fn run_guarded(
    cfg: SourceConfig,
    mut pages: MemPages,
    stream: UnixStream,
    guard: Duration,
    mut on_event: impl FnMut(&SourceEvent) + Send + 'static,
) -> Run {
    let (tx, rx) = mpsc::channel();
    let t0 = Instant::now();
    std::thread::spawn(move || {
        let mut events = Vec::new();
        let result = run_source(&cfg, &mut pages, stream, &mut |e| {
            on_event(&e);
            events.push(e);
        });
        let _ = tx.send((result, events));
    });
    match rx.recv_timeout(guard) {
        Ok((result, events)) => Run {
            result,
            events,
            took: t0.elapsed(),
        },
        Err(_) => panic!("run_source did not return within {guard:?}: it hangs"),
    }
}
