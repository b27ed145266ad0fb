//! The incremental stream reader, [`StreamReader`]: a state machine over
//! the stream's top-level items that yields [`Event`]s.

use std::io::Read;

use crate::command::{read_command, Command};
use crate::config::{read_configuration, Configuration};
use crate::device_state::{split_tail, VmDescription};
use crate::error::StreamError;
use crate::event::{Event, SectionHeader, SectionIdent};
use crate::input::Input;
use crate::options::{ReaderOptions, VmDescPolicy};
use crate::page_origin::{PageOrigin, ScanReplay};
use crate::ram::{decode_flags, read_block_list, BlockIndex, RamBlock, RecordKind};
use crate::stats::Stats;
use crate::wire::{
    SectionType, FILE_MAGIC, FILE_VERSION, RAM_IDSTR, RAM_INSTANCE_ID, RAM_SECTION_VERSION,
    SECTION_FOOTER,
};

/// What `step` produced, without borrows.
enum Step {
    Header,
    Command(u64, Command),
    SectionStart(SectionHeader),
    RamBlocks,
    Page {
        block: usize,
        offset: u64,
        origin: PageOrigin,
    },
    ZeroPage {
        block: usize,
        offset: u64,
        fill: u8,
        origin: PageOrigin,
    },
    SectionEnd {
        section_id: u32,
        footer: bool,
    },
    DeviceState,
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Header,
    Sections,
    Ram { section_id: u32 },
    Tail,
    TailRead,
    Done,
    Failed,
}

/// Reads a QEMU 7.2 or 10.0 migration stream incrementally from any
/// [`Read`]; which one is [`ReaderOptions::dialect`].
///
/// Call [`next_event`](Self::next_event) until it returns `Ok(None)`.
/// Reads block until the source has bytes (use a blocking socket). Memory
/// is one page buffer, the read buffer, the RAM block list, the set of
/// pages seen (kept as runs: one per island of out-of-order pages) and, at
/// the end, the device state and VM description; see the crate's Limits.
pub struct StreamReader<R> {
    input: Input<R>,
    opts: ReaderOptions,
    state: State,
    page_size: u64,
    config: Option<Configuration>,
    ram_section_id: Option<u32>,
    blocks: Vec<RamBlock>,
    block_index: BlockIndex,
    have_blocks: bool,
    replay: ScanReplay,
    last_block: Option<usize>,
    footers: Option<bool>,
    page: Vec<u8>,
    /// Device state, EOF and vmdesc, once read.
    tail: Vec<u8>,
    tail_offset: u64,
    device_len: usize,
    vmdesc: Option<VmDescription>,
    stats: Stats,
}

impl<R: Read> StreamReader<R> {
    /// A reader with default options (x86 page size).
    pub fn new(source: R) -> Self {
        Self::with_options(source, ReaderOptions::default())
    }

    /// A reader with the given options.
    ///
    /// # Panics
    /// If `opts.target_page_size` is not a power of two between 1 KiB and 64 KiB.
    pub fn with_options(source: R, opts: ReaderOptions) -> Self {
        let ps = opts.target_page_size;
        assert!(
            ps.is_power_of_two() && (1024..=65536).contains(&ps),
            "bad target page size {ps}"
        );
        StreamReader {
            input: Input::new(source),
            page_size: u64::from(ps),
            opts,
            state: State::Header,
            config: None,
            ram_section_id: None,
            blocks: Vec::new(),
            block_index: BlockIndex::default(),
            have_blocks: false,
            replay: ScanReplay::new([], false),
            last_block: None,
            footers: None,
            page: Vec::new(),
            tail: Vec::new(),
            tail_offset: 0,
            device_len: 0,
            vmdesc: None,
            stats: Stats::default(),
        }
    }

