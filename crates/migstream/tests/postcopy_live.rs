//! The postcopy source against a real, unmodified QEMU 7.2 destination.
//!
//! A background snapshot of the running writer guest (tests/data/guest) is
//! captured once with [`StreamReader`](vmcsnap_migstream::StreamReader)
//! into memory (tests/common/qemu.rs), then restored with `run_source` into
//! fresh destination QEMUs (`-incoming defer`, postcopy-ram, RAM in a
//! `/dev/shm` file the test reads, reference §8.6). Fails when QEMU or
//! binutils are missing, unless `VMCSNAP_SKIP_QEMU_TESTS=1`. Every run is
//! guarded by a generous timeout so that a hang fails instead of blocking.

mod common;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::postcopy::{fake_destination, run_guarded, synthetic_pages, Item, MemPages, Run};
use common::qemu::{
    build_writer, capture_writer, qemu_or_skip, spawn_qemu, writer_args, Qemu, Qmp, Snapshot,
    COUNTER,
};
use serde_json::json;
use vmcsnap_migstream::postcopy::return_path::RpError;
use vmcsnap_migstream::postcopy::{
    DestBlock, PageId, Phase, PostcopyError, SourceConfig, SourceEvent,
};

const GUARD: Duration = Duration::from_secs(120);

struct Shared {
    _dir: tempfile::TempDir,
    qemu: String,
    kernel: PathBuf,
    snap: Snapshot,
}

/// The snapshot, captured once for all tests of this file; `None` when
/// QEMU tests are skipped.
fn shared() -> Option<&'static Shared> {
    static SHARED: OnceLock<Option<Shared>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let qemu = qemu_or_skip("postcopy_live")?;
            let dir = tempfile::tempdir().unwrap();
            let kernel = build_writer(dir.path());
            let t0 = Instant::now();
            let snap = capture_writer(&qemu, &kernel, dir.path());
            eprintln!(
                "captured: {} pages, {} bytes of device state, counter {:#x}, {:?}",
                snap.page_count(),
                snap.device_state.len(),
                snap.counter,
                t0.elapsed()
            );
            Some(Shared {
                _dir: dir,
                qemu,
                kernel,
                snap,
            })
        })
        .as_ref()
}

/// A `/dev/shm` file removed when the test ends.
struct ShmFile(PathBuf);

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct Dest {
    qemu: Qemu,
    qmp: Qmp,
    ram: ShmFile,
    log: PathBuf,
    stream: Option<UnixStream>,
    _dir: tempfile::TempDir,
}

impl Dest {
    /// Starts a destination QEMU for the writer guest and connects to its
    /// `migrate-incoming` socket.
    fn start(s: &Shared, name: &str, paused: bool) -> Dest {
        let dir = tempfile::tempdir().unwrap();
        let ram = ShmFile(PathBuf::from(format!(
            "/dev/shm/vmcsnap-migstream-test-{}-{name}",
            std::process::id()
        )));
        let _ = std::fs::remove_file(&ram.0);
        let mut args = writer_args(
            &s.kernel,
            &format!(
                "memory-backend-file,id=mem,size=16M,mem-path={},share=on",
                ram.0.display()
            ),
        );
        args.extend(["-incoming".into(), "defer".into()]);
        if paused {
            args.push("-S".into());
        }
        let (qmp_path, mig) = (dir.path().join("qmp.sock"), dir.path().join("mig.sock"));
        let log = dir.path().join("dest.log");
        let qemu = spawn_qemu(&s.qemu, &args, &qmp_path, &log);
        let mut qmp = Qmp::connect(&qmp_path);
        qmp.cmd(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "postcopy-ram", "state": true}]}),
        );
        qmp.cmd(
            "migrate-incoming",
            json!({"uri": format!("unix:{}", mig.display())}),
        );
        let stream = UnixStream::connect(&mig).expect("connect to the destination");
        Dest {
            qemu,
            qmp,
            ram,
            log,
            stream: Some(stream),
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn read_ram(&self) -> Vec<u8> {
        std::fs::read(&self.ram.0).unwrap()
    }

    fn counter(&self) -> u32 {
        let ram = self.read_ram();
        let c = COUNTER as usize;
        u32::from_le_bytes(ram[c..c + 4].try_into().unwrap())
    }
}

fn base_config(snap: &Snapshot) -> SourceConfig {
    SourceConfig {
        machine: snap.machine.clone(),
        blocks: snap
            .blocks
            .iter()
            .map(|b| DestBlock {
                name: b.name.clone(),
                used_length: b.used_length,
            })
            .collect(),
        page_size: 4096,
        ram_section_id: snap.ram_section_id,
        device_state: snap.device_state.clone(),
        before_run: Vec::new(),
        demand_cluster: 4,
        background: Vec::new(),
        background_after: None,
        hold: Default::default(),
        shut_timeout: Duration::from_secs(30),
    }
}

