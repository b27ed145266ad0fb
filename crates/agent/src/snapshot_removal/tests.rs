//! Delete and prune on synthetic snapshot directories (no QEMU).

use std::path::{Path, PathBuf};

use vmcsnap_control::SnapshotKind;
use vmcsnap_image::testing::{write_small_cluster_snapshot, write_small_snapshot};
use vmcsnap_image::{list_cluster_snapshots, list_snapshots, DiskRef};

use super::*;
use crate::snapshot_removal::prune::{select, Candidate};

struct Fixture {
    _dir: tempfile::TempDir,
    run: RunDir,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        std::fs::create_dir_all(run.snapshots_dir().join(".disks")).unwrap();
        Fixture { _dir: dir, run }
    }

    fn root(&self) -> PathBuf {
        self.run.snapshots_dir()
    }

    fn disks(&self, name: &str) -> PathBuf {
        self.root().join(".disks").join(name)
    }

    /// A snapshot `name` of `vm` committed at `at`, its frozen disk a qcow2
    /// in `.disks/<name>/` whose backing file is `backing`.
    fn vm_snapshot(&self, name: &str, vm: &str, at: u64, backing: Option<&str>) -> PathBuf {
        let top = self.disks(name).join(format!("data-{name}.qcow2"));
        fake_qcow2(&top, backing);
        let disk = DiskRef {
            node: "disk0".into(),
            path: top.display().to_string(),
            format: "qcow2".into(),
            ..Default::default()
        };
        write_small_snapshot(&self.root().join(name), vm, Some(at), vec![disk]).unwrap();
        top
    }

    /// A cluster snapshot `name` of cluster `demo` (VMs a and b), its
    /// frozen disks in `.disks/<name>/<vm>/`.
    fn cluster_snapshot(&self, name: &str, at: u64) {
        let disks = self.disks(name);
        let disk = |vm: &str| {
            let top = disks.join(vm).join("data.qcow2");
            fake_qcow2(&top, None);
            vec![DiskRef {
                node: "disk0".into(),
                path: top.display().to_string(),
                format: "qcow2".into(),
                ..Default::default()
            }]
        };
        write_small_cluster_snapshot(
            &self.root().join(name),
            name,
            "demo",
            &["a", "b"],
            at,
            &disk,
        )
        .unwrap();
    }

    fn listed(&self) -> Vec<String> {
        let mut names: Vec<String> = list_snapshots(&self.root())
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        names.extend(
            list_cluster_snapshots(&self.root())
                .unwrap()
                .into_iter()
                .map(|e| e.name),
        );
        names.sort();
        names
    }

    /// Entries of the snapshot directory other than `.disks`.
    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.root())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n != ".disks")
            .collect();
        v.sort();
        v
    }

    fn delete(&self, names: &[&str]) -> Result<SnapshotsDeleteResult, RemovalError> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        delete(&self.run, &mut None, &names)
    }

    fn prune(&self, keep: u32, vm: Option<&str>, dry_run: bool) -> SnapshotsDeleteResult {
        let opts = PruneOptions {
            keep,
            vm: vm.map(str::to_string),
            dry_run,
        };
        prune(&self.run, &mut None, &opts).unwrap()
    }
}

/// A file with a qcow2 header naming `backing` (and 64 KiB of data, so
/// that it takes space).
fn fake_qcow2(path: &Path, backing: Option<&str>) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut h = vec![0u8; 64 << 10];
    h[..4].copy_from_slice(b"QFI\xfb");
    h[4..8].copy_from_slice(&3u32.to_be_bytes());
    if let Some(b) = backing {
        h[8..16].copy_from_slice(&104u64.to_be_bytes());
        h[16..20].copy_from_slice(&(b.len() as u32).to_be_bytes());
        h[104..104 + b.len()].copy_from_slice(b.as_bytes());
    }
    h[4096..].fill(0x5a);
    std::fs::write(path, h).unwrap();
}

fn names(r: &SnapshotsDeleteResult) -> Vec<&str> {
    r.removed.iter().map(|s| s.name.as_str()).collect()
}

