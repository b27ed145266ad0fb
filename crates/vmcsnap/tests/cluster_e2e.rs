//! End to end: a real 3-VM cluster under real QEMU, real guests, real TCP
//! through vmcsnap's switch.

mod common;

use std::time::Duration;

use common::{cluster_lock, field, last_field, Env};

/// Pingpong between `ping` and `pong`; `pong` also drives a KV load against
/// the server in `kvs`. Every VM runs memtouch.
const SPEC: &str = r#"
[cluster]
name = "e2e"
accel = "auto"

[[vm]]
name = "ping"
memory_mib = 192
workload = """
memtouch -m 24 &
pingpong server 7000 &
"""

[[vm]]
name = "pong"
memory_mib = 192
workload = """
memtouch -m 24 &
pingpong client {ip:ping} 7000 &
kvload {ip:kvs} 7001 &
"""

[[vm]]
name = "kvs"
memory_mib = 192
workload = """
memtouch -m 24 &
kvserver 7001 &
"""
"#;

#[test]
fn cluster_boots_talks_stays_correct_and_tears_down_cleanly() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    let up = env.json(&["up", spec.to_str().unwrap(), "--json"]);
    assert_eq!(up["cluster"], "e2e");
    let vms = up["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 3);
    let mut pids = vec![];
    for v in vms {
        assert!(v["pid"].as_u64().unwrap() > 0);
        assert!(v["boot_ms"].as_u64().unwrap() > 0);
        assert!(["tcg", "kvm"].contains(&v["accel"].as_str().unwrap()));
        pids.push(v["pid"].as_u64().unwrap() as i32);
    }

    // Guest-reported traffic: pingpong replies and verified KV operations.
    let limit = Duration::from_secs(90);
    let pong = env.wait_console("pong", "pingpong replies", limit, |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) >= 50
    });
    let kvc = env.wait_console("pong", "KV operations", limit, |c| {
        last_field(c, "kvload:", "total").unwrap_or(0) >= 50
    });
    assert_eq!(
        last_field(&kvc, "kvload:", "errors"),
        Some(0),
        "KV verification failed:\n{kvc}"
    );

    // memtouch: runs for a while with no corruption.
    for vm in ["ping", "pong", "kvs"] {
        let c = env.wait_console(vm, "memtouch verification", limit, |c| {
            c.lines().filter(|l| l.starts_with("memtouch:")).count() >= 5
        });
        assert!(
            !c.contains("MEMTOUCH-CORRUPTION"),
            "{vm}: corruption reported:\n{c}"
        );
        assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0), "{vm}");
        assert!(
            last_field(&c, "memtouch:", "verified").unwrap() > 0,
            "{vm}: memtouch verified nothing"
        );
    }

    // Switch counters agree with the guests: the ports of talking VMs
    // carried frames both ways, and nothing was dropped.
    let status = env.json(&["status", "--json"]);
    assert_eq!(status["cluster"], "e2e");
    for v in status["vms"].as_array().unwrap() {
        assert_eq!(v["state"], "running", "{v}");
    }
    let ports = status["switch"]["ports"].as_array().unwrap();
    let port = |name: &str| {
        ports
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no port {name}"))
    };
    let pingpong_total = last_field(&pong, "pingpong:", "total").unwrap();
    for name in ["ping", "pong", "kvs"] {
        let p = port(name);
        assert!(p["rx_frames"].as_u64().unwrap() > 0, "{name}: {p}");
        assert!(p["tx_frames"].as_u64().unwrap() > 0, "{name}: {p}");
        assert_eq!(p["drops"], 0, "{name}: {p}");
    }
    // Every request and every reply is at least one frame.
    assert!(
        port("pong")["tx_frames"].as_u64().unwrap() >= pingpong_total,
        "{}",
        port("pong")
    );
    assert!(
        port("ping")["tx_frames"].as_u64().unwrap() >= pingpong_total,
        "{}",
        port("ping")
    );
    let human = env.ok(&["status"]);
    assert!(
        human.contains("RX_FRAMES") && human.contains("kvs"),
        "{human}"
    );

    // Console lines carry the init's periodic stat line too.
    let c = env.console("ping");
    assert!(
        c.lines().any(|l| l.starts_with("vmcsnap-stat")
            && field(l, "retrans").is_some()
            && l.contains(" uptime=")),
        "{c}"
    );

    env.ok(&["down"]);
    for pid in pids {
        // SAFETY: kill with signal 0 only checks for existence.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "QEMU pid {pid} still alive after down");
    }
    env.assert_clean();
    let st = env.vmcsnap(&["status"]);
    assert!(String::from_utf8_lossy(&st.stdout).contains("no cluster is up"));
}
