//! Restores into QEMU 10.0 (issue 30): snapshots taken under the system's
//! QEMU 7.2 (the upgrade path) restore under QEMU 10.0 in every mode, page
//! for page (`--paused`: the destination's RAM equals the image), and
//! the guests run on; a cluster snapshot of 7.2 restores whole under 10.0 with its
//! workloads on the same TCP connections; and what cannot work is refused
//! before anything starts: a snapshot of a newer QEMU into an older one,
//! a snapshot of a QEMU vmcsnap does not know. QEMU 10.0 comes from
//! `scripts/install-qemu.sh` (`common::qemu10()`): a test that cannot have
//! it fails, never skips.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{cluster_lock, last_field, Env};

/// Two lab VMs (microvm) talking.
const SPEC: &str = r#"
[cluster]
name = "up"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
workload = """
memtouch -m 24 -r 1500 -H 4 &
pingpong server 7000 &
"""

[[vm]]
name = "b"
memory_mib = 160
workload = """
memtouch -m 8 &
pingpong client {ip:a} 7000 &
"""
"#;

/// Switches the run directory's future agents to `qemu` (the agent takes
/// `VMCSNAP_QEMU` when it starts; the cluster must be down).
fn use_qemu(env: &mut Env, qemu: &Path) {
    env.extra_env.retain(|(k, _)| k != "VMCSNAP_QEMU");
    env.extra_env
        .push(("VMCSNAP_QEMU".into(), qemu.display().to_string()));
}

/// Page-by-page comparison of `vm`'s RAM file with block "mem" of the
/// snapshot `snap`.
fn assert_ram_equals_image(env: &Env, snap: &str, vm: &str) {
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with(&format!("-{vm}")))
        .unwrap_or_else(|| panic!("{vm}'s RAM file"));
    let img = vmcsnap_agent::frozen_disks::open_image(&env.run_dir().join("snapshots").join(snap))
        .unwrap();
    let id = img.ram_block_id("mem").unwrap();
    let ps = img.page_size();
    let ram = std::fs::read(ram).unwrap();
    let mut want = vec![0u8; img.ram_block_pages(id) as usize * ps];
    img.read_ram_block(id, &mut want).unwrap();
    assert_eq!(ram.len(), want.len(), "{snap}: RAM size");
    let bad: Vec<usize> = (0..want.len() / ps)
        .filter(|p| want[p * ps..(p + 1) * ps] != ram[p * ps..(p + 1) * ps])
        .collect();
    assert!(
        bad.is_empty(),
        "{snap}: {} pages differ from the image, first {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
}