#[test]
fn delete_removes_the_snapshot_and_its_frozen_disks() {
    let f = Fixture::new();
    f.vm_snapshot("s1", "a", 100, None);
    f.vm_snapshot("s2", "a", 200, None);
    let r = f.delete(&["s1"]).unwrap();
    assert_eq!(names(&r), ["s1"]);
    let s = &r.removed[0];
    assert_eq!(
        (s.kind, s.of.as_deref(), s.created_unix_ms),
        (SnapshotKind::Vm, Some("a"), Some(100))
    );
    assert_eq!(s.disks_removed.as_deref(), Some(f.disks("s1").as_path()));
    // Memory image, index, ... and the 64 KiB disk.
    assert!(s.bytes_freed > 64 << 10, "{r:?}");
    assert_eq!(r.bytes_freed, s.bytes_freed);
    assert!(r.kept_in_use.is_empty() && !r.dry_run);
    assert!(!f.disks("s1").exists());
    assert_eq!(f.entries(), ["s2"], "no temporary directory is left");
    assert!(f.disks("s2").is_dir());
}

/// Step 1 of a delete, then a crash: the snapshot no longer lists, and gc
/// removes what is left (and the frozen disks of no snapshot).
#[test]
fn a_delete_interrupted_after_the_rename_leaves_only_what_gc_removes() {
    let f = Fixture::new();
    f.vm_snapshot("s1", "a", 100, None);
    let tmp = f.root().join(temp_name("s1"));
    std::fs::rename(f.root().join("s1"), &tmp).unwrap();
    assert!(f.listed().is_empty());
    assert!(vmcsnap_image::list::temp_dir_pid(&temp_name("s1")).is_some());
    let g = crate::gc::collect(&f.run, &mut None).unwrap();
    assert_eq!(g.removed, [f.disks("s1"), tmp.clone()]);
    assert!(!tmp.exists() && !f.disks("s1").exists());
    // A dead agent's leftover goes too (pid 0 never runs an agent).
    let dead = f.root().join("s9.tmp-0-del3");
    std::fs::create_dir(&dead).unwrap();
    assert_eq!(
        crate::gc::collect(&f.run, &mut None).unwrap().removed,
        [dead]
    );
}

#[test]
fn temp_names_carry_the_pid_and_fit_in_a_directory_entry() {
    let long = "é".repeat(120); // 240 bytes
    for name in ["s1", long.as_str()] {
        let t = temp_name(name);
        assert!(t.len() <= 255, "{t}");
        assert_eq!(
            vmcsnap_image::list::temp_dir_pid(&t),
            Some(Some(std::process::id()))
        );
    }
    assert_ne!(temp_name("s1"), temp_name("s1"));
}

#[test]
fn unknown_names_are_named_and_nothing_is_removed() {
    let f = Fixture::new();
    f.vm_snapshot("s1", "a", 100, None);
    let e = f.delete(&["s1", "nope"]).unwrap_err().to_string();
    assert!(
        e.contains("no snapshot named \"nope\"") && e.contains("`vmcsnap snapshots`"),
        "{e}"
    );
    assert_eq!(f.listed(), ["s1"]);
    assert!(f.disks("s1").is_dir());
    assert!(matches!(f.delete(&[]), Err(RemovalError::NoNames)));
}

