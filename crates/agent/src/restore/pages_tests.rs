//! The page source checks what it reads from a parent against the child.

use std::collections::BTreeMap;
use std::path::Path;

use vmcsnap_image::manifest::ParentRef;
use vmcsnap_image::testing::reseal;
use vmcsnap_image::writer::ParentInfo;
use vmcsnap_image::{
    FileKind, Image, ImageMeta, ImageWriter, PageKey, QemuInfo, RamBlock, VmInfo, WriterOptions,
};
use vmcsnap_migstream::postcopy::{PageId, PageSource};

use super::ImagePages;

const PS: usize = 4096;
const PAGES: u32 = 32;
/// A page that is zero in every generation.
const ZERO_PAGE: u32 = 7;

fn meta() -> ImageMeta {
    ImageMeta {
        vm: VmInfo {
            name: "a".into(),
            config: serde_json::json!({"memory_mib": 1, "cpus": 1}),
        },
        qemu: QemuInfo {
            version: "7.2.0".into(),
            machine: "microvm".into(),
        },
        page_size: PS as u32,
        ram_blocks: vec![RamBlock {
            name: "mem".into(),
            used_length: u64::from(PAGES) * PS as u64,
        }],
        disks: vec![],
        device_state_format: "test".into(),
        labels: BTreeMap::new(),
    }
}

fn page(p: u32) -> Vec<u8> {
    let mut d = vec![0u8; PS];
    if p != ZERO_PAGE {
        d[..4].copy_from_slice(&p.to_le_bytes());
    }
    d
}

fn write(dir: &Path, parent: Option<&Path>) {
    let opts = WriterOptions {
        pages_per_block: 8,
        ..Default::default()
    };
    let mut w = ImageWriter::create_with(dir, meta(), opts).unwrap();
    if let Some(pdir) = parent {
        let p = Image::open(pdir).unwrap();
        w.set_parent(ParentInfo {
            reference: ParentRef {
                name: "g0".into(),
                image_id: p.manifest().image_id.clone(),
                depth: 1,
            },
            ram_blocks: p.manifest().ram_blocks.clone(),
            hashes: p.page_hashes().unwrap().unwrap(),
        })
        .unwrap();
    }
    for p in 0..PAGES {
        w.add_page(0, p, &page(p)).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    w.commit().unwrap();
}

/// Regression (issue 29): an in-parent entry whose parent holds a zero
/// page was sent as zeros without checking the child's CRC.
#[test]
fn a_parent_zero_page_against_another_crc_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let (g0, g1) = (tmp.path().join("g0"), tmp.path().join("g1"));
    write(&g0, None);
    write(&g1, Some(&g0));
    // The child's entry of the zero page: in the parent, with a CRC that
    // is not a zero page's (index CRCs resealed).
    let blocks = Image::open(&g1).unwrap().blocks().len();
    let at = 64 + blocks * 16 + 16 + ZERO_PAGE as usize * 12;
    let path = g1.join(FileKind::Index.default_name());
    let mut d = std::fs::read(&path).unwrap();
    d[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    d[at + 4..at + 6].copy_from_slice(&0u16.to_le_bytes());
    d[at + 6..at + 8].copy_from_slice(&4u16.to_le_bytes());
    d[at + 8..at + 12].copy_from_slice(&0xdead_beefu32.to_le_bytes());
    reseal(FileKind::Index, &mut d);
    std::fs::write(&path, d).unwrap();
    // ... and its bit out of the zero bitmap (header, section header, bits).
    let path = g1.join(FileKind::Zero.default_name());
    let mut z = std::fs::read(&path).unwrap();
    z[64 + 16] &= !(1u8 << ZERO_PAGE);
    let count = u64::from_le_bytes(z[64 + 8..64 + 16].try_into().unwrap()) - 1;
    z[64 + 8..64 + 16].copy_from_slice(&count.to_le_bytes());
    reseal(FileKind::Zero, &mut z);
    std::fs::write(&path, z).unwrap();

    let img = Image::open(&g1).unwrap();
    let mut src = ImagePages::new(&img, &[], 0).unwrap();
    let mut buf = vec![0u8; PS];
    let id = PageId {
        block: 0,
        page: ZERO_PAGE,
    };
    let e = src.read_page(id, &mut buf).unwrap_err();
    assert!(e.to_string().contains("has another CRC"), "{e}");
    // An undamaged page of the parent still reads.
    let other = PageKey::new(0, 3);
    let ok = src.read_page(
        PageId {
            block: other.ram_block,
            page: other.page,
        },
        &mut buf,
    );
    assert!(ok.unwrap(), "page 3 is stored");
    assert_eq!(&buf[..4], &3u32.to_le_bytes());
}
