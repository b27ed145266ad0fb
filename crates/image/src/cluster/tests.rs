use serde_json::json;

use super::*;
use crate::channel_log::{write_channel_log, FrameReason};
use crate::list::{cleanup_stale, list_snapshots};
use crate::{ImageMeta, ImageWriter, RamBlock, VmInfo};

const VMS: [&str; 3] = ["alpha", "beta", "gamma"];

/// Writes a small committed per-VM snapshot of `vm` at `dir`.
fn build_vm(dir: &Path, vm: &str) {
    let meta = ImageMeta {
        vm: VmInfo {
            name: vm.into(),
            config: json!({"memory_mib": 1}),
        },
        page_size: 4096,
        ram_blocks: vec![RamBlock {
            name: "pc.ram".into(),
            used_length: 4 * 4096,
        }],
        device_state_format: "test".into(),
        ..Default::default()
    };
    let mut w = ImageWriter::create(dir, meta).unwrap();
    for p in 0..4u32 {
        w.add_page(0, p, &[p as u8 + 1; 4096]).unwrap();
    }
    w.set_device_state(b"dev").unwrap();
    w.commit().unwrap();
}

fn frames() -> Vec<ChannelFrame> {
    (0..7usize)
        .map(|i| ChannelFrame {
            sender: VMS[i % 3].into(),
            receiver: VMS[(i + 1 + i % 2) % 3].into(),
            received_unix_us: 1_000 + i as u64,
            delivered_unix_us: 2_000 + i as u64,
            reason: if i % 2 == 0 {
                FrameReason::HeldAtCut
            } else {
                FrameReason::InFlight
            },
            data: vec![i as u8; 60 + i * 10],
        })
        .collect()
}

fn timeline(base: u64) -> Timeline {
    Timeline {
        start_us: base,
        pause_start_us: base + 10,
        pause_end_us: base + 15,
        transient_done_us: base + 20,
        complete_us: base + 100,
    }
}

/// A valid manifest for VMS and `frames()`, without touching the disk.
fn manifest(name: &str) -> ClusterManifest {
    let fs_ = frames();
    let bytes = fs_.iter().map(|f| f.data.len() as u64).sum();
    ClusterManifest {
        format: ClusterManifest::FORMAT.into(),
        version: ClusterManifest::VERSION,
        name: name.into(),
        cluster: "demo".into(),
        mode: "hot".into(),
        created_unix_ms: 1_700_000_000_000,
        network: json!({"subnet": "10.77.0.0/24"}),
        vms: VMS
            .iter()
            .enumerate()
            .map(|(i, vm)| ClusterVm {
                name: (*vm).into(),
                snapshot: format!("{VMS_DIR}/{vm}"),
                memory_mib: 256,
                ip: format!("10.77.0.{}", i + 2),
                mac: format!("52:54:00:77:00:{:02x}", i + 2),
                timeline: timeline(1_000_000 * i as u64),
                metrics: json!({"downtime_ms": 3}),
            })
            .collect(),
        channel_state: ChannelStateRef {
            file: CHANNEL_LOG.into(),
            frames: fs_.len() as u64,
            bytes,
            file_size: crate::channel_log::encoded_len(&fs_),
        },
        edges: edges_from_frames(&fs_),
        metrics: json!({"backoff_ms": 0}),
    }
}

/// Builds a complete cluster snapshot in `dir` (created) named `name`.
fn build_cluster(dir: &Path, name: &str) -> ClusterManifest {
    fs::create_dir_all(dir.join(VMS_DIR)).unwrap();
    for vm in VMS {
        build_vm(&dir.join(VMS_DIR).join(vm), vm);
    }
    let fs_ = frames();
    let summary = write_channel_log(&dir.join(CHANNEL_LOG), &fs_).unwrap();
    let mut m = manifest(name);
    m.channel_state = ChannelStateRef::from_summary(&summary);
    assert_eq!(m, manifest(name), "manifest() predicts the summary");
    m.save(dir).unwrap();
    m
}

