//! Choosing the parent of a new snapshot, on synthetic snapshots.

use std::path::Path;

use vmcsnap_image::{ImageMeta, ImageWriter, RamBlock, VmInfo};

use super::*;

const PAGES: u32 = 64;

/// Snapshot `name` of VM "v" at time `at`, incremental to `parent` (as
/// `choose` picks it).
fn snap(root: &Path, name: &str, at: u64, parent: Option<ParentInfo>) {
    let meta = ImageMeta {
        vm: VmInfo {
            name: "v".into(),
            config: serde_json::Value::Null,
        },
        page_size: 4096,
        ram_blocks: vec![RamBlock {
            name: "mem".into(),
            used_length: u64::from(PAGES) * 4096,
        }],
        ..Default::default()
    };
    let mut w = ImageWriter::create(&root.join(name), meta).unwrap();
    w.set_created_unix_ms(at);
    if let Some(p) = parent {
        w.set_parent(p).unwrap();
    }
    for p in 0..PAGES {
        let mut d = vec![1u8; 4096];
        d[..4].copy_from_slice(&p.to_le_bytes());
        d[4] = if p.is_multiple_of(4) {
            (at % 251) as u8
        } else {
            0
        };
        w.add_page(0, p, &d).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    w.commit().unwrap();
}

#[test]
fn the_first_snapshot_is_full_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let e = choose(tmp.path(), "v").unwrap_err();
    assert!(matches!(e, NoParent::NoEarlier { .. }), "{e}");
    assert!(!e.is_problem());
    assert_eq!(
        e.metric(),
        "none: no earlier snapshot of v with page hashes (format 2)"
    );
}

#[test]
fn a_damaged_hashes_bin_is_named_not_silently_a_full_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    snap(tmp.path(), "s1", 1000, None);
    let p = choose(tmp.path(), "v").unwrap();
    assert_eq!(metric_of(&p), "s1 (depth 1)");
    // 200 hashes' worth of bytes flipped (the body CRC fails).
    let h = tmp.path().join("s1/hashes.bin");
    let mut d = std::fs::read(&h).unwrap();
    for b in &mut d[64 + 16..64 + 16 + 200] {
        *b ^= 0x20;
    }
    std::fs::write(&h, d).unwrap();
    let e = choose(tmp.path(), "v").unwrap_err();
    assert!(matches!(e, NoParent::Hashes { .. }), "{e}");
    assert!(e.is_problem());
    let m = e.metric();
    assert!(
        m.starts_with("none: the page hashes of s1 (hashes.bin) cannot be used")
            && m.contains("CRC mismatch")
            && m.contains("vmcsnap inspect s1 --verify"),
        "{m}"
    );
}

#[test]
fn depth_is_the_chain_as_it_is_and_capped() {
    let tmp = tempfile::tempdir().unwrap();
    snap(tmp.path(), "s0", 1000, None);
    for i in 1..=MAX_DEPTH {
        let p = choose(tmp.path(), "v").unwrap();
        assert_eq!(p.reference.depth, i);
        snap(tmp.path(), &format!("s{i}"), 1000 + u64::from(i), Some(p));
    }
    let e = choose(tmp.path(), "v").unwrap_err();
    assert!(
        matches!(e, NoParent::TooDeep { ref name } if name == "s8"),
        "{e}"
    );
    assert!(!e.is_problem());
}

#[test]
fn an_unreadable_newest_snapshot_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    snap(tmp.path(), "s1", 1000, None);
    std::fs::write(tmp.path().join("s1/device.bin"), b"x").unwrap();
    // The listing itself checks file sizes: give it one it accepts but
    // that does not open (a header CRC).
    snap(tmp.path(), "s2", 2000, None);
    let dev = tmp.path().join("s2/device.bin");
    let mut d = std::fs::read(&dev).unwrap();
    d[20] ^= 1;
    std::fs::write(&dev, d).unwrap();
    let e = choose(tmp.path(), "v").unwrap_err();
    assert!(
        matches!(e, NoParent::Unreadable { ref name, .. } if name == "s2"),
        "{e}"
    );
    assert!(e.metric().contains("vmcsnap inspect s2 --verify"));
}
