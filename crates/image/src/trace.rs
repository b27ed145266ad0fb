//! Page-access traces (`trace.bin`): named sections of page keys.
//!
//! The section [`TRACE_FAFL`] is HotRestore's first-access-first-load
//! queue: the pages the guest wrote during the snapshot, in the order they
//! were written. Later work adds more sections (e.g. a trace learned from
//! a restore) without a format change.
//!
//! Body (the file header's `count` is the number of sections):
//!
//! ```text
//! for each section:
//!   0 2 name_len     1..=255
//!   2 2 kind         0 = page keys; readers skip kinds they do not know
//!   4 4 entry_size   8 for kind 0 in v1 (readers use the first 8 bytes)
//!   8 8 entry_count
//!  16 . name         UTF-8, zero-padded to a multiple of 8
//!   . . entries      entry_count × entry_size; kind 0: ram_block u32, page u32
//! ```

use std::path::Path;

use crate::error::ReadError;
use crate::format::{get_u16, get_u32, get_u64, pad8, PageKey, MAX_NAME_LEN, MAX_TRACE_SECTIONS};

/// Name of the FAFL section (pages written by the guest during the snapshot, in order).
pub const TRACE_FAFL: &str = "fafl";
/// Section kind: a list of page keys.
pub const KIND_PAGE_KEYS: u16 = 0;
/// Entry size of kind [`KIND_PAGE_KEYS`] in v1.
pub const PAGE_KEY_ENTRY_LEN: u32 = 8;

/// One named trace.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TraceSection {
    /// The section's name (unique within the file).
    pub name: String,
    /// Pages in trace order.
    pub entries: Vec<PageKey>,
}

/// Checks a section name.
pub fn valid_section_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && !name.contains('\0')
}

/// Encodes sections as a `trace.bin` body.
pub(crate) fn encode_trace(
    sections: &[TraceSection],
    w: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(64 << 10);
    for s in sections {
        let mut h = [0u8; 16];
        h[0..2].copy_from_slice(&(s.name.len() as u16).to_le_bytes());
        h[2..4].copy_from_slice(&KIND_PAGE_KEYS.to_le_bytes());
        h[4..8].copy_from_slice(&PAGE_KEY_ENTRY_LEN.to_le_bytes());
        h[8..16].copy_from_slice(&(s.entries.len() as u64).to_le_bytes());
        w.write_all(&h)?;
        w.write_all(s.name.as_bytes())?;
        let pad = pad8(s.name.len() as u64) as usize - s.name.len();
        w.write_all(&[0u8; 8][..pad])?;
        for chunk in s.entries.chunks(8192) {
            buf.clear();
            for k in chunk {
                buf.extend_from_slice(&k.ram_block.to_le_bytes());
                buf.extend_from_slice(&k.page.to_le_bytes());
            }
            w.write_all(&buf)?;
        }
    }
    Ok(())
}

/// Decodes a `trace.bin` body (CRC already checked). Every page key is
/// checked against the RAM block sizes.
pub(crate) fn decode_trace(
    file: &Path,
    count: u32,
    ram_pages: &[u32],
    body: &[u8],
) -> Result<Vec<TraceSection>, ReadError> {
    let bad = |what: String| ReadError::corrupt(file, what);
    if count > MAX_TRACE_SECTIONS {
        return Err(bad(format!(
            "{count} trace sections (at most {MAX_TRACE_SECTIONS})"
        )));
    }
    let mut pos = 0usize;
    let mut out: Vec<TraceSection> = Vec::new();
    for i in 0..count {
        let rest = &body[pos..];
        if rest.len() < 16 {
            return Err(bad(format!(
                "section {i} header runs past the end of the body"
            )));
        }
        let name_len = usize::from(get_u16(rest, 0));
        let kind = get_u16(rest, 2);
        let entry_size = u64::from(get_u32(rest, 4));
        let entry_count = get_u64(rest, 8);
        let name_pad = pad8(name_len as u64) as usize;
        if name_len == 0 || name_len > MAX_NAME_LEN || 16 + name_pad > rest.len() {
            return Err(bad(format!("section {i} has a bad name length {name_len}")));
        }
        let name = std::str::from_utf8(&rest[16..16 + name_len])
            .ok()
            .filter(|n| valid_section_name(n))
            .ok_or_else(|| bad(format!("section {i} name is not valid UTF-8")))?
            .to_string();
        let data_len = entry_count
            .checked_mul(entry_size)
            .filter(|&l| l <= (rest.len() - 16 - name_pad) as u64)
            .ok_or_else(|| {
                bad(format!(
                    "section {name:?} entries run past the end of the body"
                ))
            })? as usize;
        let data = &rest[16 + name_pad..16 + name_pad + data_len];
        pos += 16 + name_pad + data_len;
        if kind != KIND_PAGE_KEYS {
            continue; // A kind from a later minor version: skip it.
        }
        if entry_size < u64::from(PAGE_KEY_ENTRY_LEN) {
            return Err(bad(format!("section {name:?} has entry size {entry_size}")));
        }
        if out.iter().any(|s| s.name == name) {
            return Err(bad(format!("section {name:?} appears twice")));
        }
        let mut entries = Vec::with_capacity(entry_count as usize);
        for e in data.chunks_exact(entry_size as usize) {
            let key = PageKey {
                ram_block: get_u32(e, 0),
                page: get_u32(e, 4),
            };
            match ram_pages.get(key.ram_block as usize) {
                Some(&pages) if key.page < pages => entries.push(key),
                _ => {
                    return Err(bad(format!(
                        "section {name:?} names page {}:{} which does not exist",
                        key.ram_block, key.page
                    )))
                }
            }
        }
        out.push(TraceSection { name, entries });
    }
    if pos != body.len() {
        return Err(bad(format!(
            "{} bytes after the last section",
            body.len() - pos
        )));
    }
    Ok(out)
}