fn invalid(r: Result<(), ClusterError>) -> String {
    match r {
        Err(ClusterError::Invalid { what, .. }) => what,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn manifest_round_trips_and_ignores_unknown_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let m = manifest("snap1");
    m.validate().unwrap();
    m.save(tmp.path()).unwrap();
    assert_eq!(ClusterManifest::load(tmp.path()).unwrap(), m);
    let names: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![CLUSTER_MANIFEST], "save left a temporary file");
    // Saving again replaces it.
    let mut m2 = m.clone();
    m2.created_unix_ms += 1;
    m2.save(tmp.path()).unwrap();
    assert_eq!(ClusterManifest::load(tmp.path()).unwrap(), m2);

    let path = tmp.path().join(CLUSTER_MANIFEST);
    let mut v: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(v["format"], "vmcsnap-cluster-snapshot");
    assert_eq!(v["vms"][1]["timeline"]["pause_end_us"], 1_000_015);
    assert_eq!(v["edges"][0]["from"], "alpha");
    v["added_later"] = json!({"x": 1});
    v["vms"][0]["added_later"] = json!(1);
    v.as_object_mut().unwrap().remove("metrics");
    v["vms"][2].as_object_mut().unwrap().remove("metrics");
    fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let back = ClusterManifest::load(tmp.path()).unwrap();
    assert_eq!(back.metrics, Value::Null);
    assert_eq!(back.vms[2].metrics, Value::Null);
    assert_eq!(back.vms[0], m2.vms[0]);
}

#[test]
fn load_checks_format_and_version_before_the_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(CLUSTER_MANIFEST);
    let e = ClusterManifest::load(tmp.path()).unwrap_err();
    assert!(matches!(e, ClusterError::Missing { .. }), "{e}");

    fs::write(
        &path,
        br#"{"format": "vmcsnap-cluster-snapshot", "version": 2, "all": "new"}"#,
    )
    .unwrap();
    let e = ClusterManifest::load(tmp.path()).unwrap_err();
    assert!(
        matches!(&e, ClusterError::UnsupportedVersion { found, supported: 1, .. } if found == "2"),
        "{e}"
    );
    assert!(e.to_string().contains("reads version 1"), "{e}");

    for body in [
        &br#"{"version": 1}"#[..],
        br#"{"format": "other", "version": 1}"#,
        b"[1, 2]",
    ] {
        fs::write(&path, body).unwrap();
        let e = ClusterManifest::load(tmp.path()).unwrap_err();
        assert!(matches!(e, ClusterError::BadFormat { .. }), "{e}");
    }

    let good = serde_json::to_vec(&manifest("s")).unwrap();
    for cut in [0, 1, good.len() / 2, good.len() - 1] {
        fs::write(&path, &good[..cut]).unwrap();
        let e = ClusterManifest::load(tmp.path()).unwrap_err();
        assert!(matches!(e, ClusterError::Json { .. }), "cut {cut}: {e}");
    }
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["vms"][0]["timeline"] = json!("soon");
    fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = ClusterManifest::load(tmp.path()).unwrap_err();
    assert!(matches!(e, ClusterError::Json { .. }), "{e}");
    assert!(
        e.to_string().contains("restore from another snapshot"),
        "{e}"
    );

    // Validation runs on load and names the file.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["vms"][1]["name"] = json!("alpha");
    fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = ClusterManifest::load(tmp.path()).unwrap_err();
    assert!(matches!(e, ClusterError::Invalid { .. }), "{e}");
    assert!(
        e.to_string().starts_with(&path.display().to_string()),
        "{e}"
    );

    let f = File::create(&path).unwrap();
    f.set_len(MAX_CLUSTER_MANIFEST_LEN + 1).unwrap();
    let e = ClusterManifest::load(tmp.path()).unwrap_err();
    assert!(matches!(e, ClusterError::TooLarge { .. }), "{e}");
}

