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
