//! The "ram" section's records (§2): the RAM block list of the setup and
//! the per-page record headers.

use std::collections::HashMap;
use std::io::Read;

use crate::error::StreamError;
use crate::input::Input;
use crate::wire::ram_flags;

/// Most RAM blocks accepted in a block list. A VM has a handful (RAM,
/// firmware, ROMs, ACPI blobs, VGA memory, option ROMs, DIMMs); the bound
/// keeps a hostile list from growing without end.
pub const MAX_RAM_BLOCKS: usize = 1024;

/// One entry of the RAM block list (§2.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamBlock {
    /// The block's idstr, e.g. `pc.ram`, `mem` (a memory backend's id),
    /// `pc.bios`, `/rom@etc/acpi/tables`.
    pub name: String,
    /// The block's used length in bytes (a multiple of the page size).
    pub used_length: u64,
    /// The block's own page size. Only sent with postcopy-ram for blocks
    /// whose page size differs from the host's (hugepages); the reader
    /// rejects such streams, so it is always `None` when read.
    pub page_size: Option<u64>,
    /// The block's guest address (`mr->addr`), sent for every block when
    /// `x-ignore-shared` is on; `None` otherwise.
    pub guest_addr: Option<u64>,
}

impl RamBlock {
    /// Number of target pages in the block.
    pub fn page_count(&self, target_page_size: u64) -> u64 {
        self.used_length / target_page_size
    }
}

fn bad(offset: u64, reason: impl Into<String>) -> StreamError {
    StreamError::BadRamBlockList {
        offset,
        reason: reason.into(),
    }
}

/// Reads the block list that follows a MEM_SIZE record header announcing `total` bytes: entries until their lengths add up to `total`
/// (none if `total` is 0, as for a machine without RAM).
pub(crate) fn read_block_list<R: Read>(
    input: &mut Input<R>,
    total: u64,
    page_size: u64,
    ignore_shared: bool,
) -> Result<Vec<RamBlock>, StreamError> {
    let mut blocks: Vec<RamBlock> = Vec::new();
    let mut remaining = total;
    let mut name_buf = [0u8; 256];
    while remaining > 0 {
        let entry_at = input.offset();
        if blocks.len() == MAX_RAM_BLOCKS {
            return Err(bad(entry_at, format!("more than {MAX_RAM_BLOCKS} blocks")));
        }
        let name = input.short_str(&mut name_buf, "RAM block name")?;
        let name = String::from_utf8(name.to_vec())
            .map_err(|_| bad(entry_at, "block name is not UTF-8"))?;
        if name.is_empty() {
            return Err(bad(entry_at, "empty block name"));
        }
        if blocks.iter().any(|b| b.name == name) {
            return Err(bad(entry_at, format!("block {name:?} listed twice")));
        }
        let used_length = input.be64("RAM block length")?;
        if used_length == 0 || used_length % page_size != 0 {
            return Err(bad(entry_at, format!("block {name:?} has length {used_length:#x}, not a positive multiple of the page size {page_size:#x}")));
        }
        if used_length > remaining {
            return Err(bad(entry_at, format!("block {name:?} of length {used_length:#x} overruns the announced total {total:#x}")));
        }
        remaining -= used_length;
        let guest_addr = if ignore_shared {
            Some(input.be64("RAM block guest address (x-ignore-shared)")?)
        } else {
            None
        };
        blocks.push(RamBlock {
            name,
            used_length,
            page_size: None,
            guest_addr,
        });
    }
    Ok(blocks)
}

/// What a RAM record is, from its flag bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordKind {
    /// The block list follows.
    MemSize,
    /// A one-byte-filled page: `u8 fill` follows.
    Zero,
    /// A raw page follows.
    Page,
    /// End of the section's RAM data.
    Eos,
}

/// Splits a record's flag bits into its kind and the CONTINUE bit,
/// rejecting every variant the reader does not handle (§2.1, §2.4).
pub(crate) fn decode_flags(flags: u64, at: u64) -> Result<(RecordKind, bool), StreamError> {
    let cont = flags & ram_flags::CONTINUE != 0;
    let kind = match flags & !ram_flags::CONTINUE {
        ram_flags::MEM_SIZE => RecordKind::MemSize,
        ram_flags::ZERO => RecordKind::Zero,
        ram_flags::PAGE => RecordKind::Page,
        ram_flags::EOS => RecordKind::Eos,
        ram_flags::XBZRLE => return Err(StreamError::Xbzrle { offset: at }),
        ram_flags::COMPRESS_PAGE => return Err(StreamError::CompressedPage { offset: at }),
        ram_flags::MULTIFD_FLUSH => return Err(StreamError::Multifd { offset: at }),
        f if f & ram_flags::HOOK != 0 => return Err(StreamError::RdmaHook { offset: at }),
        _ => return Err(StreamError::UnknownRamFlags { offset: at, flags }),
    };
    Ok((kind, cont))
}

/// Block indexes by name, for page records that name their block.
#[derive(Debug, Default)]
pub(crate) struct BlockIndex(HashMap<Box<[u8]>, usize>);

impl BlockIndex {
    pub(crate) fn new(blocks: &[RamBlock]) -> Self {
        BlockIndex(
            blocks
                .iter()
                .enumerate()
                .map(|(i, b)| (b.name.as_bytes().into(), i))
                .collect(),
        )
    }

    /// The index of the block named `name`.
    pub(crate) fn find(&self, name: &[u8]) -> Option<usize> {
        self.0.get(name).copied()
    }
}
