//! Feeds arbitrary bytes as each file of a snapshot image, then opens it
//! and calls every read operation (`vmcsnap_image::testing::exercise`).
//! Nothing may panic, hang or allocate without bound.
//!
//! Input: `[file, mode, payload...]`.
//! - `file % 6` picks the file (manifest, memory.img, pages.idx, zero.bmp,
//!   device.bin, trace.bin); the other five stay valid.
//! - `mode % 4`: 0 = payload is the file; 1 = payload with its CRCs
//!   recomputed; 2 = payload is a list of 6-byte edits `[op, offset u32 le,
//!   value]` applied to the valid file; 3 = edits, then CRCs recomputed.
//!   Edit ops (`op % 4`): set byte, xor byte, truncate at offset, insert byte.
#![no_main]

use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use vmcsnap_image::testing::{exercise, reseal};
use vmcsnap_image::{FileKind, ImageMeta, ImageWriter, PageKey, RamBlock, WriterOptions};
use vmcsnap_testkit::apply_edits;

const FILES: [FileKind; 6] =
    [FileKind::Manifest, FileKind::Memory, FileKind::Index, FileKind::Zero, FileKind::Device, FileKind::Trace];

struct Base {
    dir: PathBuf,
    originals: Vec<Vec<u8>>,
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(|| {
        let root = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        // libFuzzer exits without running destructors: remove what earlier
        // (finished) runs left behind, then make this run's directory.
        for e in fs::read_dir(&root).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("vmcsnap-image-fuzz-") {
                if !pid.parse().is_ok_and(vmcsnap_image::process_running) {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        let root = root.join(format!("vmcsnap-image-fuzz-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).unwrap();
        let dir = root.join("img");
        let meta = ImageMeta {
            page_size: 4096,
            ram_blocks: vec![
                RamBlock { name: "pc.ram".into(), used_length: 20 * 4096 },
                RamBlock { name: "vga".into(), used_length: 7 * 4096 - 5 },
            ],
            device_state_format: "fuzz".into(),
            ..Default::default()
        };
        let opts = WriterOptions { pages_per_block: 4, require_complete: true, ..Default::default() };
        let mut w = ImageWriter::create_with(&dir, meta, opts).unwrap();
        for (r, n) in [(0u32, 20u32), (1, 7)] {
            for p in 0..n {
                if p % 3 == 1 {
                    w.add_zero_page(r, p).unwrap();
                } else {
                    let mut page = vec![0u8; 4096];
                    page[..8].copy_from_slice(&(u64::from(r) << 32 | u64::from(p) | 1).to_le_bytes());
                    w.add_page(r, p, &page).unwrap();
                }
            }
        }
        for p in [5, 2, 9] {
            w.trace_push(PageKey::new(0, p)).unwrap();
        }
        w.add_trace_section("learned", vec![PageKey::new(1, 3)]).unwrap();
        w.set_device_state(b"device state for fuzzing").unwrap();
        w.commit().unwrap();
        let originals = FILES.iter().map(|k| fs::read(dir.join(k.default_name())).unwrap()).collect();
        Base { dir, originals }
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let b = base();
    let f = usize::from(data[0]) % FILES.len();
    let kind = FILES[f];
    let payload = &data[2..];
    let content = match data[1] % 4 {
        0 => payload.to_vec(),
        1 => {
            let mut v = payload.to_vec();
            reseal(kind, &mut v);
            v
        }
        mode => {
            let mut v = apply_edits(&b.originals[f], payload);
            if mode == 3 {
                reseal(kind, &mut v);
            }
            v
        }
    };
    let path = b.dir.join(kind.default_name());
    fs::write(&path, &content).unwrap();
    let _ = exercise(&b.dir).map_err(|e| e.to_string());
    fs::write(&path, &b.originals[f]).unwrap();
});
