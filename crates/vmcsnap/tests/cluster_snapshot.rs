//! Consistent hot snapshots of a whole cluster (HotSnap): real QEMU, real
//! guests, real TCP through the switch's packet mediator.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{cluster_lock, last_field, Env};

/// Two pingpong pairs and a KV client/server pair across four VMs, every VM
/// running memtouch.
const SPEC: &str = r#"
[cluster]
name = "cs"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 160
workload = """
memtouch -m 16 &
pingpong server 7000 &
kvserver 7001 &
"""

[[vm]]
name = "b"
memory_mib = 160
workload = """
memtouch -m 16 &
pingpong client {ip:a} 7000 &
kvload {ip:a} 7001 &
"""

[[vm]]
name = "c"
memory_mib = 160
workload = """
memtouch -m 16 &
pingpong server 7000 &
"""

[[vm]]
name = "d"
memory_mib = 160
workload = """
memtouch -m 16 &
pingpong client {ip:c} 7000 &
"""
"#;

const VMS: [&str; 4] = ["a", "b", "c", "d"];

fn boot(env: &Env) {
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let limit = Duration::from_secs(120);
    for (vm, what) in [("b", "pingpong:"), ("d", "pingpong:"), ("b", "kvload:")] {
        env.wait_console(vm, what, limit, |c| {
            last_field(c, what, "total").unwrap_or(0) >= 100
        });
    }
    // The snapshot reads each guest's TCP counters from its last status line.
    for vm in VMS {
        env.wait_console(vm, "a status line", limit, |c| c.contains("vmcsnap-stat "));
    }
}

fn assert_workloads_clean(env: &Env) {
    for vm in VMS {
        let c = env.console(vm);
        assert!(
            !c.contains("MEMTOUCH-CORRUPTION"),
            "{vm}: memtouch corruption:\n{}",
            common::tail(&c, 3000)
        );
        assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0), "{vm}");
    }
    let b = env.console("b");
    assert_eq!(
        last_field(&b, "kvload:", "errors"),
        Some(0),
        "KV verification failed:\n{}",
        common::tail(&b, 3000)
    );
    assert!(!b.contains("KVLOAD-MISMATCH"));
}