#[test]
fn names_that_are_not_snapshot_names_are_refused() {
    let f = Fixture::new();
    f.vm_snapshot("s1", "a", 100, None);
    std::fs::create_dir(f.root().join("s1.tmp-1-2")).unwrap();
    for bad in [
        "",
        ".",
        "..",
        "../s1",
        "s1/..",
        "a/b",
        "/etc",
        ".disks",
        "s1.tmp-1-2",
        "x\0",
    ] {
        match f.delete(&[bad]) {
            Err(RemovalError::BadName { name }) => assert_eq!(name, bad),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert_eq!(f.listed(), ["s1"]);
    assert!(f.disks("s1").is_dir());
}

#[test]
fn a_cluster_snapshot_is_deleted_whole_and_its_vms_are_not_deleted_alone() {
    let f = Fixture::new();
    f.cluster_snapshot("c1", 100);
    f.vm_snapshot("s1", "a", 100, None);
    let inside = [
        "c1/vms/a".to_string(),
        "c1/vms".into(),
        f.root().join("c1/vms/b").display().to_string(),
    ];
    for name in &inside {
        let e = f.delete(&[name]).unwrap_err();
        assert!(matches!(&e, RemovalError::InsideCluster { cluster, .. } if cluster == "c1"));
        assert!(
            e.to_string().contains("`vmcsnap snapshots delete c1`"),
            "{e}"
        );
    }
    assert!(f.disks("c1").join("a").is_dir());
    let r = f.delete(&["c1"]).unwrap();
    assert_eq!(names(&r), ["c1"]);
    assert_eq!(
        (r.removed[0].kind, r.removed[0].of.as_deref()),
        (SnapshotKind::Cluster, Some("demo"))
    );
    assert!(r.removed[0].bytes_freed > 2 * (64 << 10), "{r:?}");
    assert!(!f.disks("c1").exists());
    assert_eq!(f.entries(), ["s1"]);
}

/// A snapshot of a VM restored from `s` reads `s`'s frozen disk (its
/// overlay names it by absolute path): `s`'s disks stay while it exists,
/// for gc too, and go with it.
#[test]
fn frozen_disks_another_snapshot_reads_are_kept_until_it_goes() {
    let f = Fixture::new();
    let s_top = f.vm_snapshot("s", "a", 100, None);
    f.vm_snapshot("t", "a", 200, Some(s_top.to_str().unwrap()));
    f.vm_snapshot("u", "a", 300, None);
    let r = f.delete(&["s"]).unwrap();
    assert_eq!(r.kept_in_use, [f.disks("s")]);
    assert_eq!(r.removed[0].disks_removed, None);
    assert!(s_top.is_file());
    let g = crate::gc::collect(&f.run, &mut None).unwrap();
    assert!(
        g.removed.is_empty() && g.kept_in_use == [f.disks("s")],
        "{g:?}"
    );
    f.delete(&["t"]).unwrap();
    let g = crate::gc::collect(&f.run, &mut None).unwrap();
    assert_eq!(g.removed, [f.disks("s")]);

    // Going together, in one prune, both go.
    let s_top = f.vm_snapshot("s", "a", 10, None);
    f.vm_snapshot("t", "a", 20, Some(s_top.to_str().unwrap()));
    let r = f.prune(1, None, false);
    assert_eq!(names(&r), ["s", "t"]);
    assert!(r.kept_in_use.is_empty(), "{r:?}");
    assert!(!f.disks("s").exists() && !f.disks("t").exists());
    assert_eq!(f.listed(), ["u"]);
}

#[test]
fn prune_keeps_exactly_the_newest_n_of_each_vm_and_cluster() {
    let f = Fixture::new();
    for (name, vm, at) in [
        ("a1", "a", 100),
        ("a2", "a", 300),
        ("a3", "a", 200),
        ("b1", "b", 50),
        ("b2", "b", 60),
        ("z", "c", 1),
    ] {
        f.vm_snapshot(name, vm, at, None);
    }
    f.cluster_snapshot("c1", 10);
    f.cluster_snapshot("c2", 20);
    std::fs::create_dir(f.root().join("broken")).unwrap();

    let r = f.prune(2, None, false);
    assert_eq!(names(&r), ["a1"]);
    assert_eq!(r.kept, ["a2", "a3", "b2", "b1", "z", "c2", "c1"]);

    let dry = f.prune(1, None, true);
    assert!(dry.dry_run);
    assert_eq!(names(&dry), ["a3", "b1", "c1"]);
    assert!(dry.bytes_freed > 0);
    assert_eq!(dry.bytes_freed, f.prune(1, None, true).bytes_freed);
    assert_eq!(f.entries().len(), 8, "a dry run removes nothing");

    let r = f.prune(1, None, false);
    assert_eq!(names(&r), names(&dry));
    assert_eq!(r.bytes_freed, dry.bytes_freed);
    assert_eq!(f.listed(), ["a2", "b2", "broken", "c2", "z"]);
    assert!(f.disks("c2").is_dir() && !f.disks("c1").exists());
}

#[test]
fn prune_of_one_vm_leaves_the_rest_and_keep_zero_needs_a_vm() {
    let f = Fixture::new();
    f.vm_snapshot("a1", "a", 1, None);
    f.vm_snapshot("a2", "a", 2, None);
    f.vm_snapshot("b1", "b", 1, None);
    f.cluster_snapshot("c1", 1);
    let opts = PruneOptions {
        keep: 0,
        vm: None,
        dry_run: true,
    };
    let e = prune(&f.run, &mut None, &opts).unwrap_err();
    assert!(matches!(e, RemovalError::KeepZero), "{e}");
    assert!(e.to_string().contains("--vm"), "{e}");
    let r = f.prune(0, Some("a"), false);
    assert_eq!(names(&r), ["a1", "a2"]);
    assert_eq!(f.listed(), ["b1", "c1"]);
    let r = f.prune(0, Some("nobody"), false);
    assert!(r.removed.is_empty() && r.kept.is_empty());
}

/// Without a commit time in the manifest, the directory's mtime orders.
#[test]
fn prune_orders_by_mtime_without_a_commit_time() {
    let f = Fixture::new();
    let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for (name, ago) in [("new", 1), ("old", 30), ("mid", 20)] {
        f.vm_snapshot(name, "a", 0, None);
        let dir = std::fs::File::open(f.root().join(name)).unwrap();
        dir.set_modified(t0 - std::time::Duration::from_secs(ago))
            .unwrap();
    }
    let r = f.prune(1, None, true);
    assert_eq!(names(&r), ["old", "mid"]);
    assert_eq!(r.kept, ["new"]);
}

#[test]
fn selection_breaks_ties_by_name_and_keeps_series_apart() {
    let c = |name: &str, kind, series: &str, at_ms| Candidate {
        name: name.into(),
        kind,
        series: series.into(),
        at_ms,
    };
    let (going, kept) = select(
        vec![
            c("x", SnapshotKind::Vm, "a", 5),
            c("y", SnapshotKind::Vm, "a", 5),
            c("a", SnapshotKind::Cluster, "a", 1),
        ],
        1,
    );
    let n = |v: &[Candidate]| v.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
    assert_eq!(
        (n(&going), n(&kept)),
        (vec!["x".to_string()], vec!["y".into(), "a".into()])
    );
}

#[test]
fn an_invalid_snapshot_is_deleted_by_name() {
    let f = Fixture::new();
    std::fs::create_dir(f.root().join("broken")).unwrap();
    std::fs::write(f.root().join("broken/memory.img"), b"x").unwrap();
    let r = f.delete(&["broken"]).unwrap();
    assert_eq!(r.removed[0].of, None);
    assert!(f.entries().is_empty());
}

#[test]
fn a_file_linked_outside_the_removed_trees_frees_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (t1, t2) = (d.path().join("t1"), d.path().join("t2"));
    std::fs::create_dir_all(&t1).unwrap();
    std::fs::create_dir_all(&t2).unwrap();
    std::fs::write(t1.join("shared"), vec![1u8; 1 << 20]).unwrap();
    std::fs::hard_link(t1.join("shared"), t2.join("shared")).unwrap();
    std::fs::hard_link(t1.join("shared"), d.path().join("outside")).unwrap();
    let only = space::bytes_freed(&[(0, &t1), (1, &t2)], 2);
    assert!(only.iter().all(|&b| b < 1 << 20), "{only:?}");
    std::fs::remove_file(d.path().join("outside")).unwrap();
    let both = space::bytes_freed(&[(0, &t1), (1, &t2)], 2);
    assert!(
        both[0] >= 1 << 20 && both[1] < 1 << 20,
        "counted once: {both:?}"
    );
}

/// The headers qemu-img writes read back as the chain QEMU opens:
/// relative names in the naming file's directory, absolute ones as they are.
#[test]
fn chains_read_from_real_qcow2_headers() {
    let Ok(qemu_img) = crate::qemu::find_qemu_img() else {
        eprintln!("skipped: no qemu-img");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (x, y) = (d.path().join("x"), d.path().join("y"));
    std::fs::create_dir_all(&x).unwrap();
    std::fs::create_dir_all(&y).unwrap();
    let img = |args: &[&str]| {
        let st = std::process::Command::new(&qemu_img)
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "{args:?}");
    };
    let s = |p: &Path| p.display().to_string();
    img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        &s(&x.join("base.qcow2")),
        "1M",
    ]);
    let (base, mid, top) = (
        x.join("base.qcow2"),
        x.join("mid.qcow2"),
        y.join("top.qcow2"),
    );
    img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-u",
        "-b",
        "base.qcow2",
        &s(&mid),
        "1M",
    ]);
    img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        &s(&mid),
        &s(&top),
    ]);
    assert_eq!(disk_refs::chain_files(&top), [top.clone(), mid, base]);
}