fn vm_state(env: &Env, vm: &str) -> Option<String> {
    env.json(&["status", "--json"])["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == vm)
        .map(|v| v["state"].as_str().unwrap_or("").to_string())
}

/// The QEMU process that runs `vm` is the binary `qemu`.
fn assert_runs_on(env: &Env, vm: &str, qemu: &Path) {
    let st = env.json(&["status", "--json"]);
    let pid = st["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == vm)
        .and_then(|v| v["pid"].as_u64())
        .unwrap_or_else(|| panic!("{vm} has a pid: {st}"));
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert_eq!(
        exe,
        std::fs::canonicalize(qemu).unwrap(),
        "{vm} runs on {}",
        exe.display()
    );
}

/// Memtouch of `vm` prints two more lines with no error after byte `from`.
fn assert_memtouch_clean(env: &Env, vm: &str, from: usize, what: &str) {
    let c = env.wait_console(vm, what, Duration::from_secs(120), |c| {
        common::memtouch_lines(c.get(from..).unwrap_or("")) >= 2
    });
    let after = c.get(from..).unwrap_or("");
    assert!(!after.contains("MEMTOUCH-CORRUPTION"), "{what}:\n{after}");
    assert!(
        after
            .lines()
            .filter(|l| l.starts_with("memtouch: t="))
            .all(|l| common::field(l, "errors") == Some(0)),
        "{what}: memtouch counted errors:\n{after}"
    );
}

#[test]
fn snapshots_of_7_2_restore_under_10_0_in_every_mode_page_exact() {
    let _l = cluster_lock();
    let q10 = common::qemu10();
    let mut env = Env::new();
    let spec = env.write_spec(SPEC);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.wait_console("a", "memtouch", Duration::from_secs(90), |c| {
        common::memtouch_lines(c) >= 2
    });
    env.wait_console("b", "pingpong", Duration::from_secs(90), |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) > 0
    });
    for vm in ["a", "b"] {
        let name = format!("{vm}7");
        env.json(&["snapshot", vm, "--mode", "hot", "--name", &name, "--json"]);
        let m = env.json(&["inspect", &name, "--json"]);
        assert!(
            m["manifest"]["qemu"]["version"]
                .as_str()
                .unwrap()
                .starts_with("7.2."),
            "taken under the system QEMU 7.2: {m}"
        );
    }
    env.ok(&["down"]);
    use_qemu(&mut env, &q10);

    // Every mode, paused once loaded: the RAM is the image's.
    for mode in ["eager", "lazy", "workingset", "sampling-ws"] {
        let r = env.json(&[
            "restore", "--wait", "a7", "--mode", mode, "--paused", "--json",
        ]);
        assert_eq!(r["paused"], true, "{r}");
        assert_eq!(vm_state(&env, "a").as_deref(), Some("paused"), "{mode}");
        assert_runs_on(&env, "a", &q10);
        assert_ram_equals_image(&env, "a7", "a");
        eprintln!(
            "7.2 snapshot, {mode} under 10.0: latency {:.1} ms, {} pages first, {} demand faults",
            r["restore_latency_ms"].as_f64().unwrap(),
            r["ws_pages"],
            r["demand_faults"]
        );
        env.ok(&["stop", "a"]);
    }
    // Running: both guests go on where they were, and talk again.
    let mut from = std::collections::HashMap::new();
    for (vm, mode) in [("a", "lazy"), ("b", "workingset")] {
        let r = env.json(&[
            "restore",
            "--wait",
            &format!("{vm}7"),
            "--mode",
            mode,
            "--json",
        ]);
        from.insert(vm, env.console(vm).len());
        // The fault path's threads are found under 10.0's names where the
        // agent may raise priorities (root).
        if mode == "lazy" && !r["qemu_threads_raised"].is_null() {
            assert_eq!(r["qemu_threads_raised"], 2, "{r}");
        }
        assert_runs_on(&env, vm, &q10);
    }
    assert_memtouch_clean(&env, "a", from["a"], "a restored under 10.0");
    assert_memtouch_clean(&env, "b", from["b"], "b restored under 10.0");
    let total0 = last_field(&env.console("b")[..from["b"]], "pingpong:", "total").unwrap_or(0);
    env.wait_console(
        "b",
        "pingpong replies under 10.0",
        Duration::from_secs(120),
        |c| {
            last_field(c.get(from["b"]..).unwrap_or(""), "pingpong:", "total").unwrap_or(0) > total0
        },
    );
    env.ok(&["down"]);
    env.assert_clean();
}

/// Rewrites the manifest of snapshot `snap` to say it was taken under QEMU
/// `version` (a valid manifest: the CRC is recomputed).
fn set_manifest_version(env: &Env, snap: &str, version: &str) {
    set_version_in(
        &env.run_dir().join("snapshots").join(snap).join("manifest"),
        version,
    );
}

fn set_version_in(path: &Path, version: &str) {
    let (v, mut m) = vmcsnap_image::Manifest::load(path).unwrap();
    m.qemu.version = version.into();
    std::fs::write(path, m.encode_as(v)).unwrap();
}