#[test]
fn hot_cluster_snapshot_is_consistent_and_keeps_every_frame() {
    let _l = cluster_lock();
    let env = Env::new();
    boot(&env);
    let mut retrans_grew = Vec::new();
    for round in 0..3 {
        let name = format!("cut{round}");
        let r = env.json(&["snapshot", "--cluster", "--name", &name, "--json"]);
        let sw = &r["switch"];
        // The switch's accounting: nothing dropped, no post-snapshot frame
        // delivered to a pre-snapshot VM, every logged frame in the file.
        assert_eq!(sw["dropped"], 0, "round {round}: frames dropped: {sw}");
        assert_eq!(sw["violations"], 0, "round {round}: {sw}");
        assert_eq!(sw["log_overflow"], 0, "round {round}: {sw}");
        assert_eq!(sw["unlogged_at_end"], 0, "round {round}: {sw}");
        assert_eq!(
            r["channel_state_frames"], sw["logged"],
            "round {round}: every logged frame is in the snapshot"
        );
        let w: u64 = r["edges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["frames"].as_u64().unwrap())
            .sum();
        assert_eq!(
            w,
            r["channel_state_frames"].as_u64().unwrap(),
            "W(i,j) sums to the logged frames"
        );
        assert!(
            sw["forwarded"].as_u64().unwrap() > 0,
            "traffic flowed during the snapshot: {sw}"
        );
        // The pairs that talk are the ones the spec makes talk.
        let pairs: Vec<(String, String)> = r["backoff"]["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["a"].as_str().unwrap().to_string(),
                    p["b"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        for want in [("a", "b"), ("c", "d")] {
            assert!(
                pairs.contains(&(want.0.to_string(), want.1.to_string())),
                "round {round}: pair {want:?} missing from {pairs:?}"
            );
        }
        let vms = r["vms"].as_array().unwrap();
        assert_eq!(vms.len(), 4);
        // Every VM's cut was prepared (cut probes read) before any VM
        // stopped: the pauses start together. Regression: each VM stopped
        // as soon as its own cut was prepared, 22-41 ms apart at 4-8 VMs.
        let first_stop = vms
            .iter()
            .map(|v| v["pause_start_ms"].as_f64().unwrap())
            .fold(f64::INFINITY, f64::min);
        for v in vms {
            assert_eq!(v["stop_barrier_complete"], true, "round {round}: {v}");
            let prepared = v["cut_prepared_ms"].as_f64().expect("cut_prepared_ms");
            assert!(
                prepared <= first_stop,
                "round {round}: {} prepared its cut at {prepared} ms, after the first stop at {first_stop} ms: {v}",
                v["vm"]
            );
            // QEMU had all of guest RAM mapped before the pause (so its
            // read of every page inside the pause costs no fault), in
            // every round: read once by the first, still mapped after.
            let ram = &v["ram"];
            let (pages, mapped) = (
                ram["ram_pages"].as_u64().expect("ram residency"),
                ram["resident_at_pause"].as_u64().unwrap(),
            );
            assert!(
                pages > 0 && mapped + 256 >= pages,
                "round {round}: {} had {mapped} of {pages} pages mapped: {v}",
                v["vm"]
            );
            if round > 0 {
                // Read by the first round already, and nothing since
                // unmapped it: no second read.
                assert_eq!(ram["read"], false, "round {round}: {v}");
            }
        }
        for v in vms {
            let t = |k: &str| v[k].as_f64().unwrap();
            assert!(
                t("start_ms") <= t("pause_start_ms") && t("pause_start_ms") <= t("pause_end_ms"),
                "{v}"
            );
            assert!(
                t("pause_end_ms") <= t("transient_done_ms")
                    && t("transient_done_ms") <= t("complete_ms"),
                "{v}"
            );
            // Each VM's pause broken into its parts: the cut in `agent`,
            // and they add up to the pause.
            let parts = v["pause"]["parts"].as_array().expect("a breakdown");
            let sum: u64 = parts.iter().map(|p| p["us"].as_u64().unwrap()).sum();
            assert!(
                (sum as f64 - t("downtime_ms") * 1000.0).abs() <= 1000.0,
                "{v}"
            );
            let names: Vec<&str> = parts.iter().map(|p| p["name"].as_str().unwrap()).collect();
            assert_eq!(
                names,
                [
                    "stop",
                    "agent",
                    "disk_snapshot",
                    "migrate_command",
                    "qemu_setup",
                    "device_state"
                ],
                "{v}"
            );
            if let (Some(b), Some(a)) = (v["retrans_before"].as_u64(), v["retrans_after"].as_u64())
            {
                retrans_grew.push((
                    round,
                    v["vm"].as_str().unwrap().to_string(),
                    a.saturating_sub(b),
                ));
            }
        }
        // Committed, listed, and every image and the channel state verify.
        let inspect = env.vmcsnap(&["inspect", &name, "--verify"]);
        assert!(
            inspect.status.success(),
            "inspect --verify {name}: {}",
            String::from_utf8_lossy(&inspect.stderr)
        );
        let list = env.json(&["snapshots", "--json"]);
        let listed = list["cluster_snapshots"].as_array().unwrap();
        assert!(
            listed
                .iter()
                .any(|s| s["name"] == name.as_str() && s["valid"] == true),
            "{list}"
        );
    }
    eprintln!("RetransSegs growth per (round, VM): {retrans_grew:?}");
    if retrans_grew.len() != 12 {
        let silent: Vec<String> = (0..3)
            .flat_map(|round| VMS.iter().map(move |vm| (round, *vm)))
            .filter(|(round, vm)| !retrans_grew.iter().any(|r| r.0 == *round && r.1 == *vm))
            .map(|(round, vm)| {
                format!(
                    "round {round}: {vm}, its console ends:\n{}",
                    common::tail(&env.console(vm), 3000)
                )
            })
            .collect();
        panic!(
            "every guest reports its RetransSegs in every round; missing:\n{}",
            silent.join("\n")
        );
    }
    // The issue's bar is 9 of 10 snapshots without a retransmission; with
    // three here, allow one round with a retransmission (TCG on two shared
    // cores can starve a guest past its RTO without any snapshot).
    let bad_rounds: std::collections::BTreeSet<usize> = retrans_grew
        .iter()
        .filter(|r| r.2 > 0)
        .map(|r| r.0)
        .collect();
    assert!(
        bad_rounds.len() <= 1,
        "TCP retransmissions in rounds {bad_rounds:?}: {retrans_grew:?}"
    );
    // Wait for a few more seconds of work after the last cut.
    std::thread::sleep(Duration::from_secs(3));
    assert_workloads_clean(&env);
    let d = env.console("d");
    assert!(
        last_field(&d, "pingpong:", "conn") == Some(1),
        "pingpong kept its connection:\n{}",
        common::tail(&d, 2000)
    );
    env.ok(&["down"]);
    env.assert_clean();
}

#[test]
fn killing_a_vm_mid_snapshot_fails_cleanly_and_the_rest_runs_on() {
    let _l = cluster_lock();
    let env = Env::new();
    boot(&env);
    let status = env.json(&["status", "--json"]);
    let victim_pid = status["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "b")
        .unwrap()["pid"]
        .as_u64()
        .unwrap();

    let mut child = Command::new(env!("CARGO_BIN_EXE_vmcsnap"))
        .arg("--run-dir")
        .arg(env.run_dir())
        .args(["snapshot", "--cluster", "--name", "doomed"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut killed = false;
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap();
        seen.push(line.clone());
        // b is past its pause: its pages are streaming when it dies.
        if !killed && line.contains("b: transient snapshot done") {
            let st = Command::new("kill")
                .args(["-9", &victim_pid.to_string()])
                .status()
                .unwrap();
            assert!(st.success());
            killed = true;
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        killed,
        "never saw b's transient snapshot finish:\n{}",
        seen.join("\n")
    );
    assert!(
        !out.status.success(),
        "the cluster snapshot must fail:\n{}",
        seen.join("\n")
    );
    let err = seen.join("\n");
    assert!(err.contains("cluster snapshot failed"), "{err}");

    // No partial cluster snapshot is listed or left behind.
    let list = env.json(&["snapshots", "--json"]);
    assert!(
        list["cluster_snapshots"].as_array().unwrap().is_empty(),
        "{list}"
    );
    assert!(list["snapshots"].as_array().unwrap().is_empty(), "{list}");
    let root = env.run_dir().join("snapshots");
    let leftovers: Vec<String> = std::fs::read_dir(&root)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        leftovers.iter().all(|n| n == ".disks"),
        "left in snapshots/: {leftovers:?}"
    );
    assert!(
        !root.join(".disks").join("doomed").exists(),
        "frozen disks of the failed snapshot removed"
    );

    // The others keep running, with their network: c-d pingpong goes on.
    let status = env.json(&["status", "--json"]);
    for v in status["vms"].as_array().unwrap() {
        let want = if v["name"] == "b" {
            "exited"
        } else {
            "running"
        };
        assert_eq!(v["state"], want, "{v}");
    }
    let before = last_field(&env.console("d"), "pingpong:", "total").unwrap();
    env.wait_console(
        "d",
        "pingpong after the failed snapshot",
        Duration::from_secs(30),
        |c| last_field(c, "pingpong:", "total").unwrap_or(0) > before + 100,
    );
    // Regression: an abandoned background snapshot must not leave guest RAM
    // write-protected (QEMU 7.2 unprotects only on completion): every
    // surviving guest keeps running, not only the pingpong pair.
    for vm in ["a", "c"] {
        let n = env
            .console(vm)
            .lines()
            .filter(|l| l.starts_with("memtouch:"))
            .count();
        env.wait_console(vm, "memtouch still running", Duration::from_secs(30), |c| {
            c.lines().filter(|l| l.starts_with("memtouch:")).count() >= n + 3
        });
    }
    let sw = env.json(&["status", "--json"])["switch"].clone();
    assert!(
        sw["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["holding"] == false),
        "no port left held: {sw}"
    );
    for vm in ["a", "c", "d"] {
        let c = env.console(vm);
        assert!(!c.contains("MEMTOUCH-CORRUPTION"), "{vm}");
    }
    env.ok(&["down"]);
}
