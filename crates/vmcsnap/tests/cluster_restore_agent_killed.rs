//! `kill -9` of the agent during a cluster restore: every VM's page source
//! is a process of its own, so the guests never stop; the next agent adopts
//! every VM (same QEMUs, no eager re-restore, no work lost), starts those
//! the Coordinator's START had not reached, and finishes the restore.
//!
//! The stages are held with the hidden faults of `vmcsnap_agent::fault`
//! (`background-held-until=PATH`: the guests run while most pages are still
//! to load; `start-held-until=PATH`: every VM waits for START) and the next
//! agent's recovery with `VMCSNAP_TEST_HOLD_RECOVERY`, so the kill lands
//! where it must without a timing threshold.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{cluster_lock, field, last_field, Env};

/// Two VMs that talk (a pingpong ring) and touch memory.
const SPEC: &str = r#"
[cluster]
name = "cpk"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 160
workload = """
memtouch -m 24 -r 1500 -H 4 &
pingpong server 7000 &
"""

[[vm]]
name = "b"
memory_mib = 128
workload = """
memtouch -m 16 -r 1500 -H 4 &
pingpong client {ip:a} 7000 &
"""
"#;

const VMS: [&str; 2] = ["a", "b"];
const LIMIT: Duration = Duration::from_secs(240);

fn vm_dir(env: &Env, vm: &str) -> PathBuf {
    env.run_dir().join("cluster").join(vm)
}

/// The guest's console, read from its file (no agent needed).
fn console(env: &Env, vm: &str) -> String {
    std::fs::read_to_string(vm_dir(env, vm).join("console.log")).unwrap_or_default()
}

/// memtouch's `t=` values (seconds since it started) after byte `from`.
fn memtouch_times(c: &str, from: usize) -> Vec<u64> {
    c.get(from..)
        .unwrap_or("")
        .lines()
        .filter(|l| l.starts_with("memtouch: t="))
        .filter_map(|l| field(l, "t"))
        .collect()
}

