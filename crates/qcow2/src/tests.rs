//! Tests against files made by `qemu-img` and `qemu-io` (Debian package
//! qemu-utils, which `scripts/install-deps.sh` installs): what the reader
//! reads equals what `qemu-img convert -O raw` reads.

use std::path::{Path, PathBuf};

use super::*;

const MIB: u64 = 1 << 20;

use vmcsnap_testkit::run_ok as run;

fn create(path: &Path, opts: &str, backing: Option<(&str, &str)>, size: Option<u64>) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    if let Some((b, fmt)) = backing {
        args.extend(["-b", b, "-F", fmt]);
    }
    let size = size.map(|s| s.to_string());
    let p = path.to_str().unwrap();
    args.push(p);
    if let Some(s) = &size {
        args.push(s);
    }
    run("qemu-img", &args);
}

fn io(path: &Path, cmds: &[&str]) {
    let mut args = vec![];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(path.to_str().unwrap());
    run("qemu-io", &args);
}

/// The whole disk as QEMU reads it.
fn qemu_raw(path: &Path) -> Vec<u8> {
    let raw = path.with_extension("oracle.raw");
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "raw",
            path.to_str().unwrap(),
            raw.to_str().unwrap(),
        ],
    );
    let b = std::fs::read(&raw).unwrap();
    std::fs::remove_file(&raw).unwrap();
    b
}

fn ours(path: &Path) -> Vec<u8> {
    let d = Disk::open(path).unwrap();
    let mut b = vec![0xAAu8; d.len() as usize];
    // Odd-sized reads across cluster boundaries.
    for (i, c) in b.chunks_mut(12_345).enumerate() {
        d.read_at(i as u64 * 12_345, c).unwrap();
    }
    b
}

fn assert_same(path: &Path) {
    let (a, b) = (ours(path), qemu_raw(path));
    assert_eq!(a.len(), b.len());
    if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
        panic!("{}: first difference at byte {i}", path.display());
    }
}

fn blocks(path: &Path, layer: usize) -> Vec<u64> {
    let d = Disk::open(path).unwrap();
    d.allocated_blocks(layer)
        .unwrap()
        .map(|r| r.unwrap().0)
        .collect()
}

#[test]
fn a_raw_file_reads_as_itself() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("d.raw");
    let data: Vec<u8> = (0..3 * BLOCK as usize).map(|i| (i % 251) as u8).collect();
    let mut f = data.clone();
    f.extend(vec![0u8; BLOCK as usize]);
    std::fs::write(&p, &f).unwrap();
    let d = Disk::open(&p).unwrap();
    assert_eq!(d.len(), 4 * BLOCK);
    assert_eq!(d.layers()[0].format, Format::Raw);
    let mut b = vec![0; 100];
    d.read_at(5000, &mut b).unwrap();
    assert_eq!(b, data[5000..5100]);
    assert_eq!(blocks(&p, 0), vec![0, 1, 2]);
    assert!(matches!(
        d.read_at(4 * BLOCK - 1, &mut b),
        Err(DiskError::OutOfRange { .. })
    ));
}

#[test]
fn qcow2_v3_and_v2_read_like_qemu() {
    let t = tempfile::tempdir().unwrap();
    for (name, opts) in [
        ("v3.qcow2", ""),
        ("v2.qcow2", "compat=0.10"),
        ("c512.qcow2", "cluster_size=512"),
        ("c2m.qcow2", "cluster_size=2M"),
    ] {
        let p = t.path().join(name);
        create(&p, opts, None, Some(8 * MIB + 1024));
        io(
            &p,
            &[
                "write -P 0x11 0 4096",
                "write -P 0x22 65536 65536",
                "write -P 0x33 1000000 7000",
                "write -P 0x44 8388608 1000",
            ],
        );
        assert_same(&p);
        let d = Disk::open(&p).unwrap();
        assert_eq!(d.len(), 8 * MIB + 1024, "{name}");
        let b = blocks(&p, 0);
        assert!(
            b.contains(&0) && b.contains(&16) && b.contains(&31),
            "{name}: {b:?}"
        );
        assert!(!b.contains(&100), "{name}: {b:?}");
    }
}

