//! Rejuvenation on QEMU 10.0, and between 7.2 and 10.0 (issue 30): warm,
//! saved and cold restarts of VMs running on 10.0 keep (or, cold, lose) the
//! guest as on 7.2; `rejuvenate --qemu` upgrades a running VM's QEMU 7.2 to
//! 10.0 with its memory and TCP connection kept; the way back, which the
//! lab guest's microvm cannot make, is refused before the VM is touched; a
//! new QEMU that fails falls back to the kept copy of the old one, whether
//! that runs from the system or from an `install-qemu.sh` prefix. A q35
//! VM (`pc-q35-7.2`, Debian image) is upgraded warm from 7.2 to 10.0 and,
//! having a versioned machine type, back again, its data and connection
//! kept.

mod common;
mod redis_story;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{cluster_lock, last_field, qemu10, uptime, Env};

const SPEC: &str = r#"
[cluster]
name = "rjv"
accel = "auto"

[[vm]]
name = "srv"
memory_mib = 192
workload = """
memtouch -m 24 &
pingpong server 7000 &
"""

[[vm]]
name = "cli"
memory_mib = 192
workload = """
memtouch -m 24 &
pingpong client {ip:srv} 7000 &
"""
"#;

/// The system's QEMU 7.2.
fn qemu7() -> PathBuf {
    let out = std::process::Command::new("sh")
        .args(["-c", "command -v qemu-system-x86_64"])
        .output()
        .unwrap();
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn pingpong_total(env: &Env) -> u64 {
    last_field(&env.console("cli"), "pingpong:", "total").unwrap_or(0)
}

/// Waits until the client got `more` further replies than `from`.
fn wait_pingpong(env: &Env, from: u64, more: u64) -> String {
    env.wait_console("cli", "pingpong replies", Duration::from_secs(120), |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) >= from + more
    })
}

/// The client's TCP connection number goes on past a restart: `more`
/// replies later it is still `conn`.
fn assert_same_connection(env: &Env, conn: u64, what: &str) {
    let after = wait_pingpong(env, pingpong_total(env), 20);
    assert_eq!(
        last_field(&after, "pingpong:", "conn"),
        Some(conn),
        "{what}: the TCP connection was re-established:\n{}",
        common::tail(&after, 3000)
    );
}

/// memtouch's next report after now says 0 errors.
fn assert_memtouch_clean(env: &Env, vm: &str) {
    let n = common::memtouch_lines(&env.console(vm));
    let c = env.wait_console(vm, "a new memtouch report", Duration::from_secs(60), |c| {
        common::memtouch_lines(c) > n && last_field(c, "memtouch:", "errors").is_some()
    });
    assert!(!c.contains("MEMTOUCH-CORRUPTION"), "{vm}: corruption:\n{c}");
    assert_eq!(
        last_field(&c, "memtouch:", "errors"),
        Some(0),
        "{vm}:\n{}",
        common::tail(&c, 3000)
    );
}

/// `rejuvenate --vm VM --mode MODE [--qemu Q] --json`: its one report.
fn rejuvenate(env: &Env, vm: &str, mode: &str, qemu: Option<&Path>) -> serde_json::Value {
    let mut args = vec!["rejuvenate", "--vm", vm, "--mode", mode, "--json"];
    let q;
    if let Some(p) = qemu {
        q = p.display().to_string();
        args.extend(["--qemu", q.as_str()]);
    }
    let v = env.json(&args);
    let r = v["reports"][0].clone();
    assert_eq!(r["vm"], vm, "{v}");
    assert_ne!(r["old_pid"], r["new_pid"], "QEMU was not restarted: {r}");
    r
}

/// VM `name` in `status --json`.
fn status_of(env: &Env, name: &str) -> serde_json::Value {
    let st = env.json(&["status", "--json"]);
    st["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no VM {name} in {st}"))
}

/// The binary QEMU process `pid` runs.
fn exe_of(pid: &serde_json::Value) -> PathBuf {
    std::fs::read_link(format!("/proc/{}/exe", pid.as_u64().unwrap())).unwrap()
}

