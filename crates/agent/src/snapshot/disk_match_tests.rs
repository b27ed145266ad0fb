//! The detection layer's index and matcher on a small qcow2 chain made
//! with qemu-img and qemu-io, and the restore side's reader of it.

use std::path::Path;
use std::time::{Duration, Instant};

use super::*;
use crate::frozen_disks::FrozenDisks;
use crate::snapshot::writer_options;
use vmcsnap_image::{DiskPages, DiskRef};

use vmcsnap_testkit::run_ok as run;

fn io(path: &Path, cmds: &[&str]) {
    let mut args = vec![];
    for c in cmds {
        args.extend(["-c", *c]);
    }
    args.push(path.to_str().unwrap());
    run("qemu-io", &args);
}

/// The bytes of a page that qemu-io's `write -P v` wrote.
fn pattern(v: u8) -> Vec<u8> {
    vec![v; 4096]
}

fn matcher_of(layer: &DiskLayer) -> Box<dyn DiskMatcher> {
    (layer.matcher().0)()
}

fn wait_ready(layer: &DiskLayer) {
    let t = Instant::now();
    while layer.shared.index.get().is_none() {
        let s = layer.shared.stats.lock().unwrap().clone();
        assert!(s.error.is_none(), "{s:?}");
        assert!(t.elapsed() < Duration::from_secs(30), "index not ready");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pages_on_the_frozen_chain_are_found_and_confirmed_byte_by_byte() {
    let t = tempfile::tempdir().unwrap();
    let (base, top) = (t.path().join("base.qcow2"), t.path().join("top.qcow2"));
    let cache = t.path().join("cache");
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "4M"],
    );
    io(
        &base,
        &[
            "write -P 0x41 0 4096",
            "write -P 0x42 65536 4096",
            "write -P 0x43 131072 4096",
        ],
    );
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            "base.qcow2",
            top.to_str().unwrap(),
            "4M",
        ],
    );
    // The top overwrites 0x42's block, and adds 0x51 at block 300.
    io(
        &top,
        &["write -P 0x50 65536 4096", "write -P 0x51 1228800 4096"],
    );

    let mut layer = start(&top, &cache);
    let mut m = matcher_of(&layer);
    let h = |v: u8| page_hash(&pattern(v));
    // The base is indexed before the freeze; nothing is published.
    layer.wait_lower(Duration::from_secs(30));
    assert!(layer.shared.index.get().is_none());
    assert_eq!(m.find(h(0x41), &pattern(0x41)), None);
    (layer.frozen_signal().unwrap())();
    wait_ready(&layer);
    assert_eq!(m.find(h(0x41), &pattern(0x41)), Some((0, 0)));
    assert_eq!(m.find(h(0x43), &pattern(0x43)), Some((0, 32)));
    assert_eq!(m.find(h(0x51), &pattern(0x51)), Some((0, 300)));
    assert_eq!(m.find(h(0x50), &pattern(0x50)), Some((0, 16)));
    // In the base's index, but the top shadows it.
    assert_eq!(m.find(h(0x42), &pattern(0x42)), None);
    // Same hash, other bytes: the bytes decide.
    assert_eq!(m.find(h(0x41), &pattern(0x99)), None);
    assert_eq!(m.find(h(0x77), &pattern(0x77)), None);
    // Pages of another size never match.
    assert_eq!(m.find(h(0x41), &[0x41; 8192]), None);
    let s = layer.shared.stats.lock().unwrap().clone();
    assert_eq!((s.files, s.files_cached, s.blocks), (2, 0, 5), "{s:?}");
    let mut metrics = vmcsnap_capture::Metrics::default();
    layer.record(&mut metrics);
    assert_eq!(metrics.other["disk_index"]["ready"], true);

    // The next snapshot of the same files takes both indexes from the cache.
    let mut again = start(&top, &cache);
    (again.frozen_signal().unwrap())();
    wait_ready(&again);
    let s = again.shared.stats.lock().unwrap().clone();
    assert_eq!((s.files, s.files_cached, s.blocks), (2, 2, 5), "{s:?}");
    assert_eq!(
        matcher_of(&again).find(h(0x51), &pattern(0x51)),
        Some((0, 300))
    );

    // The restore side reads the same bytes through the chain.
    let disks = FrozenDisks::new();
    let d = DiskRef {
        node: "disk0".into(),
        path: top.display().to_string(),
        format: "qcow2".into(),
        extra: Default::default(),
    };
    let mut out = vec![0u8; 4096];
    disks.read(&d, 300 * 4096, &mut out).unwrap();
    assert_eq!(out, pattern(0x51));
    disks.read(&d, 32 * 4096, &mut out).unwrap();
    assert_eq!(out, pattern(0x43));
}

#[test]
fn a_snapshot_that_fails_before_the_freeze_ends_the_indexing() {
    let t = tempfile::tempdir().unwrap();
    let top = t.path().join("top.qcow2");
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", top.to_str().unwrap(), "1M"],
    );
    let layer = start(&top, &t.path().join("cache"));
    let shared = layer.shared.clone();
    drop(layer);
    let t0 = Instant::now();
    while shared.stats.lock().unwrap().error.is_none() {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(shared.index.get().is_none());
}

#[test]
fn damaged_cache_files_are_ignored() {
    let mut idx = FileIndex::default();
    idx.map.insert(7, 3);
    idx.map.insert(9, 1 << 20);
    let b = encode(&idx);
    assert_eq!(decode(&b), Some(idx));
    for i in 0..b.len() {
        let mut c = b.clone();
        c[i] ^= 0x10;
        assert_eq!(decode(&c), None, "byte {i}");
        assert_eq!(decode(&b[..i]), None, "cut at {i}");
    }
}

#[test]
fn storage_names_the_writer_options() {
    use vmcsnap_capture::Codec;
    let w = |s: &str| writer_options(s.parse().unwrap());
    // `no-disk` is the detection layer's business only.
    assert_eq!(w("zstd,no-disk"), w("zstd"));
    assert_eq!(w("no-disk"), writer_options(Default::default()));
    assert_eq!(w("zstd").codec, Codec::Zstd);
    assert_eq!(w("lz4").codec, Codec::Lz4);
    assert_eq!(w("none").codec, Codec::None);
    assert_eq!(w("none").format_major, 2);
    assert_eq!(w("v1").format_major, 1);
    assert_eq!(w("lz4-random").scatter_blocks, 256);
    assert_eq!(w("lz4").scatter_blocks, w("zstd").scatter_blocks);
}