/// Every page of the ROM blocks (all blocks but the first, "mem").
fn rom_pages(cfg: &SourceConfig) -> Vec<PageId> {
    (1..cfg.blocks.len() as u32)
        .flat_map(|b| (0..cfg.block_pages(b) as u32).map(move |page| PageId { block: b, page }))
        .collect()
}

fn run(
    cfg: SourceConfig,
    s: &Shared,
    dest: &mut Dest,
    on_event: impl FnMut(&SourceEvent) + Send + 'static,
) -> Run {
    let stream = dest.stream.take().unwrap();
    run_guarded(
        cfg,
        MemPages::new(Arc::clone(&s.snap.pages)),
        stream,
        GUARD,
        on_event,
    )
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_paused_destination_gets_every_page() {
    let Some(s) = shared() else { return };
    let mut dest = Dest::start(s, "paused", true);
    let mut cfg = base_config(&s.snap);
    cfg.before_run = (0..256).map(|page| PageId { block: 0, page }).collect();
    cfg.before_run.extend(rom_pages(&cfg));
    cfg.background = (0..cfg.block_pages(0) as u32)
        .rev()
        .map(|page| PageId { block: 0, page })
        .collect();
    let r = run(cfg, s, &mut dest, |_| {});
    let report = r
        .result
        .unwrap_or_else(|e| panic!("{e}\ndestination log:\n{}", dest.log()));
    eprintln!("paused destination: {:?}, report {report:?}", r.took);

    let ram = dest.read_ram();
    assert_eq!(ram.len() as u64, s.snap.blocks[0].used_length);
    let zero = [0u8; 4096];
    for (p, want) in s.snap.pages[0].iter().enumerate() {
        let got = &ram[p * 4096..(p + 1) * 4096];
        assert!(
            got == want.as_deref().unwrap_or(&zero),
            "page {p:#x} of mem differs from the snapshot"
        );
    }
    let mut status = json!(null);
    wait_for("query-migrate: completed", || {
        status = dest.qmp.cmd("query-migrate", json!({}))["status"].clone();
        status == "completed"
    });
    assert_eq!(report.pages_total, s.snap.page_count() as u64);
    assert_eq!(
        report.pages_before_run,
        256 + rom_pages(&base_config(&s.snap)).len() as u64
    );
    assert_eq!(
        report.pages_before_run + report.pages_on_demand + report.pages_background,
        report.pages_total
    );
    assert_eq!(report.shut_value, 0);
    assert!(
        report.pongs.contains(&1) && report.pongs.contains(&3),
        "{:?}",
        report.pongs
    );
}

#[test]
fn b_running_destination_faults_and_keeps_counting() {
    let Some(s) = shared() else { return };
    let mut dest = Dest::start(s, "running", false);
    let mut cfg = base_config(&s.snap);
    cfg.before_run = rom_pages(&cfg);
    cfg.background_after = Some(Duration::from_secs(2));
    let r = run(cfg, s, &mut dest, |_| {});
    let report = r
        .result
        .unwrap_or_else(|e| panic!("{e}\ndestination log:\n{}", dest.log()));
    let demand: Vec<String> = report
        .demand
        .iter()
        .map(|(t, p)| format!("{}:{:#x}@{t:?}", p.block, p.page))
        .collect();
    eprintln!(
        "running destination: {:?}, {} faults {demand:?}, {} requests for pages already sent, \
         {} pages on demand, {} background",
        r.took,
        report.demand.len(),
        report.requests_already_sent,
        report.pages_on_demand,
        report.pages_background
    );
    assert!(!report.demand.is_empty(), "no page request while tracing");
    // The guest only touches its code page, the counter and the markers.
    for (_, p) in &report.demand {
        let a = u64::from(p.page) * 4096;
        assert!(
            p.block == 0
                && (a == 0x100000
                    || a == COUNTER
                    || ((0x200000..0xa00000).contains(&a) && a & 0xffff == 0)),
            "unexpected fault on block {} page {a:#x}",
            p.block
        );
    }
    // The guest runs on from the snapshot's counter.
    let mut c1 = 0;
    wait_for("the counter to pass the snapshot's", || {
        c1 = dest.counter();
        c1 > s.snap.counter
    });
    wait_for("the counter to keep increasing", || dest.counter() > c1);
    eprintln!(
        "counter: snapshot {:#x}, then {c1:#x}, then {:#x}",
        s.snap.counter,
        dest.counter()
    );
    let status = dest.qmp.cmd("query-status", json!({}));
    assert_eq!(status["status"], "running");
}

#[test]
fn c_destination_killed_after_run() {
    let Some(s) = shared() else { return };
    let mut dest = Dest::start(s, "killed", false);
    let mut cfg = base_config(&s.snap);
    cfg.before_run = rom_pages(&cfg);
    // Tracing for longer than the test: only the kill can end the run.
    cfg.background_after = Some(Duration::from_secs(600));
    let pid = dest.qemu.0.id();
    let r = run(cfg, s, &mut dest, move |e| {
        if *e == SourceEvent::RunSent {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            });
        }
    });
    let e = r.result.expect_err("the destination was killed");
    eprintln!("killed destination: error after {:?}: {e}", r.took);
    assert!(
        matches!(
            e,
            PostcopyError::DestinationClosed {
                phase: Phase::AfterRun { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(r.events.contains(&SourceEvent::RunSent));
}

#[test]
fn d_fake_destination_sends_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mig.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let blocks = vec![DestBlock {
        name: "mem".into(),
        used_length: 1 << 20,
    }];
    let cfg = SourceConfig {
        machine: "microvm".into(),
        blocks: blocks.clone(),
        page_size: 4096,
        ram_section_id: 2,
        device_state: Vec::new(),
        before_run: Vec::new(),
        demand_cluster: 4,
        background: Vec::new(),
        background_after: Some(Duration::from_secs(600)),
        hold: Default::default(),
        shut_timeout: Duration::from_secs(30),
    };
    // After PONG 1 (8 bytes, sent by the fake on PING 1), garbage.
    let dest = fake_destination(listener, |item, rp| {
        if matches!(item, Item::Package { .. }) {
            rp.raw(&[0x00, 0x0b, 0x00, 0x02, 0xff, 0xff]);
        }
        true
    });
    let stream = UnixStream::connect(&path).unwrap();
    let r = run_guarded(
        cfg,
        MemPages::new(Arc::new(synthetic_pages(&blocks))),
        stream,
        GUARD,
        |_| {},
    );
    let _ = dest.join();
    let e = r.result.expect_err("garbage on the return path");
    eprintln!("garbage: error after {:?}: {e}", r.took);
    assert!(
        matches!(
            e,
            PostcopyError::ReturnPath {
                offset: 8,
                error: RpError::UnknownType { ty: 0x0b, len: 2 },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("00 0b 00 02 ff ff"), "{e}");
}

/// HotRestore's Cohort as vmcsnap runs it: the destination runs with -S,
/// RUN follows the working set at once and loads the device state while
/// the guest stays paused; the guest waits for START (here: for the
/// postcopy to be active and the VM paused), then `cont` starts it while
/// pages still load, and it runs on from the snapshot's counter.
#[test]
fn e_paused_destination_started_by_cont_during_postcopy() {
    let Some(s) = shared() else { return };
    let mut dest = Dest::start(s, "cont", true);
    let mut cfg = base_config(&s.snap);
    cfg.before_run = (0..256).map(|page| PageId { block: 0, page }).collect();
    cfg.before_run.extend(rom_pages(&cfg));
    // Only requested pages for 3 s after RUN: the guest starts while most
    // of its memory is still at the source.
    cfg.background_after = Some(Duration::from_secs(3));
    let stream = dest.stream.take().unwrap();
    let pages = MemPages::new(Arc::clone(&s.snap.pages));
    let source = std::thread::spawn(move || run_guarded(cfg, pages, stream, GUARD, |_| {}));
    wait_for("the device state to be loaded (paused)", || {
        dest.qmp.cmd("query-status", json!({}))["status"] == "paused"
    });
    assert_eq!(
        dest.qmp.cmd("query-migrate", json!({}))["status"],
        "postcopy-active",
        "the guest is started before its memory is loaded"
    );
    dest.qmp.cmd("cont", json!({}));
    let mut c1 = 0;
    wait_for("the counter to pass the snapshot's", || {
        c1 = dest.counter();
        c1 > s.snap.counter
    });
    wait_for("the counter to keep increasing", || dest.counter() > c1);
    let r = source.join().unwrap();
    let report = r
        .result
        .unwrap_or_else(|e| panic!("{e}\ndestination log:\n{}", dest.log()));
    eprintln!(
        "started by cont: {:?}; {} pages before RUN, {} on demand, {} background",
        r.took, report.pages_before_run, report.pages_on_demand, report.pages_background
    );
    assert!(
        report.pages_on_demand > 0,
        "the running guest faulted on pages"
    );
    assert_eq!(
        report.pages_before_run + report.pages_on_demand + report.pages_background,
        report.pages_total
    );
    assert_eq!(report.shut_value, 0);
    wait_for("query-migrate: completed", || {
        dest.qmp.cmd("query-migrate", json!({}))["status"] == "completed"
    });
    assert_eq!(dest.qmp.cmd("query-status", json!({}))["status"], "running");
}
