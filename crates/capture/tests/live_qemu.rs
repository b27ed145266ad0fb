//! Captures from a real QEMU 7.2 migrating into a unix socket, as the
//! agent will, in each mode, and checks every page of the image against a
//! reference:
//!
//! * guest RAM (block `mem`): a copy of the guest's RAM file taken while
//!   the VM was paused at the snapshot's moment: right before `migrate`
//!   for background-snapshot and stop-copy, after `completed` (the source
//!   stays paused) for precopy;
//! * the other RAM blocks (ROMs, ACPI tables, which are not in the file):
//!   an independent, naive reading of a copy of the same stream (every
//!   record into a map, last copy wins). (`pc.bios` cannot be checked
//!   against QEMU's `qboot.rom`: qboot writes its data into that block.)
//!
//! Plus: zero pages are in the bitmap, the device state is the stream's,
//! the FAFL trace of a background snapshot of the writing guest is
//! non-empty and holds only pages the guest writes, and a stream cut in
//! the middle (QEMU killed; the agent shutting the socket) fails and leaves
//! nothing. No test is skipped: without QEMU or binutils they fail with
//! the Debian package to install.

mod common;

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::assert_nothing_left;
use common::qemu::{guest_writes, qemu_bin, qemu_version, Tee, Vm, COUNTER};
use serde_json::json;
use vmcsnap_capture::ram_check::hash_pages;
use vmcsnap_capture::{
    capture, CaptureError, CaptureMode, CaptureOptions, CommittedInfo, FinalRam, FinalRamCheck,
    FinalRamSource, RamCheckReport,
};
use vmcsnap_image::{Image, PageKey, PageState};
use vmcsnap_migstream::{Event, RamBlock, StreamReader};

/// Guest RAM of the test VMs (the writer guest writes up to 10 MiB).
const RAM_MIB: usize = 32;
const PS: usize = 4096;

/// The naive model of a stream: every page record into a map.
struct StreamModel {
    blocks: Vec<RamBlock>,
    /// (block, offset) -> data of the first and of the last copy
    /// (`None`: a zero page).
    first: HashMap<(usize, u64), Option<Vec<u8>>>,
    last: HashMap<(usize, u64), Option<Vec<u8>>>,
    device_state: Vec<u8>,
}

fn model(stream: &[u8]) -> StreamModel {
    let mut r = StreamReader::new(stream);
    let mut m = StreamModel {
        blocks: Vec::new(),
        first: HashMap::new(),
        last: HashMap::new(),
        device_state: Vec::new(),
    };
    while let Some(ev) = r.next_event().expect("the copy of the stream parses") {
        let (block, offset, data) = match ev {
            Event::RamBlocks(b) => {
                m.blocks = b.to_vec();
                continue;
            }
            Event::DeviceState { data, .. } => {
                m.device_state = data.to_vec();
                continue;
            }
            Event::Page {
                block,
                offset,
                data,
                ..
            } => (block, offset, Some(data.to_vec())),
            Event::ZeroPage {
                block,
                offset,
                fill,
                ..
            } => (block, offset, (fill != 0).then(|| vec![fill; PS])),
            _ => continue,
        };
        m.first
            .entry((block, offset))
            .or_insert_with(|| data.clone());
        m.last.insert((block, offset), data);
    }
    m
}

fn options(mode: CaptureMode) -> CaptureOptions {
    let mut o = CaptureOptions::new(mode, "writer");
    o.qemu_version = qemu_version(&qemu_bin());
    o.vm_config = json!({"ram_mib": RAM_MIB});
    o
}

