//! Restores of a real VM through postcopy (the agent is the migration
//! source, a fresh QEMU the destination): every mode, from hot, stop-copy
//! and pre-copy snapshots, while the VM's peer keeps talking to it. The
//! guest's memtouch verifies every page it reads after the restore; the
//! peer's pingpong client must get answers from the restored VM; with
//! `--paused` the destination's RAM must equal the image page for page.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{cluster_lock, last_field, Env};

const SPEC: &str = r#"
[cluster]
name = "rs"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
workload = """
memtouch -m 24 -r 1500 -H 4 &
pingpong server 7000 &
"""

[[vm]]
name = "b"
memory_mib = 160
workload = """
pingpong client {ip:a} 7000 &
"""
"#;

/// The console of `vm` after byte `from`.
fn console_after(env: &Env, vm: &str, from: usize) -> String {
    let c = env.console(vm);
    c.get(from..).unwrap_or("").to_string()
}

/// Waits until the restored `a` has printed two memtouch lines and `b`'s
/// pingpong client has had replies since the restore.
fn check_alive(env: &Env, a_from: usize, b_from: usize, what: &str) {
    env.wait_console(
        "a",
        &format!("memtouch after {what}"),
        Duration::from_secs(120),
        |c| {
            c.get(a_from..)
                .unwrap_or("")
                .lines()
                .filter(|l| l.starts_with("memtouch: t="))
                .count()
                >= 2
        },
    );
    let after = console_after(env, "a", a_from);
    assert!(
        !after.contains("MEMTOUCH-CORRUPTION"),
        "{what}: corruption after the restore:\n{after}"
    );
    assert!(
        after
            .lines()
            .filter(|l| l.starts_with("memtouch: t="))
            .all(|l| common::field(l, "errors") == Some(0)),
        "{what}: memtouch counted errors:\n{after}"
    );
    let total0 = last_field(&env.console("b")[..b_from], "pingpong:", "total").unwrap_or(0);
    env.wait_console(
        "b",
        &format!("pingpong replies after {what}"),
        Duration::from_secs(120),
        |c| last_field(c.get(b_from..).unwrap_or(""), "pingpong:", "total").unwrap_or(0) > total0,
    );
}