    /// The next event, `Ok(None)` after [`Event::End`]. After an error,
    /// every further call returns [`StreamError::Failed`].
    pub fn next_event(&mut self) -> Result<Option<Event<'_>>, StreamError> {
        match self.state {
            State::Done => return Ok(None),
            State::Failed => return Err(StreamError::Failed),
            _ => {}
        }
        let step = match self.step() {
            Ok(step) => step,
            Err(e) => {
                self.state = State::Failed;
                return Err(e);
            }
        };
        self.stats.bytes = self.input.offset();
        Ok(Some(match step {
            Step::Header => Event::Header {
                version: FILE_VERSION,
                configuration: self.config.as_ref(),
            },
            Step::Command(stream_offset, command) => Event::Command {
                stream_offset,
                command,
            },
            Step::SectionStart(h) => Event::SectionStart(h),
            Step::RamBlocks => Event::RamBlocks(&self.blocks),
            Step::Page {
                block,
                offset,
                origin,
            } => Event::Page {
                block,
                offset,
                data: &self.page,
                origin,
            },
            Step::ZeroPage {
                block,
                offset,
                fill,
                origin,
            } => Event::ZeroPage {
                block,
                offset,
                fill,
                origin,
            },
            Step::SectionEnd { section_id, footer } => Event::SectionEnd { section_id, footer },
            Step::DeviceState => Event::DeviceState {
                stream_offset: self.tail_offset,
                data: &self.tail[..self.device_len],
            },
            Step::End => Event::End {
                vmdesc: self.vmdesc.as_ref(),
            },
        }))
    }

    /// Statistics so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The configuration section, once the header was read.
    pub fn configuration(&self) -> Option<&Configuration> {
        self.config.as_ref()
    }

    /// The RAM block list (empty until [`Event::RamBlocks`]).
    pub fn ram_blocks(&self) -> &[RamBlock] {
        &self.blocks
    }

    /// The target page size in use.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Whether sections carry footers (`send-section-footer`), once the
    /// first RAM section ended.
    pub fn section_footers(&self) -> Option<bool> {
        self.footers
    }

    /// Stream offset of the next byte to be read.
    pub fn offset(&self) -> u64 {
        self.input.offset()
    }

    /// The device state, after [`Event::DeviceState`].
    pub fn device_state(&self) -> Option<&[u8]> {
        matches!(self.state, State::TailRead | State::Done).then(|| &self.tail[..self.device_len])
    }

    /// The VM description, after [`Event::DeviceState`].
    pub fn vmdesc(&self) -> Option<&VmDescription> {
        self.vmdesc.as_ref()
    }

    /// The source, with any bytes the reader buffered but did not use lost.
    pub fn into_inner(self) -> R {
        self.input.into_inner()
    }

    fn step(&mut self) -> Result<Step, StreamError> {
        match self.state {
            State::Header => self.read_header(),
            State::Sections => self.read_section(),
            State::Ram { section_id } => self.read_ram_record(section_id),
            State::Tail => self.read_tail(),
            State::TailRead => {
                self.state = State::Done;
                Ok(Step::End)
            }
            State::Done | State::Failed => unreachable!("checked by next_event"),
        }
    }

    fn read_header(&mut self) -> Result<Step, StreamError> {
        let magic = self.input.be32("stream magic")?;
        if magic != FILE_MAGIC {
            return Err(StreamError::BadMagic { found: magic });
        }
        let version = self.input.be32("stream version")?;
        if version != FILE_VERSION {
            return Err(StreamError::UnsupportedVersion { found: version });
        }
        if self.input.peek_u8()? == Some(SectionType::Configuration as u8) {
            self.input.u8("configuration section")?;
            let config = read_configuration(&mut self.input)?;
            if let Some(bits) = config.target_page_bits {
                self.page_size = 1 << bits;
            }
            self.config = Some(config);
        }
        self.page = vec![0; self.page_size as usize];
        self.state = State::Sections;
        Ok(Step::Header)
    }

    fn read_section(&mut self) -> Result<Step, StreamError> {
        let at = self.input.offset();
        let byte = self.input.u8("a section, command or EOF")?;
        let unexpected = |context| StreamError::UnexpectedByte {
            offset: at,
            byte,
            context,
        };
        let Some(kind) = SectionType::from_byte(byte) else {
            return Err(unexpected(match byte {
                0x05 => "0x05 is a subsection marker, which only occurs inside device data",
                0x7e => "0x7e is a section footer, which only follows a section's data",
                _ => "no section type has this value",
            }));
        };
        match kind {
            SectionType::Start | SectionType::Full => {
                let section_id = self.input.be32("section id")?;
                let mut buf = [0u8; 256];
                let idstr = self.input.short_str(&mut buf, "section idstr")?;
                if idstr == RAM_IDSTR.as_bytes() {
                    return self.start_ram_section(at, kind, section_id);
                }
                if kind == SectionType::Full {
                    // The first device section: from here on the rest of
                    // the stream is device state, EOF and vmdesc (§5.3).
                    let mut prefix = vec![byte];
                    prefix.extend_from_slice(&section_id.to_be_bytes());
                    prefix.push(idstr.len() as u8);
                    prefix.extend_from_slice(idstr);
                    return self.begin_tail(at, prefix);
                }
                let idstr = String::from_utf8_lossy(idstr).into_owned();
                let hint = match idstr.as_str() {
                    "block" => "disable block migration (the blk/inc options of migrate)",
                    "dirty-bitmap" => "disable the dirty-bitmaps capability",
                    _ => "disable the capability or device (e.g. VFIO migration) that adds this iterative section",
                };
                Err(StreamError::UnknownIterativeSection {
                    offset: at,
                    section_id,
                    idstr,
                    hint,
                })
            }
            SectionType::Part | SectionType::End => {
                let section_id = self.input.be32("section id")?;
                if self.ram_section_id != Some(section_id) {
                    return Err(StreamError::UnknownSectionId {
                        offset: at,
                        kind: kind.name(),
                        section_id,
                    });
                }
                self.stats.ram_sections += 1;
                self.state = State::Ram { section_id };
                Ok(Step::SectionStart(SectionHeader {
                    stream_offset: at,
                    kind,
                    section_id,
                    ident: None,
                }))
            }
            SectionType::Command => {
                let command = read_command(&mut self.input, at, self.page_size, self.opts.dialect)?;
                self.stats.commands += 1;
                Ok(Step::Command(at, command))
            }
            SectionType::Eof => self.begin_tail(at, vec![byte]),
            SectionType::VmDescription => {
                Err(unexpected("a VM description must follow EOF (0x00)"))
            }
            SectionType::Configuration => Err(unexpected(
                "the configuration section may only follow the header",
            )),
        }
    }

    fn start_ram_section(
        &mut self,
        at: u64,
        kind: SectionType,
        section_id: u32,
    ) -> Result<Step, StreamError> {
        let instance_id = self.input.be32("section instance id")?;
        let version_id = self.input.be32("section version id")?;
        if instance_id != RAM_INSTANCE_ID {
            return Err(StreamError::RamInstance {
                offset: at,
                found: instance_id,
            });
        }
        if version_id != RAM_SECTION_VERSION {
            return Err(StreamError::RamSectionVersion {
                offset: at,
                found: version_id,
            });
        }
        match self.ram_section_id {
            Some(id) if id != section_id => {
                return Err(StreamError::UnexpectedByte {
                    offset: at,
                    byte: kind as u8,
                    context: "a second \"ram\" section with a new section id",
                })
            }
            _ => self.ram_section_id = Some(section_id),
        }
        self.stats.ram_sections += 1;
        self.state = State::Ram { section_id };
        let ident = SectionIdent {
            idstr: RAM_IDSTR.to_owned(),
            instance_id,
            version_id,
        };
        Ok(Step::SectionStart(SectionHeader {
            stream_offset: at,
            kind,
            section_id,
            ident: Some(ident),
        }))
    }

    fn read_ram_record(&mut self, section_id: u32) -> Result<Step, StreamError> {
        let at = self.input.offset();
        let header = self.input.be64("a RAM record header")?;
        let mask = self.page_size - 1;
        let (kind, cont) = decode_flags(header & mask, at)?;
        let addr = header & !mask;
        match kind {
            RecordKind::MemSize => {
                if self.have_blocks {
                    return Err(StreamError::BadRamBlockList {
                        offset: at,
                        reason: "a second RAM block list".into(),
                    });
                }
                let ignore_shared = self
                    .config
                    .as_ref()
                    .is_some_and(Configuration::ignore_shared);
                self.blocks =
                    read_block_list(&mut self.input, addr, self.page_size, ignore_shared)?;
                self.block_index = BlockIndex::new(&self.blocks);
                self.have_blocks = true;
                self.replay = ScanReplay::new(
                    self.blocks.iter().map(|b| b.page_count(self.page_size)),
                    ignore_shared,
                );
                Ok(Step::RamBlocks)
            }
            RecordKind::Zero | RecordKind::Page => {
                if !self.have_blocks {
                    return Err(StreamError::PageBeforeBlockList { offset: at });
                }
                let block = if cont {
                    self.last_block
                        .ok_or(StreamError::ContinueWithoutBlock { offset: at })?
                } else {
                    let mut buf = [0u8; 256];
                    let name = self
                        .input
                        .short_str(&mut buf, "RAM block name of a page record")?;
                    self.block_index
                        .find(name)
                        .ok_or_else(|| StreamError::UnknownRamBlock {
                            offset: at,
                            name: String::from_utf8_lossy(name).into_owned(),
                        })?
                };
                self.last_block = Some(block);
                let b = &self.blocks[block];
                if addr >= b.used_length {
                    return Err(StreamError::PageOutOfRange {
                        offset: at,
                        block: b.name.clone(),
                        page_offset: addr,
                        length: b.used_length,
                    });
                }
                let zero = kind == RecordKind::Zero;
                let fill = if zero {
                    self.input.u8("the fill byte of a ZERO page record")?
                } else {
                    self.input
                        .read_exact_at(&mut self.page, at, "a page of data")?;
                    0
                };
                let origin = self.replay.classify(block, addr / self.page_size);
                self.stats.count_page(origin, zero);
                Ok(if zero {
                    Step::ZeroPage {
                        block,
                        offset: addr,
                        fill,
                        origin,
                    }
                } else {
                    Step::Page {
                        block,
                        offset: addr,
                        origin,
                    }
                })
            }
            RecordKind::Eos => {
                let footer = self.read_footer(section_id)?;
                self.state = State::Sections;
                Ok(Step::SectionEnd { section_id, footer })
            }
        }
    }

    /// Reads the footer after a section's data if there is one, and checks
    /// that all sections agree on having footers.
    fn read_footer(&mut self, section_id: u32) -> Result<bool, StreamError> {
        let at = self.input.offset();
        let bad = |reason: String| StreamError::BadFooter {
            offset: at,
            section_id,
            reason,
        };
        match self.input.peek_u8()? {
            Some(SECTION_FOOTER) => {
                if self.footers == Some(false) {
                    return Err(bad("a footer, although earlier sections had none".into()));
                }
                self.input.u8("section footer")?;
                let id = self.input.be32("section footer id")?;
                if id != section_id {
                    return Err(bad(format!("the footer names section id {id}")));
                }
                self.footers = Some(true);
                Ok(true)
            }
            next => {
                if self.footers == Some(true) {
                    return Err(match next {
                        Some(b) => bad(format!("found {b:#04x} instead of the footer marker 0x7e")),
                        None => StreamError::Truncated {
                            offset: at,
                            end: at,
                            expected: "a section footer",
                        },
                    });
                }
                self.footers = Some(false);
                Ok(false)
            }
        }
    }

    /// The RAM data is over: check it is complete, then take the rest.
    fn begin_tail(&mut self, at: u64, prefix: Vec<u8>) -> Result<Step, StreamError> {
        if self.opts.require_all_pages && self.have_blocks {
            let ignore_shared = self
                .config
                .as_ref()
                .is_some_and(Configuration::ignore_shared);
            if let Some((blk, page, missing)) = self.replay.missing(ignore_shared) {
                return Err(StreamError::IncompleteRam {
                    offset: at,
                    missing,
                    first_block: self.blocks[blk].name.clone(),
                    first_offset: page * self.page_size,
                });
            }
        }
        self.tail = prefix;
        self.tail_offset = at;
        self.state = State::Tail;
        self.read_tail()
    }

    fn read_tail(&mut self) -> Result<Step, StreamError> {
        let limit = self.opts.max_device_state_bytes;
        if !self.input.read_to_end_limited(&mut self.tail, limit)? {
            return Err(StreamError::DeviceStateTooLarge {
                offset: self.tail_offset,
                limit,
            });
        }
        let vmdesc_required = match self.opts.vmdesc {
            VmDescPolicy::Auto => self.config.is_some(),
            VmDescPolicy::Required => true,
            VmDescPolicy::Optional => false,
        };
        let layout = split_tail(&self.tail, self.footers == Some(true), vmdesc_required).map_err(
            |reason| StreamError::BadStreamEnd {
                offset: self.tail_offset,
                end: self.input.offset(),
                reason,
            },
        )?;
        self.device_len = layout.device_len;
        self.stats.device_state_bytes = layout.device_len as u64;
        self.stats.vmdesc_bytes = layout.vmdesc.as_ref().map_or(0, |d| d.json.len() as u64);
        self.vmdesc = layout.vmdesc;
        self.state = State::TailRead;
        Ok(Step::DeviceState)
    }
}
