//! Bad input: one clear error naming what is wrong, non-zero exit, nothing
//! left running.

mod common;

use common::{cluster_lock, Env};

fn expect_error(env: &Env, spec_text: &str, needle: &str) -> String {
    let spec = env.write_spec(spec_text);
    let out = env.vmcsnap(&["up", spec.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "up succeeded on bad input; stderr: {err}"
    );
    let first = err
        .lines()
        .find(|l| l.starts_with("vmcsnap: error:"))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    assert!(
        first.contains(needle),
        "error line {first:?} does not name {needle:?}"
    );
    env.assert_clean();
    err
}

const VM: &str = "[[vm]]\nname = 'a'\nmemory_mib = 128\n";

#[test]
fn unknown_spec_field_is_named() {
    let env = Env::new();
    expect_error(
        &env,
        &format!("[cluster]\nname = 'c'\n{VM}colour = 'red'\n"),
        "colour",
    );
}

#[test]
fn duplicate_vm_name_is_named() {
    let env = Env::new();
    expect_error(
        &env,
        &format!("[cluster]\nname = 'c'\n{VM}{VM}"),
        "duplicate VM name \"a\"",
    );
}

#[test]
fn memory_below_guest_minimum_is_named() {
    let env = Env::new();
    let err = expect_error(
        &env,
        "[cluster]\nname = 'c'\n[[vm]]\nname = 'a'\nmemory_mib = 8\n",
        "memory_mib = 8",
    );
    assert!(
        err.contains(&format!("minimum of {} MiB", vmcsnap_guest::MIN_MEMORY_MIB)),
        "{err}"
    );
}

#[test]
fn missing_spec_file_is_named() {
    let env = Env::new();
    let out = env.vmcsnap(&["up", "/nonexistent/spec.toml"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/spec.toml"));
}

#[test]
fn missing_qemu_binary_names_the_package() {
    let _l = cluster_lock();
    let mut env = Env::new();
    env.extra_env.push((
        "VMCSNAP_QEMU".into(),
        "/nonexistent/qemu-system-x86_64".into(),
    ));
    expect_error(
        &env,
        &format!("[cluster]\nname = 'c'\naccel = 'tcg'\n{VM}"),
        "apt-get install qemu-system-x86",
    );
}

/// Fault matrix, `up` × a QEMU binary that fails after start: the error
/// quotes what QEMU said, and nothing is left.
#[test]
fn qemu_that_fails_after_start_is_quoted_and_leaves_nothing() {
    let _l = cluster_lock();
    let mut env = Env::new();
    let broken = env.run_dir().join("broken-qemu");
    std::fs::write(
        &broken,
        // It tells its version (up asks it first), then fails to start.
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'QEMU emulator version 7.2.22'; exit 0; }\n\
         echo 'qemu-system-x86_64: this build is broken' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&broken, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    env.extra_env
        .push(("VMCSNAP_QEMU".into(), broken.display().to_string()));
    let err = expect_error(
        &env,
        &format!("[cluster]\nname = 'c'\naccel = 'tcg'\n{VM}"),
        "VM \"a\"",
    );
    assert!(err.contains("this build is broken"), "{err}");
    assert!(env.shm_files().is_empty());
}

/// A QEMU that cannot even tell its version fails `up` before anything
/// starts, quoting what it said.
#[test]
fn qemu_that_cannot_tell_its_version_is_quoted() {
    let _l = cluster_lock();
    let mut env = Env::new();
    let broken = env.run_dir().join("broken-qemu");
    std::fs::write(
        &broken,
        "#!/bin/sh\necho 'qemu-system-x86_64: this build is broken' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&broken, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    env.extra_env
        .push(("VMCSNAP_QEMU".into(), broken.display().to_string()));
    let err = expect_error(
        &env,
        &format!("[cluster]\nname = 'c'\naccel = 'tcg'\n{VM}"),
        "--version",
    );
    assert!(err.contains("this build is broken"), "{err}");
    assert!(!env.run_dir().join("cluster/a").exists(), "{err}");
    assert!(env.shm_files().is_empty());
}

#[test]
fn vm_that_never_gets_ready_reports_its_console_and_leaves_nothing() {
    let _l = cluster_lock();
    let env = Env::new();
    // One second is less than the guest kernel needs to reach userspace
    // under TCG, so the ready marker cannot appear in time.
    let err = expect_error(
        &env,
        &format!("[cluster]\nname = 'c'\naccel = 'tcg'\nboot_timeout_s = 1\n{VM}"),
        "did not reach its ready marker within 1 s",
    );
    assert!(err.contains("last console lines"), "{err}");
}

#[test]
fn commands_without_a_cluster_say_so() {
    let env = Env::new();
    let out = env.vmcsnap(&["down"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no vmcsnap agent") || err.contains("no cluster is up"),
        "{err}"
    );
    let out = env.vmcsnap(&["status"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no cluster is up"));
}

/// Regression: `vmcsnap status | head` panicked ("failed printing to
/// stdout: Broken pipe") when the reader had gone.
#[test]
fn a_closed_stdout_ends_quietly() {
    use std::process::{Command, Stdio};
    let env = common::Env::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmcsnap"))
        .arg("--run-dir")
        .arg(env.run_dir())
        .arg("status")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before anything is printed
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Issue 23's tuning knobs and `--storage`: bad values are named before
/// the agent is asked (it checks them again for other clients).
#[test]
fn tuning_knobs_out_of_range_are_named() {
    let env = Env::new();
    for (args, needle) in [
        (
            &["snapshot", "a", "--block-pages", "0"][..],
            "0 is not in 1..=4096",
        ),
        (
            &["restore", "nosuch", "--prefetch-blocks", "99"][..],
            "99 is not in 0..=64",
        ),
        // `--storage` is parsed by the control crate's one parser.
        (
            &["snapshot", "a", "--storage", "lz4,nodisk"][..],
            "unknown image storage \"lz4,nodisk\": use one of zstd, lz4",
        ),
    ] {
        let out = env.vmcsnap(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn cluster_restore_bad_input_is_named() {
    let env = Env::new();
    // Options that only apply to one VM are refused with --cluster.
    let out = env.vmcsnap(&["restore", "--cluster", "x", "--paused"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    // A single-VM mode is not a cluster mode.
    let out = env.vmcsnap(&["restore", "--cluster", "x", "--mode", "lazy"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown cluster restore mode \"lazy\""),
        "{err}"
    );
    // An unknown cluster snapshot is named, and no cluster is left up.
    let out = env.vmcsnap(&["restore", "--cluster", "nosuch"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cluster snapshot \"nosuch\""), "{err}");
    // `status` finds the agent the restore started with no cluster, or (the
    // agent exits when idle; CI once got there first, and once connected
    // while it was exiting: see the control crate's backlog test) no agent at all.
    let out = env.vmcsnap(&["status"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        stdout.contains("no cluster is up") || stderr.contains("no vmcsnap agent"),
        "status after a failed cluster restore:\n{stdout}{stderr}"
    );
    // A cluster snapshot without a cluster.
    let out = env.vmcsnap(&["snapshot", "--cluster"]);
    assert!(!out.status.success());
}

/// A spec with one image VM whose image is `image` (a path in the spec).
fn image_spec(image: &str, extra: &str) -> String {
    format!("[cluster]\nname = 'c'\naccel = 'tcg'\n{extra}\n[[vm]]\nname = 'a'\nmemory_mib = 256\ncloud_init = false\nimage = '{image}'\n")
}

#[test]
fn an_image_that_does_not_exist_is_named() {
    let _l = cluster_lock();
    let env = Env::new();
    let err = expect_error(
        &env,
        &image_spec("/nonexistent/debian.qcow2", ""),
        "/nonexistent/debian.qcow2",
    );
    assert!(err.contains("cannot read"), "{err}");
}

#[test]
fn a_file_that_is_not_a_disk_image_is_named() {
    let _l = cluster_lock();
    let env = Env::new();
    let notes = env.run_dir().join("notes.txt");
    std::fs::write(&notes, "not a disk\n".repeat(500)).unwrap();
    let err = expect_error(&env, &image_spec(notes.to_str().unwrap(), ""), "notes.txt");
    assert!(err.contains("not a disk image"), "{err}");
}

#[test]
fn an_image_that_does_not_boot_fails_up_by_the_boot_timeout() {
    let _l = cluster_lock();
    let env = Env::new();
    // A disk with a partition table and nothing to boot: SeaBIOS finds no
    // bootable device, and no ready marker ever comes.
    let disk = env.run_dir().join("blank.raw");
    let mut bytes = vec![0u8; 4 << 20];
    bytes[510] = 0x55;
    bytes[511] = 0xaa;
    std::fs::write(&disk, bytes).unwrap();
    let err = expect_error(
        &env,
        &image_spec(disk.to_str().unwrap(), "boot_timeout_s = 8"),
        "did not reach its ready marker within 8 s",
    );
    assert!(err.contains("\"a\""), "{err}");
    assert!(disk.exists(), "the user's image is never removed");
}

/// Issue 20: a VM of 1 TiB (the spec's largest memory_mib) on a host with
/// far less is refused by the capacity check before anything is created:
/// no RAM file in /dev/shm, no QEMU.
#[test]
fn more_guest_memory_than_the_host_has_is_refused_before_anything_starts() {
    let _l = cluster_lock();
    let env = Env::new();
    let err = expect_error(
        &env,
        "[cluster]\nname = 'c'\n[[vm]]\nname = 'a'\nmemory_mib = 1048576\n",
        "not enough",
    );
    let line = err
        .lines()
        .find(|l| l.starts_with("vmcsnap: error:"))
        .expect("an error line");
    // Memory is checked first; a host with more MemAvailable than /dev/shm
    // has room could only be short of /dev/shm.
    assert!(
        line.contains("not enough memory to start 1 VM")
            || line.contains("not enough space in /dev/shm to start 1 VM"),
        "{line}"
    );
    assert!(line.contains("1048576 MiB"), "names the guest RAM: {line}");
    assert!(
        line.contains("MiB available") || line.contains("MiB free in /dev/shm"),
        "names what the host has: {line}"
    );
    assert!(line.contains("lower memory_mib"), "says what to do: {line}");
    assert_eq!(env.shm_files(), Vec::<std::path::PathBuf>::new());
    assert!(
        !env.run_dir().join("cluster").exists(),
        "nothing was created in the run directory"
    );
}
