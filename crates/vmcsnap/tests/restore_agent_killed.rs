//! `kill -9` of the agent while a lazily restored guest still depends on
//! its page source: the guest never stops (its page source is a process of
//! its own), the next agent answers `status` at once, naming what it
//! recovers, and then adopts the VM (same QEMU, no re-restore, no work
//! lost) and finishes the restore (its record in the snapshot).
//!
//! The recovery is held with `VMCSNAP_TEST_HOLD_RECOVERY` until the test
//! has seen `status` answer and the guest run on: no timing threshold.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{cluster_lock, field, Env};

const SPEC: &str = r#"
[cluster]
name = "psk"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
workload = """
memtouch -m 24 -r 1500 -H 4 &
"""
"#;

/// The guest's console, read from its file (no agent needed).
fn console(env: &Env) -> String {
    std::fs::read_to_string(env.run_dir().join("cluster/a/console.log")).unwrap_or_default()
}

/// memtouch's `t=` values (seconds since it started) after byte `from`.
fn memtouch_times(c: &str, from: usize) -> Vec<u64> {
    c.get(from..)
        .unwrap_or("")
        .lines()
        .filter(|l| l.starts_with("memtouch: t="))
        .filter_map(|l| field(l, "t"))
        .collect()
}

/// Waits (at most `limit`) until `ok` holds for the console.
fn wait_console(env: &Env, what: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> String {
    let t = Instant::now();
    loop {
        let c = console(env);
        if ok(&c) {
            return c;
        }
        assert!(
            t.elapsed() < limit,
            "{what}: not within {limit:?}; console ends:\n{}",
            common::tail(&c, 2000)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn pid_in(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not: nobody may reap a detached
/// process here at once).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
fn a_lazy_restore_survives_its_agent_and_is_adopted() {
    let _l = cluster_lock();
    let mut env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    wait_console(&env, "memtouch at boot", Duration::from_secs(120), |c| {
        memtouch_times(c, 0).len() >= 2
    });
    env.ok(&["snapshot", "a", "--mode", "hot", "--name", "s"]);
    env.ok(&["stop", "a"]);

    // A lazy restore that pushes nothing in the background for 10 s: the
    // guest depends on its page source for every page it touches first.
    let from = console(&env).len();
    let mut restore = env
        .command(&["restore", "s", "--mode", "lazy", "--no-background"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let c = wait_console(&env, "the restored guest", Duration::from_secs(120), |c| {
        !memtouch_times(c, from).is_empty()
    });
    let ps_dir = env.run_dir().join("cluster/a/page-source");
    let source = pid_in(&ps_dir.join("pid")).expect("the page source wrote its pid");
    assert!(alive(source), "the page source ended before the kill");
    let job: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ps_dir.join("job.json")).unwrap()).unwrap();
    let qemu = job["member"]["pid"].as_u64().expect("the job names QEMU") as i32;
    let agent = pid_in(&env.run_dir().join("agent.pid")).expect("an agent runs");
    // SAFETY: SIGKILL to the agent's pid, read from its pid file.
    unsafe { libc::kill(agent, libc::SIGKILL) };
    let _ = std::fs::remove_file(env.run_dir().join("agent.pid"));
    let killed_at = c.len();
    let t_before = *memtouch_times(&c, from).last().unwrap();
    let t = Instant::now();
    while restore.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(60), "restore did not end");
        std::thread::sleep(Duration::from_millis(50));
    }

    // No agent: the guest runs on, fed by its page source.
    wait_console(
        &env,
        "the guest without agent",
        Duration::from_secs(120),
        |c| memtouch_times(c, killed_at).len() >= 2,
    );
    assert!(alive(qemu), "the restored QEMU died with the agent");

    // The next agent answers at once, while its recovery is held.
    let hold = env.run_dir().join("hold-recovery");
    env.extra_env.push((
        "VMCSNAP_TEST_HOLD_RECOVERY".into(),
        hold.to_string_lossy().into_owned(),
    ));
    let asked = Instant::now();
    let st = env.json(&["status", "--json"]);
    // For the record only (no threshold): the new agent's start included.
    eprintln!("status after the kill answered in {:?}", asked.elapsed());
    let busy = st["busy"]["request"].as_str().unwrap_or("");
    assert!(
        busy.contains("recovering") && busy.contains("VM a") && busy.contains("snapshot s"),
        "status does not name the recovery: {st}"
    );
    let held_at = console(&env).len();
    wait_console(
        &env,
        "the guest while recovery waits",
        Duration::from_secs(120),
        |c| memtouch_times(c, held_at).len() >= 2,
    );
    std::fs::write(&hold, b"").unwrap();

    // Adopted: the same QEMU, the guest never went back in time.
    let t = Instant::now();
    let st = loop {
        let st = env.json(&["status", "--json"]);
        if st["busy"].is_null() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the recovery did not end: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let vm = &st["vms"].as_array().unwrap()[0];
    assert_eq!(vm["name"], "a", "{st}");
    assert_eq!(vm["state"], "running", "{st}");
    let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap_or_default();
    assert_eq!(
        vm["pid"].as_u64(),
        Some(qemu as u64),
        "re-restored: {st}\nagent log ends:\n{}\npage-source.log:\n{}",
        common::tail(&log, 3000),
        std::fs::read_to_string(env.run_dir().join("cluster/a/page-source.log"))
            .unwrap_or_default()
    );
    let c = wait_console(
        &env,
        "memtouch after adoption",
        Duration::from_secs(60),
        |c| memtouch_times(c, held_at).len() >= 4,
    );
    let after = memtouch_times(&c, killed_at);
    assert!(
        after.iter().all(|&t| t >= t_before),
        "the guest went back to the snapshot (t={t_before} before the kill, then {after:?})"
    );
    assert!(!c[from..].contains("MEMTOUCH-CORRUPTION"), "{}", &c[from..]);
    assert_eq!(common::last_field(&c, "memtouch:", "errors"), Some(0));
    // The adopting agent finished the restore: its record, no leftovers.
    let records: Vec<_> = std::fs::read_dir(env.run_dir().join("snapshots/s/restores"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with("-lazy.json"))
        .collect();
    assert_eq!(records.len(), 1, "the restore's record");
    assert!(!ps_dir.exists(), "the page source's directory is left");
    assert!(!env.run_dir().join("restoring.json").exists());
    assert!(!alive(source), "the page source runs on");

    // The adopted VM works as any other.
    env.ok(&["snapshot", "a", "--mode", "hot", "--name", "after"]);
    env.ok(&["down"]);
    env.assert_clean();
}
