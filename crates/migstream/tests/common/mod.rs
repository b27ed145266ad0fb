//! Test helpers: a test-only stream encoder, fixture loading, and an event
//! collector that turns a stream into owned values.
#![allow(dead_code)]

pub mod encoder;
pub mod postcopy;
pub mod qemu;

use std::io::Read;
use std::path::Path;

use vmcsnap_migstream::{
    Command, Configuration, Event, PageOrigin, RamBlock, ReaderOptions, SectionType, Stats,
    StreamError, StreamReader, VmDescription,
};

/// A fixture from tests/data, decompressed.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(format!("{name}.mig.gz"));
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// One page record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageRec {
    pub block: usize,
    pub offset: u64,
    /// `None` for a ZERO record.
    pub data: Option<Vec<u8>>,
    pub fill: u8,
    pub origin: PageOrigin,
}

/// Everything a stream produced.
#[derive(Debug, Default)]
pub struct Collected {
    pub config: Option<Configuration>,
    pub commands: Vec<Command>,
    /// (kind, id, footer) per RAM section.
    pub sections: Vec<(SectionType, u32, bool)>,
    pub blocks: Vec<RamBlock>,
    pub pages: Vec<PageRec>,
    pub device_offset: u64,
    pub device_state: Vec<u8>,
    pub vmdesc: Option<VmDescription>,
    pub stats: Stats,
    pub events: usize,
}

impl Collected {
    pub fn page_name(&self, p: &PageRec) -> &str {
        &self.blocks[p.block].name
    }
}

/// Reads a whole stream from `source`.
pub fn collect_from(source: impl Read, opts: ReaderOptions) -> Result<Collected, StreamError> {
    let mut r = StreamReader::with_options(source, opts);
    let mut c = Collected::default();
    let mut ended = false;
    while let Some(ev) = r.next_event()? {
        assert!(!ended, "event after End");
        c.events += 1;
        match ev {
            Event::Header {
                version,
                configuration,
            } => {
                assert_eq!(version, 3);
                c.config = configuration.cloned();
            }
            Event::Command { command, .. } => c.commands.push(command),
            Event::SectionStart(h) => c.sections.push((h.kind, h.section_id, false)),
            Event::RamBlocks(b) => c.blocks = b.to_vec(),
            Event::Page {
                block,
                offset,
                data,
                origin,
            } => c.pages.push(PageRec {
                block,
                offset,
                data: Some(data.to_vec()),
                fill: 0,
                origin,
            }),
            Event::ZeroPage {
                block,
                offset,
                fill,
                origin,
            } => c.pages.push(PageRec {
                block,
                offset,
                data: None,
                fill,
                origin,
            }),
            Event::SectionEnd { section_id, footer } => {
                let last = c
                    .sections
                    .last_mut()
                    .expect("SectionEnd without SectionStart");
                assert_eq!(last.1, section_id);
                last.2 = footer;
            }
            Event::DeviceState {
                stream_offset,
                data,
            } => {
                c.device_offset = stream_offset;
                c.device_state = data.to_vec();
            }
            Event::End { vmdesc } => {
                c.vmdesc = vmdesc.cloned();
                ended = true;
            }
        }
    }
    assert!(ended, "stream ended without End");
    assert!(r.next_event().unwrap().is_none());
    c.stats = r.stats().clone();
    Ok(c)
}

/// Reads a whole stream from memory with default options.
pub fn collect(bytes: &[u8]) -> Result<Collected, StreamError> {
    collect_from(bytes, ReaderOptions::default())
}

/// Runs a reader over `bytes` to the end or the first error, touching
/// every event, and returns the error if any.
pub fn drain(bytes: &[u8], opts: ReaderOptions) -> Option<StreamError> {
    let mut r = StreamReader::with_options(bytes, opts);
    loop {
        match r.next_event() {
            Ok(Some(Event::Page { data, .. })) => assert_eq!(data.len() as u64, r_page_size()),
            Ok(Some(_)) => {}
            Ok(None) => return None,
            Err(e) => {
                assert!(matches!(r.next_event(), Err(StreamError::Failed)));
                return Some(e);
            }
        }
    }
}

fn r_page_size() -> u64 {
    4096
}

/// A tiny xorshift generator, so randomized tests need no dependency and
/// are reproducible from their seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
