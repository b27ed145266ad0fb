//! Snapshots of a real VM under a high memory write rate: every mode
//! produces an image that verifies and holds exactly the memory of the
//! pause (compared page by page with a copy of the RAM file taken while the
//! VM was paused), the guest never sees corruption, the frozen disk stays
//! frozen while the guest keeps writing, a corrupted image is caught by
//! `inspect --verify`, and rejuvenation still works afterwards. The guest
//! reads files from its data disk first: the page-cache pages that hold
//! them are stored as references to the frozen disk (the detection layer),
//! read back through the qcow2 reader in every comparison and restore.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{cluster_lock, compare_with_reference, last_field, Env};

const SPEC: &str = r#"
[cluster]
name = "sn"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 224
workload = """
memtouch -m 32 -r 0 &
i=0; while :; do echo $i > /data/tick-$i; sync; i=$((i+1)); sleep 1; done &
dd if=/dev/urandom of=/data/rnd bs=4096 count=1024 2>/dev/null; sync; echo 3 > /proc/sys/vm/drop_caches; cat /data/rnd /data/blob > /dev/null; echo DISKREAD-DONE
"""
"#;

fn memtouch_writes(env: &Env) -> u64 {
    last_field(&env.console("a"), "memtouch:", "writes").unwrap_or(0)
}

/// Waits until memtouch has reported `n` more lines of progress.
fn wait_memtouch_progress(env: &Env, n: u64) -> String {
    let from = memtouch_writes(env);
    env.wait_console("a", "memtouch progress", Duration::from_secs(120), |c| {
        let lines: Vec<&str> = c
            .lines()
            .filter(|l| l.starts_with("memtouch: t="))
            .collect();
        lines.len() as u64 >= n && last_field(c, "memtouch:", "writes").unwrap_or(0) > from
    })
}

fn file_bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The highest N of the files `tick-N` in the ext4 root of a qcow2 image.
fn max_tick(qcow2: &Path, scratch: &Path) -> Option<u64> {
    let raw = scratch.join("disk.raw");
    let st = Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(qcow2)
        .arg(&raw)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img convert {}", qcow2.display());
    let out = Command::new("debugfs")
        .args(["-R", "ls -p /"])
        .arg(&raw)
        .output()
        .expect("debugfs");
    let _ = std::fs::remove_file(&raw);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split('/')
                .find_map(|f| f.strip_prefix("tick-")?.parse::<u64>().ok())
        })
        .max()
}

/// A snapshot report's pause breakdown: present, the parts of `mode` in
/// order, adding up to the measured downtime within 1 ms.
fn check_breakdown(mode: &str, r: &serde_json::Value) {
    let b = &r["pause"];
    let parts = b["parts"]
        .as_array()
        .unwrap_or_else(|| panic!("no breakdown: {r}"));
    let names: Vec<&str> = parts.iter().map(|p| p["name"].as_str().unwrap()).collect();
    let sum: u64 = parts.iter().map(|p| p["us"].as_u64().unwrap()).sum();
    let downtime_us = r["downtime_ms"].as_f64().unwrap() * 1000.0;
    assert!(
        (sum as f64 - downtime_us).abs() <= 1000.0,
        "parts add up to {sum} µs, the pause was {downtime_us} µs: {b}"
    );
    assert_eq!(b["total_us"].as_u64().unwrap(), sum, "{b}");
    let expected: &[&str] = match mode {
        "hot" => &[
            "stop",
            "disk_snapshot",
            "migrate_command",
            "qemu_setup",
            "device_state",
        ],
        "stop-copy" => &["stop", "disk_snapshot", "copy", "resume"],
        _ => &["switchover", "disk_snapshot", "copy", "ram_check", "resume"],
    };
    let without_agent: Vec<&str> = names.iter().copied().filter(|n| *n != "agent").collect();
    assert_eq!(without_agent, expected, "{b}");
    assert!(
        parts
            .iter()
            .any(|p| p["name"] == "disk_snapshot" && p["us"].as_u64() > Some(0)),
        "{b}"
    );
}

