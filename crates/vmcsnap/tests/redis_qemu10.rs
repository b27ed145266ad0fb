//! `redis_cluster.rs`'s story on QEMU 10.0 (issue 30: real VMs on both
//! versions): `examples/redis.toml` (q35 `pc-q35-7.2`, Debian bookworm)
//! boots, is warm-restarted, snapshotted as a cluster under load, destroyed
//! and restored whole, with the replica's link back without a full resync
//! and the client on its first connection; a single VM's hot snapshot
//! restored `workingset` and `eager`.

mod common;
mod redis_story;

use common::{cluster_lock, qemu10, Env};

#[test]
fn redis_on_qemu_10_0_survives_rejuvenation_snapshots_and_restores() {
    let _l = cluster_lock();
    redis_story::story(Env::with_qemu(&qemu10()));
}