#[test]
fn a_three_file_chain_with_a_zero_cluster_reads_like_qemu() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let base = dir.join("base.raw");
    std::fs::write(&base, vec![0x5Au8; 4 * MIB as usize]).unwrap();
    let mid = dir.join("mid.qcow2");
    let top = dir.join("top.qcow2");
    // Relative backing names, resolved against each file's directory.
    create(&mid, "", Some(("base.raw", "raw")), Some(6 * MIB));
    create(&top, "", Some(("mid.qcow2", "qcow2")), Some(6 * MIB));
    io(
        &mid,
        &["write -P 0x66 65536 131072", "write -P 0x67 5242880 4096"],
    );
    io(
        &top,
        &[
            "write -P 0x77 131072 4096",
            // A zero cluster over the middle file's data and the base's.
            "write -z 196608 65536",
            "write -z 1048576 65536",
        ],
    );
    assert_same(&top);
    let d = Disk::open(&top).unwrap();
    let names: Vec<String> = d
        .layers()
        .iter()
        .map(|l| l.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["top.qcow2", "mid.qcow2", "base.raw"]);
    let mut b = vec![0xFFu8; 4096];
    d.read_at(196608, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "zero cluster over data");
    d.read_at(1048576, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "zero cluster over the base");
    d.read_at(4 * MIB + 4096, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "past the end of the base");
    // The top's own data cluster (64 KiB at 128 KiB): its 16 blocks, with
    // the bytes below filled in from the middle file.
    let top_blocks = blocks(&top, 0);
    assert_eq!(top_blocks, (32..48).collect::<Vec<_>>());
    let first = d.allocated_blocks(0).unwrap().next().unwrap().unwrap();
    assert_eq!(first.1, vec![0x77u8; 4096]);
    let mid_blocks = blocks(&top, 1);
    // Two clusters of 0x66, and one block of 0x67 in a cluster whose
    // other blocks are past the end of the base (zeros, skipped).
    let mut want: Vec<u64> = (16..48).collect();
    want.push(1280);
    assert_eq!(mid_blocks, want);
    // The chain opened from the copy in another directory resolves there.
    let other = dir.join("copy");
    std::fs::create_dir(&other).unwrap();
    for f in ["top.qcow2", "mid.qcow2", "base.raw"] {
        std::fs::hard_link(dir.join(f), other.join(f)).unwrap();
    }
    assert_eq!(ours(&other.join("top.qcow2")), ours(&top));
    std::fs::remove_file(other.join("base.raw")).unwrap();
    let e = Disk::open(&other.join("top.qcow2"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("base.raw") && e.contains("does not exist"),
        "{e}"
    );
}

#[test]
fn unsupported_features_are_named() {
    let t = tempfile::tempdir().unwrap();
    let plain = t.path().join("plain.qcow2");
    create(&plain, "", None, Some(2 * MIB));
    io(&plain, &["write -P 0x12 0 1048576"]);
    let comp = t.path().join("comp.qcow2");
    run(
        "qemu-img",
        &[
            "convert",
            "-c",
            "-O",
            "qcow2",
            plain.to_str().unwrap(),
            comp.to_str().unwrap(),
        ],
    );
    let d = Disk::open(&comp).unwrap();
    let e = d.read_at(0, &mut [0u8; 512]).unwrap_err().to_string();
    assert!(e.contains("compressed clusters (zlib)"), "{e}");
    let ext = t.path().join("ext.qcow2");
    create(&ext, "extended_l2=on", None, Some(2 * MIB));
    let e = Disk::open(&ext).unwrap_err().to_string();
    assert!(e.contains("extended L2"), "{e}");
    let df = t.path().join("df.qcow2");
    let data = t.path().join("df.data");
    create(
        &df,
        &format!("data_file={}", data.display()),
        None,
        Some(2 * MIB),
    );
    let e = Disk::open(&df).unwrap_err().to_string();
    assert!(e.contains("external data file"), "{e}");
}

#[test]
fn a_backing_loop_is_bounded() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a.qcow2");
    create(&a, "", None, Some(MIB));
    // Point a at itself (qemu-img refuses, so edit the header).
    run(
        "qemu-img",
        &[
            "rebase",
            "-u",
            "-f",
            "qcow2",
            "-b",
            "a.qcow2",
            "-F",
            "qcow2",
            a.to_str().unwrap(),
        ],
    );
    let e = Disk::open(&a).unwrap_err();
    assert!(matches!(e, DiskError::ChainTooLong { .. }), "{e}");
}

/// A deterministic generator for the damaged-header test.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn exercise(p: &Path) {
    if let Ok(d) = Disk::open(p) {
        let mut b = vec![0u8; 8192];
        for off in [0, 65536, 4096 * 100, d.len().saturating_sub(8192)] {
            let _ = d.read_at(off, &mut b);
        }
        if let Ok(it) = d.allocated_blocks(0) {
            for r in it.take(2000) {
                if r.is_err() {
                    break;
                }
            }
        }
    }
}

#[test]
fn damaged_images_are_errors_not_panics() {
    let t = tempfile::tempdir().unwrap();
    let base = t.path().join("base.qcow2");
    create(&base, "", None, Some(4 * MIB));
    let good = t.path().join("good.qcow2");
    create(&good, "", Some(("base.qcow2", "qcow2")), Some(4 * MIB));
    io(&good, &["write -P 0x31 0 200000", "write -z 262144 65536"]);
    let orig = std::fs::read(&good).unwrap();
    let bad: PathBuf = t.path().join("bad.qcow2");
    let mut rng = Lcg(7);
    for round in 0..3000 {
        let mut f = orig.clone();
        match round % 4 {
            // Header fields.
            0 => {
                for _ in 0..1 + rng.next() % 4 {
                    let i = (rng.next() % 112) as usize;
                    f[i] = rng.next() as u8;
                }
            }
            // Anywhere in the metadata (L1 at cluster 3, L2 tables after).
            1 => {
                for _ in 0..1 + rng.next() % 8 {
                    let i = (rng.next() % f.len().min(6 * 65536) as u64) as usize;
                    f[i] ^= 1 << (rng.next() % 8);
                }
            }
            // Truncated.
            2 => f.truncate((rng.next() % f.len() as u64) as usize),
            // Whole big-endian fields set to extremes.
            _ => {
                let at = [8, 16, 20, 24, 32, 36, 40, 72, 100][(rng.next() % 9) as usize];
                let v = [0u8, 0xFF, 0x7F][(rng.next() % 3) as usize];
                for b in &mut f[at..at + 4] {
                    *b = v;
                }
            }
        }
        std::fs::write(&bad, &f).unwrap();
        exercise(&bad);
    }
}
