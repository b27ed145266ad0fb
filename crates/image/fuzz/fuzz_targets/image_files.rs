//! Feeds arbitrary bytes as each file of a snapshot image, then opens it
//! and calls every read operation (`vmcsnap_image::testing::exercise`).
//! Nothing may panic, hang or allocate without bound.
//!
//! Input: `[file, mode, payload...]`.
//! - `file % 7` picks the file (manifest, memory.img, pages.idx, zero.bmp,
//!   device.bin, trace.bin, hashes.bin); the others stay valid. The image
//!   is format 2: LZ4 blocks, duplicate pages, pages in a parent snapshot
//!   (a sibling directory, opened through the chain) and on a frozen disk
//!   (read from an in-memory disk).
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
use std::sync::Arc;
use vmcsnap_image::testing::exercise_with;
use vmcsnap_image::{
    DiskMatcher, DiskPages, DiskRef, FileKind, Image, ImageMeta, ImageWriter, PageKey, ParentInfo, ParentRef, RamBlock,
    WriterOptions,
};
use vmcsnap_testkit::apply_edits;

const FILES: [FileKind; 7] = [
    FileKind::Manifest,
    FileKind::Memory,
    FileKind::Index,
    FileKind::Zero,
    FileKind::Device,
    FileKind::Trace,
    FileKind::Hashes,
];

/// A frozen disk of 4 pages in memory; page i holds `disk_page(i)`.
#[derive(Debug)]
struct MemDisk;

fn disk_page(i: u32) -> Vec<u8> {
    let mut d = vec![0u8; 4096];
    d[..4].copy_from_slice(b"DISK");
    d[4] = i as u8;
    d
}

impl DiskPages for MemDisk {
    fn read(&self, _d: &DiskRef, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        if offset % 4096 != 0 || offset >= 4 * 4096 || out.len() != 4096 {
            return Err(std::io::Error::other("out of the disk"));
        }
        out.copy_from_slice(&disk_page((offset / 4096) as u32));
        Ok(())
    }
}

impl DiskMatcher for MemDisk {
    fn find(&mut self, _h: u128, data: &[u8]) -> Option<(u16, u32)> {
        (0..4).find(|&i| disk_page(i) == data).map(|i| (0, i))
    }
}

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
        let page = |gen: u64, r: u32, p: u32| {
            let mut page = vec![0u8; 4096];
            if p % 5 == 4 {
                page[..4].copy_from_slice(b"same"); // duplicates
            } else if p % 7 == 6 {
                return disk_page(p % 4); // on the disk
            } else {
                let g = if p % 2 == 0 { gen } else { 0 }; // half change
                page[..8].copy_from_slice(&(u64::from(r) << 32 | u64::from(p) | 1 | g << 20).to_le_bytes());
            }
            page
        };
        let mut disk = DiskRef::default();
        disk.node = "disk0".into();
        disk.path = "/nonexistent/disk.qcow2".into();
        let meta = ImageMeta { disks: vec![disk], ..meta };
        // The parent (generation 0), then the fuzzed image (generation 1).
        let parent_dir = root.join("parent");
        let _ = fs::remove_dir_all(&parent_dir);
        let mut pw = ImageWriter::create_with(&parent_dir, meta.clone(), opts).unwrap();
        for (r, n) in [(0u32, 20u32), (1, 7)] {
            for p in 0..n {
                pw.add_page(r, p, &page(0, r, p)).unwrap();
            }
        }
        pw.set_device_state(b"parent").unwrap();
        pw.commit().unwrap();
        let parent = Image::open(&parent_dir).unwrap();
        let mut w = ImageWriter::create_with(&dir, meta, opts).unwrap();
        w.set_parent(ParentInfo {
            reference: ParentRef { name: "parent".into(), image_id: parent.manifest().image_id.clone(), depth: 1 },
            ram_blocks: parent.manifest().ram_blocks.clone(),
            hashes: parent.page_hashes().unwrap().unwrap(),
        })
        .unwrap();
        w.set_disk_matcher(Box::new(MemDisk));
        for (r, n) in [(0u32, 20u32), (1, 7)] {
            for p in 0..n {
                if p % 3 == 1 {
                    w.add_zero_page(r, p).unwrap();
                } else {
                    w.add_page(r, p, &page(1, r, p)).unwrap();
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
    let _ = exercise_with(&b.dir, Some(Arc::new(MemDisk))).map_err(|e| e.to_string());
    fs::write(&path, &b.originals[f]).unwrap();
});