#[test]
fn validate_rejects_what_readers_cannot_trust() {
    let good = manifest("s");
    let check = |f: &dyn Fn(&mut ClusterManifest)| {
        let mut m = good.clone();
        f(&mut m);
        m.validate()
    };
    assert!(matches!(
        check(&|m| m.format = "vmcsnap-snapshot".into()),
        Err(ClusterError::BadFormat { .. })
    ));
    assert!(matches!(
        check(&|m| m.version = 2),
        Err(ClusterError::UnsupportedVersion { .. })
    ));
    for name in ["", ".hidden", "a/b", "x.tmp-1-2", ".."] {
        let name = name.to_string();
        invalid(check(&|m| m.name = name.clone()));
    }
    invalid(check(&|m| m.cluster = "a/b".into()));
    assert!(invalid(check(&|m| m.vms.clear())).contains("no VMs"));
    assert!(invalid(check(&|m| m.vms[2].name = "alpha".into())).contains("twice"));
    for name in ["", "a/b", ".a", "a.tmp-1", &"v".repeat(65), "nl\n"] {
        let name = name.to_string();
        invalid(check(&|m| {
            m.edges.clear();
            m.channel_state.frames = 0;
            m.channel_state.bytes = 0;
            m.channel_state.file_size = EMPTY_CHANNEL_LOG_LEN;
            m.vms[0].name = name.clone();
        }));
    }
    for snap in [
        "",
        "/",
        "/abs/vms/alpha",
        "../alpha",
        "vms/../alpha",
        "./vms/alpha",
        "vms/./a",
        "vms/..",
        "cluster.json",
        "channel-state.bin",
    ] {
        let snap = snap.to_string();
        let what = invalid(check(&|m| m.vms[0].snapshot = snap.clone()));
        assert!(what.contains("alpha"), "{snap:?}: {what}");
    }
    assert!(invalid(check(&|m| m.vms[1].snapshot = "vms//alpha/".into())).contains("another VM"));
    let fields = [
        "start_us",
        "pause_start_us",
        "pause_end_us",
        "transient_done_us",
    ];
    for (i, field) in fields.iter().enumerate() {
        let what = invalid(check(&|m| {
            let t = &mut m.vms[1].timeline;
            let v = [
                &mut t.start_us,
                &mut t.pause_start_us,
                &mut t.pause_end_us,
                &mut t.transient_done_us,
            ];
            *v.into_iter().nth(i).unwrap() = u64::MAX;
        }));
        assert!(what.contains(field) && what.contains("beta"), "{what}");
    }
    // Equal times are fine (e.g. a stop-copy with no transient phase).
    let mut m = good.clone();
    m.vms[0].timeline = Timeline {
        start_us: 5,
        pause_start_us: 5,
        pause_end_us: 5,
        transient_done_us: 5,
        complete_us: 5,
    };
    m.validate().unwrap();

    for file in ["", "cluster.json", "a/b", ".."] {
        let file = file.to_string();
        invalid(check(&|m| m.channel_state.file = file.clone()));
    }
    for size in [
        0,
        EMPTY_CHANNEL_LOG_LEN,
        good.channel_state.file_size * 10,
        u64::MAX,
    ] {
        assert!(invalid(check(&|m| m.channel_state.file_size = size)).contains("cannot be"));
    }
    invalid(check(&|m| m.channel_state.frames = u64::MAX));
    assert!(invalid(check(&|m| m.edges[0].to = "delta".into())).contains("delta"));
    assert!(invalid(check(&|m| m.edges[0].to = m.edges[0].from.clone())).contains("never"));
    assert!(invalid(check(&|m| {
        let mut e = m.edges[0].clone();
        e.frames = 0;
        e.bytes = 0;
        m.edges.push(e);
    }))
    .contains("twice"));
    assert!(invalid(check(&|m| m.edges[1].frames += 1)).contains("add up"));
    assert!(invalid(check(&|m| m.edges[1].bytes -= 1)).contains("add up"));
    // Zero edges between every other pair are fine.
    let mut m = good.clone();
    m.edges.push(Edge {
        from: "gamma".into(),
        to: "gamma-not".into(),
        frames: 0,
        bytes: 0,
    });
    invalid(m.validate());
    m.edges.pop();
    for (from, to) in [("beta", "alpha"), ("gamma", "beta")] {
        if !m.edges.iter().any(|e| e.from == from && e.to == to) {
            m.edges.push(Edge {
                from: from.into(),
                to: to.into(),
                frames: 0,
                bytes: 0,
            });
        }
    }
    m.validate().unwrap();
    // save refuses an invalid manifest and writes nothing.
    let tmp = tempfile::tempdir().unwrap();
    let mut bad = good.clone();
    bad.vms[0].snapshot = "../x".into();
    assert!(bad.save(tmp.path()).is_err());
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn edges_count_frames_per_ordered_pair() {
    let fs_ = frames();
    let edges = edges_from_frames(&fs_);
    let total: u64 = edges.iter().map(|e| e.frames).sum();
    assert_eq!(total, fs_.len() as u64);
    for e in &edges {
        let of_pair: Vec<_> = fs_
            .iter()
            .filter(|f| f.sender == e.from && f.receiver == e.to)
            .collect();
        assert_eq!(e.frames, of_pair.len() as u64);
        assert_eq!(
            e.bytes,
            of_pair.iter().map(|f| f.data.len() as u64).sum::<u64>()
        );
    }
    let mut sorted = edges.clone();
    sorted.sort_by(|a, b| (&a.from, &a.to).cmp(&(&b.from, &b.to)));
    assert_eq!(sorted, edges);
    assert!(edges_from_frames(&[]).is_empty());
}

#[test]
fn vm_names() {
    for ok in ["a", "alpha", "web-1", "Ä", &"v".repeat(64)] {
        assert!(is_vm_name(ok), "{ok:?}");
    }
    for bad in [
        "",
        ".",
        "..",
        ".a",
        "a/b",
        "a\0b",
        "a.tmp-3",
        "tab\t",
        &"v".repeat(65),
    ] {
        assert!(!is_vm_name(bad), "{bad:?}");
    }
}

#[test]
fn committed_cluster_snapshot_checks_out() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c1");
    let m = build_cluster(&dir, "c1");
    assert!(is_cluster_snapshot(&dir));
    assert_eq!(check_cluster_committed(&dir).unwrap(), m);
    assert_eq!(m.vm_dir(&dir, "beta"), Some(dir.join("vms/beta")));
    assert_eq!(m.vm_dir(&dir, "delta"), None);
    assert_eq!(m.vm("gamma").unwrap().ip, "10.77.0.4");
    let back = crate::channel_log::read_channel_log(&m.channel_log_path(&dir)).unwrap();
    assert_eq!(back, frames());
    assert_eq!(edges_from_frames(&back), m.edges);
    for vm in VMS {
        let img = crate::Image::open(&m.vm_dir(&dir, vm).unwrap()).unwrap();
        assert!(img.verify().is_ok());
    }
}

