//! A snapshot whose capture fails or stalls part-way (injected with the
//! hidden `--inject-fault`, as a full or hung disk would): in every mode the
//! command fails with an error that says what happened, the guest runs on
//! unharmed, nothing is listed or left half-written, and the next snapshot
//! of the same VM works.
//!
//! Regressions: a stop-copy capture that stopped reading kept the guest
//! paused for the whole 600 s migration timeout; one that stalled in QEMU's
//! completion phase (QEMU writing with its main loop locked) left QMP
//! silent for 120 s; and one that stalled after QEMU had written its last
//! byte held the snapshot request, and with it the agent, forever. So did
//! a commit whose fsync never returned (now given up on at a deadline).

mod common;

use std::time::Duration;

use common::{cluster_lock, last_field, memtouch_lines, Env};

const SPEC: &str = r#"
[cluster]
name = "sf"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 384
workload = """
memtouch -m 160 -r 0 &
"""
"#;

/// Long enough for any snapshot here; only a hang takes longer.
const HANG: Duration = Duration::from_secs(400);

/// Runs vmcsnap; panics if it has not ended within [`HANG`].
fn run(env: &Env, args: &[&str]) -> (bool, String, String) {
    let out = env.vmcsnap_within(args, HANG).unwrap_or_else(|| {
        panic!(
            "vmcsnap {args:?} hung for {HANG:?}; agent log:\n{}",
            agent_log(env)
        )
    });
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    (out.status.success(), text(out.stdout), text(out.stderr))
}

fn agent_log(env: &Env) -> String {
    let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap_or_default();
    common::tail(&log, 3000).to_string()
}

/// The guest runs and memtouch verifies its memory on, with no corruption.
fn assert_guest_healthy(env: &Env, after: &str) {
    let status = env.json(&["status", "--json"]);
    for v in status["vms"].as_array().unwrap() {
        assert_eq!(v["state"], "running", "after {after}: {status}");
    }
    let before = memtouch_lines(&env.console("a"));
    env.wait_console(
        "a",
        &format!("memtouch progress after {after}"),
        Duration::from_secs(120),
        |c| memtouch_lines(c) >= before + 2,
    );
    let c = env.console("a");
    assert!(
        !c.contains("MEMTOUCH-CORRUPTION"),
        "after {after}:\n{}",
        common::tail(&c, 2000)
    );
    assert_eq!(
        last_field(&c, "memtouch:", "errors"),
        Some(0),
        "after {after}"
    );
}

/// Nothing of the failed snapshot is listed or left in the snapshots dir.
fn assert_nothing_left(env: &Env, failed: &str) {
    let list = env.ok(&["snapshots"]);
    assert!(!list.contains(failed), "{failed} is listed:\n{list}");
    let dir = env.run_dir().join("snapshots");
    let left: Vec<String> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !left.iter().any(|n| n.starts_with(failed)),
        "{failed} left {left:?} in {}",
        dir.display()
    );
}

/// A snapshot that fails with `fault`; returns its error output.
fn failing_snapshot(env: &Env, mode: &str, name: &str, fault: &str) -> String {
    let (ok, out, err) = run(
        env,
        &[
            "snapshot",
            "a",
            "--mode",
            mode,
            "--name",
            name,
            "--inject-fault",
            fault,
        ],
    );
    assert!(!ok, "{mode} snapshot with {fault} succeeded: {out}");
    assert_guest_healthy(env, &format!("a {mode} snapshot with {fault}"));
    assert_nothing_left(env, name);
    err
}

