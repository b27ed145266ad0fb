//! The collector on recorded and fake DAMON trees (temporary directories;
//! never the host's /sys/kernel/mm/damon).

use std::time::{Duration, Instant};

use vmcsnap_damon::Region;

use super::*;

const BASE: u64 = 0x7f00_0000_0000;

/// The tests that take vmcsnap's one DAMON slot run one at a time.
static SLOT_TESTS: Mutex<()> = Mutex::new(());

fn reg(start: u64, end: u64, nr_accesses: u64) -> Region {
    Region::new(start, end, nr_accesses)
}

fn block(name: &str, pages: u64) -> RamBlock {
    RamBlock {
        name: name.into(),
        used_length: pages * PAGE,
    }
}

fn run(b: u32, p: u32, n: u32, ms: u32) -> AccessRun {
    AccessRun::new(b, p, n, ms)
}

#[test]
fn mapping_of_the_ram_file_at_offset_zero() {
    let maps = "\
5581d1a00000-5581d1b00000 r--p 00000000 08:01 123 /usr/bin/qemu-system-x86_64
7f0000000000-7f0010000000 rw-s 00001000 00:1a 77 /dev/shm/vmcsnap-ab-c-vm
7f0010000000-7f0020000000 rw-s 00000000 00:1a 77 /dev/shm/vmcsnap-ab-c-vm
7f0020000000-7f0020001000 rw-p 00000000 00:00 0
";
    assert_eq!(
        parse_mapping(maps, Path::new("/dev/shm/vmcsnap-ab-c-vm")),
        Some((0x7f00_1000_0000, 0x7f00_2000_0000))
    );
    assert_eq!(parse_mapping(maps, Path::new("/dev/shm/other")), None);
}

#[test]
fn runs_in_detection_order_merged_and_clipped() {
    let mut t = Tracker::new(BASE, BASE + 64 * PAGE);
    let point = Instant::now();
    // Before the snapshot point: pages 10..12 (0 ms); an unaccessed region
    // and one wholly outside the mapping count for nothing.
    t.observe(
        &[
            reg(BASE + 10 * PAGE, BASE + 12 * PAGE, 2),
            reg(BASE, BASE + 4 * PAGE, 0),
            reg(BASE - 8 * PAGE, BASE, 5),
        ],
        point - Duration::from_millis(300),
    );
    // 2 s later: 8..16 overlaps what was seen (only 8..10 and 12..16 are
    // new), 16..20 is adjacent (merged into one run), a partial page at
    // the start counts, and a region past the mapping's end is clipped.
    t.observe(
        &[
            reg(BASE + 16 * PAGE, BASE + 20 * PAGE, 1),
            reg(BASE + 8 * PAGE + 100, BASE + 16 * PAGE, 3),
            reg(BASE + 60 * PAGE, BASE + 80 * PAGE, 1),
        ],
        point + Duration::from_millis(2000),
    );
    // Seen again later: nothing new.
    t.observe(
        &[reg(BASE + 9 * PAGE, BASE + 19 * PAGE, 9)],
        point + Duration::from_millis(4000),
    );
    // The RAM block ("mem", index 1) is 62 pages: 60..64 is clipped to 60..62.
    let runs = t.runs(point, &[block("pc.bios", 64), block("mem", 62)]);
    assert_eq!(
        runs,
        vec![
            run(1, 10, 2, 0),
            run(1, 8, 2, 2000),
            run(1, 12, 8, 2000),
            run(1, 60, 2, 2000),
        ]
    );
    // The restore side accepts them.
    let file = AccessedPages {
        format: FORMAT,
        source: "damon".into(),
        runs,
    };
    AccessedPages::parse(&file.to_bytes(), &[64, 62]).unwrap();
    // Without a block named "mem": block 0.
    assert_eq!(t.runs(point, &[block("x", 64)])[0].ram_block, 0);
    assert!(t.runs(point, &[]).is_empty());
}

