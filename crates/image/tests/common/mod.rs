//! Shared helpers: build a small image with known contents.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use vmcsnap_image::{
    DiskRef, ImageMeta, ImageWriter, PageKey, QemuInfo, RamBlock, VmInfo, WriterOptions,
};

pub const PS: usize = 4096;

/// Deterministic page contents; `None` = zero page. Pages `p % 11 == 4`
/// (not zero) all hold the same bytes (v2 stores them once), pages
/// `p % 3 == 1` compress well, the others are random (stored raw).
pub fn page_content(key: PageKey) -> Option<Vec<u8>> {
    if key.page % 5 == 3 {
        return None;
    }
    if key.page % 11 == 4 {
        return Some(b"the same page ".iter().copied().cycle().take(PS).collect());
    }
    let mut p = vec![0u8; PS];
    if key.page % 3 == 1 {
        let tag = format!("page {}:{} ", key.ram_block, key.page);
        for (b, t) in p.iter_mut().zip(tag.bytes().cycle()).take(PS / 2) {
            *b = t;
        }
        return Some(p);
    }
    let mut x = u64::from(key.ram_block) << 32 | u64::from(key.page);
    for chunk in p.chunks_mut(8) {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    Some(p)
}

pub fn meta(ram: &[(&str, u64)]) -> ImageMeta {
    ImageMeta {
        vm: VmInfo {
            name: "a".into(),
            config: serde_json::json!({"memory_mib": 1, "cpus": 1}),
        },
        qemu: QemuInfo {
            version: "8.2.2".into(),
            machine: "microvm".into(),
        },
        page_size: PS as u32,
        ram_blocks: ram
            .iter()
            .map(|(n, l)| RamBlock {
                name: (*n).into(),
                used_length: *l,
            })
            .collect(),
        disks: vec![DiskRef {
            node: "disk0".into(),
            path: "/x/disk0.qcow2".into(),
            format: "qcow2".into(),
            ..Default::default()
        }],
        device_state_format: "test".into(),
        labels: BTreeMap::from([("cluster".into(), "c1".into())]),
    }
}

/// The order pages are written in: a few "guest-written" pages first (the
/// FAFL trace), then everything else in address order.
pub fn arrival_order(ram_pages: &[u32]) -> (Vec<PageKey>, Vec<PageKey>) {
    let fafl: Vec<PageKey> = [(0u32, 17u32), (0, 2), (1, 5), (0, 40), (0, 1)]
        .iter()
        .filter(|(r, p)| (*r as usize) < ram_pages.len() && *p < ram_pages[*r as usize])
        .map(|&(r, p)| PageKey::new(r, p))
        .collect();
    let mut order = fafl.clone();
    for (r, &n) in ram_pages.iter().enumerate() {
        for p in 0..n {
            let k = PageKey::new(r as u32, p);
            if !fafl.contains(&k) {
                order.push(k);
            }
        }
    }
    (order, fafl)
}

pub const DEVICE: &[u8] = b"device state blob: QEMU vmstate would go here";

/// Writes a small complete image at `dir`: RAM blocks "pc.ram" (50 pages,
/// last one partial) and "vga" (12 pages), 8 pages per block.
pub fn build(dir: &Path) -> vmcsnap_image::Committed {
    build_with(
        dir,
        &[("pc.ram", 50 * PS as u64 - 100), ("vga", 12 * PS as u64)],
        8,
    )
}

/// [`build`] in format 1.0 (one block stream, uncompressed, no duplicates).
pub fn build_v1(dir: &Path) -> vmcsnap_image::Committed {
    build_opts(
        dir,
        &[("pc.ram", 50 * PS as u64 - 100), ("vga", 12 * PS as u64)],
        WriterOptions {
            pages_per_block: 8,
            ..WriterOptions::v1()
        },
    )
}

pub fn build_with(dir: &Path, ram: &[(&str, u64)], ppb: u16) -> vmcsnap_image::Committed {
    let opts = WriterOptions {
        pages_per_block: ppb,
        ..Default::default()
    };
    build_opts(dir, ram, opts)
}

/// Writes pages in [`arrival_order`]: the FAFL pages with `add_hot_page`.
pub fn build_opts(
    dir: &Path,
    ram: &[(&str, u64)],
    opts: WriterOptions,
) -> vmcsnap_image::Committed {
    let mut w = ImageWriter::create_with(dir, meta(ram), opts).unwrap();
    let pages: Vec<u32> = ram
        .iter()
        .map(|(_, l)| l.div_ceil(PS as u64) as u32)
        .collect();
    let (order, fafl) = arrival_order(&pages);
    for (i, k) in order.iter().enumerate() {
        match page_content(*k) {
            Some(d) if fafl.contains(k) => w.add_hot_page(k.ram_block, k.page, &d).unwrap(),
            Some(d) => w.add_page(k.ram_block, k.page, &d).unwrap(),
            // Half the zero pages as data, half as zero-page records.
            None if i % 2 == 0 => w.add_page(k.ram_block, k.page, &[0u8; PS]).unwrap(),
            None => w.add_zero_page(k.ram_block, k.page).unwrap(),
        }
    }
    for k in &fafl {
        w.trace_push(*k).unwrap();
    }
    w.add_trace_section("restore-1", vec![PageKey::new(0, 3), PageKey::new(0, 4)])
        .unwrap();
    w.set_device_state(DEVICE).unwrap();
    let m = w.metrics_mut();
    m.downtime_ms = Some(4);
    m.duration_ms = Some(120);
    m.disk_snapshot_ms = Some(2);
    m.other
        .insert("wss_sampled_pages".into(), serde_json::json!(1234));
    w.commit().unwrap()
}

/// Tiny deterministic PRNG for the randomized tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// Copies a snapshot directory (flat) to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}
