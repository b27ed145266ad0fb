//! A VM snapshotted many times runs on a deep chain of disk overlays (one
//! per snapshot); snapshots, deletes and restores keep working however
//! deep it gets.
//!
//! Regression: the agent found a disk's chain by the file names QEMU gives
//! each image in `query-block`. An overlay a snapshot put on top is named
//! `json:{"backing": {…}}` (the whole chain below it), and QEMU cuts names
//! at 4095 bytes: the 33rd snapshot of a lab VM failed with "disk disk0
//! (…) is not among QEMU's block devices" (`agent::block_chains` now reads
//! QEMU's block graph).

mod common;

use common::{cluster_lock, Env};

const SPEC: &str = r#"
[cluster]
name = "ddc"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 128
workload = """
i=0; while :; do echo $i > /data/tick; sync; i=$((i+1)); sleep 1; done &
"""
"#;

/// More overlays than the 4095 bytes of a QEMU name hold (the 32nd
/// snapshot failed in this test before).
const SNAPSHOTS: usize = 36;

#[test]
fn thirty_six_snapshots_deletes_and_a_restore_on_one_disk_chain() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    for i in 1..=SNAPSHOTS {
        let name = format!("p{i}");
        env.full_snapshot("a", "stop-copy", &name);
        // Every other one deleted: the running VM's chain must be known
        // to the delete, which keeps the files a running VM reads.
        if i % 2 == 1 {
            env.ok(&["snapshots", "delete", &name]);
        }
    }
    let last = format!("p{SNAPSHOTS}");
    env.ok(&["inspect", &last, "--verify"]);
    env.ok(&["down"]);
    // The restored VM runs on the last snapshot's frozen chain, and can be
    // snapshotted again.
    env.ok(&["restore", "--wait", &last]);
    env.full_snapshot("a", "stop-copy", "after");
    env.ok(&["inspect", "after", "--verify"]);
    env.ok(&["down"]);
}