/// Checks every page of the committed image: block `mem` against `ram`,
/// the others against the stream model; the device state; verification.
/// Returns the number of zero pages of `mem`.
fn check_image(c: &CommittedInfo, ram: &[u8], m: &StreamModel) -> u64 {
    let img = Image::open(&c.path).expect("open the committed image");
    let report = img.verify();
    assert!(report.is_ok(), "image does not verify: {report:?}");
    let names: Vec<(&str, u64)> = img
        .ram_blocks()
        .iter()
        .map(|b| (b.name.as_str(), b.used_length))
        .collect();
    let stream_names: Vec<(&str, u64)> = m
        .blocks
        .iter()
        .map(|b| (b.name.as_str(), b.used_length))
        .collect();
    assert_eq!(names, stream_names, "RAM blocks");
    assert_eq!(img.device_state().unwrap(), m.device_state, "device state");
    assert!(m.device_state.len() > 1000, "device state of a real VM");

    let mut buf = vec![0u8; PS];
    let mut mem_zero = 0;
    let mut checked = 0;
    for (rb, block) in m.blocks.iter().enumerate() {
        let want_block: Vec<u8> = if block.name == "mem" {
            assert_eq!(block.used_length as usize, ram.len(), "RAM file size");
            ram.to_vec()
        } else {
            let mut v = Vec::new();
            for off in (0..block.used_length).step_by(PS) {
                match &m.last[&(rb, off)] {
                    Some(d) => v.extend_from_slice(d),
                    None => v.extend_from_slice(&[0; PS]),
                }
            }
            v
        };
        for (p, want) in want_block.chunks(PS).enumerate() {
            let key = PageKey::new(rb as u32, p as u32);
            let state = img.read_page(key, &mut buf).unwrap();
            let zero = want.iter().all(|&b| b == 0);
            match state {
                PageState::Zero => assert!(zero, "{}:{p:#x} is zero in the image", block.name),
                PageState::Stored(_) => {
                    assert!(!zero, "{}:{p:#x}: a zero page was stored", block.name);
                    assert!(
                        buf == want,
                        "{} page {p:#x} differs from the reference",
                        block.name
                    );
                }
                PageState::Absent => panic!("{} page {p:#x} is absent", block.name),
                s => panic!(
                    "{} page {p:#x} is {s:?}: a capture makes no references",
                    block.name
                ),
            }
            if zero && block.name == "mem" {
                mem_zero += 1;
            }
            checked += 1;
        }
    }
    let total = img.stats().pages_total;
    assert_eq!(checked, total, "pages checked");
    assert_eq!(c.manifest.metrics.pages_total, Some(total));
    mem_zero
}

/// The guest's RAM file once QEMU has stopped the guest for the
/// switch-over: a pre-copy stream ends only after that, and QEMU leaves the
/// guest stopped (postmigrate), so the capture's check reads it as it is.
struct PausedRam {
    path: std::path::PathBuf,
}

impl FinalRamSource for PausedRam {
    fn final_ram(&self) -> Result<FinalRam, String> {
        let file = std::fs::File::open(&self.path).map_err(|e| e.to_string())?;
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        let hashes = hash_pages(&file, 0, len, PS, 2).map_err(|e| e.to_string())?;
        Ok(FinalRam {
            block: "mem".into(),
            file,
            file_offset: 0,
            hashes,
        })
    }

    fn checked(&self, _outcome: Result<&RamCheckReport, &CaptureError>) {}
}