#[test]
fn check_names_what_is_missing_or_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("c1");
    build_cluster(&dir, "c1");

    // A VM's snapshot gone.
    let beta = dir.join("vms/beta");
    let moved = tmp.path().join("beta-away");
    fs::rename(&beta, &moved).unwrap();
    let e = check_cluster_committed(&dir).unwrap_err();
    match &e {
        ClusterError::Vm { vm, source, .. } => {
            assert_eq!(vm, "beta");
            assert!(matches!(source, ReadError::Missing { .. }), "{e}");
        }
        _ => panic!("{e}"),
    }
    assert!(e.to_string().contains("VM beta"), "{e}");
    // A VM's directory holding another VM's snapshot.
    fs::rename(dir.join("vms/gamma"), &beta).unwrap();
    fs::rename(&moved, dir.join("vms/gamma")).unwrap();
    let e = check_cluster_committed(&dir).unwrap_err();
    assert!(matches!(e, ClusterError::Invalid { .. }), "{e}");
    assert!(
        e.to_string().contains("holds a snapshot of VM \"gamma\""),
        "{e}"
    );
    fs::rename(dir.join("vms/gamma"), &moved).unwrap();
    fs::rename(&beta, dir.join("vms/gamma")).unwrap();
    fs::rename(&moved, &beta).unwrap();
    check_cluster_committed(&dir).unwrap();

    // A VM's image damaged (a data file of the wrong size).
    let mem = dir.join("vms/alpha/memory.img");
    let len = fs::metadata(&mem).unwrap().len();
    File::options()
        .write(true)
        .open(&mem)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let e = check_cluster_committed(&dir).unwrap_err();
    assert!(
        matches!(&e, ClusterError::Vm { vm, source: ReadError::Truncated { .. }, .. } if vm == "alpha"),
        "{e}"
    );
    File::options()
        .write(true)
        .open(&mem)
        .unwrap()
        .set_len(len)
        .unwrap();
    check_cluster_committed(&dir).unwrap();

    // The channel log of the wrong size, then gone.
    let log = dir.join(CHANNEL_LOG);
    let good_log = fs::read(&log).unwrap();
    fs::write(&log, &good_log[..good_log.len() - 5]).unwrap();
    let e = check_cluster_committed(&dir).unwrap_err();
    assert!(
        matches!(e, ClusterError::ChannelLogSize { expected, found, .. } if expected == found + 5),
        "{e}"
    );
    fs::write(&log, [&good_log[..], b"x"].concat()).unwrap();
    assert!(matches!(
        check_cluster_committed(&dir),
        Err(ClusterError::ChannelLogSize { .. })
    ));
    fs::remove_file(&log).unwrap();
    let e = check_cluster_committed(&dir).unwrap_err();
    assert!(
        matches!(&e, ClusterError::Missing { file } if *file == log),
        "{e}"
    );
    fs::write(&log, &good_log).unwrap();
    check_cluster_committed(&dir).unwrap();

    fs::remove_file(dir.join(CLUSTER_MANIFEST)).unwrap();
    assert!(!is_cluster_snapshot(&dir));
    assert!(matches!(
        check_cluster_committed(&dir),
        Err(ClusterError::Missing { .. })
    ));
}

