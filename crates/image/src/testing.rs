//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`reseal`] recomputes the CRCs of a deliberately damaged file so the
//! damage reaches the structural checks behind the CRCs; [`exercise`]
//! opens an image and calls every read operation on it.
//! [`reseal_channel_log`] and [`exercise_channel_log`] do the same for a
//! cluster snapshot's channel-state file.

use std::path::Path;

use crate::channel_log::{
    encode_channel_log, parse_channel_log, ChannelFrame, ChannelLogError, CHANNEL_HEADER_LEN,
    CHANNEL_TRAILER_LEN, MAX_CHANNEL_HEADER_LEN, RECORD_MAGIC, TRAILER_MAGIC,
};
use crate::cluster::edges_from_frames;
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

/// Recomputes every CRC of `data`, a (possibly damaged) channel-state
/// file, as far as its structure allows: the header's, each record's that
/// lies within the data, the trailer's. Leaves everything else alone.
pub fn reseal_channel_log(data: &mut [u8]) {
    if data.len() < 16 {
        return;
    }
    let header_len = get_u32(data, 12) as usize;
    if !(CHANNEL_HEADER_LEN..=MAX_CHANNEL_HEADER_LEN).contains(&header_len)
        || header_len > data.len()
    {
        return;
    }
    let crc = crc32c::crc32c(&data[..header_len - 4]);
    put_u32(data, header_len - 4, crc);
    let mut pos = header_len;
    while pos + 4 <= data.len() && data[pos..pos + 4] == RECORD_MAGIC {
        let mut p = pos + 4;
        for _ in 0..2 {
            match data.get(p) {
                Some(&n) => p += 1 + usize::from(n),
                None => return,
            }
        }
        if p + 21 > data.len() {
            return;
        }
        let crc_off = p + 21 + get_u32(data, p + 17) as usize;
        if crc_off + 4 > data.len() {
            return;
        }
        let crc = crc32c::crc32c(&data[pos..crc_off]);
        put_u32(data, crc_off, crc);
        pos = crc_off + 4;
    }
    if pos + CHANNEL_TRAILER_LEN <= data.len() && data[pos..pos + 8] == TRAILER_MAGIC {
        let crc = crc32c::crc32c(&data[pos..pos + 24]);
        put_u32(data, pos + 24, crc);
    }
}

/// Parses `bytes` as a channel-state file (what the `channel_log` fuzz
/// target runs). If that succeeds, the frames must encode again, and
/// re-encoding must give back the same records and trailer (and the same
/// file, if the header is the one this build writes); panics otherwise,
/// which is a bug. Must never panic on a parse error.
pub fn exercise_channel_log(bytes: &[u8]) -> Result<Vec<ChannelFrame>, ChannelLogError> {
    let frames = parse_channel_log(bytes)?;
    let _ = edges_from_frames(&frames);
    let again = match encode_channel_log(&frames) {
        Ok(v) => v,
        Err(e) => panic!("parsed frames do not encode again: {e}"),
    };
    let header_len = get_u32(bytes, 12) as usize;
    assert_eq!(
        again[CHANNEL_HEADER_LEN..],
        bytes[header_len..],
        "re-encoding changed the records or the trailer"
    );
    if bytes[..CHANNEL_HEADER_LEN] == again[..CHANNEL_HEADER_LEN] {
        assert_eq!(again, bytes, "re-encoding changed the file");
    }
    Ok(frames)
}
