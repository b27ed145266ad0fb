//! A first hot snapshot of a QEMU reads all of guest RAM once before its
//! pause (20 s for a 4 GiB guest under TCG, longer on a busy host). That
//! read must not count against the capture's bounded wait for QEMU's
//! connection.
//!
//! Regression: the capture started waiting (30 s) before the read, so the
//! first hot snapshot of a 4 GiB lab guest on QEMU 10.0, on a machine at a
//! load average of 12-16, failed with "capture: QEMU did not connect
//! within 30s" (bench/qemu_versions.py). The hidden fault
//! `ram-read-delay=SECONDS` makes the read that much longer.

mod common;

use common::{cluster_lock, last_field, Env};
use std::time::Duration;

const SPEC: &str = r#"
[cluster]
name = "srr"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 128
workload = """
memtouch -m 16 &
"""
"#;

#[test]
fn a_first_hot_snapshot_whose_ram_read_outlasts_the_connect_wait_succeeds() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    // Longer than the capture's wait for QEMU's connection (30 s, 5 s
    // with this fault armed: `fault::short_capture_waits`).
    let r = env.json(&[
        "snapshot",
        "a",
        "--mode",
        "hot",
        "--name",
        "s1",
        "--inject-fault",
        "ram-read-delay=8",
        "--json",
    ]);
    assert_eq!(r["name"], "s1", "{r}");
    assert!(r["duration_ms"].as_f64().unwrap() > 8_000.0, "{r}");
    let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap();
    assert!(log.contains("injected fault ram-read-delay"), "{log}");
    let listed = env.ok(&["snapshots"]);
    assert!(listed.contains("s1"), "{listed}");
    // The guest runs on, its memory intact.
    let n = common::memtouch_lines(&env.console("a"));
    let c = env.wait_console("a", "a memtouch report", Duration::from_secs(60), |c| {
        common::memtouch_lines(c) > n
    });
    assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0), "{c}");
    env.ok(&["down"]);
    env.assert_clean();
}