/// Waits until the guest has changed its counter (it is running).
fn wait_guest_running(vm: &Vm) {
    let c0 = vm.counter();
    let deadline = Instant::now() + Duration::from_secs(60);
    while vm.counter() == c0 {
        assert!(Instant::now() < deadline, "the guest never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn counter_of(ram: &[u8]) -> u32 {
    let c = COUNTER as usize;
    u32::from_le_bytes(ram[c..c + 4].try_into().unwrap())
}

/// Captures `mode` from `conn`, waits for QEMU's `completed`, adds the
/// downtime and commits.
fn capture_and_commit(
    vm: &mut Vm,
    conn: UnixStream,
    root: &Path,
    mode: CaptureMode,
) -> (CommittedInfo, Vec<u8>) {
    let mut tee = Tee {
        inner: conn,
        copy: Vec::new(),
    };
    let mut opts = options(mode);
    if mode == CaptureMode::Precopy {
        // As the agent does: QEMU 7.2's TCG can miss a guest write in
        // pre-copy (docs/snapshot.md), which the check against the paused
        // guest's RAM repairs. Without it this test failed about once in
        // a few dozen runs ("mem page … differs from the reference").
        opts.final_ram = Some(FinalRamCheck(Arc::new(PausedRam {
            path: vm.ram_path.clone(),
        })));
    }
    opts.progress_interval_bytes = 8 << 20;
    let mut reports = 0;
    let mut captured = capture(&mut tee, &root.join("snap"), opts, &mut |_| reports += 1)
        .unwrap_or_else(|e| panic!("{mode} capture: {e}"));
    let q = vm.wait_migration();
    assert_eq!(q["status"], "completed", "{q}");
    captured.metrics_mut().downtime_ms = q["downtime"].as_u64();
    let c = captured.commit().expect("commit");
    let s = &c.stats;
    eprintln!(
        "{mode}: {} stream bytes in {:?} ({:.0} MB/s), {} page records, {} resent, {} guest-written, {} progress reports",
        s.stream_bytes,
        s.stream_time,
        s.stream_mb_per_s(),
        s.page_records,
        s.pages_resent,
        s.pages_guest_written,
        reports
    );
    assert_eq!(s.stream_bytes, tee.copy.len() as u64);
    assert!(reports >= 2, "progress reports: {reports}");
    assert_eq!(c.manifest.metrics.downtime_ms, q["downtime"].as_u64());
    let listed = vmcsnap_image::list_snapshots(root).unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].is_valid(), "{:?}", listed[0].status);
    (c, tee.copy)
}

