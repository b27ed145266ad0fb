//! A hot snapshot reads guest RAM before its pause so that QEMU's read of
//! every page before write-protecting it (`qemu_setup`) costs no page
//! fault inside the pause. That read goes by guest-physical address, so it
//! must know where the machine maps RAM.
//!
//! Regression: the read used microvm's layout (3 GiB below 4 GiB) for
//! every VM; q35 keeps only 2 GiB low once a VM has 2.75 GiB or more, so
//! up to 1 GiB of such a VM's RAM was never read and QEMU populated it
//! inside the pause. The per-VM `ram` metrics of `snapshot --cluster`
//! say how much of guest RAM QEMU had mapped just before the pause.

mod common;

use common::{cluster_lock, Env};

/// One q35 Debian VM (the `redis` image) with 3 GiB of RAM, next to a lab
/// (microvm) VM.
const SPEC: &str = r#"
[cluster]
name = "q35ram"
accel = "auto"
boot_timeout_s = 900

[[vm]]
name = "big"
image_recipe = "redis"
memory_mib = 3072
cloud_init = false

[[vm]]
name = "lab"
memory_mib = 160
workload = """
memtouch -m 16 &
"""
"#;

#[test]
fn every_vm_has_all_its_ram_mapped_before_a_cluster_snapshot_pause() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    env.ok(&["up", spec.to_str().unwrap()]);
    for round in 0..2 {
        let name = format!("ram{round}");
        let r = env.json(&["snapshot", "--cluster", "--name", &name, "--json"]);
        let vms = r["vms"].as_array().unwrap();
        assert_eq!(vms.len(), 2, "{r}");
        for v in vms {
            let ram = &v["ram"];
            let pages = ram["ram_pages"].as_u64().expect("ram residency");
            let mapped = ram["resident_at_pause"].as_u64().unwrap();
            let want = if v["vm"] == "big" { 3072 } else { 160 } * 256;
            assert_eq!(pages, want, "round {round}: {v}");
            // The q35 legacy window (0xa0000-0xfffff) may stay unmapped.
            assert!(
                mapped + 256 >= pages,
                "round {round}: {} had {mapped} of {pages} pages of guest RAM mapped before its pause: {v}",
                v["vm"]
            );
            eprintln!(
                "round {round}: {}: ram {ram}, pause {}",
                v["vm"], v["pause"]
            );
        }
    }
    env.ok(&["down"]);
    env.assert_clean();
}
