//! The user's case: `examples/redis.toml`, a Redis primary, a replica and
//! a client driving a verifying load (redisload), all on Debian bookworm
//! images that `vmcsnap image build redis` makes, with systemd, DHCP from
//! the switch, and the host reaching them through the cluster's network
//! namespace (`vmcsnap exec`).
//!
//! One cluster boot for the whole file (a Debian VM boots in 15-60 s under
//! TCG): warm rejuvenation keeps Redis's connections and data; a hot
//! cluster snapshot under load, the cluster destroyed and restored whole
//! (default mode): the replica's link is up again without a full
//! resynchronisation, every key the client had acknowledged reads back
//! (redisload's full check), and the client carries on over the same
//! connection; a single VM's hot snapshot restored `workingset` and
//! `eager`; a stopped and restored primary is found by its replica again.

mod common;
mod redis_story;

use common::{cluster_lock, Env};

#[test]
fn redis_on_debian_images_survives_rejuvenation_snapshots_and_restores() {
    let _l = cluster_lock();
    redis_story::story(Env::new());
}
