//! `--inject-fault` exists only in a `fault-injection` build, and even
//! there it never reaches the wire: the CLI arms the fault in the run
//! directory, and removes it when no operation took it. No agent and no VM
//! is needed: each check runs the CLI against an empty run directory.

use std::process::Command;

fn vmcsnap(run_dir: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vmcsnap"))
        .arg("--run-dir")
        .arg(run_dir)
        .args(args)
        .output()
        .expect("running vmcsnap");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
#[cfg(not(feature = "fault-injection"))]
fn a_build_without_the_feature_has_no_inject_fault() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["snapshot", "a", "--inject-fault", "capture-error-after=1"][..],
        &["rejuvenate", "--vm", "a", "--inject-fault", "new-qemu-dies"],
        &[
            "restore",
            "--cluster",
            "c",
            "--inject-fault",
            "start-held-until=/x",
        ],
    ] {
        let (ok, err) = vmcsnap(dir.path(), args);
        assert!(!ok, "{args:?} was accepted");
        assert!(
            err.contains("unexpected argument '--inject-fault'"),
            "{args:?}: {err}"
        );
    }
    assert!(!dir.path().join("faults").exists());
}

#[test]
#[cfg(feature = "fault-injection")]
fn a_fault_no_operation_took_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = vmcsnap(
        dir.path(),
        &["snapshot", "a", "--inject-fault", "capture-error-after=1"],
    );
    assert!(!ok, "a snapshot without an agent succeeded");
    assert!(err.contains("no vmcsnap agent"), "{err}");
    let faults = dir.path().join("faults");
    assert!(faults.is_dir(), "the fault was not armed in {faults:?}");
    let left: Vec<_> = std::fs::read_dir(&faults).unwrap().collect();
    assert!(left.is_empty(), "armed faults left behind: {left:?}");
}
