//! Restarting the agent while a cluster runs traffic: the VMs are untouched
//! (same QEMU pids, same TCP connection), the switch drops nothing and its
//! counters carry on, and the CLI works against the new agent image.

mod common;

use std::time::Duration;

use common::{cluster_lock, last_field, Env};

const SPEC: &str = r#"
[cluster]
name = "ar"
accel = "auto"

[[vm]]
name = "srv"
memory_mib = 160
workload = """
pingpong server 7000 &
kvserver 7001 &
"""

[[vm]]
name = "cli"
memory_mib = 160
workload = """
pingpong client {ip:srv} 7000 &
kvload {ip:srv} 7001 &
"""
"#;

fn pids(status: &serde_json::Value) -> Vec<u64> {
    status["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["pid"].as_u64().unwrap())
        .collect()
}

fn frames(status: &serde_json::Value) -> u64 {
    status["switch"]["totals"]["rx_frames"].as_u64().unwrap()
}

#[test]
fn agent_restart_keeps_vms_connections_and_every_frame() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let c = env.wait_console("cli", "traffic", Duration::from_secs(90), |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) >= 100
            && last_field(c, "kvload:", "total").unwrap_or(0) >= 100
    });
    let conn = last_field(&c, "pingpong:", "conn").unwrap();
    let before = env.json(&["status", "--json"]);

    for _ in 0..3 {
        let out = env.ok(&["agent", "restart"]);
        assert!(out.contains("agent restarted"), "{out}");
    }

    let after = env.json(&["status", "--json"]);
    assert_eq!(pids(&after), pids(&before), "QEMU processes were replaced");
    assert!(
        frames(&after) >= frames(&before),
        "switch counters went backwards: {before} -> {after}"
    );
    let total = last_field(&env.console("cli"), "pingpong:", "total").unwrap();
    let c = env.wait_console(
        "cli",
        "traffic after restart",
        Duration::from_secs(60),
        |c| last_field(c, "pingpong:", "total").unwrap_or(0) >= total + 100,
    );
    assert_eq!(
        last_field(&c, "pingpong:", "conn"),
        Some(conn),
        "the TCP connection was re-established:\n{c}"
    );
    assert_eq!(last_field(&c, "kvload:", "errors"), Some(0), "{c}");
    let last = env.json(&["status", "--json"]);
    assert!(frames(&last) > frames(&after));
    // The VMs' ports; the host interface's relay (`_host`) is a thread of
    // the agent, started again by each new image.
    for p in last["switch"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] != "_host")
    {
        assert_eq!(p["drops"], 0, "{p}");
        assert_eq!(p["connections"], 1, "a QEMU reconnected: {p}");
    }
    for v in last["vms"].as_array().unwrap() {
        assert_eq!(v["state"], "running");
    }
    // The restarted agent can still do everything, down included.
    env.ok(&["rejuvenate", "--vm", "srv", "--mode", "warm"]);
    env.ok(&["down"]);
    env.assert_clean();
}
