//! gc of `<run>/disk-index/` on real qcow2 chains (qemu-img) and a real
//! snapshot directory.

use std::path::{Path, PathBuf};

use vmcsnap_image::testing::write_small_snapshot;
use vmcsnap_image::DiskRef;
use vmcsnap_qcow2::Disk;

use super::*;
use crate::RunDir;

fn qemu_img(args: &[&str]) {
    let bin = crate::qemu::find_qemu_img().expect("qemu-img (QEMU is installed for the tests)");
    let st = std::process::Command::new(bin).args(args).status().unwrap();
    assert!(st.success(), "qemu-img {args:?}");
}

/// `top` (qcow2) on `base` (raw, 1 MiB, in the same directory).
fn chain(top: &Path, base: &Path) {
    std::fs::create_dir_all(top.parent().unwrap()).unwrap();
    std::fs::write(base, vec![7u8; 1 << 20]).unwrap();
    let name = base.file_name().unwrap().to_str().unwrap();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "raw",
        "-b",
        name,
        top.to_str().unwrap(),
        "1M",
    ]);
}

/// A cached index of each file of the chain whose top is `top`, named as
/// the index builder names it (from the opened disk's identity).
fn cache_chain(cache: &Path, top: &Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(cache).unwrap();
    let d = Disk::open(top).unwrap();
    (0..d.layers().len())
        .map(|i| {
            let p = cache.join(cache_name(&d.identity(i).unwrap()));
            std::fs::write(&p, b"VMCSDIX1").unwrap();
            p
        })
        .collect()
}

#[test]
fn gc_removes_the_disk_indexes_no_snapshot_or_vm_uses_and_keeps_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let run = RunDir::new(tmp.path());
    let root = run.snapshots_dir();
    let cache = run.root().join("disk-index");
    // A committed snapshot's frozen chain.
    let top = root.join(".disks/s1/data.qcow2");
    chain(&top, &root.join(".disks/s1/base.raw"));
    let disk = DiskRef {
        node: "disk0".into(),
        path: top.display().to_string(),
        format: "qcow2".into(),
        ..Default::default()
    };
    write_small_snapshot(&root.join("s1"), "a", Some(100), vec![disk]).unwrap();
    let snapshot_idx = cache_chain(&cache, &top);
    // A snapshot that was deleted: its frozen chain is gone.
    let gone = tmp.path().join("gone/data.qcow2");
    chain(&gone, &tmp.path().join("gone/base.raw"));
    let gone_idx = cache_chain(&cache, &gone);
    std::fs::remove_dir_all(tmp.path().join("gone")).unwrap();
    // A file indexed before it changed (another length: another identity).
    let changed = tmp.path().join("vm/changed.raw");
    std::fs::create_dir_all(changed.parent().unwrap()).unwrap();
    std::fs::write(&changed, vec![1u8; 8192]).unwrap();
    let changed_idx = cache_chain(&cache, &changed);
    std::fs::write(&changed, vec![1u8; 4096]).unwrap();
    // A VM's disk chain (the VM is not in a cluster here: given to `clean`).
    let vm_top = tmp.path().join("vm/overlay.qcow2");
    chain(&vm_top, &tmp.path().join("vm/vmbase.raw"));
    let vm_idx = cache_chain(&cache, &vm_top);
    // Temporary files of cache writes: a dead writer's, this process's.
    let dead = cache.join("1-2-3-4.tmp-999999999");
    let ours = cache.join(format!("1-2-3-4.tmp-{}", std::process::id()));
    let other = cache.join("README");
    for f in [&dead, &ours, &other] {
        std::fs::write(f, b"x").unwrap();
    }

    // gc as the agent runs it: the snapshot's chain stays, the VM is not
    // known to it, so its indexes go with the stale ones.
    let r = crate::gc::collect(&run, &mut None).unwrap();
    let mut want: Vec<PathBuf> = gone_idx
        .iter()
        .chain(&changed_idx)
        .chain(&vm_idx)
        .cloned()
        .chain([dead.clone()])
        .collect();
    want.sort();
    assert_eq!(r.removed, want);
    for p in snapshot_idx.iter().chain([&ours, &other]) {
        assert!(p.exists(), "{} was removed", p.display());
    }
    assert!(root.join("s1").exists() && top.exists());

    // A VM's disk chain counts as in use: its indexes stay.
    let vm_idx = cache_chain(&cache, &vm_top);
    let in_use = BTreeSet::from([vm_top.clone()]);
    assert!(clean(&cache, &root.join(".disks"), &in_use).is_empty());
    assert!(vm_idx.iter().all(|p| p.exists()));
    // Once the snapshot is deleted (and its frozen disks with it), its
    // indexes go too.
    std::fs::remove_dir_all(root.join("s1")).unwrap();
    std::fs::remove_dir_all(root.join(".disks/s1")).unwrap();
    let mut removed = clean(&cache, &root.join(".disks"), &in_use);
    removed.sort();
    let mut want = snapshot_idx.clone();
    want.sort();
    assert_eq!(removed, want);
}
