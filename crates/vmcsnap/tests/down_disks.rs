//! `down` removes every disk the VMs wrote, the overlay a snapshot put on
//! top included, and `gc` removes the disks a `down` left behind (issue 29,
//! 5d: `down` removed `disk0.qcow2` but left the VM's current overlay
//! `data-<ms>.qcow2` that backs on it, and `gc` did not see it).

mod common;

use std::path::{Path, PathBuf};

use common::{cluster_lock, Env};

const SPEC: &str = r#"
[cluster]
name = "dd"
accel = "auto"

[[vm]]
name = "a"
memory_mib = 192
"#;

/// The disk files under `cluster/`: qcow2 files and restored chains.
fn disks(run: &Path) -> Vec<PathBuf> {
    let mut found = vec![];
    let mut stack = vec![run.join("cluster")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if name.starts_with("disk-") {
                    found.push(p.clone());
                }
                stack.push(p);
            } else if name.ends_with(".qcow2") {
                found.push(p);
            }
        }
    }
    found.sort();
    found
}

fn qcow2(path: &Path) {
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(path)
        .arg("1M")
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn down_and_gc_leave_no_disk_of_a_vm() {
    let _l = cluster_lock();
    let env = Env::new();
    let spec = env.write_spec(SPEC);
    let run = env.run_dir().to_path_buf();
    env.ok(&["up", spec.to_str().unwrap()]);
    // The snapshot moves the VM onto a new overlay, data-<ms>.qcow2.
    env.ok(&["snapshot", "a", "--mode", "hot", "--name", "s1"]);
    assert!(
        disks(&run).iter().any(|p| p
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("data-")),
        "the VM runs on a snapshot's overlay: {:?}",
        disks(&run)
    );
    env.ok(&["down"]);
    assert_eq!(disks(&run), Vec::<PathBuf>::new(), "down left disks");
    assert!(
        run.join("cluster/a/console.log").exists(),
        "logs stay until the next up"
    );

    // A restored VM runs on a chain of its own (`disk-<ms>/`).
    env.ok(&["restore", "s1", "--mode", "eager"]);
    assert!(!disks(&run).is_empty());
    env.ok(&["down"]);
    assert_eq!(disks(&run), Vec::<PathBuf>::new(), "down left disks");

    // What an earlier `down` left, gc removes; the logs stay.
    let vm = run.join("cluster/a");
    qcow2(&vm.join("disk0.qcow2"));
    qcow2(&vm.join("data-1700000000000.qcow2"));
    std::fs::create_dir_all(vm.join("disk-1700000000000")).unwrap();
    qcow2(&vm.join("disk-1700000000000/data-1700000000000.qcow2"));
    let g = env.json(&["gc", "--json"]);
    let removed: Vec<PathBuf> = g["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| PathBuf::from(p.as_str().unwrap()))
        .collect();
    for f in [
        "disk0.qcow2",
        "data-1700000000000.qcow2",
        "disk-1700000000000",
    ] {
        assert!(removed.contains(&vm.join(f)), "gc removed {f}: {g}");
    }
    assert_eq!(disks(&run), Vec::<PathBuf>::new(), "gc left disks");
    assert!(vm.join("console.log").exists());
    // ... but never those of a VM that runs.
    env.ok(&["up", spec.to_str().unwrap()]);
    let before = disks(&run);
    assert!(!before.is_empty());
    env.ok(&["gc"]);
    assert_eq!(disks(&run), before, "gc took a running VM's disks");
    env.ok(&["down"]);
    env.assert_clean();
}