#[test]
fn a_snapshot_of_a_newer_or_unknown_qemu_is_refused_before_anything_starts() {
    let _l = cluster_lock();
    let q10 = common::qemu10();
    let mut env = Env::new();
    let spec = env.write_spec(
        r#"
[cluster]
name = "dg"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 128
workload = "memtouch -m 8 &"
"#,
    );
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.json(&["snapshot", "a", "--name", "s", "--json"]);
    env.ok(&["stop", "a"]);
    let v = env.json(&["inspect", "s", "--verify", "--json"]);
    let into: Vec<&str> = v["restores_into"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect();
    assert_eq!(into, ["7.2", "10.0"], "{v}");

    // As if taken under 10.0.2, restored by the system 7.2.
    set_manifest_version(&env, "s", "10.0.2");
    let v = env.json(&["inspect", "s", "--verify", "--json"]);
    assert_eq!(v["restores_into"], serde_json::json!(["10.0"]), "{v}");
    let text = env.ok(&["inspect", "s", "--verify"]);
    assert!(
        text.contains("restores into QEMU 10.0 only"),
        "inspect says where it restores: {text}"
    );
    let before = qemus(&env);
    let out = env.vmcsnap(&["restore", "--wait", "s", "--mode", "lazy"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a downgrade restored: {err}");
    assert!(
        err.contains("taken under QEMU 10.0.2")
            && err.contains("cannot be restored into QEMU 7.2.")
            && err.contains("install-qemu.sh 10.0"),
        "one clear error naming both versions: {err}"
    );
    assert_nothing_started(&env, &before);
    // Under 10.0 the same image is accepted (it is a 7.2 image really).
    env.ok(&["down"]);
    use_qemu(&mut env, &q10);
    env.json(&[
        "restore", "--wait", "s", "--mode", "lazy", "--paused", "--json",
    ]);
    assert_runs_on(&env, "a", &q10);
    env.ok(&["stop", "a"]);

    // A QEMU vmcsnap does not know.
    set_manifest_version(&env, "s", "9.1.0");
    let v = env.json(&["inspect", "s", "--verify", "--json"]);
    assert_eq!(v["restores_into"], serde_json::json!([]), "{v}");
    let before = qemus(&env);
    let out = env.vmcsnap(&["restore", "--wait", "s"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("taken under QEMU \"9.1.0\", a version vmcsnap does not know"),
        "{err}"
    );
    assert_nothing_started(&env, &before);
    env.ok(&["down"]);
    env.assert_clean();
}

/// The QEMUs of this run directory.
fn qemus(env: &Env) -> Vec<u32> {
    env.processes()
        .into_iter()
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/exe"))
                .is_ok_and(|e| e.to_string_lossy().contains("qemu-system"))
        })
        .collect()
}

/// The refused restore started no QEMU, left no VM and no RAM file.
fn assert_nothing_started(env: &Env, before: &[u32]) {
    let after = qemus(env);
    assert!(
        after.iter().all(|p| before.contains(p)),
        "new QEMUs {after:?} (before {before:?})"
    );
    assert_eq!(vm_state(env, "a"), None, "no VM a is listed");
    assert!(
        env.shm_files().is_empty(),
        "no RAM file: {:?}",
        env.shm_files()
    );
}

/// q35 (`pc-q35-7.2` on both versions), a Debian image VM booted by its
/// firmware: a 7.2 snapshot restores under 10.0 page for page, and runs.
#[test]
fn a_q35_snapshot_of_7_2_restores_under_10_0_page_exact() {
    let _l = cluster_lock();
    let q10 = common::qemu10();
    let mut env = Env::new();
    env.ok(&["image", "build", "base"]);
    let spec = env.write_spec(
        r#"
[cluster]
name = "qu"
boot_timeout_s = 900

[[vm]]
name = "q"
image_recipe = "base"
memory_mib = 256
"#,
    );
    env.ok(&["up", spec.to_str().unwrap()]);
    env.json(&["snapshot", "q", "--mode", "hot", "--name", "q7", "--json"]);
    let m = env.json(&["inspect", "q7", "--json"]);
    assert_eq!(m["manifest"]["qemu"]["machine"], "pc-q35-7.2", "{m}");
    env.ok(&["down"]);
    use_qemu(&mut env, &q10);
    env.json(&[
        "restore", "--wait", "q7", "--mode", "lazy", "--paused", "--json",
    ]);
    assert_runs_on(&env, "q", &q10);
    assert_ram_equals_image(&env, "q7", "q");
    env.ok(&["stop", "q"]);
    env.json(&["restore", "--wait", "q7", "--mode", "eager", "--json"]);
    assert_runs_on(&env, "q", &q10);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(vm_state(&env, "q").as_deref(), Some("running"));
    env.ok(&["down"]);
    env.assert_clean();
}

/// A cluster snapshot taken under 7.2 restores whole under 10.0
/// (HotRestore's restore line), and the workloads go on on the same TCP
/// connections: the frames in flight at the cut are replayed.
#[test]
fn a_cluster_snapshot_of_7_2_restores_under_10_0_on_the_same_connections() {
    let _l = cluster_lock();
    let q10 = common::qemu10();
    let mut env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    env.wait_console("b", "pingpong", Duration::from_secs(90), |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) >= 100
    });
    let snap = env.json(&["snapshot", "--cluster", "--name", "cut", "--json"]);
    assert_eq!(snap["switch"]["dropped"], 0, "{snap}");
    // `inspect --verify` says where each VM's image restores.
    let v = env.json(&["inspect", "cut", "--cluster", "--verify", "--json"]);
    let vms = v["verify"]["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 2, "{v}");
    for vm in vms {
        assert_eq!(
            vm["restores_into"],
            serde_json::json!(["7.2", "10.0"]),
            "{v}"
        );
    }
    // The connection b's client had at the cut (it counts connections).
    let conn_at_cut = last_field(&env.console("b"), "pingpong:", "conn");
    env.ok(&["down"]);
    // One VM of it as if taken under 10.0: the system 7.2 refuses the
    // whole cluster restore before any VM starts.
    let man = env.run_dir().join("snapshots/cut/vms/b/manifest");
    let good = std::fs::read(&man).unwrap();
    set_version_in(&man, "10.0.2");
    let out = env.vmcsnap(&["restore", "--wait", "--cluster", "cut"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a downgrade restored: {err}");
    assert!(
        err.contains("taken under QEMU 10.0.2")
            && err.contains("cannot be restored into QEMU 7.2."),
        "{err}"
    );
    assert!(qemus(&env).is_empty(), "no QEMU started");
    assert!(env.shm_files().is_empty(), "{:?}", env.shm_files());
    std::fs::write(&man, good).unwrap();
    // Under 10.0 it restores.
    use_qemu(&mut env, &q10);
    let r = env.json(&[
        "restore",
        "--wait",
        "--cluster",
        "cut",
        "--mode",
        "hotrestore-rl",
        "--json",
    ]);
    assert_eq!(r["vms"].as_array().map(Vec::len), Some(2), "{r}");
    let replayed: u64 = r["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["frames_replayed"].as_u64().unwrap())
        .sum();
    assert_eq!(
        replayed,
        snap["channel_state_frames"].as_u64().unwrap(),
        "every logged frame replayed: {r}"
    );
    for vm in ["a", "b"] {
        assert_runs_on(&env, vm, &q10);
    }
    let from_a = env.console("a").len();
    let total0 = last_field(&env.console("b"), "pingpong:", "total").unwrap_or(0);
    let c = env.wait_console(
        "b",
        "pingpong after the restore under 10.0",
        Duration::from_secs(120),
        |c| last_field(c, "pingpong:", "total").unwrap_or(0) > total0 + 100,
    );
    assert_eq!(
        last_field(&c, "pingpong:", "conn"),
        conn_at_cut,
        "b's pingpong connection survived the restore under 10.0:\n{}",
        common::tail(&c, 3000)
    );
    assert_memtouch_clean(&env, "a", from_a, "a after the cluster restore");
    env.ok(&["down"]);
    env.assert_clean();
}

/// A snapshot taken under 10.0 restores under 10.0 in every mode, page for
/// page, and its guest runs on; the system's 7.2 refuses it before
/// anything starts.
#[test]
fn snapshots_of_10_0_restore_under_10_0_in_every_mode_and_never_into_7_2() {
    let _l = cluster_lock();
    let q10 = common::qemu10();
    let mut env = Env::with_qemu(&q10);
    let spec = env.write_spec(SPEC);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.wait_console("a", "memtouch", Duration::from_secs(90), |c| {
        common::memtouch_lines(c) >= 2
    });
    for (mode, name) in [("hot", "h10"), ("stop-copy", "sc10")] {
        env.json(&["snapshot", "a", "--mode", mode, "--name", name, "--json"]);
    }
    let m = env.json(&["inspect", "h10", "--json"]);
    assert!(
        m["manifest"]["qemu"]["version"]
            .as_str()
            .unwrap()
            .starts_with("10.0."),
        "taken under 10.0: {m}"
    );
    assert_eq!(m["restores_into"], serde_json::json!(["10.0"]), "{m}");
    for (mode, snap) in [
        ("eager", "h10"),
        ("lazy", "sc10"),
        ("workingset", "h10"),
        ("sampling-ws", "sc10"),
    ] {
        env.ok(&["stop", "a"]);
        env.json(&[
            "restore", "--wait", snap, "--mode", mode, "--paused", "--json",
        ]);
        assert_eq!(vm_state(&env, "a").as_deref(), Some("paused"), "{mode}");
        assert_runs_on(&env, "a", &q10);
        assert_ram_equals_image(&env, snap, "a");
    }
    env.ok(&["stop", "a"]);
    env.json(&["restore", "--wait", "h10", "--mode", "lazy", "--json"]);
    let from = env.console("a").len();
    assert_memtouch_clean(&env, "a", from, "a restored from a 10.0 snapshot");
    env.ok(&["down"]);

    // The system QEMU 7.2 refuses the real 10.0 snapshot.
    env.extra_env.retain(|(k, _)| k != "VMCSNAP_QEMU");
    let out = env.vmcsnap(&["restore", "--wait", "h10"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a downgrade restored: {err}");
    assert!(
        err.contains("taken under QEMU 10.0.") && err.contains("cannot be restored into QEMU 7.2."),
        "{err}"
    );
    assert!(qemus(&env).is_empty(), "no QEMU started");
    assert!(env.shm_files().is_empty(), "{:?}", env.shm_files());
    env.assert_clean();
}

/// `--preempt` (QEMU 10.0's postcopy-preempt channel): a restore is page
/// for page the image (`--paused`), a running guest's pages requested on
/// faults all travel on the preempt channel and its workload goes on, and
/// the restored VM (whose QEMU has the capability on) can be snapshotted
/// again.
#[test]
fn preempt_restores_are_page_exact_and_faulted_pages_take_the_preempt_channel() {
    let _l = cluster_lock();
    let q10 = common::qemu10();
    let env = Env::with_qemu(&q10);
    let spec = env.write_spec(
        r#"
[cluster]
name = "pre"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
workload = "memtouch -m 24 -r 1500 -H 4 &"
"#,
    );
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    env.wait_console("a", "memtouch", Duration::from_secs(90), |c| {
        common::memtouch_lines(c) >= 2
    });
    env.json(&["snapshot", "a", "--mode", "hot", "--name", "p", "--json"]);
    for mode in ["lazy", "workingset"] {
        env.ok(&["stop", "a"]);
        let r = env.json(&[
            "restore",
            "--wait",
            "p",
            "--mode",
            mode,
            "--paused",
            "--preempt",
            "--json",
        ]);
        assert_eq!(vm_state(&env, "a").as_deref(), Some("paused"), "{mode}");
        assert_ram_equals_image(&env, "p", "a");
        assert_eq!(r["pages_on_preempt"], r["demand_faults"], "{mode}: {r}");
    }
    env.ok(&["stop", "a"]);
    let r = env.json(&[
        "restore",
        "--wait",
        "p",
        "--mode",
        "lazy",
        "--preempt",
        "--json",
    ]);
    let faults = r["demand_faults"].as_u64().unwrap();
    assert!(faults > 0, "a lazily restored guest faults: {r}");
    // Every demand fault was served on the preempt channel.
    assert_eq!(r["pages_on_preempt"].as_u64(), Some(faults), "{r}");
    assert!(r["demand_served_ms"]["p50"].as_f64().is_some(), "{r}");
    let from = env.console("a").len();
    assert_memtouch_clean(&env, "a", from, "a restored with --preempt");
    // Its QEMU has postcopy-preempt on: the snapshot turns it off with
    // postcopy-ram (QEMU refuses one without the other).
    env.json(&["snapshot", "a", "--mode", "hot", "--name", "p2", "--json"]);
    env.ok(&["down"]);
    env.assert_clean();
}
