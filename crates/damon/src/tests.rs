//! Tests on recorded DAMON sysfs trees built in temporary directories.
//! Nothing here reads or writes the real /sys/kernel/mm/damon.

use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use crate::*;

/// An admin root in a fresh temporary directory.
struct Tree {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Tree {
    fn new() -> Tree {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("admin");
        fs::create_dir(&root).unwrap();
        Tree { _dir: dir, root }
    }

    /// A tree as a kernel shows it with `nr` kdamonds in the given states.
    fn with_kdamonds(states: &[&str]) -> Tree {
        let t = Tree::new();
        t.put("kdamonds/nr_kdamonds", &format!("{}\n", states.len()));
        for (k, s) in states.iter().enumerate() {
            t.put(&format!("kdamonds/{k}/state"), &format!("{s}\n"));
            t.put(&format!("kdamonds/{k}/contexts/nr_contexts"), "0\n");
        }
        t
    }

    fn put(&self, rel: &str, content: &str) {
        let p = self.root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    fn get(&self, rel: &str) -> String {
        fs::read_to_string(self.root.join(rel)).unwrap()
    }

    fn region(&self, r: &str, start: &str, end: &str, nr: &str, age: &str) {
        let base = "kdamonds/0/contexts/0/schemes/0/tried_regions";
        for (f, c) in [
            ("start", start),
            ("end", end),
            ("nr_accesses", nr),
            ("age", age),
        ] {
            self.put(&format!("{base}/{r}/{f}"), c);
        }
    }
}

fn allow(_: &Path) -> io::Result<()> {
    Ok(())
}

// ---- probe ----

#[test]
fn probe_absent_without_admin_dir() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(probe(&dir.path().join("admin")), Availability::Absent);
}

#[test]
fn probe_usable_with_no_kdamond() {
    let t = Tree::with_kdamonds(&[]);
    assert_eq!(probe_with(&t.root, allow), Availability::Usable);
    assert!(probe_with(&t.root, allow).is_usable());
}

#[test]
fn a_stopped_kdamond_is_someone_elses_slot_too() {
    let t = Tree::with_kdamonds(&["off"]);
    t.put(
        "kdamonds/0/contexts/0/avail_operations",
        "vaddr\nfvaddr\npaddr\n",
    );
    assert_eq!(
        probe_with(&t.root, allow),
        Availability::SlotInUse {
            kdamond: 0,
            state: "off".into()
        }
    );
}

#[test]
fn probe_slot_in_use() {
    let t = Tree::with_kdamonds(&["on"]);
    assert_eq!(
        probe_with(&t.root, allow),
        Availability::SlotInUse {
            kdamond: 0,
            state: "on".into()
        }
    );
    // With several, the first is named.
    let t = Tree::with_kdamonds(&["off", "on"]);
    assert_eq!(
        probe_with(&t.root, allow),
        Availability::SlotInUse {
            kdamond: 0,
            state: "off".into()
        }
    );
}

#[test]
fn probe_no_vaddr() {
    let t = Tree::with_kdamonds(&["off"]);
    t.put("kdamonds/0/contexts/0/avail_operations", "fvaddr\npaddr\n");
    assert_eq!(probe_with(&t.root, allow), Availability::NoVaddr);
}

#[test]
fn probe_permission_denied_through_injected_check() {
    let t = Tree::with_kdamonds(&[]);
    let denied = |_: &Path| Err(io::Error::from(io::ErrorKind::PermissionDenied));
    assert_eq!(probe_with(&t.root, denied), Availability::PermissionDenied);
    let read_only_fs = |_: &Path| Err(io::Error::from_raw_os_error(30));
    assert_eq!(
        probe_with(&t.root, read_only_fs),
        Availability::PermissionDenied
    );
}

#[test]
fn probe_permission_denied_on_read_only_file() {
    use std::os::unix::fs::PermissionsExt;
    let t = Tree::with_kdamonds(&[]);
    let nr = t.root.join("kdamonds/nr_kdamonds");
    fs::set_permissions(&nr, fs::Permissions::from_mode(0o444)).unwrap();
    if can_open_for_write(&nr).is_ok() {
        // Root (CAP_DAC_OVERRIDE) writes through mode bits; the denial
        // logic is covered by probe_permission_denied_through_injected_check.
        // Written to the stderr handle, which the test harness does not
        // capture (eprintln! would be hidden for a passing test).
        let _ = writeln!(
            io::stderr(),
            "note: SKIPPED the assertion of probe_permission_denied_on_read_only_file: \
             this process ignores file modes (root); covered by the injected check"
        );
        return;
    }
    assert_eq!(probe(&t.root), Availability::PermissionDenied);
}

#[test]
fn probe_unreadable_count() {
    let t = Tree::new();
    t.put("kdamonds/nr_kdamonds", "many\n");
    match probe_with(&t.root, allow) {
        Availability::Unreadable { file, reason } => {
            assert_eq!(file, "kdamonds/nr_kdamonds");
            assert!(reason.contains("many"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // A count of kdamonds whose directories are missing.
    let t = Tree::new();
    t.put("kdamonds/nr_kdamonds", "1\n");
    assert!(matches!(
        probe_with(&t.root, allow),
        Availability::Unreadable { .. }
    ));
}

#[test]
fn availability_serializes_for_metadata() {
    let a = Availability::SlotInUse {
        kdamond: 0,
        state: "on".into(),
    };
    let json = serde_json::to_string(&a).unwrap();
    assert_eq!(json, r#"{"status":"slot-in-use","kdamond":0,"state":"on"}"#);
    assert_eq!(serde_json::from_str::<Availability>(&json).unwrap(), a);
    assert_eq!(
        serde_json::to_string(&Availability::Usable).unwrap(),
        r#"{"status":"usable"}"#
    );
    assert!(Availability::NoVaddr.to_string().contains("vaddr"));
}

// ---- setup ----

#[test]
fn setup_plan_order_and_values() {
    let target = Target {
        pid: 4242,
        range: Some((0x7f00_0000_0000, 0x7f00_1000_0000)),
    };
    let plan = plan_setup(target, &MonitorAttrs::default()).unwrap();
    let paths: Vec<String> = plan
        .iter()
        .map(|(p, _)| p.to_string_lossy().into_owned())
        .collect();
    assert_eq!(plan[0], (PathBuf::from("kdamonds/nr_kdamonds"), "1".into()));
    assert_eq!(plan.last().unwrap().0, PathBuf::from("kdamonds/0/state"));
    assert_eq!(plan.last().unwrap().1, "on");
    let value = |suffix: &str| {
        let i = paths.iter().position(|p| p.ends_with(suffix)).unwrap();
        (i, plan[i].1.clone())
    };
    assert_eq!(value("targets/0/pid_target").1, "4242");
    assert_eq!(value("/operations").1, "fvaddr");
    assert_eq!(value("targets/0/regions/nr_regions").1, "1");
    assert_eq!(
        value("regions/0/start").1,
        (0x7f00_0000_0000u64).to_string()
    );
    assert_eq!(value("regions/0/end").1, (0x7f00_1000_0000u64).to_string());
    assert_eq!(value("intervals/sample_us").1, "100000");
    assert_eq!(value("intervals/aggr_us").1, "2000000");
    assert_eq!(value("nr_regions/min").1, "200");
    assert_eq!(value("schemes/0/action").1, "stat");
    assert_eq!(value("access_pattern/nr_accesses/min").1, "1");
    // Every access-pattern bound is written (they default to 0..0).
    for f in ["sz/min", "sz/max", "nr_accesses/max", "age/min", "age/max"] {
        value(&format!("access_pattern/{f}"));
    }
    // Each file is written after the `nr_*` count that creates its directory.
    for (i, p) in paths.iter().enumerate() {
        for (count, child) in [
            ("kdamonds/nr_kdamonds", "kdamonds/0/"),
            ("contexts/nr_contexts", "contexts/0/"),
            ("targets/nr_targets", "targets/0/"),
            ("regions/nr_regions", "regions/0/"),
            ("schemes/nr_schemes", "schemes/0/"),
        ] {
            if p.contains(child) {
                assert!(value(count).0 < i, "{p} written before {count}");
            }
        }
    }
}

fn vaddr(pid: u32) -> Target {
    Target { pid, range: None }
}

#[test]
fn setup_without_range_watches_the_whole_process() {
    let plan = plan_setup(vaddr(9), &MonitorAttrs::default()).unwrap();
    let ops = plan
        .iter()
        .find(|(p, _)| p.ends_with("operations"))
        .unwrap();
    assert_eq!(ops.1, "vaddr");
    assert!(!plan
        .iter()
        .any(|(p, _)| p.to_string_lossy().contains("targets/0/regions")));
    let empty = Target {
        pid: 9,
        range: Some((4096, 4096)),
    };
    assert!(matches!(
        plan_setup(empty, &MonitorAttrs::default()),
        Err(DamonError::InvalidAttrs(_))
    ));
}

#[test]
fn setup_refuses_attrs_the_kernel_refuses() {
    let d = MonitorAttrs::default();
    for bad in [
        MonitorAttrs {
            min_regions: 2,
            ..d
        },
        MonitorAttrs {
            min_regions: 500,
            max_regions: 400,
            ..d
        },
        MonitorAttrs {
            sample_us: 3_000_000,
            ..d
        },
        MonitorAttrs { update_us: 0, ..d },
    ] {
        let err = plan_setup(vaddr(1), &bad).unwrap_err();
        assert!(matches!(err, DamonError::InvalidAttrs(_)), "{err}");
    }
}

#[test]
fn apply_writes_in_order_on_a_tree() {
    let t = Tree::with_kdamonds(&[]);
    let plan = plan_setup(vaddr(77), &MonitorAttrs::default()).unwrap();
    // Stand in for the kernel: the files a nr_* write would create.
    for (rel, _) in &plan {
        t.put(&rel.to_string_lossy(), "0\n");
    }
    apply(&t.root, &plan).unwrap();
    assert_eq!(t.get("kdamonds/nr_kdamonds"), "1");
    assert_eq!(t.get("kdamonds/0/contexts/0/targets/0/pid_target"), "77");
    assert_eq!(t.get("kdamonds/0/state"), "on");
    apply(&t.root, &plan_refresh()).unwrap();
    assert_eq!(t.get("kdamonds/0/state"), "update_schemes_tried_regions");
    apply(&t.root, &plan_stop()).unwrap();
    assert_eq!(t.get("kdamonds/0/state"), "off");
    assert_eq!(t.get("kdamonds/nr_kdamonds"), "0");
}

#[test]
fn apply_stops_at_a_missing_file_and_names_it() {
    let t = Tree::with_kdamonds(&[]);
    let plan = plan_setup(vaddr(77), &MonitorAttrs::default()).unwrap();
    // No kernel here: kdamonds/0/contexts does not appear.
    let err = apply(&t.root, &plan).unwrap_err();
    match &err {
        DamonError::Write { path, value, .. } => {
            assert!(path.ends_with("kdamonds/0/contexts/nr_contexts"), "{err}");
            assert_eq!(value, "1");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(t.get("kdamonds/nr_kdamonds"), "1");
}

// ---- tried_regions ----

#[test]
fn tried_regions_parsed_sorted_and_total_bytes_ignored() {
    let t = Tree::new();
    t.region("0", "8192\n", "16384\n", "3\n", "1\n");
    t.region("1", "4096\n", "8192\n", "0\n", "7\n");
    t.region("10", "65536\n", "73728\n", "20\n", "0\n");
    t.put(
        "kdamonds/0/contexts/0/schemes/0/tried_regions/total_bytes",
        "20480\n",
    );
    let regions = read_tried_regions(&t.root, 0, 0, 0).unwrap();
    let starts: Vec<u64> = regions.iter().map(|r| r.start).collect();
    assert_eq!(starts, [4096, 8192, 65536]);
    assert_eq!(
        regions[1],
        Region {
            start: 8192,
            end: 16384,
            nr_accesses: 3,
            age: 1
        }
    );
}

#[test]
fn tried_regions_empty_before_first_update() {
    let t = Tree::new();
    fs::create_dir_all(tried_regions_dir(&t.root, 0, 0, 0)).unwrap();
    assert!(read_tried_regions(&t.root, 0, 0, 0).unwrap().is_empty());
}

#[test]
fn tried_regions_malformed_names_the_file() {
    let t = Tree::new();
    t.region("0", "0x1000\n", "8192\n", "1\n", "0\n");
    let err = read_tried_regions(&t.root, 0, 0, 0).unwrap_err();
    match &err {
        DamonError::Malformed { path, reason } => {
            assert!(path.ends_with("tried_regions/0/start"), "{err}");
            assert!(reason.contains("0x1000"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("tried_regions/0/start"));

    let t = Tree::new();
    t.region("0", "8192\n", "4096\n", "1\n", "0\n");
    let err = read_tried_regions(&t.root, 0, 0, 0).unwrap_err();
    assert!(
        matches!(&err, DamonError::Malformed { path, .. } if path.ends_with("0/end")),
        "{err}"
    );

    let t = Tree::new();
    t.put(
        "kdamonds/0/contexts/0/schemes/0/tried_regions/0/start",
        "0\n",
    );
    let err = read_tried_regions(&t.root, 0, 0, 0).unwrap_err();
    assert!(
        matches!(&err, DamonError::Read { path, .. } if path.ends_with("0/end")),
        "{err}"
    );
}

#[test]
fn tried_regions_missing_dir_is_a_read_error() {
    let t = Tree::new();
    let err = read_tried_regions(&t.root, 0, 0, 3).unwrap_err();
    assert!(
        matches!(&err, DamonError::Read { path, .. } if path.ends_with("schemes/3/tried_regions")),
        "{err}"
    );
}

// ---- accessed_pages ----

fn reg(start: u64, end: u64, nr_accesses: u64) -> Region {
    Region::new(start, end, nr_accesses)
}

#[test]
fn accessed_pages_clips_to_the_mapping() {
    let base = 0x7f00_0000_0000;
    let regions = [
        // Starts before the mapping: clipped to pages 0..2.
        reg(base - 0x3000, base + 0x2000, 5),
        // Never accessed: skipped.
        reg(base + 0x2000, base + 0x5000, 0),
        // Partial pages count: 0x5800..0x6800 covers pages 5 and 6.
        reg(base + 0x5800, base + 0x6800, 1),
        // Runs past the end (mapping is 10 pages): pages 9 only.
        reg(base + 0x9000, base + 0xc000, 2),
        // Entirely outside.
        reg(base + 0x20000, base + 0x30000, 9),
    ];
    assert_eq!(
        accessed_pages(&regions, base, 0xa000, 0x1000),
        [0, 1, 5, 6, 9]
    );
}

#[test]
fn accessed_pages_ordered_without_duplicates() {
    // Unsorted input, two regions sharing page 1 (0x1800 is mid-page).
    let regions = [reg(0x1800, 0x3000, 1), reg(0x0, 0x1800, 1)];
    assert_eq!(accessed_pages(&regions, 0, 0x10000, 0x1000), [0, 1, 2]);
    // 2 MiB pages.
    let regions = [reg(0x1000, 0x0040_0000 + 1, 1)];
    assert_eq!(accessed_pages(&regions, 0, 1 << 30, 2 << 20), [0, 1, 2]);
    assert!(accessed_pages(&regions, 0, 1 << 30, 0).is_empty());
    assert!(accessed_pages(&[], 0, 1 << 30, 4096).is_empty());
}

// ---- parsing over arbitrary bytes ----

#[test]
fn parse_value_accepts_sysfs_numbers_only() {
    assert_eq!(parse_value(b"123\n"), Ok(123));
    assert_eq!(parse_value(b"18446744073709551615\n"), Ok(u64::MAX));
    assert!(parse_value(b"18446744073709551616").is_err());
    for bad in [&b""[..], b"\n", b"-1", b"+1", b"1 2", b"0x10", b"\xff1"] {
        assert!(parse_value(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn parse_region_never_panics_on_random_bytes() {
    // A cheap deterministic fuzz loop (xorshift64), so no fuzz toolchain is
    // needed in CI; parse_region is also usable as a cargo-fuzz target.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let alphabet = b"0123456789 \n\t-x\xffa";
    let mut ok = 0;
    for _ in 0..20_000 {
        let mut field = || {
            let len = (next() % 24) as usize;
            (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect::<Vec<u8>>()
        };
        let (s, e, n, a) = (field(), field(), field(), field());
        if let Ok(r) = parse_region(&s, &e, &n, &a) {
            assert!(r.start <= r.end);
            ok += 1;
        }
    }
    assert!(ok > 0, "the loop never produced a valid region");
}

// ---- from_kernel_config ----

#[test]
fn the_kernel_config_decides_before_sysfs_is_read() {
    // This machine's host kernel (2026-11-26): DAMON and its sysfs, no vaddr.
    let host = "CONFIG_DAMON=y\n# CONFIG_DAMON_VADDR is not set\nCONFIG_DAMON_PADDR=y\nCONFIG_DAMON_SYSFS=y\n";
    assert_eq!(from_kernel_config(host), Some(Availability::NoVaddr));
    // Debian 12's own kernels.
    assert_eq!(
        from_kernel_config("# CONFIG_DAMON is not set\n"),
        Some(Availability::Absent)
    );
    assert_eq!(
        from_kernel_config("CONFIG_DAMON=y\nCONFIG_DAMON_VADDR=y\n"),
        Some(Availability::Absent),
        "no sysfs interface"
    );
    // bookworm-backports 6.12: the sysfs probe decides.
    let bpo = "CONFIG_DAMON=y\nCONFIG_DAMON_VADDR=y\nCONFIG_DAMON_PADDR=y\nCONFIG_DAMON_SYSFS=y\n";
    assert_eq!(from_kernel_config(bpo), None);
}
