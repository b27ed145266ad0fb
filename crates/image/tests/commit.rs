//! The commit protocol: interrupted snapshots never appear as valid.

mod common;

use std::fs;

use common::*;
use vmcsnap_image::{
    check_committed, cleanup_stale, list_snapshots, process_running, Image, ImageWriter,
};

#[test]
fn uncommitted_snapshot_is_not_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    build(&root.join("done"));
    let mut w =
        ImageWriter::create(&root.join("pending"), meta(&[("mem", 8 * PS as u64)])).unwrap();
    w.add_page(0, 0, &[1u8; PS]).unwrap();
    w.set_device_state(b"d").unwrap();
    assert!(w.temp_path().starts_with(root) && w.temp_path().exists());
    let names: Vec<String> = list_snapshots(root)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, vec!["done"]);
    assert!(!root.join("pending").exists());
    // A running writer's directory survives cleanup.
    assert!(cleanup_stale(root).unwrap().is_empty());
    assert!(w.temp_path().exists());
    drop(w);
    assert_eq!(
        fs::read_dir(root).unwrap().count(),
        1,
        "drop left something behind"
    );
}

#[test]
fn crashed_writer_leaves_only_a_temp_dir_that_cleanup_removes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let mut w = ImageWriter::create(&root.join("s"), meta(&[("mem", 8 * PS as u64)])).unwrap();
    for p in 0..8 {
        w.add_page(0, p, &[p as u8 + 1; PS]).unwrap();
    }
    w.set_device_state(b"d").unwrap();
    let tmpdir = w.temp_path().to_path_buf();
    std::mem::forget(w); // a crash: no Drop, no commit
    assert!(tmpdir.exists());
    assert!(list_snapshots(root).unwrap().is_empty());
    assert!(Image::open(&tmpdir).is_err(), "a temp dir has no manifest");
    // Pretend the writer was a process that has exited.
    let dead = root.join("s.tmp-4000000000-0");
    fs::rename(&tmpdir, &dead).unwrap();
    fs::create_dir(root.join("t.tmp-junk")).unwrap();
    let removed = cleanup_stale(root).unwrap();
    assert_eq!(removed, vec![dead, root.join("t.tmp-junk")]);
    assert_eq!(fs::read_dir(root).unwrap().count(), 0);
}

/// Regression (CI, stop 25): an agent killed mid-snapshot stays a zombie
/// until whatever adopted it reaps it, and `/proc/<pid>` exists meanwhile;
/// the next agent kept its temporary directory as "being written".
#[test]
fn a_zombie_writers_temp_dir_is_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    // Not reaped: it stays a zombie once it has exited.
    let t = std::time::Instant::now();
    while process_running(pid) {
        assert!(t.elapsed().as_secs() < 10, "`true` did not exit");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the child is a zombie, still in /proc"
    );
    let dir = root.join(format!("s.tmp-{pid}-0"));
    fs::create_dir(&dir).unwrap();
    assert_eq!(cleanup_stale(root).unwrap(), vec![dir]);
    child.wait().unwrap();
    assert!(process_running(std::process::id()));
}

#[test]
fn drop_without_commit_removes_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    {
        let mut w =
            ImageWriter::create(&root.join("s"), meta(&[("mem", 100 * PS as u64)])).unwrap();
        for p in 0..100 {
            w.add_page(0, p, &[p as u8 + 1; PS]).unwrap();
        }
        w.trace_push(vmcsnap_image::PageKey::new(0, 1)).unwrap();
    }
    assert_eq!(fs::read_dir(root).unwrap().count(), 0);
    let w = ImageWriter::create(&root.join("s"), meta(&[])).unwrap();
    w.abort();
    assert_eq!(fs::read_dir(root).unwrap().count(), 0);
    assert!(list_snapshots(root).unwrap().is_empty());
}

#[test]
fn listing_reports_broken_snapshots_as_invalid() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    build(&root.join("a"));
    build(&root.join("b"));
    fs::create_dir(root.join("c-empty")).unwrap();
    fs::write(root.join("not-a-dir"), b"x").unwrap();
    fs::create_dir(root.join(".hidden")).unwrap();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(root.join("b/memory.img"))
        .unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 4096).unwrap();
    let list = list_snapshots(root).unwrap();
    let summary: Vec<(&str, bool)> = list
        .iter()
        .map(|e| (e.name.as_str(), e.is_valid()))
        .collect();
    assert_eq!(summary, vec![("a", true), ("b", false), ("c-empty", false)]);
    assert!(list[1]
        .status
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    assert_eq!(list[0].status.as_ref().unwrap().vm.name, "a");
    assert!(check_committed(&root.join("a")).is_ok());
}

#[test]
fn commit_does_not_clobber_an_existing_snapshot() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let mut w = ImageWriter::create(&root.join("s"), meta(&[])).unwrap();
    w.set_device_state(b"first").unwrap();
    // Someone else commits "s" meanwhile.
    let mut w2 = ImageWriter::create(&root.join("s"), meta(&[])).unwrap();
    w2.set_device_state(b"second").unwrap();
    w2.commit().unwrap();
    assert!(w.commit().is_err());
    let img = Image::open(&root.join("s")).unwrap();
    assert_eq!(img.device_state().unwrap(), b"second");
    assert_eq!(fs::read_dir(root).unwrap().count(), 1);
}

#[test]
fn a_cancelled_commit_leaves_nothing() {
    use std::sync::atomic::AtomicBool;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let mut w = ImageWriter::create(&root.join("s"), meta(&[])).unwrap();
    w.set_device_state(b"state").unwrap();
    let e = w.commit_unless(&AtomicBool::new(true)).unwrap_err();
    assert!(matches!(e, vmcsnap_image::WriteError::Cancelled), "{e}");
    assert!(e.to_string().contains("nothing was committed"), "{e}");
    assert_eq!(
        fs::read_dir(root).unwrap().count(),
        0,
        "no snapshot, no temporary directory"
    );
    let mut w = ImageWriter::create(&root.join("s"), meta(&[])).unwrap();
    w.set_device_state(b"state").unwrap();
    w.commit_unless(&AtomicBool::new(false)).unwrap();
    assert!(check_committed(&root.join("s")).is_ok());
}
