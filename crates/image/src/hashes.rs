//! Page hashes (`hashes.bin`, format 2, optional): a 128-bit content hash
//! (XXH3-128) of every page, so that a later snapshot of the same VM can
//! store only the pages that changed (an incremental snapshot) without
//! reading this snapshot's pages.
//!
//! Body, for each RAM block in manifest order: a 16-byte section header
//! (`ram_block` u32, `pages` u32, 8 reserved zero bytes), then one 16-byte
//! little-endian hash per page (0 for a zero page). The file header's
//! `count` is the number of RAM blocks.

use std::path::Path;

use crate::error::ReadError;
use crate::format::get_u32;

/// Bytes per section header.
const SECTION: usize = 16;

/// The hash of a page's bytes.
pub fn page_hash(data: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(data)
}

/// Body length for these RAM block sizes.
pub(crate) fn hashes_body_len(ram_pages: &[u32]) -> u64 {
    ram_pages
        .iter()
        .map(|&p| SECTION as u64 + 16 * u64::from(p))
        .sum()
}

/// Encodes the body.
pub(crate) fn encode_hashes(
    hashes: &[Vec<u128>],
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    for (r, h) in hashes.iter().enumerate() {
        let mut head = [0u8; SECTION];
        head[0..4].copy_from_slice(&(r as u32).to_le_bytes());
        head[4..8].copy_from_slice(&(h.len() as u32).to_le_bytes());
        out.write_all(&head)?;
        let mut buf = Vec::with_capacity(h.len() * 16);
        for x in h {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        out.write_all(&buf)?;
    }
    Ok(())
}

/// Decodes a body (its CRC already checked) for these RAM block sizes.
pub(crate) fn decode_hashes(
    file: &Path,
    ram_pages: &[u32],
    body: &[u8],
) -> Result<Vec<Vec<u128>>, ReadError> {
    if body.len() as u64 != hashes_body_len(ram_pages) {
        return Err(ReadError::corrupt(
            file,
            "body length does not match the RAM blocks",
        ));
    }
    let mut pos = 0;
    let mut out = Vec::with_capacity(ram_pages.len());
    for (r, &pages) in ram_pages.iter().enumerate() {
        let s = &body[pos..pos + SECTION];
        if get_u32(s, 0) as usize != r || get_u32(s, 4) != pages {
            return Err(ReadError::corrupt(
                file,
                format!("section {r} does not match RAM block {r}"),
            ));
        }
        pos += SECTION;
        let v = body[pos..pos + 16 * pages as usize]
            .chunks_exact(16)
            .map(|c| {
                let mut b = [0u8; 16];
                b.copy_from_slice(c);
                u128::from_le_bytes(b)
            })
            .collect();
        pos += 16 * pages as usize;
        out.push(v);
    }
    Ok(out)
}
