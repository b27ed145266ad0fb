//! Debian 13 guests (issue 30 item 6): a VM of `vmcsnap image build base
//! --suite trixie` (kernel 6.12) boots to its ready marker under QEMU 7.2
//! and under QEMU 10.0, runs its workload (fw_cfg), its guest agent
//! answers, and it runs with the CPU model chosen for that QEMU (7.2's TCG:
//! `max,-cx16`, for 6.12 kernels; 10.0: the accelerator's `max`). On
//! 7.2 a hot snapshot of it restores `--paused` page for page.
//!
//! The image is built once and cached (several minutes the first time).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{cluster_lock, Env};
use vmcsnap_qmp::ga::GuestAgent;

fn spec(env: &Env) -> std::path::PathBuf {
    env.write_spec(
        r#"
[cluster]
name = "tx"
boot_timeout_s = 900

[[vm]]
name = "t"
image_recipe = "base"
image_suite = "trixie"
memory_mib = 320
cloud_init = false
workload = """
echo "TRIXIE-WORKLOAD kernel $(uname -r)"
"""
"#,
    )
}

/// Builds (or finds) the trixie image and checks what it is.
fn trixie_image(env: &Env) {
    let t = Instant::now();
    let b = env.json(&["image", "build", "base", "--suite", "trixie", "--json"]);
    eprintln!(
        "image build base --suite trixie: {:.1} s (cache hit if short)",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(b["suite"], "trixie", "{b}");
    let kernel = b["kernel_version"].as_str().unwrap();
    assert!(kernel.starts_with("6.12."), "{b}");
    let listed = env.ok(&["image", "list"]);
    assert!(
        listed
            .lines()
            .any(|l| l.contains("trixie") && l.contains(kernel)),
        "{listed}"
    );
}

/// `up`: the VM's boot time (ms) as the agent measured it, and its
/// accelerator.
fn up(env: &Env) -> (u64, String) {
    let up = env.json(&["up", spec(env).to_str().unwrap(), "--json"]);
    let vm = &up["vms"][0];
    (
        vm["boot_ms"].as_u64().expect("boot_ms"),
        vm["accel"].as_str().expect("accel").to_string(),
    )
}

/// The `-cpu` a VM of `accel` must run with when TCG gets `tcg`.
fn want_cpu(accel: &str, tcg: &str) -> String {
    match accel {
        "kvm" => "host".into(),
        _ => tcg.into(),
    }
}

/// The `-cpu` argument of this run directory's QEMU of VM t.
fn qemu_cpu(env: &Env) -> String {
    for pid in env.processes() {
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| a.starts_with("guest=t,")) {
            let i = args.iter().position(|a| a == "-cpu").expect("-cpu");
            return args[i + 1].clone();
        }
    }
    panic!("no QEMU of VM t found")
}

/// The guest agent answers and the guest runs a 6.12 kernel; the workload
/// came through fw_cfg and ran.
fn check_guest(env: &Env) {
    let mut ga = GuestAgent::connect(
        &env.run_dir().join("cluster/t/qga.sock"),
        Duration::from_secs(120),
    )
    .expect("the guest agent answers");
    let out = ga.exec("/bin/uname", &["-r"]).unwrap();
    assert!(out.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let release = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(release.starts_with("6.12."), "{release}");
    let out = ga
        .exec("/bin/cat", &["/etc/debian_version", "/etc/vmcsnap-image"])
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.starts_with("13."), "{text}");
    assert!(text.contains("base"), "{text}");
    env.wait_console("t", "the workload", Duration::from_secs(300), |c| {
        c.contains(&format!("TRIXIE-WORKLOAD kernel {release}"))
    });
}

/// Page-by-page comparison of `ram` (a RAM file) with block "mem" of the image.
fn assert_ram_equals_image(img_dir: &Path, ram: &Path) {
    let img = vmcsnap_agent::frozen_disks::open_image(img_dir).unwrap();
    let id = img.ram_block_id("mem").unwrap();
    let ps = img.page_size();
    let ram = std::fs::read(ram).unwrap();
    let mut want = vec![0u8; img.ram_block_pages(id) as usize * ps];
    img.read_ram_block(id, &mut want).unwrap();
    assert_eq!(ram.len(), want.len());
    let bad: Vec<usize> = (0..want.len() / ps)
        .filter(|p| want[p * ps..(p + 1) * ps] != ram[p * ps..(p + 1) * ps])
        .collect();
    assert!(
        bad.is_empty(),
        "{} pages differ from the image, first {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
}

#[test]
fn a_trixie_vm_runs_on_qemu_7_2_without_cx16_and_its_hot_snapshot_restores_page_exact() {
    let _l = cluster_lock();
    let env = Env::new();
    trixie_image(&env);
    let (boot_ms, accel) = up(&env);
    eprintln!("QEMU 7.2: trixie VM ready after {boot_ms} ms ({accel})");
    let cpu = want_cpu(&accel, "max,-cx16");
    assert_eq!(qemu_cpu(&env), cpu);
    check_guest(&env);

    env.ok(&["snapshot", "t", "--mode", "hot", "--name", "s-hot"]);
    env.ok(&["stop", "t"]);
    let r = env.json(&[
        "restore", "s-hot", "--mode", "lazy", "--paused", "--wait", "--json",
    ]);
    eprintln!("restore --paused: {r}");
    let st = env.json(&["status", "--json"]);
    assert_eq!(st["vms"][0]["state"], "paused", "{st}");
    // The restored VM keeps the CPU model it was created with.
    assert_eq!(qemu_cpu(&env), cpu);
    let ram = env
        .shm_files()
        .into_iter()
        .find(|p| p.to_string_lossy().ends_with("-tx-t"))
        .expect("t's RAM file");
    assert_ram_equals_image(&env.run_dir().join("snapshots/s-hot"), &ram);
    env.ok(&["down"]);
    env.assert_clean();
}

#[test]
fn a_trixie_vm_runs_on_qemu_10_0_with_plain_max() {
    let _l = cluster_lock();
    let env = Env::with_qemu(&common::qemu10());
    trixie_image(&env);
    let (boot_ms, accel) = up(&env);
    eprintln!("QEMU 10.0: trixie VM ready after {boot_ms} ms ({accel})");
    assert_eq!(qemu_cpu(&env), want_cpu(&accel, "max"));
    check_guest(&env);
    env.ok(&["down"]);
    env.assert_clean();
}

/// The CPU model is chosen by the QEMU version, so `up` asks the binary
/// first: a version vmcsnap does not know is one error naming it, before
/// any VM exists.
#[test]
fn up_refuses_a_qemu_of_an_unknown_version_before_starting_anything() {
    use std::os::unix::fs::PermissionsExt;
    let _l = cluster_lock();
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("qemu-system-x86_64");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'QEMU emulator version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)'\nexit 0\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let env = Env::with_qemu(&fake);
    let out = env.vmcsnap(&["up", spec(&env).to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("QEMU 8.2.2 is not supported") && err.contains("install-qemu.sh"),
        "{err}"
    );
    assert!(!env.run_dir().join("cluster/t").exists(), "{err}");
    let _ = env.vmcsnap(&["down"]);
    env.assert_clean();
}