#[test]
fn no_snapshot_has_children_yet() {
    assert!(children_of(Path::new("/nonexistent"), "s1").is_empty());
}

/// Generation `gen` of a 200-page VM "inc": every 10th page changes.
fn inc_page(gen: u32, p: u32) -> Vec<u8> {
    let mut d = vec![0u8; 4096];
    let g = if p.is_multiple_of(10) { gen } else { 0 };
    d[..8].copy_from_slice(&[p as u8, (p >> 8) as u8, g as u8, 9, 9, 9, 9, 1]);
    d
}

/// Writes snapshot `name` of generation `gen`, incremental to `parent`.
fn inc_snapshot(root: &Path, name: &str, gen: u32, at: u64, parent: Option<&str>) {
    use vmcsnap_image::{ImageMeta, ImageWriter, ParentInfo, ParentRef, RamBlock, VmInfo};
    let meta = ImageMeta {
        vm: VmInfo {
            name: "inc".into(),
            config: serde_json::Value::Null,
        },
        page_size: 4096,
        ram_blocks: vec![RamBlock {
            name: "mem".into(),
            used_length: 200 * 4096,
        }],
        ..Default::default()
    };
    let mut w = ImageWriter::create(&root.join(name), meta).unwrap();
    w.set_created_unix_ms(at);
    if let Some(p) = parent {
        let img = vmcsnap_image::Image::open(&root.join(p)).unwrap();
        let depth = img.manifest().parent.as_ref().map_or(0, |r| r.depth) + 1;
        w.set_parent(ParentInfo {
            reference: ParentRef {
                name: p.into(),
                image_id: img.manifest().image_id.clone(),
                depth,
            },
            ram_blocks: img.manifest().ram_blocks.clone(),
            hashes: img.page_hashes().unwrap().unwrap(),
        })
        .unwrap();
    }
    for p in 0..200 {
        w.add_page(0, p, &inc_page(gen, p)).unwrap();
    }
    w.set_device_state(b"dev").unwrap();
    w.commit().unwrap();
}