#[test]
fn background_snapshot_equals_the_ram_at_the_pause() {
    let dir = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(dir.path(), RAM_MIB, true);
    wait_guest_running(&vm);
    vm.qmp("stop", json!({}));
    let reference = vm.read_ram();
    let conn = vm.migrate(&["background-snapshot"]);
    let (c, stream) =
        capture_and_commit(&mut vm, conn, root.path(), CaptureMode::BackgroundSnapshot);

    // QEMU resumed the guest, which kept writing: its RAM moved on, but the
    // image must be the RAM of the pause.
    let deadline = Instant::now() + Duration::from_secs(60);
    while vm.counter() == counter_of(&reference) {
        assert!(
            Instant::now() < deadline,
            "the guest did not run after the snapshot"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let m = model(&stream);
    let zero = check_image(&c, &reference, &m);
    assert!(zero > 0, "no zero pages in the bitmap");
    assert_eq!(c.stats.pages_resent, 0);

    let img = Image::open(&c.path).unwrap();
    let mem = img.ram_block_id("mem").unwrap();
    let fafl = img.fafl();
    eprintln!("FAFL: {} pages", fafl.len());
    assert!(!fafl.is_empty(), "no guest-written pages in the FAFL trace");
    for k in fafl {
        assert_eq!(k.ram_block, mem);
        let addr = u64::from(k.page) * PS as u64;
        assert!(
            guest_writes(addr),
            "{addr:#x} in the FAFL trace, never written by the guest"
        );
    }
    assert_eq!(
        c.manifest.metrics.pages_guest_written,
        Some(fafl.len() as u64)
    );
}

#[test]
fn stop_copy_equals_the_ram_at_the_pause() {
    let dir = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(dir.path(), RAM_MIB, true);
    wait_guest_running(&vm);
    vm.qmp("stop", json!({}));
    let reference = vm.read_ram();
    let conn = vm.migrate(&[]);
    let (c, stream) = capture_and_commit(&mut vm, conn, root.path(), CaptureMode::StopCopy);
    assert!(vm.read_ram() == reference, "the paused guest's RAM changed");
    let m = model(&stream);
    assert!(
        check_image(&c, &reference, &m) > 0,
        "no zero pages in the bitmap"
    );
    assert_eq!(c.stats.pages_resent, 0);
    assert!(Image::open(&c.path).unwrap().fafl().is_empty());
}

#[test]
fn precopy_of_a_running_guest_equals_the_ram_at_the_final_pause() {
    let dir = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(dir.path(), RAM_MIB, true);
    wait_guest_running(&vm);
    let conn = vm.migrate(&[]);
    let (c, stream) = capture_and_commit(&mut vm, conn, root.path(), CaptureMode::Precopy);
    // Completed: the source stays paused, its RAM is the final round's.
    let status = vm.qmp("query-status", json!({}));
    assert_eq!(status["status"], "postmigrate", "{status}");
    let reference = vm.read_ram();
    let m = model(&stream);
    assert!(
        check_image(&c, &reference, &m) > 0,
        "no zero pages in the bitmap"
    );
    assert!(
        c.stats.pages_resent > 0,
        "the running guest's pages were never re-sent"
    );
    // The test means something only if a page's first copy was stale.
    let mem = m.blocks.iter().position(|b| b.name == "mem").unwrap();
    let stale = m
        .first
        .iter()
        .filter(|((b, off), first)| {
            let want = &reference[*off as usize..*off as usize + PS];
            let first_is_want = match first {
                Some(d) => d == want,
                None => want.iter().all(|&x| x == 0),
            };
            *b == mem && !first_is_want
        })
        .count();
    eprintln!("precopy: {stale} pages whose first copy was stale");
    let other = &c.manifest.metrics.other;
    assert_eq!(
        other["precopy_pages_checked"],
        (reference.len() / PS) as u64,
        "every page of mem checked against the paused RAM"
    );
    eprintln!(
        "precopy: {} pages patched (writes QEMU's stream missed)",
        other["precopy_pages_patched"]
    );
    assert!(stale > 0, "no page changed after its first copy");
    assert!(Image::open(&c.path).unwrap().fafl().is_empty());
}

/// Forwards reads; after `limit` bytes runs `action` once (kill QEMU, or
/// shut the socket down).
struct CutAfter<F: FnMut(&UnixStream)> {
    inner: UnixStream,
    limit: u64,
    read: u64,
    action: Option<F>,
}

impl<F: FnMut(&UnixStream)> Read for CutAfter<F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.read >= self.limit {
            if let Some(mut a) = self.action.take() {
                a(&self.inner);
            }
        }
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

/// Captures with a cut after 4 MiB; checks the image was being written
/// when the cut came, that the capture failed, and that nothing is left.
fn capture_cut(
    conn: UnixStream,
    root: &Path,
    mode: CaptureMode,
    action: impl FnMut(&UnixStream),
) -> CaptureError {
    let cut = CutAfter {
        inner: conn,
        limit: 4 << 20,
        read: 0,
        action: Some(action),
    };
    let mut opts = options(mode);
    opts.progress_interval_bytes = 1 << 20;
    let mut temp_seen = false;
    let r = capture(cut, &root.join("snap"), opts, &mut |_| {
        // The writer's temporary directory exists while pages stream in.
        temp_seen |= std::fs::read_dir(root).unwrap().count() == 1;
    });
    let err = match r {
        Ok(_) => panic!("{mode}: a cut stream was captured"),
        Err(e) => e,
    };
    assert!(temp_seen, "the image was never started");
    assert!(matches!(err, CaptureError::Stream(_)), "{mode}: {err}");
    eprintln!("{mode} cut: {err}");
    assert_nothing_left(root);
    err
}

#[test]
fn qemu_killed_mid_stream_leaves_no_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(dir.path(), RAM_MIB, true);
    wait_guest_running(&vm);
    vm.qmp("stop", json!({}));
    let conn = vm.migrate(&["background-snapshot"]);
    let mut kill = vm.killer();
    capture_cut(
        conn,
        root.path(),
        CaptureMode::BackgroundSnapshot,
        move |_| kill(),
    );
}

#[test]
fn agent_closing_the_socket_mid_stream_leaves_no_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let mut vm = Vm::start(dir.path(), RAM_MIB, true);
    wait_guest_running(&vm);
    let conn = vm.migrate(&[]);
    capture_cut(conn, root.path(), CaptureMode::Precopy, |s| {
        s.shutdown(Shutdown::Both).unwrap()
    });
    // QEMU's side of the migration fails, and the guest keeps running.
    let q = vm.wait_migration();
    assert_eq!(q["status"], "failed", "{q}");
    assert_eq!(vm.qmp("query-status", json!({}))["status"], "running");
}
