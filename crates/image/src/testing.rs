//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`reseal`] recomputes the CRCs of a deliberately damaged file so the
//! damage reaches the structural checks behind the CRCs; [`exercise`]
//! opens an image and calls every read operation on it.

use std::path::Path;

use crate::error::ReadError;
use crate::format::{
    get_u16, get_u32, put_u32, FileKind, BLOCK_ENTRY_LEN, BLOCK_HEADER_LEN, BLOCK_MAGIC,
    FILE_HEADER_LEN,
};
use crate::manifest::MAX_MANIFEST_HEADER;
use crate::reader::{Image, PageState};
use crate::PageKey;

/// Recomputes every CRC of `data`, a file of kind `kind`, as far as its
/// (possibly damaged) structure allows; leaves everything else alone.
pub fn reseal(kind: FileKind, data: &mut Vec<u8>) {
    if kind == FileKind::Manifest {
        let head = &data[..data.len().min(MAX_MANIFEST_HEADER)];
        let Some(nl) = head.iter().position(|&c| c == b'\n') else {
            return;
        };
        let line = String::from_utf8_lossy(&head[..nl]).into_owned();
        let mut parts = line.splitn(3, ' ');
        let (Some(magic), Some(version)) = (parts.next(), parts.next()) else {
            return;
        };
        let body = data.split_off(nl + 1);
        let head = format!(
            "{magic} {version} len={} crc32c={:08x}\n",
            body.len(),
            crc32c::crc32c(&body)
        );
        *data = [head.into_bytes(), body].concat();
        return;
    }
    if data.len() < FILE_HEADER_LEN {
        return;
    }
    let header_len = get_u32(data, 12) as usize;
    if header_len < FILE_HEADER_LEN || header_len > data.len() {
        return;
    }
    if kind == FileKind::Memory {
        let mut pos = header_len;
        while pos + BLOCK_HEADER_LEN <= data.len() && data[pos..pos + 4] == BLOCK_MAGIC {
            let pages = usize::from(get_u16(data, pos + 8));
            let total =
                BLOCK_HEADER_LEN + pages * BLOCK_ENTRY_LEN + get_u32(data, pos + 12) as usize;
            if pos + total > data.len() {
                break;
            }
            let crc = crc32c::crc32c_append(
                crc32c::crc32c(&data[pos..pos + BLOCK_HEADER_LEN - 4]),
                &data[pos + BLOCK_HEADER_LEN..pos + total],
            );
            put_u32(data, pos + BLOCK_HEADER_LEN - 4, crc);
            pos += total;
        }
    } else {
        let crc = crc32c::crc32c(&data[header_len..]);
        put_u32(data, 52, crc);
    }
    let crc = crc32c::crc32c(&data[..header_len - 4]);
    put_u32(data, header_len - 4, crc);
}

/// Opens the image in `dir` and calls every read operation on it: verify,
/// every page, every block, a read plan, the device state and the traces.
/// Returns the first error; must never panic, whatever the files hold.
pub fn exercise(dir: &Path) -> Result<(), ReadError> {
    let img = Image::open(dir)?;
    let _ = img.verify().to_string();
    let _ = img.stats();
    let mut first_err = None;
    let mut keep = |r: Result<(), ReadError>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    let mut buf = vec![0u8; img.page_size()];
    let mut keys = Vec::new();
    for r in 0..img.ram_blocks().len() as u32 {
        let _ = img.zero_bitmap(r).map(|z| z.iter().count());
        for p in 0..img.ram_block_pages(r) {
            let k = PageKey::new(r, p);
            keys.push(k);
            keep(img.read_page(k, &mut buf).map(|_| ()));
            if let Ok(PageState::Stored(loc)) = img.locate(k) {
                let _ = loc.offset;
            }
        }
    }
    for b in img.iter_blocks() {
        keep(b.map(|b| {
            let _ = b.iter().count();
        }));
    }
    let mut ext = Vec::new();
    let plan = img.plan_reads(&keys, 1 << 16, 1 << 20)?;
    for e in &plan.extents {
        keep(img.read_extent(e, &mut ext));
    }
    let _ = img.blocks_for(img.fafl())?;
    for s in img.trace_sections() {
        let _ = img.trace(&s.name);
    }
    keep(img.device_state().map(|_| ()));
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
