//! Capture throughput of a 256 MiB guest's background snapshot (numbers to
//! look at, not a test).
//!
//! ```sh
//! cargo run --release -p vmcsnap-capture --example throughput [-- --mib 256 --dir /var/tmp]
//! ```
//!
//! 0. **QEMU alone**: the same background snapshot read into memory by a
//!    plain read loop: how fast QEMU produces the stream (kept for 2.).
//! 1. **live**: QEMU 7.2 (TCG) runs the writer guest of the tests with its
//!    RAM pre-filled with pseudo-random pages (7/8 non-zero), is paused,
//!    and migrates with `background-snapshot` into a unix socket that
//!    `capture` reads; MB/s of stream from its first byte to its end, then
//!    the commit (fsync of everything).
//! 2. **replay**: the same stream again from memory, so QEMU is not the
//!    limit: parse only (`StreamReader`, pages dropped), then `capture` in
//!    background-snapshot mode and in precopy mode (staged through the
//!    scratch file), each with its commit.
//!
//! Images go under `--dir` (default: the system temp directory).

#[path = "../tests/common/qemu.rs"]
mod qemu;

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;
use vmcsnap_capture::{capture, CaptureMode, CaptureOptions, CommittedInfo};
use vmcsnap_migstream::StreamReader;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let mib: usize = arg("--mib").map(|s| s.parse()).transpose()?.unwrap_or(256);
    let root = arg("--dir")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let work = tempfile::tempdir()?;
    let snaps = tempfile::tempdir_in(&root)?;
    let opts = |mode| {
        let mut o = CaptureOptions::new(mode, "writer");
        o.qemu_version = qemu::qemu_version(&qemu::qemu_bin());
        o
    };

    // 0. QEMU alone; the stream is kept (in pre-touched memory, so that
    // keeping it costs next to nothing) for the replays.
    let stream = {
        let dir = work.path().join("drain");
        std::fs::create_dir(&dir)?;
        let mut vm = start_paused_guest(&dir, mib);
        let mut conn = vm.migrate(&["background-snapshot"]);
        let mut stream = vec![0u8; (mib << 20) + (64 << 20)];
        let (mut n, mut first) = (0usize, None);
        loop {
            if n == stream.len() {
                stream.resize(n * 2, 0);
            }
            let k = std::io::Read::read(&mut conn, &mut stream[n..])?;
            if k == 0 {
                break;
            }
            first.get_or_insert_with(Instant::now);
            n += k;
        }
        let s = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
        vm.wait_migration();
        stream.truncate(n);
        println!(
            "QEMU alone (stream read into memory): {} MiB, {:.0} MB/s (first byte to end, {s:.3} s)",
            n >> 20,
            n as f64 / s / 1e6
        );
        stream
    };

    // 1. Live from QEMU.
    let dir = work.path().join("live");
    std::fs::create_dir(&dir)?;
    let mut vm = start_paused_guest(&dir, mib);
    let conn = vm.migrate(&["background-snapshot"]);
    let mut captured = capture(
        conn,
        &snaps.path().join("live"),
        opts(CaptureMode::BackgroundSnapshot),
        &mut |p| eprintln!("  {:>5} MiB received", p.stream_bytes >> 20),
    )?;
    let q = vm.wait_migration();
    assert_eq!(q["status"], "completed", "{q}");
    captured.metrics_mut().downtime_ms = q["downtime"].as_u64();
    let t = Instant::now();
    let c = captured.commit()?;
    report("live background snapshot", &c, t.elapsed().as_secs_f64());
    println!(
        "  QEMU: downtime {} ms, total {} ms; FAFL {} pages",
        q["downtime"], q["total-time"], c.stats.pages_guest_written
    );
    drop(vm);

    // 2. Replays from memory.
    let t = Instant::now();
    let mut r = StreamReader::new(&stream[..]);
    while r.next_event()?.is_some() {}
    let s = t.elapsed().as_secs_f64();
    println!(
        "parse only (StreamReader): {} MiB in {s:.3} s = {:.0} MB/s",
        stream.len() >> 20,
        stream.len() as f64 / s / 1e6
    );
    for (name, mode) in [
        (
            "replay background-snapshot",
            CaptureMode::BackgroundSnapshot,
        ),
        ("replay precopy (staged)", CaptureMode::Precopy),
    ] {
        let dir = snaps.path().join(mode.name());
        let captured = capture(&stream[..], &dir, opts(mode), &mut |_| {})?;
        let t = Instant::now();
        let c = captured.commit()?;
        report(name, &c, t.elapsed().as_secs_f64());
    }
    println!(
        "(images were written under {} and are removed on exit)",
        snaps.path().display()
    );
    Ok(())
}

/// The writer guest, run until it writes, then paused.
fn start_paused_guest(dir: &Path, mib: usize) -> qemu::Vm {
    let mut vm = qemu::Vm::start(dir, mib, true);
    let c0 = vm.counter();
    while vm.counter() == c0 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    vm.qmp("stop", json!({}));
    vm
}

fn report(name: &str, c: &CommittedInfo, commit_s: f64) {
    let s = &c.stats;
    let total = s.total_time.as_secs_f64() + commit_s;
    println!(
        "{name}: {} MiB of stream, {:.0} MB/s (first byte to end of stream, {:.3} s), \
         finish {:.3} s, commit {commit_s:.3} s, {:.0} MB/s overall; image {} MiB",
        s.stream_bytes >> 20,
        s.stream_mb_per_s(),
        s.stream_time.as_secs_f64(),
        s.finish_time.as_secs_f64(),
        s.stream_bytes as f64 / total / 1e6,
        c.manifest.metrics.bytes_written.unwrap_or(0) >> 20,
    );
}