#[test]
fn snapshot_modes_are_exact_and_harmless() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.json(&["up", spec.to_str().unwrap(), "--json"]);
    wait_memtouch_progress(&env, 2);
    env.wait_console(
        "a",
        "the guest to read its data disk",
        Duration::from_secs(120),
        |c| c.contains("DISKREAD-DONE"),
    );

    // A snapshot failing while the VM is paused (here: the debug reference
    // copy cannot be written) leaves the VM running and nothing listed.
    let before = memtouch_writes(&env);
    let out = env.vmcsnap(&[
        "snapshot",
        "a",
        "--mode",
        "stop-copy",
        "--name",
        "bad",
        "--reference",
        "/nonexistent/dir/ref",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/dir/ref"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env.json(&["status", "--json"])["vms"][0]["state"],
        "running"
    );
    env.wait_console(
        "a",
        "memtouch to continue after a failed snapshot",
        Duration::from_secs(60),
        |c| last_field(c, "memtouch:", "writes").unwrap_or(0) > before,
    );
    let out = env.vmcsnap(&["snapshot", "a", "--name", "../x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad snapshot name"));
    let leftovers: Vec<String> = std::fs::read_dir(env.run_dir().join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".disks")
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");

    let mut measured = vec![];
    let mut first_hot: Option<serde_json::Value> = None;
    // Pre-copy three times: QEMU 7.2 under TCG loses writes in about one
    // pre-copy in four with guest RAM a multiple of 64 pages (vmcsnap
    // padded it for a while: `qemu::TCG_DIRTY_TRACKING_PAD_KIB`), and one
    // page in about 30 with it; every pre-copy is now checked against the
    // paused guest's RAM. The third pre-copy changes page 0 of guest RAM behind QEMU's
    // back in its pause (`precopy-untracked-write`, a write QEMU's dirty
    // tracking missed, put back before the guest resumes): the image must
    // hold the changed page all the same.
    for (mode, name) in [
        ("hot", "s-hot"),
        ("stop-copy", "s-stop-copy"),
        ("precopy", "s-precopy"),
        ("precopy", "s-precopy2"),
        ("precopy", "s-precopy3"),
        // Every storage of the image (format 2 LZ4 above, the default).
        ("hot", "s-hot-zstd"),
        ("hot", "s-hot-none"),
        ("stop-copy", "s-sc-v1"),
    ] {
        let name = name.to_string();
        let reference: PathBuf = env.run_dir().join(format!("ref-{name}.bin"));
        let before = memtouch_writes(&env);
        let storage = name
            .rsplit('-')
            .next()
            .filter(|s| ["zstd", "none", "v1"].contains(s));
        let mut args = vec![
            "snapshot",
            "a",
            "--mode",
            mode,
            "--name",
            &name,
            "--reference",
            reference.to_str().unwrap(),
            "--json",
        ];
        if let Some(s) = storage {
            args.extend(["--storage", s]);
        }
        let untracked = name == "s-precopy3";
        if untracked {
            args.extend(["--inject-fault", "precopy-untracked-write=0"]);
        }
        let r = env.json(&args);
        assert_eq!(r["name"], name.as_str());
        assert_eq!(r["mode"], mode);
        let dir = PathBuf::from(r["path"].as_str().unwrap());
        assert_eq!(dir, env.run_dir().join("snapshots").join(&name));
        let inspect = env.json(&["inspect", &name, "--verify", "--json"]);
        assert_eq!(inspect["verify"]["ok"], true, "{inspect}");
        assert_eq!(inspect["stats"]["pages_absent"], 0);
        assert_eq!(
            inspect["manifest"]["metrics"]["downtime_ms"],
            r["downtime_ms"].as_f64().unwrap().round() as u64
        );
        assert_eq!(
            inspect["format"],
            if storage == Some("v1") { "1.0" } else { "2.0" },
            "{inspect}"
        );
        if storage.is_none() || storage == Some("zstd") {
            assert!(
                inspect["stats"]["blocks_compressed"].as_u64().unwrap() > 0,
                "{inspect}"
            );
        }
        // Every snapshot after the first is incremental to the VM's newest
        // (v1 ones excepted): it is compared page by page through its chain.
        if name == "s-stop-copy" {
            assert_eq!(inspect["parent"]["name"], "s-hot", "{inspect}");
            assert!(
                inspect["stats"]["pages_in_parent"].as_u64().unwrap() > 0,
                "{inspect}"
            );
        }
        check_breakdown(mode, &r);
        if mode == "precopy" {
            let m = &inspect["manifest"]["metrics"];
            let pages = (224 * 1024 + 8) / 4;
            assert!(
                [pages, 224 * 256].contains(&m["precopy_pages_checked"].as_u64().unwrap()),
                "{m}"
            );
            let patched = m["precopy_pages_patched"].as_u64().unwrap();
            eprintln!("{name}: {patched} pages patched from the paused guest's RAM");
            assert!(!untracked || patched >= 1, "{m}");
        }
        let (stored, zero) = compare_with_reference(&dir, &reference);
        let _ = std::fs::remove_file(&reference);
        if mode == "hot" {
            // Copy on write: the guest kept writing during the snapshot.
            assert!(r["pages_guest_written"].as_u64().unwrap() > 0, "{r}");
            assert_eq!(inspect["fafl_len"], r["pages_guest_written"]);
            first_hot = Some(r.clone());
        }
        if storage != Some("v1") {
            // The detection layer: the page cache holds /data/rnd and
            // /data/blob (8 MiB), read from the disk frozen with the
            // snapshot; the comparison above read them through it.
            // An incremental snapshot finds them in its parent first (the
            // parent has them on its disk): the comparison above read
            // them through the chain, disk references included.
            let on_disk = inspect["stats"]["pages_on_disk"].as_u64().unwrap();
            let in_parent = inspect["stats"]["pages_in_parent"].as_u64().unwrap();
            let index = &inspect["manifest"]["metrics"]["disk_index"];
            eprintln!("{name}: {on_disk} pages on disk, {in_parent} in parent, disk index {index}");
            if inspect["parent"].is_null() {
                assert!(on_disk > 0, "no page found on the frozen disk: {inspect}");
            } else {
                assert!(on_disk + in_parent > 2048, "{inspect}");
            }
            // Verify read each of them, and those its parents keep on
            // their disks for it.
            assert!(
                inspect["verify"]["disk_pages_checked"].as_u64() >= Some(on_disk),
                "{inspect}"
            );
        }
        eprintln!(
            "{mode}: downtime {:.1} ms (disk snapshot {:.1} ms), duration {:.1} ms, stream {} bytes, {stored} pages stored, {zero} zero, {} guest-written",
            r["downtime_ms"].as_f64().unwrap(),
            r["disk_snapshot_ms"].as_f64().unwrap(),
            r["duration_ms"].as_f64().unwrap(),
            r["stream_bytes"],
            r["pages_guest_written"]
        );
        // The guest runs on and never sees a bad page.
        env.wait_console("a", "memtouch to continue", Duration::from_secs(60), |c| {
            last_field(c, "memtouch:", "writes").unwrap_or(0) > before
        });
        let status = env.json(&["status", "--json"]);
        assert_eq!(status["vms"][0]["state"], "running");
    }

    // Timings without the debug reference copy (which is inside the pause).
    for mode in ["hot", "stop-copy", "precopy"] {
        let name = format!("m-{mode}");
        let r = env.json(&["snapshot", "a", "--mode", mode, "--name", &name, "--json"]);
        let inspect = env.json(&["inspect", &name, "--verify", "--json"]);
        assert_eq!(inspect["verify"]["ok"], true);
        // The pause broken into its parts, in the report and the manifest.
        check_breakdown(mode, &r);
        assert_eq!(inspect["manifest"]["metrics"]["pause"], r["pause"]);
        measured.push((
            mode,
            r["downtime_ms"].as_f64().unwrap(),
            r["duration_ms"].as_f64().unwrap(),
            r["disk_snapshot_ms"].as_f64().unwrap(),
        ));
    }

    // The floor: QEMU's own background snapshot of the VM, nothing kept,
    // and the guest runs on.
    let listed = env.json(&["snapshots", "--json"])["snapshots"]
        .as_array()
        .unwrap()
        .len();
    let before = memtouch_writes(&env);
    let limit = env.json(&["pause-limit", "a", "--json"]);
    assert!(limit["downtime_ms"].as_f64().unwrap() > 0.0, "{limit}");
    assert!(
        limit["setup_while_running_ms"].as_f64().unwrap() > 0.0,
        "{limit}"
    );
    assert_eq!(
        env.json(&["snapshots", "--json"])["snapshots"]
            .as_array()
            .unwrap()
            .len(),
        listed
    );
    env.wait_console(
        "a",
        "memtouch to continue after pause-limit",
        Duration::from_secs(60),
        |c| last_field(c, "memtouch:", "writes").unwrap_or(0) > before,
    );
    let out = env.vmcsnap(&["pause-limit", "nosuchvm"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nosuchvm"));

    // The disk frozen by the hot snapshot stays frozen while the guest
    // writes a file every second to the overlay it now runs on.
    let hot = first_hot.unwrap();
    let frozen = PathBuf::from(hot["frozen_disk"].as_str().unwrap());
    let frozen_bytes = file_bytes(&frozen);
    let frozen_tick = max_tick(&frozen, env.run_dir());
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        file_bytes(&frozen) == frozen_bytes,
        "the frozen disk changed"
    );
    let live = env.run_dir().join("cluster/a");
    let overlays: Vec<PathBuf> = std::fs::read_dir(&live)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("data-")
        })
        .collect();
    let newest = overlays.iter().max().expect("an overlay").clone();
    let live_tick = max_tick(&newest, env.run_dir());
    assert!(
        live_tick > frozen_tick,
        "the live disk has no newer file: live {live_tick:?}, frozen {frozen_tick:?}"
    );

    // Listing.
    let list = env.json(&["snapshots", "--json"]);
    let names: Vec<&str> = list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec![
            "m-hot",
            "m-precopy",
            "m-stop-copy",
            "s-hot",
            "s-hot-none",
            "s-hot-zstd",
            "s-precopy",
            "s-precopy2",
            "s-precopy3",
            "s-sc-v1",
            "s-stop-copy"
        ]
    );
    assert!(list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["valid"] == true));

    // Rejuvenation still works after snapshots (capabilities were reset,
    // and the new QEMU opens the overlay).
    env.json(&["rejuvenate", "--vm", "a", "--mode", "warm", "--json"]);
    let text = wait_memtouch_progress(&env, 2);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("memtouch: t="))
        .collect();
    assert!(
        lines.iter().all(|l| common::field(l, "errors") == Some(0)),
        "memtouch saw errors:\n{}",
        lines.join("\n")
    );
    assert!(
        !text.contains("MEMTOUCH-CORRUPTION"),
        "corruption reported:\n{}",
        common::tail(&text, 3000)
    );
    let writes = memtouch_writes(&env);
    env.wait_console(
        "a",
        "memtouch after warm restart",
        Duration::from_secs(60),
        |c| last_field(c, "memtouch:", "writes").unwrap_or(0) > writes,
    );

    // One flipped byte in memory.img: verification fails, naming the block.
    let mem = env.run_dir().join("snapshots/s-stop-copy/memory.img");
    let mut bytes = file_bytes(&mem);
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&mem, &bytes).unwrap();
    let out = env.vmcsnap(&["inspect", "s-stop-copy", "--verify"]);
    assert!(!out.status.success(), "verify passed on a corrupted image");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stderr.contains("failed verification") && stderr.contains("block "),
        "{stderr}\n{stdout}"
    );
    assert!(stdout.contains("bad blocks"), "{stdout}");

    // A paused restore of the hot snapshot: the restored RAM is the image,
    // disk-reference pages included.
    env.ok(&["stop", "a"]);
    env.json(&[
        "restore", "--wait", "s-hot", "--mode", "lazy", "--paused", "--json",
    ]);
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-sn-a"))
        .expect("a's RAM file");
    let img =
        vmcsnap_agent::frozen_disks::open_image(&env.run_dir().join("snapshots/s-hot")).unwrap();
    assert!(img.stats().pages_on_disk > 0);
    let id = img.ram_block_id("mem").unwrap();
    let ps = img.page_size();
    let mut want = vec![0u8; img.ram_block_pages(id) as usize * ps];
    img.read_ram_block(id, &mut want).unwrap();
    let got = file_bytes(&ram);
    assert_eq!(got.len(), want.len());
    let bad = (0..want.len() / ps)
        .filter(|p| want[p * ps..(p + 1) * ps] != got[p * ps..(p + 1) * ps])
        .count();
    assert_eq!(bad, 0, "pages of the restored RAM differ from the image");

    for (mode, d, t, disk) in &measured {
        eprintln!("MEASURED {mode}: downtime_ms={d:.1} duration_ms={t:.1} disk_snapshot_ms={disk:.1} (224 MiB guest, memtouch -m 32 -r 0)");
    }
    env.ok(&["down"]);
    env.assert_clean();
}

#[test]
fn snapshot_without_a_cluster_or_of_an_unknown_vm_fails_cleanly() {
    let env = Env::new();
    let out = env.vmcsnap(&["snapshots", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 0);
    let out = env.vmcsnap(&["inspect", "nope", "--verify"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
}