/// Waits (at most `limit`) until `ok` holds for `vm`'s console.
fn wait_console(env: &Env, vm: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let t = Instant::now();
    loop {
        let c = console(env, vm);
        if ok(&c) {
            return c;
        }
        assert!(
            t.elapsed() < LIMIT,
            "VM {vm}, {what}: not within {LIMIT:?}; console ends:\n{}\nagent log ends:\n{}\npage-source.log:\n{}",
            common::tail(&c, 2000),
            agent_log(env),
            std::fs::read_to_string(vm_dir(env, vm).join("page-source.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn pid_in(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| !r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

fn json_file(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Boots the cluster, lets the workloads run, takes cluster snapshot `cut`
/// and brings the cluster down.
fn snapshot_cluster(env: &Env) {
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    for vm in VMS {
        wait_console(env, vm, "memtouch at boot", |c| {
            memtouch_times(c, 0).len() >= 2
        });
    }
    env.wait_console("b", "pingpong", LIMIT, |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) >= 20
    });
    env.ok(&["snapshot", "--cluster", "--name", "cut"]);
    env.ok(&["down"]);
}

/// Starts `restore --cluster cut` with `fault` (the consoles emptied
/// first: what they show afterwards is the restored guests').
fn start_restore(env: &Env, mode: &str, fault: &str) -> Child {
    for vm in VMS {
        let _ = std::fs::remove_file(vm_dir(env, vm).join("console.log"));
    }
    env.command(&[
        "restore",
        "--cluster",
        "cut",
        "--mode",
        mode,
        "--inject-fault",
        fault,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap()
}

/// Each VM's page source (its pid) and QEMU (pid, from its job), once
/// `ready` holds for its `observed.json`.
fn sources(env: &Env, ready: impl Fn(&serde_json::Value) -> bool) -> Vec<(i32, i32)> {
    let t = Instant::now();
    VMS.iter()
        .map(|vm| {
            let dir = vm_dir(env, vm).join("page-source");
            loop {
                let job = json_file(&dir.join("job.json"));
                let obs = json_file(&dir.join("observed.json"));
                if let (Some(src), Some(job), Some(obs)) = (pid_in(&dir.join("pid")), job, obs) {
                    if ready(&obs) {
                        let qemu = job["member"]["pid"].as_u64().expect("the job names QEMU");
                        return (src, qemu as i32);
                    }
                }
                assert!(
                    t.elapsed() < LIMIT,
                    "VM {vm}: its page source did not get there; agent log ends:\n{}",
                    agent_log(env)
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .collect()
}

fn agent_log(env: &Env) -> String {
    let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap_or_default();
    common::tail(&log, 4000).to_string()
}

/// `kill -9` of the agent; waits for the restore's client to end.
fn kill_agent(env: &Env, mut restore: Child) {
    let agent = pid_in(&env.run_dir().join("agent.pid")).expect("an agent runs");
    // SAFETY: SIGKILL to the agent's pid, read from its pid file.
    unsafe { libc::kill(agent, libc::SIGKILL) };
    let _ = std::fs::remove_file(env.run_dir().join("agent.pid"));
    let t = Instant::now();
    while restore.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(60), "restore did not end");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts the next agent with its recovery held until `hold` exists;
/// checks that `status` names the recovery of the cluster restore.
fn next_agent(env: &mut Env, hold: &Path) {
    env.extra_env.push((
        "VMCSNAP_TEST_HOLD_RECOVERY".into(),
        hold.to_string_lossy().into_owned(),
    ));
    let st = env.json(&["status", "--json"]);
    let busy = st["busy"]["request"].as_str().unwrap_or("");
    assert!(
        busy.contains("recovering") && busy.contains("cluster restore of snapshot cut"),
        "status does not name the recovery: {st}"
    );
}

/// Waits until the recovery has ended; checks that every VM runs on the
/// QEMU its restore started (adopted, not restored again).
fn adopted(env: &Env, sources: &[(i32, i32)]) {
    let t = Instant::now();
    let st = loop {
        let st = env.json(&["status", "--json"]);
        if st["busy"].is_null() {
            break st;
        }
        assert!(t.elapsed() < LIMIT, "the recovery did not end: {st}");
        std::thread::sleep(Duration::from_millis(300));
    };
    let vms = st["vms"].as_array().expect("VMs");
    for (vm, (_, qemu)) in VMS.iter().zip(sources) {
        let v = vms
            .iter()
            .find(|v| v["name"] == *vm)
            .unwrap_or_else(|| panic!("VM {vm} is not in the cluster: {st}"));
        assert_eq!(v["state"], "running", "{st}");
        assert_eq!(
            v["pid"].as_u64(),
            Some(*qemu as u64),
            "VM {vm} was restored again: {st}\nagent log ends:\n{}",
            agent_log(env)
        );
    }
    for (vm, (src, _)) in VMS.iter().zip(sources) {
        assert!(!alive(*src), "VM {vm}'s page source runs on");
        assert!(
            !vm_dir(env, vm).join("page-source").exists(),
            "VM {vm}'s page-source directory is left"
        );
    }
    assert!(!env.run_dir().join("restoring.json").exists());
}

/// The adopting agent finished every VM's restore: one record per VM of
/// the restore `mode` in the cluster snapshot.
fn records(env: &Env, mode_suffix: &str) -> usize {
    VMS.iter()
        .map(|vm| {
            std::fs::read_dir(
                env.run_dir()
                    .join("snapshots/cut/vms")
                    .join(vm)
                    .join("restores"),
            )
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(mode_suffix))
                    .count()
            })
            .unwrap_or(0)
        })
        .sum()
}

/// The workloads go on after the adoption: memtouch without errors, never
/// back in time from `t_before` (per VM), pingpong's count growing.
fn workloads_continue(env: &Env, t_before: &[u64]) {
    for (vm, &t0) in VMS.iter().zip(t_before) {
        let from = console(env, vm).len();
        let c = wait_console(env, vm, "memtouch after adoption", |c| {
            memtouch_times(c, from).len() >= 2
        });
        let after = memtouch_times(&c, from);
        assert!(
            after.iter().all(|&t| t >= t0),
            "VM {vm} went back to the snapshot (t={t0} before the kill, then {after:?})"
        );
        assert!(!c.contains("MEMTOUCH-CORRUPTION"), "{c}");
        assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0), "VM {vm}");
    }
    let before = last_field(&console(env, "b"), "pingpong:", "total").unwrap_or(0);
    wait_console(env, "b", "pingpong after adoption", |c| {
        last_field(c, "pingpong:", "total").unwrap_or(0) > before
    });
}

/// Killed once every guest runs, while most pages are still to load (the
/// background push held): the guests run on without an agent; the next
/// agent adopts them and finishes the restore.
fn killed_while_loading(env: &mut Env, mode: &str, suffix: &str, round: usize) {
    let go = env.run_dir().join(format!("background-go-{round}"));
    let restore = start_restore(
        env,
        mode,
        &format!("background-held-until={}", go.display()),
    );
    for vm in VMS {
        wait_console(env, vm, "the restored guest", |c| {
            !memtouch_times(c, 0).is_empty()
        });
    }
    let srcs = sources(env, |o| o["latency_ms"].is_number());
    for (src, _) in &srcs {
        assert!(alive(*src), "a page source ended before the kill");
    }
    kill_agent(env, restore);
    let killed_at: Vec<usize> = VMS.iter().map(|vm| console(env, vm).len()).collect();
    let t_before: Vec<u64> = VMS
        .iter()
        .map(|vm| *memtouch_times(&console(env, vm), 0).last().unwrap())
        .collect();

    // No agent: the guests run on, fed by their page sources.
    for (vm, &at) in VMS.iter().zip(&killed_at) {
        wait_console(env, vm, "the guest without agent", |c| {
            memtouch_times(c, at).len() >= 2
        });
    }
    for (vm, (src, qemu)) in VMS.iter().zip(&srcs) {
        assert!(alive(*qemu), "VM {vm}'s QEMU died with the agent");
        assert!(alive(*src), "VM {vm}'s page source died with the agent");
    }

    let hold = env.run_dir().join(format!("hold-recovery-{round}"));
    next_agent(env, &hold);
    std::fs::write(&go, b"").unwrap();
    std::fs::write(&hold, b"").unwrap();
    adopted(env, &srcs);
    assert_eq!(records(env, suffix), VMS.len(), "one record per VM");
    workloads_continue(env, &t_before);
    env.extra_env.clear();
    env.ok(&["down"]);
}

#[test]
fn a_cluster_restore_survives_its_agent_while_pages_load() {
    let _l = cluster_lock();
    let mut env = Env::new();
    snapshot_cluster(&env);
    killed_while_loading(&mut env, "hotrestore-rl", "-workingset.json", 0);
    killed_while_loading(&mut env, "workingset-restore", "-sampling-ws.json", 1);
    env.assert_clean();
}

#[test]
fn a_cluster_restore_killed_before_start_is_started_by_the_next_agent() {
    let _l = cluster_lock();
    let mut env = Env::new();
    snapshot_cluster(&env);
    let never = env.run_dir().join("start-never");
    let restore = start_restore(
        &env,
        "hotrestore-rl",
        &format!("start-held-until={}", never.display()),
    );
    // Every VM's page source has sent RUN: QEMU loads the device state
    // (or has), the guest waits for START, which never comes.
    let srcs = sources(&env, |o| o["run_sent_ms"].is_number());
    for vm in VMS {
        assert!(
            memtouch_times(&console(&env, vm), 0).is_empty(),
            "VM {vm} started before START"
        );
    }
    kill_agent(&env, restore);
    for (vm, (src, qemu)) in VMS.iter().zip(&srcs) {
        assert!(alive(*qemu), "VM {vm}'s QEMU died with the agent");
        // While its VM waits, the source pushes every page and may end.
        let result = vm_dir(&env, vm).join("page-source/result.json");
        assert!(
            alive(*src) || result.exists(),
            "VM {vm}'s page source died with the agent"
        );
    }

    let hold = env.run_dir().join("hold-recovery");
    next_agent(&mut env, &hold);
    std::fs::write(&hold, b"").unwrap();
    adopted(&env, &srcs);
    assert!(!never.exists());
    assert_eq!(
        records(&env, "-workingset.json"),
        VMS.len(),
        "one record per VM"
    );
    let log = std::fs::read_to_string(env.run_dir().join("agent.log")).unwrap_or_default();
    assert!(
        log.contains("were waiting for START: started"),
        "the next agent did not start the VMs: {}",
        agent_log(&env)
    );
    // The guests run from the snapshot on: their workloads go on.
    for vm in VMS {
        wait_console(&env, vm, "memtouch after the start", |c| {
            memtouch_times(c, 0).len() >= 2
        });
    }
    workloads_continue(&env, &[0, 0]);
    env.extra_env.clear();
    env.ok(&["down"]);
    env.assert_clean();
}