fn same_file(a: &Path, b: &Path) -> bool {
    std::fs::canonicalize(a).unwrap() == std::fs::canonicalize(b).unwrap()
}

/// Warm, saved and cold restarts of VMs running on QEMU 10.0 (from the
/// project's own install-qemu.sh): warm and saved keep memory, uptime and
/// the TCP connection; cold boots the guest again.
#[test]
fn warm_saved_and_cold_restarts_on_qemu_10_0() {
    let _l = cluster_lock();
    let q10 = qemu10();
    let env = Env::with_qemu(&q10);
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let before = wait_pingpong(&env, 0, 20);
    let conn = last_field(&before, "pingpong:", "conn").unwrap();
    assert!(same_file(&exe_of(&status_of(&env, "srv")["pid"]), &q10));

    let up = uptime(&env.console("srv"));
    let r = rejuvenate(&env, "srv", "warm", None);
    assert!(r["state_bytes"].as_u64().unwrap() < 4 << 20, "{r}");
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert!(same_file(&exe_of(&r["new_pid"]), &q10), "{r}");
    assert_same_connection(&env, conn, "warm on 10.0");
    assert_memtouch_clean(&env, "srv");
    assert_uptime_went_on(&env, "srv", up, "warm on 10.0");

    let up = uptime(&env.console("cli"));
    let r = rejuvenate(&env, "cli", "saved", None);
    assert!(r["state_bytes"].as_u64().unwrap() > 4 << 20, "{r}");
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert_same_connection(&env, conn, "saved on 10.0");
    assert_memtouch_clean(&env, "cli");
    assert_uptime_went_on(&env, "cli", up, "saved on 10.0");

    let up = uptime(&env.console("srv"));
    let r = rejuvenate(&env, "srv", "cold", None);
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    // The console log may start again with the new boot.
    let srv = env.wait_console("srv", "a boot again", Duration::from_secs(120), |c| {
        c.contains("vmcsnap-stat") && uptime(c) < up
    });
    assert!(uptime(&srv) < up);
    env.wait_console("cli", "a reconnect", Duration::from_secs(120), |c| {
        last_field(c, "pingpong:", "conn").unwrap_or(0) > conn
    });
    assert_memtouch_clean(&env, "srv");
    env.ok(&["down"]);
    env.assert_clean();
}