fn assert_generation(root: &Path, name: &str, gen: u32) {
    let img = vmcsnap_image::Image::open(&root.join(name)).unwrap();
    let mut all = vec![0u8; 200 * 4096];
    img.read_ram_block(0, &mut all).unwrap();
    for p in 0..200u32 {
        assert_eq!(
            all[p as usize * 4096..(p as usize + 1) * 4096],
            inc_page(gen, p)[..],
            "{name} page {p}"
        );
    }
    assert!(img.verify().is_ok());
}

#[test]
fn deleting_a_parent_merges_it_into_its_children() {
    let fx = Fixture::new();
    let root = fx.root();
    inc_snapshot(&root, "g0", 0, 1000, None);
    inc_snapshot(&root, "g1", 1, 2000, Some("g0"));
    inc_snapshot(&root, "g2", 2, 3000, Some("g1"));
    std::fs::create_dir(root.join("g1").join("restores")).unwrap();
    std::fs::write(root.join("g1/restores/r1.json"), b"{}").unwrap();
    assert_eq!(children_of(&root, "g1"), vec!["g2".to_string()]);
    let id_g1 = vmcsnap_image::check_committed(&root.join("g1"))
        .unwrap()
        .image_id;

    // The middle of the chain: g2 now reads g0 directly; g1 is gone.
    let r = delete(&fx.run, &mut None, &["g1".to_string()]).unwrap();
    assert_eq!(r.merged, vec!["g2".to_string()]);
    assert!(!root.join("g1").exists());
    assert_generation(&root, "g0", 0);
    assert_generation(&root, "g2", 2);
    let m = vmcsnap_image::check_committed(&root.join("g2")).unwrap();
    let p = m.parent.unwrap();
    assert_eq!((p.name.as_str(), p.depth), ("g0", 1));
    assert_eq!(m.created_unix_ms, 3000, "a rewrite keeps its place");
    assert_ne!(m.image_id, id_g1);

    // The root: g2 becomes full, and a snapshot's extra files move with it.
    std::fs::create_dir(root.join("g2").join("restores")).unwrap();
    std::fs::write(root.join("g2/restores/r2.json"), b"{}").unwrap();
    let r = delete(&fx.run, &mut None, &["g0".to_string()]).unwrap();
    assert_eq!(r.merged, vec!["g2".to_string()]);
    assert_generation(&root, "g2", 2);
    assert!(vmcsnap_image::check_committed(&root.join("g2"))
        .unwrap()
        .parent
        .is_none());
    assert!(root.join("g2/restores/r2.json").exists());
    // Nothing half-written is left behind.
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".disks")
        .collect();
    assert_eq!(names, vec!["g2".to_string()]);
}

