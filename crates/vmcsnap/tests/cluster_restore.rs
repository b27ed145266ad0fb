//! Restoring a whole cluster from a hot cluster snapshot (HotRestore):
//! real QEMU guests of different sizes and workloads, restored in each
//! mode; the workloads continue on the same TCP connections.

mod common;

use std::time::Duration;

use common::{cluster_lock, last_field, Env};

/// Heterogeneous: different memory sizes and workloads; a pingpong pair
/// and a KV pair.
const SPEC: &str = r#"
[cluster]
name = "cr"
accel = "auto"

[[vm]]
name = "srv"
memory_mib = 256
workload = """
memtouch -m 48 &
pingpong server 7000 &
kvserver 7001 &
"""

[[vm]]
name = "cli"
memory_mib = 128
workload = """
memtouch -m 8 &
pingpong client {ip:srv} 7000 &
"""

[[vm]]
name = "kvc"
memory_mib = 192
workload = """
memtouch -m 24 &
kvload {ip:srv} 7001 &
"""

[[vm]]
name = "idle"
memory_mib = 160
workload = """
memtouch -m 4 &
"""
"#;

const VMS: [&str; 4] = ["srv", "cli", "kvc", "idle"];

#[test]
fn a_cluster_snapshot_restores_in_every_mode_and_its_workloads_continue() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let limit = Duration::from_secs(120);
    env.wait_console("cli", "pingpong", limit, |c| last_field(c, "pingpong:", "total").unwrap_or(0) >= 100);
    env.wait_console("kvc", "kvload", limit, |c| last_field(c, "kvload:", "total").unwrap_or(0) >= 100);
    // Warm up once (the first hot snapshot reads guest RAM), then the one used.
    let snap = env.json(&["snapshot", "--cluster", "--name", "cut", "--json"]);
    assert_eq!(snap["switch"]["dropped"], 0);
    env.ok(&["down"]);

    for mode in ["workingset-restore", "hotrestore", "hotrestore-rl"] {
        let r = env.json(&["restore", "--cluster", "cut", "--mode", mode, "--json"]);
        assert_eq!(r["mode"], mode);
        let vms = r["vms"].as_array().unwrap();
        assert_eq!(vms.len(), 4, "{mode}: {r}");
        for v in vms {
            assert!(v["latency_ms"].as_f64().unwrap() > 0.0, "{mode}: {v}");
            assert!(v["pages_before_start"].as_u64().unwrap() > 0, "{mode}: {v}");
        }
        if mode == "hotrestore-rl" {
            assert_eq!(r["starts_follow_dependencies"], true, "restore-line order: {r}");
        }
        let replayed: u64 = vms.iter().map(|v| v["frames_replayed"].as_u64().unwrap()).sum();
        assert_eq!(replayed, snap["channel_state_frames"].as_u64().unwrap(), "{mode}: every logged frame replayed");
        let retrans: Vec<(String, i64)> = vms
            .iter()
            .map(|v| {
                let d = v["retrans_later"].as_i64().unwrap_or(0) - v["retrans_first"].as_i64().unwrap_or(0);
                (v["vm"].as_str().unwrap().to_string(), d)
            })
            .collect();
        eprintln!("{mode}: RetransSegs growth {retrans:?}, backoff avg {} ms", r["backoff_avg_ms"]);

        // The workloads go on from the snapshot, on the same connections.
        let cli = env.console("cli");
        let total0 = last_field(&cli, "pingpong:", "total").unwrap_or(0);
        env.wait_console("cli", "pingpong after the restore", Duration::from_secs(60), |c| {
            last_field(c, "pingpong:", "total").unwrap_or(0) > total0 + 200
        });
        let kvc = env.wait_console("kvc", "kvload after the restore", Duration::from_secs(60), |c| {
            c.lines().filter(|l| l.starts_with("kvload:")).count() >= 3
        });
        assert_eq!(last_field(&kvc, "kvload:", "errors"), Some(0), "{mode}: KV verification:\n{}", common::tail(&kvc, 2000));
        assert_eq!(last_field(&kvc, "kvload:", "conn"), Some(1), "{mode}: the KV connection survived");
        assert_eq!(last_field(&env.console("cli"), "pingpong:", "conn"), Some(1), "{mode}: the pingpong connection survived");
        for vm in VMS {
            let c = env.console(vm);
            assert!(!c.contains("MEMTOUCH-CORRUPTION"), "{mode}: {vm}: corruption:\n{}", common::tail(&c, 2000));
            assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0), "{mode}: {vm}");
        }
        env.ok(&["down"]);
    }
    env.assert_clean();
}