#[test]
fn unseen_parts_around_seen_intervals() {
    let mut t = Tracker::new(0, 100 * PAGE);
    let at = Instant::now();
    t.observe(
        &[reg(10 * PAGE, 20 * PAGE, 1), reg(30 * PAGE, 40 * PAGE, 1)],
        at,
    );
    assert_eq!(t.unseen(0, 50), vec![(0, 10), (20, 30), (40, 50)]);
    assert_eq!(t.unseen(15, 35), vec![(20, 30)]);
    assert_eq!(t.unseen(12, 18), vec![]);
    t.observe(&[reg(20 * PAGE, 30 * PAGE, 1)], at);
    assert_eq!(t.seen.len(), 1, "adjacent intervals merge: {:?}", t.seen);
}

#[test]
fn without_damon_the_note_says_why_and_nothing_runs() {
    let _one = SLOT_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let config = |window| Config {
        root: dir.path().join("admin"),
        attrs: MonitorAttrs::default(),
        window,
        marker: None,
    };
    let c = Collector::start(
        "vm",
        std::process::id(),
        Path::new("/x"),
        config(DEFAULT_WINDOW),
    );
    assert!(c.note().starts_with("none: DAMON absent"), "{}", c.note());
    c.finish(dir.path(), &[block("mem", 4)]);
    let off = Collector::start("vm", 1, Path::new("/x"), config(Duration::ZERO));
    assert_eq!(off.note(), "none: off (access window 0)");
    drop(off);
    assert!(!dir.path().join(FILE).exists());
}

/// Region directories the fake kernel lists.
const SLOTS: usize = 4;

/// A fake DAMON admin tree and a thread standing in for the kernel: it
/// answers each `update_schemes_tried_regions` by replacing the listed
/// regions with the test's current ones (at most [`SLOTS`]).
struct FakeKernel {
    root: PathBuf,
    regions: Arc<Mutex<Vec<Region>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<usize>>,
}

impl FakeKernel {
    fn start(root: &Path, regions: Vec<Region>) -> FakeKernel {
        let put = |rel: &str, v: &str| {
            let p = root.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, v).unwrap();
        };
        put("kdamonds/nr_kdamonds", "0\n");
        // The files the setup plan writes, as the kernel creates them.
        let plan = vmcsnap_damon::plan_setup(
            Target {
                pid: 1,
                range: Some((1, 2)),
            },
            &MonitorAttrs::default(),
        )
        .unwrap();
        for (rel, _) in plan.iter().skip(1) {
            put(&rel.to_string_lossy(), "0\n");
        }
        let dir = vmcsnap_damon::tried_regions_dir(root, 0, 0, 0);
        fs::create_dir_all(&dir).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let regions = Arc::new(Mutex::new(regions));
        let (state, stop2, current) =
            (root.join("kdamonds/0/state"), stop.clone(), regions.clone());
        let thread = std::thread::spawn(move || {
            let mut refreshes = 0;
            let mut last = None;
            while !stop2.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
                // A refresh is a new write of the command (the kernel's
                // store handler runs per write): a new modification time.
                // The fake never writes `state` itself, so it never races
                // with the collector's `off`.
                let Ok(modified) = fs::metadata(&state).and_then(|m| m.modified()) else {
                    continue;
                };
                if last == Some(modified)
                    || fs::read_to_string(&state).unwrap_or_default()
                        != "update_schemes_tried_regions"
                {
                    continue;
                }
                last = Some(modified);
                refreshes += 1;
                // A fixed set of region directories whose files are
                // replaced one by one (write + rename): a reader never
                // finds a file missing; unused slots are empty regions.
                let mut phase = current.lock().unwrap().clone();
                phase.resize(SLOTS, reg(0, 0, 0));
                for (i, r) in phase.iter().enumerate() {
                    let rdir = dir.join(i.to_string());
                    fs::create_dir_all(&rdir).unwrap();
                    for (f, v) in [
                        ("start", r.start),
                        ("end", r.end),
                        ("nr_accesses", r.nr_accesses),
                        ("age", 0),
                    ] {
                        let tmp = rdir.join(format!(".{f}"));
                        fs::write(&tmp, format!("{v}\n")).unwrap();
                        fs::rename(&tmp, rdir.join(f)).unwrap();
                    }
                }
            }
            refreshes
        });
        FakeKernel {
            root: root.to_path_buf(),
            regions,
            stop,
            thread: Some(thread),
        }
    }

    /// What the next refreshes report.
    fn set(&self, regions: Vec<Region>) {
        *self.regions.lock().unwrap() = regions;
    }

    fn get(&self, rel: &str) -> String {
        fs::read_to_string(self.root.join(rel)).unwrap()
    }

    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// The mapping of this test binary's first segment (a file mapped at