#[test]
fn listing_separates_cluster_and_vm_snapshots() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    build_cluster(&root.join("c1"), "c1");
    // Broken: its channel log was cut short.
    let c2 = root.join("c2");
    build_cluster(&c2, "c2");
    let log = c2.join(CHANNEL_LOG);
    let n = fs::metadata(&log).unwrap().len();
    File::options()
        .write(true)
        .open(&log)
        .unwrap()
        .set_len(n - 1)
        .unwrap();
    // A cluster snapshot still being built (or left by a crash).
    let building = root.join("c3.tmp-4000000000-0");
    build_cluster(&building, "c3");
    // An ordinary per-VM snapshot, a hidden directory and a plain file.
    build_vm(&root.join("single"), "solo");
    fs::create_dir(root.join(".disks")).unwrap();
    fs::write(root.join("notes.txt"), b"x").unwrap();

    let clusters = list_cluster_snapshots(root).unwrap();
    let summary: Vec<(&str, bool)> = clusters
        .iter()
        .map(|e| (e.name.as_str(), e.is_valid()))
        .collect();
    assert_eq!(summary, vec![("c1", true), ("c2", false)]);
    assert!(matches!(
        clusters[1].status,
        Err(ClusterError::ChannelLogSize { .. })
    ));
    assert_eq!(clusters[0].status.as_ref().unwrap().vms.len(), 3);

    let singles: Vec<String> = list_snapshots(root)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(
        singles,
        vec!["single"],
        "cluster snapshots are not per-VM snapshots"
    );

    assert_eq!(cleanup_stale(root).unwrap(), vec![building]);
    assert_eq!(list_cluster_snapshots(root).unwrap().len(), 2);
    assert!(list_cluster_snapshots(&root.join("nope")).is_err());
}

