//! Killing the agent in the middle of a hot snapshot: the VM keeps running
//! and healthy (QEMU is in its own process group and resumes the guest
//! itself once copy-on-write is armed), and no partial snapshot is listed.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{cluster_lock, last_field, memtouch_lines, Env};
use vmcsnap_qmp::QmpClient;

const SPEC: &str = r#"
[cluster]
name = "ak"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 384
workload = """
memtouch -m 160 -r 0 &
"""
"#;

fn console(env: &Env) -> String {
    std::fs::read_to_string(env.run_dir().join("cluster/a/console.log")).unwrap_or_default()
}

#[test]
fn killing_the_agent_mid_snapshot_leaves_the_vm_running_and_lists_nothing() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    // memtouch has filled its 160 MiB, so the stream is large enough to
    // interrupt.
    env.wait_console("a", "memtouch running", Duration::from_secs(120), |c| {
        memtouch_lines(c) >= 3
    });
    let agent_pid: i32 = std::fs::read_to_string(env.run_dir().join("agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let mut snap = Command::new(env!("CARGO_BIN_EXE_vmcsnap"))
        .arg("--run-dir")
        .arg(env.run_dir())
        .args(["snapshot", "a", "--mode", "hot", "--name", "killed"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the image is being written (its temporary directory exists).
    let snaps = env.run_dir().join("snapshots");
    let deadline = Instant::now() + Duration::from_secs(60);
    let in_progress = || {
        std::fs::read_dir(&snaps)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("killed.tmp-"))
            })
            .unwrap_or(false)
    };
    while !in_progress() {
        assert!(
            Instant::now() < deadline,
            "the snapshot never started writing"
        );
        assert!(
            snap.try_wait().unwrap().is_none(),
            "snapshot finished before it could be interrupted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: SIGKILL to the agent's pid, read from its pid file.
    assert_eq!(unsafe { libc::kill(agent_pid, libc::SIGKILL) }, 0);
    let out = snap.wait_with_output().unwrap();
    assert!(!out.status.success(), "the snapshot cannot have succeeded");

    // The VM is running, through its own QMP socket (the agent is gone).
    let mut qmp = QmpClient::connect(
        &env.run_dir().join("cluster/a/qmp.sock"),
        Duration::from_secs(10),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = qmp
            .execute("query-status", serde_json::Value::Null)
            .unwrap();
        if st["status"] == "running" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "VM not running after the agent died: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // ... and healthy: memtouch keeps verifying with no corruption.
    let before = memtouch_lines(&console(&env));
    let deadline = Instant::now() + Duration::from_secs(60);
    while memtouch_lines(&console(&env)) < before + 3 {
        assert!(
            Instant::now() < deadline,
            "memtouch stopped progressing:\n{}",
            console(&env)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let c = console(&env);
    assert!(!c.contains("MEMTOUCH-CORRUPTION"), "{c}");
    assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0));

    // No partial snapshot is listed.
    let list = env.json(&["snapshots", "--json"]);
    let names: Vec<String> = list
        .as_array()
        .or_else(|| list["snapshots"].as_array())
        .into_iter()
        .flatten()
        .filter(|s| s["valid"].as_bool().unwrap_or(true))
        .filter_map(|s| s["name"].as_str().map(String::from))
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with("killed")),
        "partial snapshot listed: {list}"
    );
    let _ = qmp.execute("quit", serde_json::Value::Null);
}

/// The nice value of every thread of `pid` (empty once it is gone).
fn thread_nices(pid: u32) -> Vec<(u32, i32)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return vec![];
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let tid: u32 = t.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 2..];
            Some((tid, rest.split(' ').nth(16)?.parse().ok()?))
        })
        .collect()
}

fn qemu_pid(env: &Env) -> u32 {
    let st = env.json(&["status", "--json"]);
    st["vms"][0]["pid"].as_u64().expect("a QEMU pid") as u32
}

/// Issue 29 (5a): an agent killed during a hot snapshot's pause, while it
/// had raised QEMU's priority, left every QEMU thread (vCPUs included) at
/// nice -10 for good. The next agent puts them back on adoption, and later
/// snapshots end with them where they were.
#[test]
fn an_agent_killed_in_the_pause_leaves_no_raised_priority() {
    // Raising a priority needs CAP_SYS_NICE; without it there is no boost.
    // SAFETY: geteuid has no arguments and no memory effects.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: raising QEMU's priority needs root");
        return;
    }
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(
        r#"
[cluster]
name = "boost"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
workload = """
memtouch -m 32 -r 0 &
"""
"#,
    );
    env.ok(&["up", spec.to_str().unwrap()]);
    let pid = qemu_pid(&env);
    let before = thread_nices(pid);
    assert!(!before.is_empty());
    let normal = before.iter().find(|(t, _)| *t == pid).unwrap().1;
    assert!(normal > -10, "QEMU starts above the pause's priority");

    let mut snap = env
        .command(&[
            "snapshot",
            "a",
            "--mode",
            "hot",
            "--name",
            "boosted",
            "--inject-fault",
            "hang-when-paused",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The pause holds (the fault): QEMU's threads are raised.
    let deadline = Instant::now() + Duration::from_secs(60);
    while thread_nices(pid).iter().any(|&(_, n)| n != -10) {
        assert!(
            Instant::now() < deadline,
            "QEMU's threads were never raised: {:?}",
            thread_nices(pid)
        );
        assert!(snap.try_wait().unwrap().is_none(), "the snapshot ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    let agent: i32 = std::fs::read_to_string(env.run_dir().join("agent.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: SIGKILL to the agent's pid, read from its pid file.
    assert_eq!(unsafe { libc::kill(agent, libc::SIGKILL) }, 0);
    let _ = snap.wait();

    // The next agent (started by `status`) adopts the VM: resumed, and
    // every thread back where it was.
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"][0]["state"], "running", "{st}");
    let after: Vec<(u32, i32)> = thread_nices(pid);
    assert!(
        after.iter().all(|&(_, n)| n == normal),
        "after adoption, nice values {after:?} (before the snapshot: {before:?})"
    );
    assert!(
        !env.run_dir().join("cluster/a/boost.json").exists(),
        "the boost's record is gone once undone"
    );
    // A later snapshot ends with them there too.
    env.ok(&["snapshot", "a", "--mode", "hot", "--name", "later"]);
    let later = thread_nices(pid);
    assert!(
        later.iter().all(|&(_, n)| n == normal),
        "after a later snapshot: {later:?}"
    );
    env.ok(&["down"]);
}
