//! Issue 29's acceptance test: a Debian image VM (`vmcsnap image build
//! base`) with an extra raw disk and a workload over 4 KB. The workload
//! copies its own first 4 KiB onto the extra disk (so the bytes are known,
//! and only a workload that arrived whole prints its end marker); a cluster
//! snapshot freezes every disk; the guest then overwrites those bytes; the
//! cluster is destroyed and restored, and the extra disk holds the
//! snapshot's bytes again, read by the guest itself past its page cache,
//! and the guest's clock is the host's (it lagged by the snapshot's age).
//!
//! Before the fixes: `up` refused the workload (the lab guest's 2047-byte
//! command line), the snapshot froze only the root disk and its restore
//! failed to open the removed `cluster/w/disk0.qcow2`, and the restored
//! guest's clock lagged the host by the time since the snapshot.

mod common;

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{cluster_lock, Env};
use vmcsnap_qmp::ga::GuestAgent;

/// The extra disk as the guest names it (its node is `disk0`).
const DEV: &str = "/dev/disk/by-id/virtio-disk0";
/// The 4 KiB block of the extra disk the test writes.
const BLOCK: u64 = 256;

/// The workload: writes its own first 4 KiB to block [`BLOCK`] of the extra
/// disk, past the page cache; padded with comments to over 4 KB.
fn workload() -> String {
    let mut w = String::from(
        "#!/bin/sh\n# vmcsnap issue 29: a workload over 4 KB reaches an image VM whole.\n",
    );
    for i in 0..80 {
        w +=
            &format!("# padding line {i:02}: the lab guest's command line would cut this script\n");
    }
    w += &format!(
        "while [ ! -e {DEV} ]; do sleep 1; done\n\
         head -c 4096 /run/vmcsnap/workload.sh | dd of={DEV} bs=4096 seek={BLOCK} oflag=direct conv=fsync status=none\n\
         echo WORKLOAD-END\n"
    );
    assert!(w.len() > 4096 + 1024, "{}", w.len());
    w
}

fn agent(env: &Env) -> GuestAgent {
    GuestAgent::connect(
        &env.run_dir().join("cluster/w/qga.sock"),
        Duration::from_secs(60),
    )
    .expect("the guest agent answers")
}

/// Block [`BLOCK`] of the extra disk as the guest reads it from the disk.
fn read_block(env: &Env) -> Vec<u8> {
    let skip = format!("skip={BLOCK}");
    let out = agent(env)
        .exec(
            "/bin/dd",
            &[
                &format!("if={DEV}"),
                "bs=4096",
                &skip,
                "count=1",
                "iflag=direct",
                "status=none",
            ],
        )
        .unwrap();
    assert!(
        out.success(),
        "dd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The guest fills block [`BLOCK`] of the extra disk with `c`.
fn write_block(env: &Env, c: char) {
    let fill = format!(
        "head -c 4096 /dev/zero | tr '\\0' {c} | dd of={DEV} bs=4096 seek={BLOCK} oflag=direct conv=fsync status=none"
    );
    let out = agent(env).exec("/bin/sh", &["-c", &fill]).unwrap();
    assert!(out.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(read_block(env), vec![c as u8; 4096]);
}

fn host_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

/// A raw disk image holding an MBR signature (what vmcsnap asks of a raw
/// `disks` entry: a partition table or an ext file system).
fn payload_image(path: &Path) {
    let mut bytes = vec![0u8; 16 << 20];
    bytes[510] = 0x55;
    bytes[511] = 0xaa;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn an_image_vms_extra_disk_and_clock_survive_a_cluster_snapshot_down_and_restore() {
    let _l = cluster_lock();
    let env = Env::new();
    env.ok(&["image", "build", "base"]);
    payload_image(&env.run_dir().join("payload.img"));
    let workload = workload();
    let spec = env.write_spec(&format!(
        r#"
[cluster]
name = "dk"
boot_timeout_s = 900

[[vm]]
name = "w"
image_recipe = "base"
memory_mib = 512
disks = [{{ path = "payload.img", format = "raw" }}]
workload = {workload:?}
"#
    ));
    env.ok(&["up", spec.to_str().unwrap()]);
    let expected = workload.as_bytes()[..4096].to_vec();
    let t = Instant::now();
    while read_block(&env) != expected {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the workload did not write its bytes to the extra disk:\n{}",
            env.console("w")
        );
        std::thread::sleep(Duration::from_secs(2));
    }

    let snap = env.json(&["snapshot", "--cluster", "--name", "ds", "--json"]);
    assert_eq!(snap["vms"].as_array().map(Vec::len), Some(1), "{snap}");
    env.ok(&["inspect", "ds", "--cluster", "--verify"]);
    // Every writable disk frozen, each inside the snapshot's own frozen disks.
    let img =
        vmcsnap_agent::frozen_disks::open_image(&env.run_dir().join("snapshots/ds/vms/w")).unwrap();
    let disks = &img.manifest().disks;
    let own = env.run_dir().join("snapshots/.disks/ds/w");
    let nodes: Vec<&str> = disks
        .iter()
        .map(|d| d.extra["config_node"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["root0", "disk0"], "{disks:?}");
    for d in disks {
        assert!(Path::new(&d.path).starts_with(&own), "{d:?}");
    }

    // The guest changes the bytes after the snapshot; the restore must not
    // see that.
    write_block(&env, 'Q');
    env.ok(&["down"]);
    // Give the snapshot an age the guest's clock would lag by.
    std::thread::sleep(Duration::from_secs(5));

    let restored = env.json(&["restore", "--cluster", "ds", "--json"]);
    let clocks = restored["guest_clocks"].as_array().expect("guest_clocks");
    assert_eq!(clocks.len(), 1, "{restored}");
    eprintln!("guest clock after the restore: {}", clocks[0]);
    assert_eq!(clocks[0]["outcome"], "set", "{restored}");
    assert!(
        clocks[0]["offset_before_ms"].as_f64().unwrap() < -4000.0,
        "the restored guest's clock did not lag by the snapshot's age: {}",
        clocks[0]
    );
    assert!(
        clocks[0]["offset_after_ms"].as_f64().unwrap().abs() < 3000.0,
        "{}",
        clocks[0]
    );
    assert_eq!(
        read_block(&env),
        expected,
        "the extra disk does not hold the snapshot's bytes after the restore"
    );
    // The guest's clock, read independently: within a few seconds of the host's.
    let mut ga = agent(&env);
    let before = host_ns();
    let guest = ga.get_time_ns().unwrap();
    let after = host_ns();
    let off_ms = (guest - (before + after) / 2) as f64 / 1e6;
    assert!(
        off_ms.abs() < 3000.0,
        "guest clock {off_ms:+.0} ms off the host's"
    );
    drop(ga);

    // A snapshot of the VM alone freezes every disk too, and its restore
    // sets the clock as well.
    write_block(&env, 'R');
    env.ok(&["snapshot", "w", "--name", "s1"]);
    write_block(&env, 'S');
    env.ok(&["stop", "w"]);
    std::thread::sleep(Duration::from_secs(5));
    let one = env.json(&["restore", "s1", "--mode", "eager", "--json"]);
    eprintln!("guest clock after the VM's restore: {}", one["clock"]);
    assert_eq!(one["clock"]["outcome"], "set", "{one}");
    assert!(
        one["clock"]["offset_before_ms"].as_f64().unwrap() < -4000.0,
        "{one}"
    );
    assert_eq!(read_block(&env), vec![b'R'; 4096]);
    env.ok(&["down"]);
    env.assert_clean();
}