#[test]
fn commit_publishes_a_checked_directory_once() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let building = root.join(format!("c1{TEMP_MARKER}{}-7", std::process::id()));
    let m = build_cluster(&building, "c1");
    assert!(list_cluster_snapshots(root).unwrap().is_empty());

    let final_dir = root.join("c1");
    // A name that does not match the manifest is refused, nothing moves.
    let e = commit_cluster_dir(&building, &root.join("other")).unwrap_err();
    assert!(e.to_string().contains("\"c1\""), "{e}");
    for bad in [".c1", "c1.tmp-1"] {
        let e = commit_cluster_dir(&building, &root.join(bad)).unwrap_err();
        assert!(matches!(e, ClusterError::Invalid { .. }), "{e}");
    }
    assert!(building.exists());

    assert_eq!(commit_cluster_dir(&building, &final_dir).unwrap(), m);
    assert!(!building.exists());
    assert_eq!(check_cluster_committed(&final_dir).unwrap(), m);
    let listed = list_cluster_snapshots(root).unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].is_valid());

    // The final name is taken now: a second commit is refused.
    let again = root.join(format!("c1{TEMP_MARKER}{}-8", std::process::id()));
    build_cluster(&again, "c1");
    let e = commit_cluster_dir(&again, &final_dir).unwrap_err();
    assert!(matches!(e, ClusterError::Exists { .. }), "{e}");
    // An empty directory of that name counts as taken too.
    let empty = root.join("c2");
    fs::create_dir(&empty).unwrap();
    let mut m2 = m.clone();
    m2.name = "c2".into();
    m2.save(&again).unwrap();
    assert!(matches!(
        commit_cluster_dir(&again, &empty),
        Err(ClusterError::Exists { .. })
    ));
    fs::remove_dir(&empty).unwrap();

    // An incomplete directory is never published.
    fs::remove_dir_all(again.join("vms/gamma")).unwrap();
    let e = commit_cluster_dir(&again, &empty).unwrap_err();
    assert!(matches!(e, ClusterError::Vm { .. }), "{e}");
    assert!(again.exists() && !empty.exists());
}

#[test]
fn the_documented_example_is_valid() {
    let doc = include_str!("../../../../docs/cluster-snapshot.md");
    let start = doc
        .find("```json\n")
        .expect("docs/cluster-snapshot.md has a JSON example")
        + 8;
    let end = start + doc[start..].find("```").unwrap();
    let m = ClusterManifest::decode(
        Path::new("docs/cluster-snapshot.md"),
        &doc.as_bytes()[start..end],
    )
    .unwrap();
    // Its channel state is what encoding such frames gives.
    let frame = |from: &str, to: &str, n: usize| ChannelFrame {
        sender: from.into(),
        receiver: to.into(),
        received_unix_us: 0,
        delivered_unix_us: 0,
        reason: FrameReason::InFlight,
        data: vec![0; n],
    };
    let fs_ = [
        frame("alpha", "beta", 74),
        frame("alpha", "beta", 1514),
        frame("beta", "alpha", 66),
    ];
    let encoded = crate::channel_log::encode_channel_log(&fs_).unwrap();
    assert_eq!(m.channel_state.file_size, encoded.len() as u64);
    assert_eq!(m.edges, edges_from_frames(&fs_));
    // And it is what the writer's summary gives.
    let tmp = tempfile::tempdir().unwrap();
    let s = write_channel_log(&tmp.path().join(CHANNEL_LOG), &fs_).unwrap();
    assert_eq!(ChannelStateRef::from_summary(&s), m.channel_state);
}
