//! The first stop-copy snapshot of a busy VM under TCG completes.
//!
//! Regression: vmcsnap used to give TCG guests 8 KiB more RAM than asked
//! (`qemu::TCG_DIRTY_TRACKING_PAD_KIB`), which sent QEMU's dirty-bitmap
//! sync down its per-page path: one reset of TCG's whole TLB per dirty
//! page, with the big lock held. A migration's first sync finds every page
//! dirty, and a guest that has written a lot has a big TLB: the first
//! stop-copy snapshot of a 1 GiB lab guest running `memtouch -m 600` froze
//! QEMU 7.2 for minutes and failed ("the capture made no progress for 30s
//! after 0 MiB"), 7 of 7 runs; the same snapshot now takes 1.3-1.8 s.

mod common;

use common::{cluster_lock, last_field, Env};
use std::time::Duration;

const SPEC: &str = r#"
[cluster]
name = "sfs"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 1024
workload = """
memtouch -m 600 &
"""
"#;

#[test]
fn the_first_stop_copy_snapshot_of_a_busy_vm_completes() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    // memtouch has run 20 s: every page dirty for the first sync, TCG's
    // TLB grown (after 2 sweeps, ~10 s, the snapshot did not stall yet).
    env.wait_console("a", "20 s of memtouch", Duration::from_secs(300), |c| {
        last_field(c, "memtouch:", "t").unwrap_or(0) >= 20
    });
    env.full_snapshot("a", "stop-copy", "s1");
    let verify = env.ok(&["inspect", "s1", "--verify"]);
    assert!(verify.contains("  verify "), "{verify}");
    // The guest runs on, its memory intact.
    let n = common::memtouch_lines(&env.console("a"));
    let c = env.wait_console("a", "a memtouch report", Duration::from_secs(120), |c| {
        common::memtouch_lines(c) > n
    });
    assert_eq!(last_field(&c, "memtouch:", "errors"), Some(0), "{c}");
    env.ok(&["down"]);
}
