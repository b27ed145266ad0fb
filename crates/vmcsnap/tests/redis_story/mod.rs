//! The Redis story of `redis_cluster.rs` (7.2) and `redis_qemu10.rs`
//! (10.0), in one place; its probes of redisload (`load`,
//! `next_full_check`) serve `rejuvenate_q35.rs` too.
#![allow(dead_code)] // each test file uses a part

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::Env;

const PRIMARY: &str = "10.77.0.2";
const REPLICA: &str = "10.77.0.3";

fn example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/redis.toml")
}

/// `redis-cli -h HOST ARGS...` run in the cluster's namespace.
fn redis(env: &Env, host: &str, args: &[&str]) -> String {
    let mut a = vec!["exec", "--", "redis-cli", "-h", host];
    a.extend_from_slice(args);
    let out = env.vmcsnap(&a);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `field:value` of an INFO section.
fn info(env: &Env, host: &str, section: &str, field: &str) -> Option<String> {
    redis(env, host, &["info", section]).lines().find_map(|l| {
        l.trim()
            .strip_prefix(&format!("{field}:"))
            .map(str::to_string)
    })
}

pub fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn replica_link_up(env: &Env) -> bool {
    info(env, REPLICA, "replication", "master_link_status").as_deref() == Some("up")
}

/// A key written on the primary now reaches the replica.
fn replicates(env: &Env, what: &str) {
    let value = format!("{what}-{}", std::process::id());
    assert_eq!(
        redis(env, PRIMARY, &["set", "probe", &value]).trim(),
        "OK",
        "{what}: SET on the primary"
    );
    wait_until(
        &format!("{what}: a write on the primary reaching the replica"),
        Duration::from_secs(120),
        || redis(env, REPLICA, &["get", "probe"]).trim() == value,
    );
}

/// redisload's lines on the client's console.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Load {
    pub sets: u64,
    pub acked: u64,
    pub errors: u64,
    pub conn: u64,
    pub reconnects: u64,
}

fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

pub fn load(env: &Env) -> Option<Load> {
    let c = env.console("client");
    let l = c
        .lines()
        .rev()
        .find(|l| l.contains("redisload: t=") && l.contains(" sets="))?;
    Some(Load {
        sets: field(l, "sets")?,
        acked: field(l, "acked")?,
        errors: field(l, "errors")?,
        conn: field(l, "conn")?,
        reconnects: field(l, "reconnects")?,
    })
}

/// The full checks on the client's console: (keys, errors).
fn full_checks(env: &Env) -> Vec<(u64, u64)> {
    env.console("client")
        .lines()
        .filter(|l| l.contains(" full-check "))
        .filter_map(|l| Some((field(l, "keys")?, field(l, "errors")?)))
        .collect()
}

/// Waits for a full check after the ones seen so far, and returns it.
pub fn next_full_check(env: &Env, what: &str) -> (u64, u64) {
    let before = full_checks(env).len();
    wait_until(
        &format!("{what}: a full check of every key"),
        Duration::from_secs(240),
        || full_checks(env).len() > before,
    );
    full_checks(env)[before]
}

fn vm_states(env: &Env) -> Vec<(String, String)> {
    let st = env.json(&["status", "--json"]);
    st["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().into(),
                v["state"].as_str().unwrap().into(),
            )
        })
        .collect()
}

fn assert_running(env: &Env, what: &str) {
    for (vm, state) in vm_states(env) {
        assert_eq!(state, "running", "{what}: {vm} is {state}");
    }
}