/// A good snapshot, verified; returns its stream size.
fn good_snapshot(env: &Env, mode: &str, name: &str) -> u64 {
    let (ok, out, err) = run(
        env,
        &["snapshot", "a", "--mode", mode, "--name", name, "--json"],
    );
    assert!(
        ok,
        "the {mode} snapshot after a failed one failed: {err}\n{}",
        agent_log(env)
    );
    env.ok(&["inspect", name, "--verify"]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    report["stream_bytes"].as_u64().unwrap()
}

#[test]
fn a_snapshot_whose_capture_fails_or_stalls_leaves_the_guest_running_and_nothing_behind() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    // memtouch has filled its 160 MiB: the stream is far longer than the
    // 50 MB after which the faults strike.
    env.wait_console("a", "memtouch running", Duration::from_secs(120), |c| {
        memtouch_lines(c) >= 3
    });

    let mut stop_copy_bytes = 0;
    for mode in ["stop-copy", "precopy", "hot"] {
        let err = failing_snapshot(
            &env,
            mode,
            &format!("err-{mode}"),
            "capture-error-after=50000000",
        );
        assert!(
            err.contains("injected fault") && err.contains("no snapshot was written"),
            "{mode}: {err}"
        );
        let bytes = good_snapshot(&env, mode, &format!("ok-{mode}"));
        if mode == "stop-copy" {
            stop_copy_bytes = bytes;
        }
    }
    assert!(
        stop_copy_bytes > 100_000_000,
        "stream of {stop_copy_bytes} bytes: memtouch's memory is missing"
    );

    // A stop-copy capture that stops reading: early, QEMU blocks while
    // copying RAM with the guest paused; 150 kB before the end, it blocks
    // in its completion phase or has already written everything and
    // reported completion while the capture still holds the data.
    let near_end = stop_copy_bytes - 150_000;
    for (mode, at) in [
        ("stop-copy", 50_000_000),
        ("stop-copy", near_end),
        ("hot", 50_000_000),
    ] {
        let fault = format!("capture-stall-after={at}");
        let err = failing_snapshot(&env, mode, &format!("stall-{mode}"), &fault);
        assert!(
            err.contains("made no progress") && err.contains("hung"),
            "{mode} {fault}: {err}"
        );
    }
    // A commit that hangs (fsync on a hung disk) is given up on at its
    // deadline: the request, and with it the agent, is not held; the
    // image is not committed, now or later.
    for mode in ["hot", "stop-copy"] {
        let err = failing_snapshot(
            &env,
            mode,
            &format!("commit-stall-{mode}"),
            "commit-stall-deadline=3",
        );
        assert!(
            err.contains("did not finish within 3s") && err.contains("hung"),
            "{mode}: {err}"
        );
    }
    good_snapshot(&env, "stop-copy", "ok-after-stalls");

    // A bug in the agent (a panic in the request's handler while the VM is
    // paused) fails that request only: the same agent serves on, the VM
    // runs, and the next snapshot works. Regression: a panic in any handler
    // took the whole agent, and every VM's management, down.
    let pid = || std::fs::read_to_string(env.run_dir().join("agent.pid")).unwrap();
    let before = pid();
    for mode in ["stop-copy", "hot"] {
        let err = failing_snapshot(&env, mode, &format!("panic-{mode}"), "panic-when-paused");
        assert!(
            err.contains("hit a bug") && err.contains("keeps serving"),
            "{mode}: {err}"
        );
        assert_eq!(
            pid(),
            before,
            "the agent was replaced after a panic in {mode}"
        );
    }
    good_snapshot(&env, "hot", "ok-after-panics");

    // `vmcsnap gc` removes what the failed snapshots left (frozen disks of
    // snapshots never committed, temporary directories of this agent's
    // abandoned writers) and nothing a snapshot or the VM uses. Regression:
    // a snapshot killed at the wrong moment left `.disks/<name>/` forever,
    // and `inspect` suggested a `cleanup` command that did not exist.
    let gc = env.json(&["gc", "--json"]);
    let root = env.run_dir().join("snapshots");
    let leftovers = |root: &std::path::Path| -> Vec<String> {
        let mut out = vec![];
        for e in std::fs::read_dir(root.join(".disks"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if !root.join(e.file_name()).exists() {
                out.push(format!(".disks/{}", e.file_name().to_string_lossy()));
            }
        }
        for e in std::fs::read_dir(root).unwrap().flatten() {
            if e.file_name().to_string_lossy().contains(".tmp-") {
                out.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        out
    };
    assert_eq!(
        leftovers(&root),
        Vec::<String>::new(),
        "gc left these: {gc}"
    );
    for kept in [
        "ok-stop-copy",
        "ok-hot",
        "ok-after-stalls",
        "ok-after-panics",
    ] {
        env.ok(&["inspect", kept, "--verify"]);
    }
    let again = env.json(&["gc", "--json"]);
    assert_eq!(again["removed"], serde_json::json!([]), "{again}");
    let out = env.vmcsnap(&["inspect", "nosuch"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("cleanup"), "{err}");

    // Requests are served concurrently: `status` answers while a snapshot
    // runs (its commit held for 5 s), naming it. Regression: requests were
    // served one at a time, and a long snapshot blocked `status`.
    let mut slow = env
        .command(&[
            "snapshot",
            "a",
            "--name",
            "slow",
            "--inject-fault",
            "commit-stall-deadline=5",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut busy_seen = None;
    while slow.try_wait().unwrap().is_none() {
        let s = env.json(&["status", "--json"]);
        if !s["busy"].is_null() && slow.try_wait().unwrap().is_none() {
            busy_seen = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = slow.wait();
    let s = busy_seen.expect("no status answered while the snapshot ran");
    assert!(
        s["busy"]["request"]
            .as_str()
            .unwrap()
            .starts_with("snapshot a"),
        "{s}"
    );
    assert_eq!(s["vms"][0]["name"], "a", "{s}");
    assert_guest_healthy(&env, "a snapshot during which status was asked");

    let (ok, _, err) = run(
        &env,
        &[
            "snapshot",
            "a",
            "--name",
            "typo",
            "--inject-fault",
            "capture-error-afterr=1",
        ],
    );
    assert!(
        !ok && err.contains("not a fault vmcsnap can inject"),
        "{err}"
    );
    env.ok(&["down"]);
}
