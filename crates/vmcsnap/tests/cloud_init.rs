//! A VM with a cloud-init NoCloud seed (`cloud_init = true`): an image with
//! cloud-init (`vmcsnap image build cloud --packages cloud-init`) finds the
//! seed vmcsnap made, takes its hostname and the spec's SSH key, runs the
//! seed's ready-marker script, and the host logs in through the cluster's
//! network namespace. On Debian 12 (the default suite) and, opt-in because
//! it builds another image, Debian 13.

mod common;

use common::{cluster_lock, Env};

#[test]
fn cloud_init_takes_the_seed_and_ssh_works_through_vmcsnap_exec() {
    cloud_init_works("bookworm");
}

/// The same on Debian 13 (`--suite trixie`, kernel 6.12). Opt-in: its image
/// is one more build of several minutes
/// (`cargo test --release -p vmcsnap --test cloud_init -- --ignored`).
#[test]
#[ignore]
fn cloud_init_works_on_trixie() {
    cloud_init_works("trixie");
}

fn cloud_init_works(suite: &str) {
    let _l = cluster_lock();
    let env = Env::new();
    env.ok(&[
        "image",
        "build",
        "cloud",
        "--suite",
        suite,
        "--packages",
        "cloud-init",
    ]);
    let key = env.run_dir().join("key");
    let st = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", ""])
        .arg("-f")
        .arg(&key)
        .status()
        .unwrap();
    assert!(st.success());
    let spec = env.write_spec(&format!(
        r#"
[cluster]
name = "ci"
boot_timeout_s = 600

[[vm]]
name = "cloudy"
image_recipe = "cloud"
image_suite = "{suite}"
memory_mib = 512
cloud_init = true
ssh_authorized_keys = "key.pub"
"#
    ));
    env.ok(&["up", spec.to_str().unwrap()]);
    let key = key.to_str().unwrap();
    let out = env.vmcsnap(&[
        "exec",
        "--",
        "ssh",
        "-i",
        key,
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=60",
        "root@10.77.0.2",
        "hostname; cloud-init status --wait >/dev/null; cat /run/cloud-init/result.json",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ssh with the spec's key failed: {}{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.lines().next(), Some("cloudy"), "{text}");
    assert!(
        text.contains("DataSourceNoCloud"),
        "cloud-init did not take vmcsnap's seed: {text}"
    );
    // The seed's per-boot script writes the ready marker too (so that a
    // cloud image without vmcsnap's own ready unit is seen ready): this
    // image has both, so the events port gets two.
    let events = env.run_dir().join("cluster/cloudy/events.log");
    let t = std::time::Instant::now();
    while std::fs::read_to_string(&events)
        .unwrap_or_default()
        .matches("VMCSNAP-READY cloudy")
        .count()
        < 2
    {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(180),
            "no marker from cloud-init's per-boot script: {:?}",
            std::fs::read_to_string(&events)
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    env.ok(&["down"]);
    env.assert_clean();
}