/// Page-by-page comparison of `ram` (a RAM file) with block "mem" of the image.
fn assert_ram_equals_image(img_dir: &Path, ram: &Path) {
    let img = vmcsnap_agent::frozen_disks::open_image(img_dir).unwrap();
    let id = img.ram_block_id("mem").unwrap();
    let ps = img.page_size();
    let ram = std::fs::read(ram).unwrap();
    let mut want = vec![0u8; img.ram_block_pages(id) as usize * ps];
    img.read_ram_block(id, &mut want).unwrap();
    assert_eq!(ram.len(), want.len());
    let bad: Vec<usize> = (0..want.len() / ps)
        .filter(|p| want[p * ps..(p + 1) * ps] != ram[p * ps..(p + 1) * ps])
        .collect();
    assert!(
        bad.is_empty(),
        "{} pages differ from the image, first {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
}

#[test]
fn every_mode_restores_a_working_vm_from_every_snapshot_kind() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.wait_console("a", "memtouch", Duration::from_secs(60), |c| {
        c.matches("memtouch: t=").count() >= 2
    });
    env.wait_console("b", "pingpong", Duration::from_secs(60), |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) > 0
    });
    for (mode, name) in [
        ("hot", "s-hot"),
        ("stop-copy", "s-sc"),
        ("precopy", "s-pre"),
    ] {
        // s-sc is incremental to s-hot (the default); s-pre is full, so
        // that damaging s-sc below leaves it whole.
        let mut args = vec!["snapshot", "a", "--mode", mode, "--name", name, "--json"];
        if name == "s-pre" {
            args.push("--full");
        }
        let r = env.json(&args);
        // What it is incremental to, or why it is full, in the report.
        let want = match name {
            "s-sc" => "s-hot (depth 1)",
            "s-pre" => "none: --full",
            _ => "",
        };
        if !want.is_empty() {
            assert_eq!(r["parent"], want, "{r}");
        }
    }
    let sc = env.json(&["inspect", "s-sc", "--json"]);
    assert_eq!(sc["parent"]["name"], "s-hot", "{sc}");
    assert_eq!(
        sc["manifest"]["metrics"]["parent"], "s-hot (depth 1)",
        "{sc}"
    );
    assert!(sc["stats"]["pages_in_parent"].as_u64().unwrap() > 0, "{sc}");
    assert_eq!(
        env.json(&["inspect", "s-pre", "--json"])["parent"],
        serde_json::Value::Null
    );

    // Refused while a runs; unknown snapshot named.
    let out = env.vmcsnap(&["restore", "--wait", "s-hot"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = env.vmcsnap(&["restore", "--wait", "nope"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no snapshot named \"nope\""));

    for (mode, snap) in [
        ("eager", "s-hot"),
        ("lazy", "s-sc"),
        ("workingset", "s-pre"),
        ("sampling-ws", "s-hot"),
        ("workingset", "s-hot"),
    ] {
        let (a_from, b_from) = (env.console("a").len(), env.console("b").len());
        env.ok(&["stop", "a"]);
        // One restore opts out of the CPU priorities.
        let opt_out = mode == "sampling-ws";
        let r = if opt_out {
            env.json(&[
                "restore",
                "--wait",
                snap,
                "--mode",
                mode,
                "--no-priorities",
                "--json",
            ])
        } else {
            env.json(&["restore", "--wait", snap, "--mode", mode, "--json"])
        };
        let total = r["pages_total"].as_u64().unwrap();
        eprintln!(
            "{mode} from {snap}: latency {:.1} ms, {} pages first, {} demand faults, full load {:.1} ms, QEMU threads raised {}",
            r["restore_latency_ms"].as_f64().unwrap(),
            r["ws_pages"],
            r["demand_faults"],
            r["full_load_ms"].as_f64().unwrap(),
            r["qemu_threads_raised"]
        );
        match mode {
            // Eager sends all but one page first: QEMU 7.2 needs at least
            // one DISCARD before LISTEN, so the source holds one back.
            "eager" => assert_eq!(r["ws_pages"].as_u64(), Some(total - 1)),
            "lazy" => assert!(r["ws_pages"].as_u64().unwrap() <= 1, "{r}"),
            _ => assert!(r["ws_pages"].as_u64().unwrap() < total, "{r}"),
        }
        // Where the agent may raise priorities (root), both of QEMU's
        // fault-path threads were found by their names and raised; lazy
        // restores run long enough in postcopy for that to be certain.
        if mode == "lazy" && !r["qemu_threads_raised"].is_null() {
            assert_eq!(r["qemu_threads_raised"], 2, "{r}");
        }
        if opt_out {
            assert!(
                r["qemu_threads_raised"].is_null(),
                "--no-priorities changes nothing: {r}"
            );
        }
        assert_eq!(
            env.json(&["status", "--json"])["vms"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        check_alive(&env, a_from, b_from, &format!("{mode} restore of {snap}"));
    }

    // Tracing: nothing preloaded, only demanded pages for 10 s; analyze-ws
    // scores the FAFL working set against those first accesses.
    let (a_from, b_from) = (env.console("a").len(), env.console("b").len());
    env.ok(&["stop", "a"]);
    let r = env.json(&[
        "restore",
        "--wait",
        "s-hot",
        "--mode",
        "lazy",
        "--trace",
        "--no-background",
        "--json",
    ]);
    let faults = r["demand_faults"].as_u64().unwrap();
    assert!(faults > 0, "{r}");
    check_alive(&env, a_from, b_from, "traced restore");
    let a = env.json(&["analyze-ws", "s-hot", "--json"]);
    assert_eq!(a["trace_pages"].as_u64(), Some(faults), "{a}");
    let rows = a["fafl"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "{a}");
    for q in rows {
        for k in ["hit_rate", "accuracy"] {
            let x = q[k].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{k} {x} in {a}");
        }
    }
    eprintln!("analyze-ws: {a}");
    // The next restore learns from the faults just recorded.
    env.ok(&["stop", "a"]);
    let r = env.json(&[
        "restore",
        "--wait",
        "s-hot",
        "--mode",
        "workingset",
        "--json",
    ]);
    assert_eq!(r["learned"], true, "{r}");

    // A restored VM snapshots again, in every mode. Regression: the restore
    // left QEMU's postcopy-ram capability on; a hot snapshot was refused
    // ("Background-snapshot is not compatible with postcopy-ram") and a
    // pre-copy one hung with the guest paused.
    let mut damaged = None;
    for (mode, name) in [
        ("hot", "again-hot"),
        ("precopy", "again-pre"),
        ("stop-copy", "again-sc"),
    ] {
        let (a_from, b_from) = (env.console("a").len(), env.console("b").len());
        let s = env.json(&["snapshot", "a", "--mode", mode, "--name", name, "--json"]);
        assert!(
            s["downtime_ms"].as_f64().is_some(),
            "{mode} snapshot of a restored VM: {s}"
        );
        check_alive(
            &env,
            a_from,
            b_from,
            &format!("{mode} snapshot of a restored VM"),
        );
        if name == "again-pre" {
            // 200 of its page hashes flipped. Regression: the next
            // snapshot came out full without a word, and verify said OK.
            let h = env.run_dir().join("snapshots/again-pre/hashes.bin");
            let good = std::fs::read(&h).unwrap();
            let mut bad = good.clone();
            for b in &mut bad[64 + 16..64 + 16 + 200 * 16] {
                *b ^= 0x01;
            }
            std::fs::write(&h, &bad).unwrap();
            damaged = Some((h, good));
        }
        if name == "again-sc" {
            let why = s["parent"].as_str().unwrap_or_default();
            assert!(
                why.starts_with("none: the page hashes of again-pre (hashes.bin) cannot be used"),
                "{s}"
            );
            let m = env.json(&["inspect", "again-sc", "--json"]);
            assert_eq!(m["manifest"]["metrics"]["parent"], s["parent"], "{m}");
            let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap();
            assert!(
                log.contains("its parent cannot be used") && log.contains("again-pre"),
                "the agent's log does not say why again-sc is full"
            );
        }
    }
    let out = env.vmcsnap(&["inspect", "again-pre", "--verify"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("hashes.bin"), "{err}");
    let (h, good) = damaged.unwrap();
    std::fs::write(h, good).unwrap();
    let out = env.vmcsnap(&["inspect", "again-pre", "--verify"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Image format 1.0 (what vmcsnap wrote before format 2) still restores;
    // checked page by page below.
    env.json(&[
        "snapshot",
        "a",
        "--name",
        "s-v1",
        "--storage",
        "v1",
        "--json",
    ]);
    let v1 = env.json(&["inspect", "s-v1", "--json"]);
    assert_eq!(v1["format"], "1.0", "{v1}");
    assert_eq!(v1["stats"]["blocks_compressed"], 0, "{v1}");

    // The destination QEMU dies mid-restore: a clear error, nothing of a left.
    env.ok(&["stop", "a"]);
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_vmcsnap"))
        .arg("--run-dir")
        .arg(env.run_dir())
        .args([
            "restore",
            "--wait",
            "s-pre",
            "--mode",
            "lazy",
            "--no-background",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let incoming = || {
        env.processes().into_iter().find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("-incoming"))
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let pid = loop {
        if let Some(p) = incoming() {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no destination QEMU appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(1500)); // the guest runs, faulting pages in
                                                     // SAFETY: kill(2) on the destination QEMU's pid, read from /proc just now.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("restore of VM \"a\" failed"), "{err}");
    // Issue 29: what explains it is kept and named, with how QEMU ended
    // (the test's SIGKILL, not a kill of the agent's once it was dying).
    let pm = postmortem(&err);
    assert!(
        pm.qmp["exit_status"]
            .as_str()
            .is_some_and(|s| s.starts_with("signal: 9")),
        "{}",
        pm.qmp
    );
    assert!(incoming().is_none(), "a destination QEMU is left");
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"].as_array().unwrap().len(), 1, "only b runs: {st}");

    // --paused: once loaded, the destination's RAM is the image (a is not
    // running: the killed restore left nothing).
    env.json(&[
        "restore", "--wait", "s-hot", "--mode", "lazy", "--paused", "--json",
    ]);
    let st = env.json(&["status", "--json"]);
    let a = st["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "a")
        .unwrap()
        .clone();
    assert_eq!(a["state"], "paused", "{st}");
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-rs-a"))
        .expect("a's RAM file");
    assert_ram_equals_image(&env.run_dir().join("snapshots/s-hot"), &ram);
    // The hot snapshot is format 2: compressed locality blocks, the
    // guest-written pages in hot blocks.
    let hot = env.json(&["inspect", "s-hot", "--json"]);
    assert_eq!(hot["format"], "2.0", "{hot}");
    assert!(
        hot["stats"]["blocks_compressed"].as_u64().unwrap() > 0,
        "{hot}"
    );
    assert!(hot["stats"]["blocks_hot"].as_u64().unwrap() > 0, "{hot}");
    // An incremental snapshot restores exactly, reading through its parent.
    env.ok(&["stop", "a"]);
    env.json(&[
        "restore", "--wait", "s-sc", "--mode", "lazy", "--paused", "--json",
    ]);
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-rs-a"))
        .expect("a's RAM file");
    assert_ram_equals_image(&env.run_dir().join("snapshots/s-sc"), &ram);
    // A pre-copy snapshot too (full, format 2).
    env.ok(&["stop", "a"]);
    env.json(&[
        "restore", "--wait", "s-pre", "--mode", "eager", "--paused", "--json",
    ]);
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-rs-a"))
        .expect("a's RAM file");
    assert_ram_equals_image(&env.run_dir().join("snapshots/s-pre"), &ram);
    // And a format 1.0 image restores exactly too.
    env.ok(&["stop", "a"]);
    env.json(&[
        "restore", "--wait", "s-v1", "--mode", "lazy", "--paused", "--json",
    ]);
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-rs-a"))
        .expect("a's RAM file");
    assert_ram_equals_image(&env.run_dir().join("snapshots/s-v1"), &ram);

    // A corrupt page is never delivered: the restore fails, nothing of a runs.
    env.ok(&["stop", "a"]);
    let mem = env.run_dir().join("snapshots/s-sc/memory.img");
    let mut bytes = std::fs::read(&mem).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&mem, &bytes).unwrap();
    let out = env.vmcsnap(&["restore", "--wait", "s-sc", "--mode", "eager"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("restore of VM \"a\" failed") && err.to_lowercase().contains("crc"),
        "{err}"
    );
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"].as_array().unwrap().len(), 1, "only b runs: {st}");

    env.ok(&["down"]);
    env.assert_clean();

    // Without a cluster (and after `down` removed the VM's directory):
    // the restore starts the agent and a cluster of its own. s-pre is the
    // third snapshot, so its frozen disk is a chain of three files
    // (regression: the chain used to point into the removed directory).
    let r = env.json(&[
        "restore",
        "--wait",
        "s-pre",
        "--mode",
        "workingset",
        "--json",
    ]);
    assert_eq!(r["vm"], "a");
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["cluster"], "rs", "{st}");
    assert_eq!(st["vms"].as_array().unwrap().len(), 1, "{st}");
    let from = env.console("a").len();
    env.wait_console(
        "a",
        "memtouch after a restore without a cluster",
        Duration::from_secs(120),
        |c| {
            c.get(from..)
                .unwrap_or("")
                .lines()
                .filter(|l| l.starts_with("memtouch: t="))
                .count()
                >= 2
        },
    );
    let after = console_after(&env, "a", from);
    assert!(
        !after.contains("MEMTOUCH-CORRUPTION") && !after.contains("EXT4-fs error"),
        "{after}"
    );
    env.ok(&["down"]);
    env.assert_clean();
}

/// One small VM whose guest prints a line a second (memtouch).
const ONE_VM: &str = r#"
[cluster]
name = "rf"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 160
workload = """
memtouch -m 16 -r 1500 -H 4 &
"""
"#;

/// What a failed restore kept (issue 29), from the directory its error
/// names.
struct Postmortem {
    stderr: String,
    qmp: serde_json::Value,
}

impl Postmortem {
    /// The statuses of the MIGRATION events QEMU sent, in order.
    fn migration_statuses(&self) -> Vec<String> {
        self.qmp["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["event"] == "MIGRATION")
            .filter_map(|e| e["data"]["status"].as_str().map(str::to_string))
            .collect()
    }
}

/// Checks that the error `err` names its post-mortem directory and that
/// the directory holds every file it says, the error among them.
fn postmortem(err: &str) -> Postmortem {
    let dir = err
        .split("kept for its post-mortem in ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .unwrap_or_else(|| panic!("the error names no post-mortem: {err}"));
    let dir = Path::new(dir);
    assert!(
        dir.parent().unwrap().ends_with("failed-restores"),
        "{}",
        dir.display()
    );
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .unwrap_or_else(|e| panic!("{}/{f}: {e}", dir.display()))
    };
    let error = read("error.txt");
    assert!(err.contains(error.trim()), "{error}\nvs\n{err}");
    read("console.log");
    let qmp: serde_json::Value = serde_json::from_str(&read("qmp.json")).unwrap();
    assert!(qmp["events"].is_array(), "{qmp}");
    Postmortem {
        stderr: read("qemu-stderr.log"),
        qmp,
    }
}

/// Issue 20: a failed restore's error quotes only what its own QEMU
/// printed, not the console of the VM's earlier incarnations (the log is
/// appended across them), and its QEMU, whose state is worthless, is
/// killed at once instead of being asked to quit (7 s of QMP timeout and
/// grace for a postcopy destination that does not quit).
#[test]
fn a_failed_restore_quotes_only_its_own_console_and_kills_its_qemu_at_once() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(ONE_VM);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.json(&[
        "snapshot",
        "a",
        "--mode",
        "stop-copy",
        "--name",
        "s",
        "--json",
    ]);

    // An earlier incarnation that restored fine and printed on the console
    // after the first boot's lines (the ready marker among them).
    let from = env.console("a").len();
    env.ok(&["stop", "a"]);
    env.json(&["restore", "--wait", "s", "--mode", "lazy", "--json"]);
    let before = env.wait_console(
        "a",
        "memtouch after the good restore",
        Duration::from_secs(120),
        |c| c.get(from..).unwrap_or("").contains("memtouch: t="),
    );
    assert!(before.contains("VMCSNAP-READY"), "{before}");
    env.ok(&["stop", "a"]);

    let mem = env.run_dir().join("snapshots/s/memory.img");
    let mut bytes = std::fs::read(&mem).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&mem, &bytes).unwrap();
    let agent_log = || std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap();

    let quotes_no_earlier_console = |err: &str| {
        for earlier in ["VMCSNAP-READY", "memtouch:", "vmcsnap-stat"] {
            assert!(
                !err.contains(earlier),
                "an earlier incarnation's console ({earlier:?}) quoted:\n{err}"
            );
        }
    };

    // Before RUN (eager): QEMU gets a broken stream and exits by itself;
    // the error quotes its log and the console, of which it printed nothing.
    let out = env.vmcsnap(&["restore", "--wait", "s", "--mode", "eager"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("restore of VM \"a\" failed") && err.contains("QEMU exited"),
        "{err}"
    );
    quotes_no_earlier_console(&err);
    assert!(err.contains(vmcsnap_agent::vm::CONSOLE_EMPTY), "{err}");
    // Issue 29: the post-mortem holds QEMU's own words on the broken
    // stream, the incoming migration's status changes, and its exit.
    let pm = postmortem(&err);
    assert!(!pm.stderr.trim().is_empty(), "QEMU's stderr: {err}");
    assert!(
        err.contains(pm.stderr.trim().lines().last().unwrap()),
        "{err}"
    );
    assert!(pm.qmp["exit_status"].is_string(), "{}", pm.qmp);
    // (QEMU exits without flushing the events that follow `setup`.)
    assert!(
        pm.migration_statuses().iter().any(|s| s == "setup"),
        "{}",
        pm.qmp
    );

    // After RUN (lazy, background loading held back so that the corrupt
    // page goes on the running guest's demand): the postcopy destination
    // waits for pages that never come and would not quit on request; it is
    // killed at once. QEMU 7.2 sometimes dies by itself first (the stream
    // broke before its guest ran, or a SIGSEGV): nothing to kill then, so
    // a few tries.
    let killed_at_once = "at once, without a quit: its restore failed";
    let mut killed = false;
    for attempt in 1..=5 {
        let out = env.vmcsnap(&[
            "restore",
            "--wait",
            "s",
            "--mode",
            "lazy",
            "--start-quiet",
            "2000",
        ]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("restore of VM \"a\" failed"), "{err}");
        quotes_no_earlier_console(&err);
        let pm = postmortem(&err);
        if agent_log().contains(killed_at_once) {
            // Asked before it was killed: a postcopy destination that was
            // running the guest.
            assert!(
                pm.qmp["query-migrate"]["status"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("postcopy")),
                "{}",
                pm.qmp
            );
            assert!(
                pm.migration_statuses()
                    .iter()
                    .any(|s| s == "postcopy-active"),
                "{}",
                pm.qmp
            );
            // QEMU's own words on why it stopped loading are quoted.
            assert!(
                err.contains("QEMU was still running (migration postcopy-")
                    && err.contains("Detected IO failure for postcopy"),
                "{err}"
            );
            killed = true;
            break;
        }
        eprintln!("try {attempt}: the destination QEMU ended by itself: {err}");
    }
    let log = agent_log();
    assert!(
        killed,
        "no failed restore's QEMU was killed at once; agent log:\n{log}"
    );
    assert!(
        !log.contains("did not quit"),
        "a failed restore's QEMU was asked to quit; agent log:\n{log}"
    );
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"].as_array().unwrap().len(), 0, "nothing runs: {st}");

    // The console log still holds every incarnation (`vmcsnap console`
    // shows it whole while the VM runs).
    let c = std::fs::read_to_string(env.run_dir().join("cluster/a/console.log")).unwrap();
    assert!(
        c.contains("VMCSNAP-READY") && c.contains("memtouch: t="),
        "{c}"
    );

    env.ok(&["down"]);
    env.assert_clean();
}

/// Regression: QEMU 7.2 crashed (SIGSEGV in `qio_channel_writev`, from
/// `vm_start` flushing the packets its NIC queued) when a restored guest
/// started before the switch had connected to the new QEMU's `-netdev
/// stream` socket: 1 in 20 lazy restores, whose guest starts within
/// milliseconds (40 restores by hand: 2 crashes, both with that stack). The
/// restore now waits for the switch first. 16 lazy restores in a row must
/// all succeed (without the wait, 16 pass together about 44% of the time).
#[test]
fn lazy_restores_in_a_row_never_crash_qemu() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(ONE_VM);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.json(&["snapshot", "a", "--mode", "hot", "--name", "s", "--json"]);
    for i in 0..16 {
        env.ok(&["stop", "a"]);
        let out = env.vmcsnap(&["restore", "--wait", "s", "--mode", "lazy", "--json"]);
        assert!(
            out.status.success(),
            "lazy restore {i} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"][0]["state"], "running", "{st}");
    access_data_fallback(&env);
    learning_stays_bounded(&env);
    snapshot_lifecycle(&env);
    env.ok(&["down"]);
    env.assert_clean();
}

/// Issue 23: a restore whose snapshot has no access data, or access data
/// that is corrupt or names pages the VM does not have, works and says why
/// it went on without; valid access data is used. (In the cluster of
/// `lazy_restores_in_a_row_never_crash_qemu`.)
fn access_data_fallback(env: &Env) {
    env.json(&["snapshot", "a", "--mode", "hot", "--name", "acc", "--json"]);
    let access = env.run_dir().join("snapshots/acc/access");
    let restore = |what: &str| {
        env.ok(&["stop", "a"]);
        let r = env.json(&["restore", "--wait", "acc", "--mode", "workingset", "--json"]);
        let st = env.json(&["status", "--json"]);
        assert_eq!(st["vms"][0]["state"], "running", "{what}: {st}");
        r["access_data"].as_str().unwrap_or_default().to_string()
    };
    let a = restore("no access data");
    assert!(a.starts_with("none ("), "{a}");
    std::fs::create_dir_all(&access).unwrap();
    std::fs::write(
        access.join("accessed.json"),
        b"{\"format\": 1, \"runs\": [tru",
    )
    .unwrap();
    let a = restore("corrupt access data");
    assert!(
        a.starts_with("ignored: ") && a.contains("does not parse"),
        "{a}"
    );
    std::fs::write(
        access.join("accessed.json"),
        br#"{"format":1,"source":"damon","runs":[{"ram_block":0,"first_page":4294967000,"pages":4,"first_seen_ms":0}]}"#,
    )
    .unwrap();
    let a = restore("access data of another VM");
    assert!(a.contains("does not belong to this snapshot"), "{a}");
    std::fs::write(
        access.join("accessed.json"),
        br#"{"format":1,"source":"damon","runs":[{"ram_block":0,"first_page":1000,"pages":300,"first_seen_ms":5}]}"#,
    )
    .unwrap();
    let a = restore("valid access data");
    assert!(a.starts_with("damon: 300 accessed pages"), "{a}");
    // The snapshots of `snapshot_lifecycle` come after `s` alone.
    env.json(&["snapshots", "delete", "acc", "--json"]);
}

/// Issue 23: repeated `workingset` restores of one snapshot learn from
/// each other without growing: each learned size is at most the larger of
/// the size it learned from and what the guest was seen to touch (pages of
/// the working set it used plus pages it missed), so over 10 restores the
/// size never exceeds the first one's or the most ever seen touched.
/// Before, each restore loaded the union of everything faulted so far
/// (397 → 1682 → 4024 → … → 15 059 pages).
fn learning_stays_bounded(env: &Env) {
    env.json(&[
        "snapshot", "a", "--mode", "hot", "--name", "learn", "--json",
    ]);
    let (mut sizes, mut most_touched) = (vec![], 0u64);
    for i in 0..10 {
        env.ok(&["stop", "a"]);
        let r = env.json(&[
            "restore",
            "--wait",
            "learn",
            "--mode",
            "workingset",
            "--json",
        ]);
        let wss = r["wss"].as_u64().unwrap();
        let next = r["next_wss"].as_u64().expect("a workingset restore learns");
        assert_eq!(r["learned"], i > 0, "restore {i}: {r}");
        let q = &r["quality"];
        let (used, missed) = (q["used"].as_u64().unwrap(), q["missed"].as_u64().unwrap());
        assert!(used <= q["loaded"].as_u64().unwrap(), "{r}");
        for k in ["hit_rate", "accuracy"] {
            let x = q[k].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&x), "{k} {x}: {r}");
        }
        most_touched = most_touched.max(used + missed);
        assert!(
            next <= wss.max(used + missed),
            "restore {i}: learned {next} from a size of {wss} with {used} used + {missed} missed: {r}"
        );
        assert!(
            next <= sizes.first().copied().unwrap_or(wss).max(most_touched),
            "restore {i}: {next} after {sizes:?}"
        );
        sizes.push(wss);
    }
    eprintln!("learned sizes over 10 restores: {sizes:?}");
    env.json(&["snapshots", "delete", "learn", "--json"]);
}

/// `snapshots delete`, `prune` and `gc` on a live cluster whose VM `a`
/// runs restored from snapshot `s` (so its disk chain reads `s`'s frozen
/// disk), in the cluster of `lazy_restores_in_a_row_never_crash_qemu` (no
/// boot of its own).
fn snapshot_lifecycle(env: &Env) {
    use serde_json::json;
    let snaps = env.run_dir().join("snapshots");
    let disks = |n: &str| snaps.join(".disks").join(n);
    let removed = |r: &serde_json::Value| -> Vec<String> {
        r["removed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap().to_string())
            .collect()
    };
    // p1..p3 are of a restored VM (restored from s), each incremental to
    // the one before. Regression: their frozen disks named s's by absolute
    // path, so deleting s broke them; a restored VM's disk chain is now
    // linked into its own directory, and every frozen disk is whole.
    for name in ["p1", "p2", "p3"] {
        env.json(&["snapshot", "a", "--mode", "hot", "--name", name, "--json"]);
    }
    env.ok(&["stop", "a"]);
    env.json(&["restore", "--wait", "p2", "--mode", "eager", "--json"]);

    // a runs restored from p2, on its own links of p2's disk: p2 goes
    // whole (its child p3 rewritten without it), and a runs on.
    let r = env.json(&["snapshots", "delete", "p2", "--json"]);
    assert_eq!(removed(&r), ["p2"], "{r}");
    assert_eq!(r["kept_in_use"], json!([]), "{r}");
    assert_eq!(r["merged"], json!(["p3"]), "{r}");
    assert!(r["bytes_freed"].as_u64().unwrap() > 0, "{r}");
    assert!(!snaps.join("p2").exists() && !disks("p2").exists());
    let st = env.json(&["status", "--json"]);
    assert!(
        st["vms"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "a" && v["state"] == "running"),
        "{st}"
    );
    // Nothing needs s's frozen disk any more.
    let r = env.json(&["snapshots", "delete", "s", "--json"]);
    assert_eq!(r["kept_in_use"], json!([]), "{r}");
    assert!(!disks("s").exists());
    let out = env.vmcsnap(&["snapshots", "delete", "p2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no snapshot named \"p2\""),
        "{err}"
    );

    // Prune: a dry run removes nothing, then p1 goes with its disk.
    let dry = env.json(&["snapshots", "prune", "--keep", "1", "--dry-run", "--json"]);
    assert_eq!(
        (removed(&dry), &dry["kept"]),
        (vec!["p1".into()], &json!(["p3"])),
        "{dry}"
    );
    assert!(snaps.join("p1").is_dir());
    let r = env.json(&["snapshots", "prune", "--keep", "1", "--json"]);
    assert_eq!(removed(&r), ["p1"], "{r}");
    assert_eq!(r["removed"][0]["disks_removed"], json!(disks("p1")), "{r}");
    let human = env.ok(&["snapshots", "prune", "--keep", "1"]);
    assert!(human.contains("nothing to remove"), "{human}");
    let list = env.json(&["snapshots", "--json"]);
    let listed: Vec<&str> = list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["p3"], "{list}");

    // Nothing is left for gc, and p3 (rewritten twice) restores on its
    // own frozen disk alone.
    env.ok(&["stop", "a"]);
    let g = env.json(&["gc", "--json"]);
    // Nothing but the cached disk indexes of files that went with the
    // deleted snapshots, and the disks of the stopped VM (no VM and no
    // QEMU uses its directory any more): no snapshot's file.
    let index = env.run_dir().join("disk-index");
    let stopped = env.run_dir().join("cluster").join("a");
    let removed: Vec<&str> = g["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(
        removed
            .iter()
            .all(|p| Path::new(p).starts_with(&index) || Path::new(p).starts_with(&stopped)),
        "{g}"
    );
    env.json(&[
        "restore", "--wait", "p3", "--mode", "eager", "--paused", "--json",
    ]);
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"][0]["state"], "paused", "{st}");
    assert!(disks("p3").is_dir() && snaps.join("p3").is_dir());
}