/// `rejuvenate --qemu` moves running VMs from QEMU 7.2 to 10.0, warm and
/// saved, with memory and the TCP connection kept. The way back is
/// refused before anything is done (microvm has no versioned machine
/// type): same QEMU process, still running, the guest going on. A cold
/// restart may go back (the guest boots again).
#[test]
fn upgrade_from_7_2_to_10_0_keeps_the_guest_and_the_way_back_is_refused() {
    let _l = cluster_lock();
    let (q7, q10) = (qemu7(), qemu10());
    let env = Env::with_qemu(&q7);
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let before = wait_pingpong(&env, 0, 20);
    let conn = last_field(&before, "pingpong:", "conn").unwrap();

    // Warm upgrade of the server.
    let up = uptime(&env.console("srv"));
    let r = rejuvenate(&env, "srv", "warm", Some(&q10));
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert!(same_file(&exe_of(&r["new_pid"]), &q10), "{r}");
    assert!(r["state_bytes"].as_u64().unwrap() < 4 << 20, "{r}");
    assert_same_connection(&env, conn, "warm upgrade 7.2 -> 10.0");
    assert_memtouch_clean(&env, "srv");
    assert_uptime_went_on(&env, "srv", up, "the guest rebooted");
    // Again on 10.0 (its firmware stays the one it booted with).
    let r = rejuvenate(&env, "srv", "warm", Some(&q10));
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert!(same_file(&exe_of(&r["new_pid"]), &q10), "{r}");
    assert_same_connection(&env, conn, "warm on 10.0 after the upgrade");

    // The way back, refused before the VM is touched.
    let pid = status_of(&env, "srv")["pid"].clone();
    let total = pingpong_total(&env);
    let out = env.vmcsnap(&[
        "rejuvenate",
        "--vm",
        "srv",
        "--mode",
        "warm",
        "--qemu",
        q7.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a downgrade was not refused");
    assert!(
        err.contains("from QEMU 10.0 to QEMU 7.2") && err.contains("not touched"),
        "{err}"
    );
    let srv = status_of(&env, "srv");
    assert_eq!(srv["pid"], pid, "the refused restart touched the VM");
    assert_eq!(srv["state"], "running", "{srv}");
    assert!(
        !env.run_dir().join("cluster/srv/qemu-kept").exists(),
        "a refused restart left a kept copy"
    );
    wait_pingpong(&env, total, 10);
    assert_same_connection(&env, conn, "refused downgrade");

    // Saved upgrade of the client.
    let r = rejuvenate(&env, "cli", "saved", Some(&q10));
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert!(same_file(&exe_of(&r["new_pid"]), &q10), "{r}");
    assert_same_connection(&env, conn, "saved upgrade 7.2 -> 10.0");
    assert_memtouch_clean(&env, "cli");

    // Cold may go back: the guest boots on 7.2.
    let r = rejuvenate(&env, "srv", "cold", Some(&q7));
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert!(same_file(&exe_of(&r["new_pid"]), &q7), "{r}");
    assert_memtouch_clean(&env, "srv");
    env.ok(&["down"]);
    env.assert_clean();
}

/// A new QEMU that dies during an upgrade: the kept copy of the system's
/// 7.2 takes over. And a VM running on the 10.0 of install-qemu.sh (its
/// firmware and modules under the prefix) whose new QEMU cannot start
/// falls back to the kept copy of that 10.0, twice in a row.
#[test]
fn failed_restarts_fall_back_to_the_kept_copy_across_versions_and_prefixes() {
    let _l = cluster_lock();
    let (q7, q10) = (qemu7(), qemu10());
    let env = Env::with_qemu(&q7);
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let before = wait_pingpong(&env, 0, 20);
    let conn = last_field(&before, "pingpong:", "conn").unwrap();

    let v = env.json(&[
        "rejuvenate",
        "--vm",
        "srv",
        "--mode",
        "warm",
        "--qemu",
        q10.to_str().unwrap(),
        "--inject-fault",
        "new-qemu-dies",
        "--json",
    ]);
    let r = &v["reports"][0];
    assert_eq!(r["fell_back_to_old_binary"], true, "{v}");
    let kept = env
        .run_dir()
        .join("cluster/srv/qemu-kept/qemu-system-x86_64");
    assert!(same_file(&exe_of(&r["new_pid"]), &kept), "{v}");
    assert_same_connection(&env, conn, "fallback to 7.2 during an upgrade");
    assert_memtouch_clean(&env, "srv");

    // Now upgrade for real, then a broken binary: the kept 10.0 (copied
    // from the install-qemu.sh prefix) takes over, twice.
    let r = rejuvenate(&env, "srv", "warm", Some(&q10));
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    let broken = env.run_dir().join("qemu-broken");
    std::fs::write(&broken, "#!/bin/sh\necho 'broken qemu' >&2\nexit 1\n").unwrap();
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&broken)
        .status()
        .unwrap();
    for round in 0..2 {
        let r = rejuvenate(&env, "srv", "warm", Some(&broken));
        assert_eq!(r["fell_back_to_old_binary"], true, "round {round}: {r}");
        assert!(same_file(&exe_of(&r["new_pid"]), &kept), "{r}");
        let origin: serde_json::Value = serde_json::from_slice(
            &std::fs::read(env.run_dir().join("cluster/srv/qemu-kept/kept.json")).unwrap(),
        )
        .unwrap();
        assert!(
            same_file(Path::new(origin["installed"].as_str().unwrap()), &q10),
            "round {round}: the kept copy is not of the 10.0: {origin}"
        );
        assert_same_connection(&env, conn, "fallback to the kept 10.0");
        assert_memtouch_clean(&env, "srv");
    }
    env.ok(&["down"]);
    env.assert_clean();
}

#[test]
fn an_unreadable_or_missing_qemu_is_a_clear_error() {
    let env = Env::new();
    let out = env.vmcsnap(&[
        "rejuvenate",
        "--vm",
        "x",
        "--qemu",
        "/nonexistent/qemu-system-x86_64",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--qemu=/nonexistent"), "{err}");
}

/// `--mode cpr`, QEMU 10.0's cpr-transfer: refused before anything is done
/// on a VM not started with aux-ram-share=on and towards 7.2; after a warm
/// restart on 10.0 it moves the VM to a new QEMU, twice, with memory and
/// the TCP connection kept, and the sockets of the new QEMU (QMP, switch
/// port) still reachable for the next restart.
#[test]
fn cpr_transfer_on_qemu_10_0_keeps_the_guest() {
    let _l = cluster_lock();
    let (q7, q10) = (qemu7(), qemu10());
    let env = Env::with_qemu(&q10);
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let before = wait_pingpong(&env, 0, 20);
    let conn = last_field(&before, "pingpong:", "conn").unwrap();

    let refused = |args: &[&str], why: &str| {
        let pid = status_of(&env, "srv")["pid"].clone();
        let out = env.vmcsnap(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{err}");
        let srv = status_of(&env, "srv");
        assert_eq!(srv["pid"], pid, "a refused cpr restart touched the VM");
        assert_eq!(srv["state"], "running");
    };
    refused(
        &["rejuvenate", "--vm", "srv", "--mode", "cpr"],
        "aux-ram-share",
    );
    let r = rejuvenate(&env, "srv", "warm", None);
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    refused(
        &[
            "rejuvenate",
            "--vm",
            "srv",
            "--mode",
            "cpr",
            "--qemu",
            q7.to_str().unwrap(),
        ],
        "cpr-transfer is QEMU 10.0's",
    );
    for round in 0..2 {
        let up = uptime(&env.console("srv"));
        let out = env.vmcsnap(&["rejuvenate", "--vm", "srv", "--mode", "cpr", "--json"]);
        if !out.status.success() {
            let log = |p: &str| std::fs::read_to_string(env.run_dir().join(p)).unwrap_or_default();
            panic!(
                "round {round}: {}\nagent log:\n{}\nQEMU log:\n{}",
                String::from_utf8_lossy(&out.stderr),
                common::tail(&log("agent.log"), 4000),
                log("cluster/srv/qemu.log")
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let r = v["reports"][0].clone();
        assert_eq!(r["mode"], "cpr", "{r}");
        assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
        assert_eq!(r["state_bytes"], 0, "{r}");
        assert!(r["downtime_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(same_file(&exe_of(&r["new_pid"]), &q10), "{r}");
        assert_same_connection(&env, conn, &format!("cpr round {round}"));
        assert_memtouch_clean(&env, "srv");
        assert_uptime_went_on(&env, "srv", up, &format!("round {round}: rebooted"));
        let srv = status_of(&env, "srv");
        assert_eq!(srv["pid"], r["new_pid"], "{srv}");
        assert_eq!(srv["state"], "running", "{srv}");
    }
    // The new QEMU's sockets outlived the old QEMU's clean-up.
    let r = rejuvenate(&env, "srv", "warm", None);
    assert_eq!(r["fell_back_to_old_binary"], false, "{r}");
    assert_same_connection(&env, conn, "warm after cpr");
    assert_memtouch_clean(&env, "srv");
    env.ok(&["down"]);
    env.assert_clean();
}

/// Two q35 VMs of the `redis` image (machine `pc-q35-7.2`): a Redis server
/// and a client driving redisload against it, which checks every key it
/// wrote (the image VMs' memtouch) over one TCP connection.
const Q35_SPEC: &str = r#"
[cluster]
name = "rjq"
accel = "auto"
boot_timeout_s = 900

[[vm]]
name = "primary"
image_recipe = "redis"
memory_mib = 512
cloud_init = false

[[vm]]
name = "client"
image_recipe = "redis"
memory_mib = 384
cloud_init = false
workload = """
redisload {ip:primary} 6379 -k 2000 -r 200 -i 2 -V 6 &
"""
"#;

/// The machine type on VM `name`'s QEMU command line.
fn machine_of(env: &Env, name: &str) -> String {
    let pid = status_of(env, name)["pid"].as_u64().unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let i = args.iter().position(|a| a == "-M" || a == "-machine");
    let m = i.and_then(|i| args.get(i + 1)).cloned().unwrap_or_default();
    m.split(',').next().unwrap_or("").to_string()
}

/// A warm restart of `vm` onto `qemu`: same machine type, the new binary,
/// redisload on its first connection with every key reading back.
fn q35_warm_to(env: &Env, vm: &str, qemu: &Path, before: redis_story::Load, what: &str) {
    let r = rejuvenate(env, vm, "warm", Some(qemu));
    assert_eq!(r["fell_back_to_old_binary"], false, "{what}: {r}");
    assert!(same_file(&exe_of(&r["new_pid"]), qemu), "{what}: {r}");
    assert!(r["state_bytes"].as_u64().unwrap() < 4 << 20, "{what}: {r}");
    assert_eq!(machine_of(env, vm), "pc-q35-7.2", "{what}");
    assert_eq!(status_of(env, vm)["state"], "running", "{what}");
    let (keys, errors) = redis_story::next_full_check(env, what);
    assert!(
        keys > 0 && errors == 0,
        "{what}: full check {keys} keys, {errors} errors"
    );
    let after = redis_story::load(env).unwrap();
    assert!(
        after.sets > before.sets && after.errors == 0 && after.conn == before.conn,
        "{what}: the load did not carry on over its connection: {before:?} -> {after:?}"
    );
}

/// q35 VMs started under QEMU 7.2 move warm to 10.0 (the server, then the
/// client, whose redisload process and connection live in the moved RAM),
/// and the server back to 7.2 (q35's versioned machine type allows it):
/// each time on the same machine type, the same TCP connection, every key
/// reading back.
#[test]
fn q35_vms_upgrade_warm_from_7_2_to_10_0_and_back_keeping_data_and_connection() {
    let _l = cluster_lock();
    let (q7, q10) = (qemu7(), qemu10());
    let env = Env::with_qemu(&q7);
    let spec = env.write_spec(Q35_SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    for vm in ["primary", "client"] {
        assert!(same_file(&exe_of(&status_of(&env, vm)["pid"]), &q7));
        assert_eq!(machine_of(&env, vm), "pc-q35-7.2");
    }
    let (keys, errors) = redis_story::next_full_check(&env, "after up");
    assert!(
        keys > 0 && errors == 0,
        "first full check: {keys} keys, {errors} errors"
    );
    let l0 = redis_story::load(&env).unwrap();

    q35_warm_to(&env, "primary", &q10, l0, "server 7.2 -> 10.0");
    let l1 = redis_story::load(&env).unwrap();
    q35_warm_to(&env, "client", &q10, l1, "client 7.2 -> 10.0");
    let l2 = redis_story::load(&env).unwrap();
    q35_warm_to(&env, "primary", &q7, l2, "server 10.0 -> 7.2");
    env.ok(&["down"]);
    env.assert_clean();
}

/// Waits for the guest's next `vmcsnap-stat` line, then asserts that its
/// uptime went on from `up` (the guest did not reboot). CI once read the
/// console right after a saved restart returned, before the guest had
/// printed a line since, and saw the old uptime.
fn assert_uptime_went_on(env: &Env, vm: &str, up: f64, what: &str) {
    let stats = |c: &str| c.lines().filter(|l| l.starts_with("vmcsnap-stat")).count();
    let n = stats(&env.console(vm));
    let c = env.wait_console(
        vm,
        "a new vmcsnap-stat line",
        Duration::from_secs(120),
        |c| stats(c) > n,
    );
    assert!(uptime(&c) > up, "{what}: uptime {} after {up}", uptime(&c));
}
