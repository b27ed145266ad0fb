//! Every snapshot mode on QEMU 10.0 (installed by `scripts/install-qemu.sh
//! 10.0`, found by `common::qemu10()`; the test fails if it cannot be had):
//! hot, stop-copy and pre-copy snapshots of a real VM under a high memory
//! write rate hold exactly the memory of the pause (compared page by page
//! with a copy of the RAM file taken while the VM was paused), the pre-copy
//! RAM check holds (an injected write QEMU's tracking missed is in the
//! image), the manifest records the running QEMU's version, `pause-limit`
//! measures, a cluster snapshot keeps the TCP sessions, and the guests never
//! see a bad page. One cluster for the whole file: tests are slow under TCG.
//!
//! Regression for issue 30: on 10.0 a hot snapshot failed ("QEMU did not
//! resume the guest within 30s": QEMU 10.0 leaves a guest paused as it
//! found it) and stop-copy / pre-copy failed on "unknown command 11"
//! (SWITCHOVER_START).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{cluster_lock, compare_with_reference, last_field, qemu10, Env};

const SPEC: &str = r#"
[cluster]
name = "q10"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 224
workload = """
memtouch -m 32 -r 0 &
pingpong server 7000 &
"""

[[vm]]
name = "b"
memory_mib = 160
workload = """
memtouch -m 16 &
pingpong client {ip:a} 7000 &
"""
"#;

fn writes(env: &Env, vm: &str) -> u64 {
    last_field(&env.console(vm), "memtouch:", "writes").unwrap_or(0)
}

fn pingpong_rounds(env: &Env) -> u64 {
    last_field(&env.console("b"), "pingpong:", "total").unwrap_or(0)
}

/// Waits until `vm`'s memtouch has written more than `after`.
fn wait_writes(env: &Env, vm: &str, after: u64, what: &str) {
    env.wait_console(vm, what, Duration::from_secs(120), |c| {
        last_field(c, "memtouch:", "writes").unwrap_or(0) > after
    });
}

#[test]
fn every_snapshot_mode_on_qemu_10_0_is_page_exact() {
    let _l = cluster_lock();
    let qemu = qemu10();
    let env = Env::with_qemu(&qemu);
    let spec = env.write_spec(SPEC);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    wait_writes(&env, "a", 0, "memtouch on a");
    env.wait_console("b", "pingpong", Duration::from_secs(120), |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) > 0
    });

    for (mode, name) in [
        ("hot", "q-hot"),
        ("stop-copy", "q-stop-copy"),
        ("precopy", "q-precopy"),
        // A write QEMU's dirty tracking missed, made in the pause: the
        // pre-copy RAM check must put it in the image on 10.0 as on 7.2.
        ("precopy", "q-precopy-untracked"),
        // The second hot snapshot of the same QEMU (RAM already read once).
        ("hot", "q-hot2"),
    ] {
        let reference: PathBuf = env.run_dir().join(format!("ref-{name}.bin"));
        let before = writes(&env, "a");
        let mut args = vec![
            "snapshot",
            "a",
            "--mode",
            mode,
            "--name",
            name,
            "--reference",
            reference.to_str().unwrap(),
            "--json",
        ];
        let untracked = name.ends_with("untracked");
        if untracked {
            args.extend(["--inject-fault", "precopy-untracked-write=0"]);
        }
        let r = env.json(&args);
        assert_eq!(r["mode"], mode);
        let dir = PathBuf::from(r["path"].as_str().unwrap());
        let inspect = env.json(&["inspect", name, "--verify", "--json"]);
        assert_eq!(inspect["verify"]["ok"], true, "{inspect}");
        assert_eq!(inspect["stats"]["pages_absent"], 0);
        let version = inspect["manifest"]["qemu"]["version"].as_str().unwrap();
        assert!(
            version.starts_with("10.0."),
            "the manifest records QEMU {version}, not the running 10.0"
        );
        assert_eq!(
            inspect["manifest"]["device_state_format"],
            "qemu-10.0-device-sections"
        );
        compare_with_reference(&dir, &reference);
        let _ = std::fs::remove_file(&reference);
        if mode == "hot" {
            assert!(r["pages_guest_written"].as_u64().unwrap() > 0, "{r}");
            let parts: Vec<&str> = r["pause"]["parts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["name"].as_str().unwrap())
                .collect();
            assert_eq!(parts.last(), Some(&"device_state"), "{r}");
        }
        if mode == "precopy" {
            let m = &inspect["manifest"]["metrics"];
            let patched = m["precopy_pages_patched"].as_u64().unwrap();
            assert!(!untracked || patched >= 1, "{m}");
        }
        eprintln!(
            "QEMU 10.0 {name}: downtime {:.1} ms, pause {}",
            r["downtime_ms"].as_f64().unwrap(),
            r["pause"]
        );
        wait_writes(&env, "a", before, "memtouch to continue");
        assert_eq!(
            env.json(&["status", "--json"])["vms"][0]["state"],
            "running"
        );
    }

    // QEMU's own background snapshot, nothing kept, the guest runs on.
    let before = writes(&env, "a");
    let limit = env.json(&["pause-limit", "a", "--json"]);
    assert!(limit["downtime_ms"].as_f64().unwrap() > 0.0, "{limit}");
    // At once a hot snapshot: 10.0 says a background snapshot `completed`
    // before it has removed its write protection, and refuses another one
    // until then ("not compatible with guest memory configuration", seen
    // by bench/qemu_versions.py at 4 GiB); vmcsnap waits for it.
    let r = env.json(&[
        "snapshot",
        "a",
        "--mode",
        "hot",
        "--name",
        "q-after-limit",
        "--json",
    ]);
    assert_eq!(r["name"], "q-after-limit", "{r}");
    wait_writes(&env, "a", before, "memtouch after pause-limit");

    // A consistent hot snapshot of the whole cluster; the TCP session of
    // the pingpong pair goes on through it.
    let rounds = pingpong_rounds(&env);
    let r = env.json(&["snapshot", "--cluster", "--name", "q-cluster", "--json"]);
    let sw = &r["switch"];
    assert_eq!(sw["dropped"], 0, "{sw}");
    assert_eq!(sw["violations"], 0, "{sw}");
    let inspect = env.json(&["inspect", "q-cluster", "--cluster", "--verify", "--json"]);
    assert!(
        !inspect.to_string().contains("\"ok\":false"),
        "cluster snapshot does not verify: {inspect}"
    );
    env.wait_console(
        "b",
        "pingpong after the cluster snapshot",
        Duration::from_secs(120),
        |c| last_field(c, "pingpong:", "total").unwrap_or(0) > rounds,
    );
    // Still the first connection: the session survived the cut.
    assert_eq!(last_field(&env.console("b"), "pingpong:", "conn"), Some(1));

    // The guests never saw a bad page.
    for vm in ["a", "b"] {
        let text = env.console(vm);
        assert!(
            !text.contains("MEMTOUCH-CORRUPTION"),
            "{vm}: corruption reported:\n{}",
            common::tail(&text, 3000)
        );
        assert!(
            text.lines()
                .filter(|l| l.starts_with("memtouch: t="))
                .all(|l| common::field(l, "errors") == Some(0)),
            "{vm}: memtouch saw errors"
        );
    }
    env.ok(&["down"]);
    env.assert_clean();
}
