//! What the reader yields: [`Event`] and the section header it carries.

use crate::command::Command;
use crate::config::Configuration;
use crate::device_state::VmDescription;
use crate::page_origin::PageOrigin;
use crate::ram::RamBlock;
use crate::wire::SectionType;

/// The header of a section (§1.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionHeader {
    /// Stream offset of the section's type byte.
    pub stream_offset: u64,
    /// START, PART, END or FULL.
    pub kind: SectionType,
    /// The section id.
    pub section_id: u32,
    /// For START and FULL: the idstr, instance id and version.
    pub ident: Option<SectionIdent>,
}

/// The identification in a START or FULL section header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionIdent {
    /// The handler's idstr, e.g. `ram`.
    pub idstr: String,
    /// The instance id.
    pub instance_id: u32,
    /// The handler's version.
    pub version_id: u32,
}

/// One thing read from the stream.
///
/// The order is always: `Header`; then any number of `Command`s and RAM
/// sections (`SectionStart`, an optional `RamBlocks`, `Page`/`ZeroPage`s,
/// `SectionEnd`); then exactly one `DeviceState` and one `End`; after that
/// [`StreamReader::next_event`](crate::StreamReader::next_event) returns `None`.
#[derive(Debug)]
pub enum Event<'a> {
    /// Magic and version were checked; the configuration section, if the
    /// source sent one (`send-configuration`, on by default).
    Header {
        /// The stream version (always 3).
        version: u32,
        /// The configuration section.
        configuration: Option<&'a Configuration>,
    },
    /// A command between sections.
    Command {
        /// Stream offset of the command.
        stream_offset: u64,
        /// The command.
        command: Command,
    },
    /// A "ram" section begins.
    SectionStart(SectionHeader),
    /// The RAM block list of the setup (inside the START section).
    RamBlocks(&'a [RamBlock]),
    /// A page with data.
    Page {
        /// Index of the block in the block list.
        block: usize,
        /// Byte offset of the page within the block.
        offset: u64,
        /// The page, `target_page_size` bytes.
        data: &'a [u8],
        /// Why the page is where it is in the stream.
        origin: PageOrigin,
    },
    /// A page filled with one byte (QEMU always sends 0).
    ZeroPage {
        /// Index of the block in the block list.
        block: usize,
        /// Byte offset of the page within the block.
        offset: u64,
        /// The fill byte.
        fill: u8,
        /// Why the page is where it is in the stream.
        origin: PageOrigin,
    },
    /// A "ram" section ended (EOS and, if present, the footer).
    SectionEnd {
        /// The section id.
        section_id: u32,
        /// Whether the section had a footer.
        footer: bool,
    },
    /// The device state: every FULL device section, verbatim, as one run
    /// of bytes (empty if the stream has none). Ready to be replayed as is.
    DeviceState {
        /// Stream offset of its first byte; `stream_offset + data.len()`
        /// is the stream offset of the EOF byte.
        stream_offset: u64,
        /// The bytes.
        data: &'a [u8],
    },
    /// The stream ended after EOF and the optional VM description.
    End {
        /// The VM description, absent with `suppress-vmdesc`.
        vmdesc: Option<&'a VmDescription>,
    },
}
