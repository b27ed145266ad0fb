//! A VM with a cloud-init NoCloud seed (`cloud_init = true`): an image with
//! cloud-init (`vmcsnap image build cloud --packages cloud-init`) finds the
//! seed vmcsnap made, takes its hostname and the spec's SSH key, and the
//! host logs in through the cluster's network namespace.

mod common;

use common::{cluster_lock, Env};

#[test]
fn cloud_init_takes_the_seed_and_ssh_works_through_vmcsnap_exec() {
    let _l = cluster_lock();
    let env = Env::new();
    env.ok(&["image", "build", "cloud", "--packages", "cloud-init"]);
    let key = env.run_dir().join("key");
    let st = std::process::Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", ""]).arg("-f").arg(&key).status().unwrap();
    assert!(st.success());
    let spec = env.write_spec(
        r#"
[cluster]
name = "ci"
boot_timeout_s = 600

[[vm]]
name = "cloudy"
image_recipe = "cloud"
memory_mib = 512
cloud_init = true
ssh_authorized_keys = "key.pub"
"#,
    );
    env.ok(&["up", spec.to_str().unwrap()]);
    let key = key.to_str().unwrap();
    let out = env.vmcsnap(&[
        "exec", "--", "ssh", "-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=60", "root@10.77.0.2", "hostname; cat /run/cloud-init/result.json",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ssh with the spec's key failed: {}{text}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.lines().next(), Some("cloudy"), "{text}");
    assert!(text.contains("DataSourceNoCloud"), "cloud-init did not take vmcsnap's seed: {text}");
    env.ok(&["down"]);
    env.assert_clean();
}