/// The whole story on `env` (whose `VMCSNAP_QEMU` chooses the QEMU).
pub fn story(env: Env) {
    // Builds the image on first use (about a minute), then boots 3 VMs.
    let up = env.ok(&["up", example().to_str().unwrap()]);
    assert!(up.contains("primary") && up.contains("client"), "{up}");
    wait_until(
        "the replica's link to the primary",
        Duration::from_secs(240),
        || replica_link_up(&env),
    );
    let first = next_full_check(&env, "after up");
    assert!(
        first.0 > 0 && first.1 == 0,
        "redisload's first full check: {first:?}\n{}",
        env.console("client")
    );
    let sync_full = info(&env, PRIMARY, "stats", "sync_full").expect("sync_full on the primary");
    let l0 = load(&env).unwrap();
    assert_eq!(l0.errors, 0, "{l0:?}");

    // Warm rejuvenation of every VM: connections and data stay.
    env.ok(&["rejuvenate", "--all", "--mode", "warm"]);
    assert_running(&env, "after the warm restart");
    let c = next_full_check(&env, "after the warm restart");
    assert_eq!(c.1, 0, "a key changed across the warm restart: {c:?}");
    let l1 = load(&env).unwrap();
    assert!(
        l1.sets > l0.sets && l1.errors == 0 && l1.conn == l0.conn,
        "the load did not carry on over its connection: {l0:?} -> {l1:?}"
    );
    assert!(replica_link_up(&env));
    assert_eq!(
        info(&env, PRIMARY, "stats", "sync_full").as_deref(),
        Some(sync_full.as_str()),
        "a warm restart made the replica resync in full"
    );

    // A hot cluster snapshot under load; the cluster destroyed; restored.
    let snap = env.json(&["snapshot", "--cluster", "--name", "rc", "--json"]);
    assert_eq!(snap["vms"].as_array().map(Vec::len), Some(3), "{snap}");
    // Guest facts of image VMs come from qemu-guest-agent (the lab guest's
    // come from its console): known, not guessed.
    for v in snap["vms"].as_array().unwrap() {
        assert!(
            v["retrans_before"].is_u64() && v["retrans_after"].is_u64(),
            "TCP counters unknown: {v}"
        );
    }
    let at_cut = load(&env).unwrap();
    env.ok(&["down"]);
    let restored = env.json(&["restore", "--wait", "--cluster", "rc", "--json"]);
    assert_eq!(
        restored["vms"].as_array().map(Vec::len),
        Some(3),
        "{restored}"
    );
    for v in restored["vms"].as_array().unwrap() {
        assert!(
            v["retrans_later"].is_u64(),
            "TCP counters unknown after the restore: {v}"
        );
        assert_eq!(v["lost_segments"], 0, "{v}");
    }
    assert_running(&env, "after the cluster restore");
    wait_until(
        "the replica's link after the restore",
        Duration::from_secs(120),
        || replica_link_up(&env),
    );
    assert_eq!(
        info(&env, PRIMARY, "stats", "sync_full").as_deref(),
        Some(sync_full.as_str()),
        "the restored replica needed a full resynchronisation"
    );
    // The restored client's memory is the cut's: its next full check reads
    // back every key it had acknowledged then, from the restored primary.
    let c = next_full_check(&env, "after the cluster restore");
    assert!(
        c.0 > 0 && c.1 == 0,
        "acknowledged keys did not read back after the restore: {c:?}\n{}",
        env.console("client")
    );
    let l2 = load(&env).unwrap();
    assert!(
        l2.sets > at_cut.sets,
        "the client did not carry on: {at_cut:?} -> {l2:?}"
    );
    assert_eq!(
        (l2.errors, l2.conn),
        (0, at_cut.conn),
        "the client saw errors or a new connection: {l2:?}"
    );

    // One VM's hot snapshot, restored workingset and eager: the replica.
    env.ok(&["snapshot", "replica", "--mode", "hot", "--name", "r1"]);
    for mode in ["workingset", "eager"] {
        env.ok(&["stop", "replica"]);
        env.ok(&["restore", "--wait", "r1", "--mode", mode]);
        wait_until(
            &format!("the replica's link after a {mode} restore"),
            Duration::from_secs(120),
            || replica_link_up(&env),
        );
        let keys: u64 = redis(&env, REPLICA, &["dbsize"])
            .trim()
            .parse()
            .unwrap_or(0);
        assert!(keys > 0, "the replica restored {mode} has no keys");
        replicates(&env, &format!("replica restored {mode}"));
    }

    // A stopped and restored primary is found by its replica again.
    env.ok(&["snapshot", "primary", "--mode", "hot", "--name", "p1"]);
    env.ok(&["stop", "primary"]);
    env.ok(&["restore", "--wait", "p1", "--mode", "workingset"]);
    wait_until(
        "the replica finding the restored primary",
        Duration::from_secs(180),
        || replica_link_up(&env),
    );
    replicates(&env, "primary stopped and restored");
    assert_running(&env, "at the end");

    env.ok(&["down"]);
    env.assert_clean();
}