/// offset 0 in this process, as QEMU maps the RAM file).
fn own_mapping() -> (PathBuf, u64, u64) {
    let exe = fs::canonicalize(std::env::current_exe().unwrap()).unwrap();
    let (start, end) = find_mapping(std::process::id(), &exe).unwrap();
    (exe, start, end)
}

fn wait_for(path: &Path) -> Vec<u8> {
    for _ in 0..500 {
        if let Ok(b) = fs::read(path) {
            return b;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{} never appeared", path.display());
}

#[test]
fn collects_on_a_fake_kernel_writes_the_file_and_leaves_damon_off() {
    let _one = SLOT_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("admin");
    let (exe, start, end) = own_mapping();
    let pages = (end - start) / PAGE;
    assert!(pages >= 16, "mapping of {pages} pages");
    // While QEMU copies guest RAM, every page looks accessed.
    let kernel = FakeKernel::start(&root, vec![reg(start, end, 10)]);
    let attrs = MonitorAttrs {
        sample_us: 5_000,
        aggr_us: 50_000,
        ..MonitorAttrs::default()
    };
    let marker = dir.path().join(MARKER);
    let config = Config {
        root: root.clone(),
        attrs,
        window: Duration::from_millis(1000),
        marker: Some(marker.clone()),
    };
    let point = Instant::now();
    let c = Collector::start("vm", std::process::id(), &exe, config);
    assert_eq!(c.note(), "damon");
    assert_eq!(kernel.get("kdamonds/0/contexts/0/operations"), "fvaddr");
    assert_eq!(
        kernel.get("kdamonds/0/contexts/0/targets/0/regions/0/start"),
        start.to_string()
    );
    assert_eq!(
        kernel.get("kdamonds/0/contexts/0/targets/0/regions/0/end"),
        end.to_string()
    );
    assert_eq!(
        fs::read_to_string(&marker).unwrap(),
        format!("{} {start}\n", std::process::id())
    );
    std::thread::sleep(Duration::from_millis(150));
    // The copy is over; the guest reads pages 0..2 and one region past the
    // end of the mapping, later 1..6 as well (2..6 new).
    let early = vec![
        reg(start, start + 2 * PAGE, 4),
        reg(end - PAGE, end + (1 << 20), 1),
    ];
    kernel.set(early.clone());
    std::thread::sleep(Duration::from_millis(100));
    c.set_point(point);
    // A second snapshot meanwhile goes without: one kdamond at a time.
    let second = Collector::start(
        "vm2",
        std::process::id(),
        &exe,
        Config {
            root: root.clone(),
            attrs,
            window: Duration::from_secs(1),
            marker: Some(marker.clone()),
        },
    );
    assert!(second.note().starts_with("none: "), "{}", second.note());
    drop(second);
    std::thread::sleep(Duration::from_millis(300));
    let mut later = early;
    later.push(reg(start + PAGE, start + 6 * PAGE, 1));
    kernel.set(later);
    let snap = dir.path().join("snap");
    fs::create_dir(&snap).unwrap();
    c.finish(&snap, &[block("mem", pages)]);
    let bytes = wait_for(&snap.join(FILE));
    let a = AccessedPages::parse(&bytes, &[pages as u32]).unwrap();
    let firsts: Vec<(u32, u32)> = a.runs.iter().map(|r| (r.first_page, r.pages)).collect();
    assert_eq!(
        firsts,
        vec![(0, 2), (pages as u32 - 1, 1), (2, 4)],
        "the copy's accesses do not count: {:?}",
        a.runs
    );
    assert!(a.runs[0].first_seen_ms >= 250, "{:?}", a.runs);
    assert!(a.runs[2].first_seen_ms >= 550, "{:?}", a.runs);
    assert!(
        a.runs[1].first_seen_ms < a.runs[2].first_seen_ms,
        "{:?}",
        a.runs
    );
    // DAMON as found: the kdamond off and removed; the slot free again.
    assert_eq!(kernel.get("kdamonds/0/state"), "off");
    assert_eq!(kernel.get("kdamonds/nr_kdamonds"), "0");
    assert!(!SLOT.load(Ordering::SeqCst));
    assert!(!marker.exists());
    assert!(!snap.join("access/.accessed.json.tmp").exists());
    let refreshes = kernel.stop();
    assert!(refreshes >= 8, "{refreshes} refreshes");
}

#[test]
fn a_failed_snapshot_stops_damon_and_writes_nothing() {
    let _one = SLOT_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("admin");
    let (exe, start, _) = own_mapping();
    let kernel = FakeKernel::start(&root, vec![reg(start, start + PAGE, 1)]);
    let config = Config {
        root,
        attrs: MonitorAttrs {
            sample_us: 5_000,
            aggr_us: 50_000,
            ..MonitorAttrs::default()
        },
        window: Duration::from_secs(60),
        marker: None,
    };
    let c = Collector::start("vm", std::process::id(), &exe, config);
    assert_eq!(c.note(), "damon");
    std::thread::sleep(Duration::from_millis(120));
    let t = Instant::now();
    drop(c);
    assert!(t.elapsed() < Duration::from_secs(2));
    kernel.stop_and_check();
    assert!(!dir.path().join("access").exists());
}

impl FakeKernel {
    fn stop_and_check(self) {
        assert_eq!(self.get("kdamonds/0/state"), "off");
        assert_eq!(self.get("kdamonds/nr_kdamonds"), "0");
        self.stop();
    }
}

#[test]
fn a_kdamond_left_by_a_killed_agent_is_removed_someone_elses_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("admin");
    let marker = dir.path().join(MARKER);
    let tree = |pid: &str| {
        for (rel, v) in [
            ("kdamonds/nr_kdamonds", "1\n"),
            ("kdamonds/0/state", "on\n"),
            ("kdamonds/0/contexts/0/targets/0/pid_target", pid),
            ("kdamonds/0/contexts/0/targets/0/regions/0/start", "4096\n"),
        ] {
            let p = root.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, v).unwrap();
        }
    };
    let get = |rel: &str| fs::read_to_string(root.join(rel)).unwrap();
    // Someone else's kdamond (another target): untouched; the stale
    // marker goes.
    tree("999\n");
    fs::write(&marker, "4242 4096\n").unwrap();
    reclaim_leftover(&root, &marker);
    assert_eq!(get("kdamonds/0/state"), "on\n");
    assert!(!marker.exists());
    // The one the marker names: stopped and removed.
    tree("4242\n");
    fs::write(&marker, "4242 4096\n").unwrap();
    reclaim_leftover(&root, &marker);
    assert_eq!(get("kdamonds/0/state"), "off");
    assert_eq!(get("kdamonds/nr_kdamonds"), "0");
    assert!(!marker.exists());
    // No marker: nothing happens.
    tree("4242\n");
    reclaim_leftover(&root, &marker);
    assert_eq!(get("kdamonds/0/state"), "on\n");
}