#[test]
fn pruning_a_chain_keeps_the_newest_restorable() {
    let fx = Fixture::new();
    let root = fx.root();
    inc_snapshot(&root, "g0", 0, 1000, None);
    inc_snapshot(&root, "g1", 1, 2000, Some("g0"));
    inc_snapshot(&root, "g2", 2, 3000, Some("g1"));
    inc_snapshot(&root, "g3", 3, 4000, Some("g2"));
    let r = prune(
        &fx.run,
        &mut None,
        &PruneOptions {
            keep: 2,
            vm: None,
            dry_run: false,
        },
    )
    .unwrap();
    let mut gone: Vec<&str> = r.removed.iter().map(|x| x.name.as_str()).collect();
    gone.sort();
    assert_eq!(gone, ["g0", "g1"]);
    assert_generation(&root, "g2", 2);
    assert_generation(&root, "g3", 3);
    assert_eq!(list_snapshots(&root).unwrap().len(), 2);
}

fn depth_of(root: &Path, name: &str) -> u32 {
    let m = vmcsnap_image::check_committed(&root.join(name)).unwrap();
    m.parent.map_or(0, |p| p.depth)
}

#[test]
fn merging_the_middle_of_a_chain_recomputes_every_depth_below_it() {
    let fx = Fixture::new();
    let root = fx.root();
    inc_snapshot(&root, "h1", 0, 1000, None);
    inc_snapshot(&root, "h2", 1, 2000, Some("h1"));
    inc_snapshot(&root, "h3", 2, 3000, Some("h2"));
    inc_snapshot(&root, "sc", 3, 4000, Some("h3"));
    inc_snapshot(&root, "sd", 4, 5000, Some("sc"));
    assert_eq!(depth_of(&root, "sd"), 4);
    let r = delete(&fx.run, &mut None, &["h2".to_string()]).unwrap();
    assert_eq!(r.merged, vec!["h3".to_string()]);
    // h3 -> h1 now: every snapshot below it is one shallower, as its
    // chain is (the grandchildren were not rewritten, only their depth).
    for (name, depth) in [("h3", 1), ("sc", 2), ("sd", 3)] {
        assert_eq!(depth_of(&root, name), depth, "{name}");
        assert_eq!(depth::chain_depth(&root, name), Some(depth), "{name}");
    }
    assert_generation(&root, "sc", 3);
    assert_generation(&root, "sd", 4);
    // The next snapshot counts from there.
    let p = crate::snapshot::parent::choose(&root, "inc").unwrap();
    assert_eq!((p.reference.name.as_str(), p.reference.depth), ("sd", 4));
}
