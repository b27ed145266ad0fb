//! The errors of the stream reader.
//!
//! Every error that concerns the stream names the byte offset where the
//! offending item starts, so a capture can be inspected with `xxd -s`.
//! Errors for features the reader deliberately does not handle say which
//! QEMU capability or setting to change.

use crate::dialect::Dialect;
use std::io;

use thiserror::Error;

/// Why a stream could not be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StreamError {
    /// Reading from the underlying source failed.
    #[error("I/O error reading the migration stream at byte {offset}: {source}")]
    Io {
        /// Stream offset of the read that failed.
        offset: u64,
        /// The error of the source.
        source: io::Error,
    },

    /// The stream ended in the middle of an item.
    #[error("migration stream truncated: it ends at byte {end}, but {expected} was expected at byte {offset} (was the capture cut short, or did QEMU fail?)")]
    Truncated {
        /// Stream offset where the missing item starts.
        offset: u64,
        /// Length of the stream (where it ended).
        end: u64,
        /// What the reader was reading.
        expected: &'static str,
    },

    /// The first four bytes are not `QEVM`.
    #[error("not a QEMU migration stream: magic is {found:#010x}, expected 0x5145564d (\"QEVM\")")]
    BadMagic {
        /// The big-endian u32 found at offset 0.
        found: u32,
    },

    /// The stream version is not 3.
    #[error(
        "unsupported migration stream version {found} (only version 3, QEMU ≥ 2.x, is supported)"
    )]
    UnsupportedVersion {
        /// The version found at offset 4.
        found: u32,
    },

    /// The configuration section is malformed.
    #[error("bad configuration section at byte {offset}: {reason}")]
    BadConfiguration {
        /// Stream offset of the offending field.
        offset: u64,
        /// What is wrong.
        reason: String,
    },

    /// The configuration section has a subsection this reader does not know;
    /// subsections carry no length, so it cannot be skipped.
    #[error("unknown configuration subsection {name:?} at byte {offset}: this reader knows the target-page-bits, capabilities and uuid subsections QEMU 7.2 and 10.0 write")]
    UnknownConfigSubsection {
        /// Stream offset of the subsection.
        offset: u64,
        /// Its name.
        name: String,
    },

    /// A byte that starts no top-level item where one was expected.
    #[error("unexpected byte {byte:#04x} at byte {offset} where a section, command or EOF must start ({context})")]
    UnexpectedByte {
        /// Stream offset of the byte.
        offset: u64,
        /// The byte.
        byte: u8,
        /// What the reader was looking for, and what the byte would mean.
        context: &'static str,
    },

    /// A START section of an iterative device other than "ram": its data
    /// is not self-delimiting, so it can be neither parsed nor skipped.
    #[error("iterative section {idstr:?} (section id {section_id}) at byte {offset} is not supported: only \"ram\" is; {hint}")]
    UnknownIterativeSection {
        /// Stream offset of the section.
        offset: u64,
        /// The section id.
        section_id: u32,
        /// The section's idstr.
        idstr: String,
        /// What to change on the QEMU side.
        hint: &'static str,
    },

    /// A PART or END section whose id belongs to no START section seen.
    #[error("{kind} section at byte {offset} has section id {section_id}, which no START section announced")]
    UnknownSectionId {
        /// Stream offset of the section.
        offset: u64,
        /// START/PART/END name.
        kind: &'static str,
        /// The id.
        section_id: u32,
    },

    /// The "ram" section has a version other than 4.
    #[error("\"ram\" section at byte {offset} has version {found}; only version 4 (QEMU 2.x–10.0, including 7.2 and 10.0) is supported")]
    RamSectionVersion {
        /// Stream offset of the section.
        offset: u64,
        /// The version found.
        found: u32,
    },

    /// The "ram" section has an instance id other than 0.
    #[error("\"ram\" section at byte {offset} has instance id {found}; QEMU always uses 0")]
    RamInstance {
        /// Stream offset of the section.
        offset: u64,
        /// The instance id found.
        found: u32,
    },

    /// A section footer is missing or names another section.
    #[error("bad section footer at byte {offset} for section id {section_id}: {reason}")]
    BadFooter {
        /// Stream offset where the footer was expected.
        offset: u64,
        /// The section being closed.
        section_id: u32,
        /// What was found instead.
        reason: String,
    },

    /// A command with a number the reader's QEMU version does not define.
    #[error("unknown command {cmd} at byte {offset} ({dialect} defines commands 1..={max}; is the stream from another QEMU version than the reader was told?)")]
    UnknownCommand {
        /// Stream offset of the command.
        offset: u64,
        /// The command number.
        cmd: u16,
        /// The QEMU version the reader reads ([`ReaderOptions::dialect`](crate::ReaderOptions::dialect)).
        dialect: Dialect,
        /// The highest command number that version defines.
        max: u16,
    },

    /// A command whose payload length does not fit its number.
    #[error("command {name} at byte {offset} has payload length {len}, expected {expected}")]
    BadCommandLength {
        /// Stream offset of the command.
        offset: u64,
        /// The command's name.
        name: &'static str,
        /// The length found.
        len: u16,
        /// The lengths allowed.
        expected: &'static str,
    },

    /// A postcopy command: the stream is (or became) a postcopy migration,
    /// whose device state and pages are not laid out as in a precopy or
    /// background-snapshot stream.
    #[error("postcopy command {name} at byte {offset}: this reader handles precopy and background-snapshot streams only; do not run migrate-start-postcopy (and disable the postcopy-ram capability)")]
    Postcopy {
        /// Stream offset of the command.
        offset: u64,
        /// The command's name.
        name: &'static str,
    },

    /// A command this reader does not support for another reason.
    #[error("unsupported command {name} at byte {offset}: {hint}")]
    UnsupportedCommand {
        /// Stream offset of the command.
        offset: u64,
        /// The command's name.
        name: &'static str,
        /// What to change on the QEMU side.
        hint: &'static str,
    },

    /// Postcopy was advised with RAM whose page size differs from the target
    /// page size (hugepages): the RAM block list then carries per-block page
    /// sizes for blocks the stream does not identify.
    #[error("POSTCOPY_ADVISE at byte {offset} announces RAM page sizes {summary:#x} other than the target page size {target_page_size:#x} (hugepage-backed RAM with postcopy-ram): not supported; disable the postcopy-ram capability")]
    HugePages {
        /// Stream offset of the command.
        offset: u64,
        /// The OR of all RAM block page sizes.
        summary: u64,
        /// The target page size.
        target_page_size: u64,
    },

    /// The stream's target page size differs from the one the reader uses.
    #[error("target page size mismatch at byte {offset}: the stream says {stream:#x}, the reader uses {reader:#x} (set ReaderOptions::target_page_size for non-x86 targets)")]
    PageSizeMismatch {
        /// Stream offset of the item that carries the page size.
        offset: u64,
        /// The page size in the stream.
        stream: u64,
        /// The reader's page size.
        reader: u64,
    },

    /// An XBZRLE-encoded page.
    #[error("XBZRLE-encoded page at byte {offset}: not supported; disable the xbzrle migration capability")]
    Xbzrle {
        /// Stream offset of the record.
        offset: u64,
    },

    /// A zlib-compressed page.
    #[error("compressed page at byte {offset}: not supported; disable the compress migration capability")]
    CompressedPage {
        /// Stream offset of the record.
        offset: u64,
    },

    /// An RDMA hook record.
    #[error("RDMA hook record at byte {offset}: not supported; migrate over a unix socket, TCP, exec: or a file instead of rdma:")]
    RdmaHook {
        /// Stream offset of the record.
        offset: u64,
    },

    /// A RAM record with a flag combination QEMU never writes in the streams read.
    #[error("RAM record at byte {offset} has unknown flags {flags:#x} (QEMU 7.2 and 10.0 write exactly one of ZERO 0x2, MEM_SIZE 0x4, PAGE 0x8, EOS 0x10, optionally with CONTINUE 0x20); is the target page size right?")]
    UnknownRamFlags {
        /// Stream offset of the record.
        offset: u64,
        /// The flag bits.
        flags: u64,
    },

    /// A multifd sync point (`MULTIFD_FLUSH`, QEMU 8.0 and later): the
    /// pages go over multifd channels, not in this stream.
    #[error("RAM record at byte {offset} is a multifd flush (flag 0x200): the pages go over multifd channels this reader does not see; disable the multifd capability")]
    Multifd {
        /// Stream offset of the record.
        offset: u64,
    },

    /// The RAM block list (setup) is malformed.
    #[error("bad RAM block list at byte {offset}: {reason}")]
    BadRamBlockList {
        /// Stream offset of the offending entry.
        offset: u64,
        /// What is wrong.
        reason: String,
    },

    /// A page record before the RAM block list.
    #[error("RAM page record at byte {offset} before the RAM block list (MEM_SIZE)")]
    PageBeforeBlockList {
        /// Stream offset of the record.
        offset: u64,
    },

    /// A page record naming a block that is not in the block list.
    #[error(
        "RAM page record at byte {offset} names block {name:?}, which is not in the RAM block list"
    )]
    UnknownRamBlock {
        /// Stream offset of the record.
        offset: u64,
        /// The name in the record.
        name: String,
    },

    /// A CONTINUE page record with no previous record naming a block.
    #[error("RAM page record at byte {offset} has CONTINUE but no earlier record named a block")]
    ContinueWithoutBlock {
        /// Stream offset of the record.
        offset: u64,
    },

    /// A page record whose offset lies outside its block.
    #[error("RAM page record at byte {offset}: page offset {page_offset:#x} is outside block {block:?} of length {length:#x}")]
    PageOutOfRange {
        /// Stream offset of the record.
        offset: u64,
        /// The block's name.
        block: String,
        /// The page offset in the record.
        page_offset: u64,
        /// The block's used length.
        length: u64,
    },

    /// The RAM sections ended without every page of every block having been
    /// sent at least once, which QEMU 7.2 always does in a precopy or
    /// background-snapshot stream unless the pages went elsewhere.
    #[error("RAM data ended at byte {offset} with {missing} page(s) never sent (first: block {first_block:?} offset {first_offset:#x}); pages on other channels are not supported: disable the multifd capability")]
    IncompleteRam {
        /// Stream offset where the device state (or EOF) starts.
        offset: u64,
        /// How many pages were never sent.
        missing: u64,
        /// The block of the first missing page.
        first_block: String,
        /// The offset of the first missing page in its block.
        first_offset: u64,
    },

    /// The device state and what follows it exceed the configured limit.
    #[error("device state starting at byte {offset} is larger than the limit of {limit} bytes (ReaderOptions::max_device_state_bytes)")]
    DeviceStateTooLarge {
        /// Stream offset where the device state starts.
        offset: u64,
        /// The limit.
        limit: usize,
    },

    /// The bytes after the RAM data do not end as device state must.
    #[error("bad end of stream: the device state starts at byte {offset} and the stream ends at byte {end}, but {reason} (truncated stream?)")]
    BadStreamEnd {
        /// Stream offset where the device state starts.
        offset: u64,
        /// Length of the stream.
        end: u64,
        /// What is wrong.
        reason: String,
    },

    /// `next_event` was called again after it returned an error.
    #[error("the stream reader already failed; create a new reader")]
    Failed,
}
