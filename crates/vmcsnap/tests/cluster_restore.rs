//! Restoring a whole cluster from a hot cluster snapshot (HotRestore):
//! real QEMU guests of different sizes and workloads, restored in each
//! mode; the workloads continue on the same TCP connections.

mod common;

use std::time::Duration;

use common::{cluster_lock, last_field, Env};

/// Heterogeneous: different memory sizes and workloads. A pingpong ring
/// (r1 → r2 → r3 → r1: each VM runs a server and a client of the next) and
/// a KV pair (kvc → r1).
const SPEC: &str = include_str!("../../../examples/ring-kv.toml");

const VMS: [&str; 4] = ["r1", "r2", "r3", "kvc"];
const RING: [&str; 3] = ["r1", "r2", "r3"];

#[test]
fn a_cluster_snapshot_restores_in_every_mode_and_its_workloads_continue() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    let limit = Duration::from_secs(120);
    for vm in RING {
        env.wait_console(vm, "pingpong", limit, |c| {
            last_field(c, "pingpong:", "total").unwrap_or(0) >= 100
        });
    }
    env.wait_console("kvc", "kvload", limit, |c| {
        last_field(c, "kvload:", "total").unwrap_or(0) >= 100
    });
    // Warm up once (the first hot snapshot reads guest RAM), then the one used.
    let snap = env.json(&["snapshot", "--cluster", "--name", "cut", "--json"]);
    assert_eq!(snap["switch"]["dropped"], 0);
    env.ok(&["down"]);

    // The restore dependency graph as `inspect --rdg` shows it, with its
    // DOT picture (and the PNG where graphviz is installed).
    let dot = env.run_dir().join("rdg.dot");
    let g = env.json(&[
        "inspect",
        "cut",
        "--rdg",
        "--dot",
        dot.to_str().unwrap(),
        "--json",
    ]);
    let names = |v: &serde_json::Value| -> Vec<String> {
        let mut n: Vec<String> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect();
        n.sort();
        n
    };
    let mut all: Vec<String> = VMS.iter().map(|s| s.to_string()).collect();
    all.sort();
    assert_eq!(
        names(&g["restore_line"]),
        all,
        "the restore line orders every VM once: {g}"
    );
    let mut grouped: Vec<String> = g["rings"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(names)
        .collect();
    grouped.extend(names(&g["orphans"]));
    grouped.sort();
    assert_eq!(grouped, all, "every VM is in one ring or an orphan: {g}");
    for vm in RING {
        assert!(
            g["rings"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| names(r).contains(&vm.to_string())),
            "{vm} talks, so is in a ring: {g}"
        );
    }
    let text = std::fs::read_to_string(&dot).unwrap();
    assert!(
        text.starts_with("digraph") && VMS.iter().all(|v| text.contains(v)),
        "{text}"
    );
    if std::process::Command::new("dot")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        let png = std::fs::read(dot.with_extension("png"))
            .expect("graphviz is installed: the PNG is written");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    }

    for mode in [
        "workingset-restore",
        "hotrestore",
        "hotrestore-rl",
        "eager-rl",
    ] {
        // eager-rl has nothing left to load after the start: --start-quiet
        // changes nothing there but what the report says.
        let quiet = if mode == "eager-rl" {
            0
        } else {
            vmcsnap_agent::restore::CLUSTER_START_QUIET.as_millis() as u64
        };
        let mut args = vec![
            "restore",
            "--wait",
            "--cluster",
            "cut",
            "--mode",
            mode,
            "--json",
        ];
        if mode == "eager-rl" {
            args.extend(["--start-quiet", "0"]);
        }
        let r = env.json(&args);
        assert_eq!(r["mode"], mode);
        assert_eq!(
            r["start_quiet_ms"].as_u64(),
            Some(quiet),
            "{mode}: the quiet start is reported"
        );
        assert_eq!(r["edges"], g["edges"], "{mode}: the graph inspect showed");
        let vms = r["vms"].as_array().unwrap();
        assert_eq!(vms.len(), 4, "{mode}: {r}");
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        for v in vms {
            assert!(v["latency_ms"].as_f64().unwrap() > 0.0, "{mode}: {v}");
            let started = v["started_unix_us"]
                .as_u64()
                .expect("the guest's start time");
            assert!(
                started <= now_us && now_us - started < 600_000_000,
                "{mode}: a start time of this restore: {v}"
            );
            // Eager loads everything first. A working set may be empty: it
            // holds the pages the guest wrote during the snapshot, and a
            // guest starved of CPU for those ~100 ms may write none (seen
            // once in CI: r2, sampled size 33, nothing in the queue).
            if mode == "eager-rl" {
                assert!(v["pages_before_start"].as_u64().unwrap() > 0, "{mode}: {v}");
            } else {
                // Until its START, a VM loads its working set and the pages
                // QEMU faults on while it loads the device state, nothing
                // in the background: a VM that waits for START must not
                // take the CPUs and the disk from the VMs still loading
                // theirs (the restore line waits for those). Regression:
                // hotrestore-rl VMs pushed their background while they
                // waited, 5-37k pages per VM on the Redis cluster.
                assert_eq!(
                    v["background_before_start"], false,
                    "{mode}: {} pushed pages in the background before its START: {v}",
                    v["vm"]
                );
            }
        }
        if mode == "hotrestore-rl" {
            assert_eq!(
                r["starts_follow_dependencies"], true,
                "restore-line order: {r}"
            );
        }
        let replayed: u64 = vms
            .iter()
            .map(|v| v["frames_replayed"].as_u64().unwrap())
            .sum();
        assert_eq!(
            replayed,
            snap["channel_state_frames"].as_u64().unwrap(),
            "{mode}: every logged frame replayed"
        );
        let growth = |v: &serde_json::Value, k: &str| v["tcp_growth"][k].as_u64();
        type Growth = (
            String,
            Option<u64>,
            Option<u64>,
            Option<u64>,
            Option<u64>,
            Option<u64>,
        );
        let tcp: Vec<Growth> = vms
            .iter()
            .map(|v| {
                let name = v["vm"].as_str().unwrap().to_string();
                let lost = v["lost_segments"].as_u64();
                (
                    name,
                    growth(v, "retrans"),
                    growth(v, "tlp"),
                    growth(v, "tlp_recovered"),
                    growth(v, "dsack"),
                    lost,
                )
            })
            .collect();
        eprintln!(
            "{mode}: (vm, RetransSegs, TLPs, TLPs that repaired a loss, duplicate SACKs, lost) growth {tcp:?}, backoff avg {} ms",
            r["backoff_avg_ms"]
        );
        // No segment is lost across the cut and the restore: every frame in
        // flight was logged and replayed, and every frame the VMs' QEMUs had
        // read was in the guests (the cut probes). A lost segment shows as a
        // retransmission the peer answers without a duplicate SACK (and, for
        // a tail, as a loss probe that repaired it: TCPLossProbeRecovery;
        // seen in CI before the probes: RetransSegs +2 for r1 after every
        // restore of one snapshot, in every mode). Retransmissions do happen
        // after restores here, spurious ones: a peer that runs but is slow
        // for over 200 ms (TCG retranslating every guest's code at once on 2
        // cores, demand faults) gets a tail loss probe it already had and
        // answers with a duplicate SACK (docs/restore.md). Their number is
        // printed, not held to a bound: it is the host's speed (with the
        // quiet start, hotrestore-rl's was 0 in four runs in a row, and 0 in
        // 34 of 37 four-VM restores of the benchmark). Every one of them
        // must have been answered by a duplicate SACK (`lost` = 0).
        // Regression: CI once saw r1 with 3 retransmissions no duplicate
        // SACK answered after a workingset-restore; the guest's status line
        // had been read across a stall, counting loss probes in TcpExt but
        // not yet in RetransSegs (guest/init now reads RetransSegs on both
        // sides of TcpExt).
        for (vm, _, _, repaired, _, lost) in &tcp {
            assert_eq!(
                *repaired,
                Some(0),
                "{mode}: {vm}: a loss probe repaired a lost segment: {tcp:?}"
            );
            assert_eq!(
                *lost,
                Some(0),
                "{mode}: {vm}: a retransmission no duplicate SACK answered: {tcp:?}"
            );
        }

        // The workloads go on from the snapshot, on the same connections.
        for vm in RING {
            let total0 = last_field(&env.console(vm), "pingpong:", "total").unwrap_or(0);
            let c = env.wait_console(
                vm,
                "pingpong after the restore",
                Duration::from_secs(60),
                |c| last_field(c, "pingpong:", "total").unwrap_or(0) > total0 + 100,
            );
            assert_eq!(
                last_field(&c, "pingpong:", "conn"),
                Some(1),
                "{mode}: {vm}'s pingpong connection survived"
            );
        }
        let kvc = env.wait_console(
            "kvc",
            "kvload after the restore",
            Duration::from_secs(60),
            |c| c.lines().filter(|l| l.starts_with("kvload:")).count() >= 3,
        );
        assert_eq!(
            last_field(&kvc, "kvload:", "errors"),
            Some(0),
            "{mode}: KV verification:\n{}",
            common::tail(&kvc, 2000)
        );
        assert_eq!(
            last_field(&kvc, "kvload:", "conn"),
            Some(1),
            "{mode}: the KV connection survived"
        );
        for vm in VMS {
            let c = env.console(vm);
            assert!(
                !c.contains("MEMTOUCH-CORRUPTION"),
                "{mode}: {vm}: corruption:\n{}",
                common::tail(&c, 2000)
            );
            assert_eq!(
                last_field(&c, "memtouch:", "errors"),
                Some(0),
                "{mode}: {vm}"
            );
        }
        env.ok(&["down"]);
    }

    // A VM that fails once every VM has loaded (an injected fault: r1's
    // Cohort reports a failure in place of LOAD_FIN, after the others'
    // LOAD_FIN): r2 and r3, in r1's ring, cannot start before r1 does, so
    // they are abandoned while paused with their device state loaded and
    // postcopy under way, the case a real failure hits only by chance.
    // Their QEMUs are stopped and nothing of the restore is left.
    let e = env
        .vmcsnap_within(
            &[
                "restore",
                "--wait",
                "--cluster",
                "cut",
                "--inject-fault",
                "cohort-fail-when-peers-loaded=nope",
            ],
            Duration::from_secs(60),
        )
        .unwrap();
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && msg.contains("\"nope\"") && msg.contains("r1, r2, r3, kvc"),
        "an unknown VM in the fault is refused: {msg}"
    );
    env.assert_clean();
    let fault = [
        "restore",
        "--wait",
        "--cluster",
        "cut",
        "--mode",
        "hotrestore-rl",
        "--inject-fault",
        "cohort-fail-when-peers-loaded=r1",
    ];
    let out = env
        .vmcsnap_within(&fault, Duration::from_secs(300))
        .expect("the failed restore returns");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("r1: injected fault cohort-fail-when-peers-loaded"),
        "the error names the failed VM and why: {err}"
    );
    for vm in ["r2", "r3"] {
        let abandoned = format!("{vm}: abandoned while paused, loaded and waiting for START");
        assert_eq!(
            err.matches(&abandoned).count(),
            1,
            "{vm} waited paused for START and was abandoned, named once: {err}"
        );
    }
    assert!(
        !err.contains("QEMU exited"),
        "abandoned VMs are stopped by the restore, not reported as crashes: {err}"
    );
    let st = env.json(&["status", "--json"]);
    assert!(
        st["vms"].as_array().is_none_or(|v| v.is_empty()),
        "nothing of the abandoned restore runs: {st}"
    );
    eprintln!("the abandoned restore said: {err}");
    env.assert_clean();

    // Regression: a QEMU that died while its VM waited, paused, for START
    // went unnoticed until START's `cont` failed, so the rest of the ring
    // was started first (and then stopped). Here r1's QEMU is killed once
    // every VM has loaded, and no LOAD_FIN is sent for it: only the restore
    // noticing the dead QEMU by itself can end this restore before the
    // coordinator's 600 s load deadline, and it must do so before any
    // guest starts. `eager-rl`: every page has been sent
    // by then, so no page write can notice it first.
    let kill = [
        "restore",
        "--wait",
        "--cluster",
        "cut",
        "--mode",
        "eager-rl",
        "--inject-fault",
        "qemu-killed-when-peers-loaded=r1",
    ];
    let out = env
        .vmcsnap_within(&kill, Duration::from_secs(300))
        .expect("a restore whose QEMU died returns");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("its QEMU died while paused, loaded and waiting for START")
            && err.contains("SIGKILL"),
        "the error names r1's dead QEMU, where it was and the signal: {err}"
    );
    for vm in ["r2", "r3"] {
        assert!(
            err.contains(&format!("{vm}: abandoned while paused")),
            "{vm} was abandoned before it started: {err}"
        );
    }
    assert!(
        !err.contains("StartSent") && !err.contains("StartFin"),
        "no START went out: {err}"
    );
    eprintln!("the restore whose QEMU died said: {err}");
    env.assert_clean();

    // A VM whose memory image is corrupt fails the whole restore with an
    // error naming it: the Coordinator abandons the others (loaded, their
    // QEMUs paused waiting for START, or still loading), every QEMU of the
    // restore is stopped and nothing of it is left behind.
    let mem = env.run_dir().join("snapshots/cut/vms/r2/memory.img");
    let mut bytes = std::fs::read(&mem).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&mem, &bytes).unwrap();
    let out = env
        .vmcsnap_within(
            &[
                "restore",
                "--wait",
                "--cluster",
                "cut",
                "--mode",
                "eager-rl",
            ],
            Duration::from_secs(300),
        )
        .expect("the failed restore returns");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("r2") && err.to_lowercase().contains("crc"),
        "{err}"
    );
    let line = err
        .lines()
        .find(|l| l.starts_with("vmcsnap: error:"))
        .unwrap_or_default();
    assert_eq!(
        line.matches("CRC mismatch").count(),
        1,
        "the failed VM's error is given once: {err}"
    );
    let st = env.json(&["status", "--json"]);
    assert!(
        st["vms"].as_array().is_none_or(|v| v.is_empty()),
        "nothing of the failed restore runs: {st}"
    );
    eprintln!("the failed restore said: {err}");
    env.assert_clean();
}
