//! The fault matrix (issue 20): operations × the faults production brings,
//! on one lab cluster booted once, with invariants checked after every
//! cell:
//!
//! - no VM lost or left paused: every VM the cell does not kill runs (the
//!   ones it kills come back through the operation an operator would use);
//! - the workload is clean: memtouch goes on with 0 errors in every VM;
//! - no partial snapshot: everything `snapshots --json` lists is valid, and
//!   no temporary directory is left in the snapshot directory;
//! - nothing leaked: `vmcsnap gc` finds nothing to remove, /dev/shm holds
//!   exactly the RAM files of the running VMs, and the only processes of
//!   the run directory are the agent and the VMs' QEMUs;
//! - the next operation works: a hot snapshot of a VM, verified.
//!
//! The run directory is a tmpfs of its own (mounted by the test: it runs as
//! root, as the whole suite does), so "disk full" is a real ENOSPC. Not only
//! the snapshot directory: a snapshot keeps its frozen disk as hard links of
//! the VM's disk files, so the two must share a file system (a snapshot
//! directory mounted apart is refused with an error that says so; unit test
//! in `disk_chain`).
//!
//! `fast_cells` runs in the default suite; `every_cell` (ignored by default)
//! is the whole matrix: `make test-faults` runs it together with
//! `agent_killed.rs` (agent `kill -9` in every operation) and
//! `snapshot_failure.rs` (capture errors, stalls, hung commits, panics).
//! Each prints its table.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{cluster_lock, last_field, memtouch_lines, Env};

const SPEC: &str = r#"
[cluster]
name = "fm"
accel = "auto"

[[vm]]
name = "srv"
memory_mib = 256
workload = """
memtouch -m 48 -r 0 &
pingpong server 7000 &
"""

[[vm]]
name = "cli"
memory_mib = 192
workload = """
memtouch -m 16 -r 0 &
pingpong client {ip:srv} 7000 &
"""
"#;

const VMS: [&str; 2] = ["srv", "cli"];
/// Size of the run directory's tmpfs.
const RUN_FS_MIB: u64 = 1536;
/// Free space left in it for a "disk full" cell: far less than a snapshot.
const FULL_FREE_MIB: u64 = 12;
/// Longer than any operation here takes; only a hang takes longer.
const HANG: Duration = Duration::from_secs(400);

/// A tmpfs mounted for the test, lazily unmounted at the end.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, mib: u64) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let st = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .unwrap();
        assert!(
            st.success(),
            "the fault matrix mounts a {mib} MiB tmpfs on {} to fill it (disk full): run it as root",
            dir.display()
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        // The run directory's own removal (before, in `Env`'s drop) could
        // not remove its mount point.
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The cluster, its snapshots of each VM to come back from, and the table.
struct Matrix {
    env: Env,
    /// After `env`: dropped once `env` has taken the cluster down.
    _fs: Tmpfs,
    snapshots: PathBuf,
    base: Vec<(String, String)>,
    table: Vec<String>,
    n: u32,
}

/// What a cell leaves: the VMs it killed were brought back, or not.
struct Outcome {
    /// What happened, for the table.
    note: String,
}

impl Matrix {
    fn new() -> Matrix {
        let env = Env::new();
        let fs = Tmpfs::mount(env.run_dir(), RUN_FS_MIB);
        let snapshots = env.run_dir().join("snapshots");
        let spec = env.write_spec(SPEC);
        env.ok(&["up", spec.to_str().unwrap()]);
        let mut m = Matrix {
            env,
            _fs: fs,
            snapshots,
            base: vec![],
            table: vec![],
            n: 0,
        };
        for vm in VMS {
            m.wait_memtouch(vm, "the first memtouch reports");
            let name = format!("base-{vm}");
            m.ok(&["snapshot", vm, "--mode", "hot", "--name", &name]);
            m.base.push((vm.to_string(), name));
        }
        m
    }

    fn run(&self, args: &[&str]) -> (bool, String) {
        let out = self.env.vmcsnap_within(args, HANG).unwrap_or_else(|| {
            panic!(
                "vmcsnap {args:?} hung for {HANG:?}; agent log:\n{}",
                self.agent_log()
            )
        });
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, text) = self.run(args);
        assert!(ok, "vmcsnap {args:?} failed:\n{text}\n{}", self.agent_log());
        text
    }

    fn agent_log(&self) -> String {
        let log = std::fs::read_to_string(self.env.run_dir().join("agent.log")).unwrap_or_default();
        common::tail(&log, 3000).to_string()
    }

    fn status(&self) -> Vec<(String, String, u32)> {
        let st = self.env.json(&["status", "--json"]);
        st["vms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap().to_string(),
                    v["state"].as_str().unwrap().to_string(),
                    v["pid"].as_u64().unwrap() as u32,
                )
            })
            .collect()
    }

    fn pid(&self, vm: &str) -> u32 {
        self.status().into_iter().find(|s| s.0 == vm).unwrap().2
    }

    fn wait_memtouch(&self, vm: &str, what: &str) {
        let before = memtouch_lines(&self.env.console(vm));
        self.env
            .wait_console(vm, what, Duration::from_secs(120), |c| {
                memtouch_lines(c) >= before + 2
            });
    }

    /// A unique snapshot name for this cell.
    fn name(&mut self, what: &str) -> String {
        self.n += 1;
        format!("{what}-{}", self.n)
    }

    /// Fills the run directory's file system but `FULL_FREE_MIB`;
    /// returns the filler (a dot file: never listed as a snapshot).
    fn fill(&self) -> PathBuf {
        // SAFETY: statvfs on a NUL-terminated path into a zeroed struct.
        let free = unsafe {
            let mut st: libc::statvfs = std::mem::zeroed();
            let p = std::ffi::CString::new(self.snapshots.to_str().unwrap()).unwrap();
            assert_eq!(libc::statvfs(p.as_ptr(), &mut st), 0);
            st.f_bavail * st.f_frsize
        };
        std::fs::create_dir_all(&self.snapshots).unwrap();
        let filler = self.snapshots.join(".filler");
        let len = free.saturating_sub(FULL_FREE_MIB << 20);
        let st = Command::new("fallocate")
            .args(["-l", &len.to_string()])
            .arg(&filler)
            .status()
            .unwrap();
        assert!(st.success(), "fallocate {len} bytes");
        filler
    }

    /// Kills VM `vm`'s QEMU `after` into the command `args`; returns
    /// whether the command succeeded (it may have finished first) and its
    /// output.
    fn kill_qemu_during(&self, vm: &str, args: &[&str], after: Duration) -> (bool, String) {
        let pid = self.pid(vm);
        let child = self
            .env
            .command(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(after);
        // SAFETY: SIGKILL to the VM's QEMU, whose pid status just gave.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let t = Instant::now();
        let out = child.wait_with_output().unwrap();
        assert!(t.elapsed() < HANG, "vmcsnap {args:?} hung");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// Brings back `vm` after its QEMU was killed: stop it (its files go),
    /// restore it from its base snapshot.
    fn bring_back(&self, vm: &str) {
        let state = self.status().into_iter().find(|s| s.0 == vm).unwrap().1;
        assert_eq!(state, "exited", "VM {vm} whose QEMU was killed");
        self.ok(&["stop", vm]);
        let base = &self.base.iter().find(|b| b.0 == vm).unwrap().1;
        self.ok(&["restore", "--wait", base, "--mode", "lazy"]);
    }

    /// Restores `vm` from its base snapshot if a failed operation left it
    /// exited (stopped first) or out of the cluster.
    fn restore_if_gone(&self, vm: &str) -> bool {
        match self.status().into_iter().find(|s| s.0 == vm) {
            Some((_, state, _)) if state == "running" => return false,
            Some(_) => {
                self.ok(&["stop", vm]);
            }
            None => {}
        }
        let base = &self.base.iter().find(|b| b.0 == vm).unwrap().1;
        self.ok(&["restore", "--wait", base, "--mode", "lazy"]);
        true
    }

    /// Runs `args` (which starts a new QEMU for `vm`) and kills that QEMU
    /// `after` it appeared; returns whether the command succeeded, its
    /// output, and whether a QEMU was found to kill.
    fn kill_new_qemu_during(
        &self,
        vm: &str,
        args: &[&str],
        after: Duration,
    ) -> (bool, String, bool) {
        let known = self.env.processes();
        let mut child = self
            .env
            .command(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let needle = format!("cluster/{vm}/");
        let t = Instant::now();
        let mut killed = false;
        while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(60) {
            let new = self.env.processes().into_iter().find(|p| {
                !known.contains(p)
                    && std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|e| {
                        // Not qemu-img, which creates the VM's overlay first.
                        e.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("qemu-system"))
                    })
                    && std::fs::read(format!("/proc/{p}/cmdline"))
                        .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
            });
            if let Some(pid) = new {
                std::thread::sleep(after);
                // SAFETY: SIGKILL to the QEMU the command started (found by
                // its command line among the run directory's processes).
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                killed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text, killed)
    }

    /// After an operation that took the cluster down: the command lines of
    /// the run directory's processes still there after up to 10 s (the
    /// agent exits right after its answer).
    fn processes_left(&self) -> Vec<String> {
        let t = Instant::now();
        while !self.env.processes().is_empty() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.env
            .processes()
            .iter()
            .map(|p| {
                let c = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                String::from_utf8_lossy(&c).replace('\0', " ")
            })
            .collect()
    }

    /// The invariants, after `cell`.
    fn check(&mut self, cell: &str) {
        // No VM lost or left paused.
        let status = self.status();
        let mut names: Vec<&str> = status.iter().map(|s| s.0.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["cli", "srv"], "{cell}: a VM was lost: {status:?}");
        for (vm, state, pid) in &status {
            assert_eq!(state, "running", "{cell}: VM {vm} is {state}");
            assert!(
                Path::new(&format!("/proc/{pid}")).exists(),
                "{cell}: VM {vm}'s QEMU {pid} is gone"
            );
        }
        // The workload is clean.
        for vm in VMS {
            self.wait_memtouch(vm, &format!("memtouch after {cell}"));
            let c = self.env.console(vm);
            assert!(!c.contains("MEMTOUCH-CORRUPTION"), "{cell}: {vm} corrupt");
            assert_eq!(
                last_field(&c, "memtouch:", "errors"),
                Some(0),
                "{cell}: {vm}"
            );
        }
        // No partial snapshot listed, no temporary directory left.
        let list = self.env.json(&["snapshots", "--json"]);
        for s in list["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .chain(list["cluster_snapshots"].as_array().unwrap())
        {
            assert_eq!(
                s["valid"], true,
                "{cell}: an invalid snapshot is listed: {s}"
            );
        }
        let temps: Vec<String> = std::fs::read_dir(&self.snapshots)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect();
        assert!(
            temps.is_empty(),
            "{cell}: temporary directories left: {temps:?}"
        );
        // Nothing leaked. gc may drop cached disk indexes of files that
        // went away with the failed VM (a cache, not a leftover).
        let gc = self.env.json(&["gc", "--json"]);
        let index = self.env.run_dir().join("disk-index");
        let leaked: Vec<&str> = gc["removed"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p.as_str())
            .filter(|p| !std::path::Path::new(p).starts_with(&index))
            .collect();
        assert!(leaked.is_empty(), "{cell}: gc found leftovers: {gc}");
        assert_eq!(
            self.env.shm_files().len(),
            VMS.len(),
            "{cell}: /dev/shm: {:?}",
            self.env.shm_files()
        );
        let agent: u32 = std::fs::read_to_string(self.env.run_dir().join("agent.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let mut expected: Vec<u32> = status.iter().map(|s| s.2).chain([agent]).collect();
        expected.sort_unstable();
        let mut procs = self.env.processes();
        procs.sort_unstable();
        assert_eq!(procs, expected, "{cell}: processes of the run directory");
        // The next operation works.
        let next = self.name("next");
        self.ok(&["snapshot", "srv", "--mode", "hot", "--name", &next]);
        self.ok(&["inspect", &next, "--verify"]);
        // Deleted again (with its frozen disks; it may be the parent of
        // nothing yet, or merged into a child), so that the matrix fits its
        // tmpfs; then nothing is left for gc.
        let del = self.env.json(&["snapshots", "delete", &next, "--json"]);
        assert_eq!(del["removed"][0]["name"], next.as_str(), "{cell}: {del}");
        let gc = self.env.json(&["gc", "--json"]);
        assert_eq!(
            gc["removed"],
            serde_json::json!([]),
            "{cell}: gc after delete: {gc}"
        );
    }

    /// Runs one cell and checks the invariants; records a table row.
    fn cell(&mut self, op: &str, fault: &str, f: impl FnOnce(&mut Matrix) -> Outcome) {
        let t = Instant::now();
        let cell = format!("{op} × {fault}");
        eprintln!("cell {cell} ...");
        let outcome = f(self);
        self.check(&cell);
        self.table.push(format!(
            "| {op} | {fault} | {} | {:.0} |",
            outcome.note,
            t.elapsed().as_secs_f64()
        ));
    }

    fn print_table(&self) {
        eprintln!("| operation | fault | what happened (invariants held) | s |");
        eprintln!("|---|---|---|---|");
        for r in &self.table {
            eprintln!("{r}");
        }
    }
}

/// A snapshot into a full file system fails with an error that says so.
fn snapshot_disk_full(m: &mut Matrix, mode: &str) -> Outcome {
    let name = m.name(&format!("full-{mode}"));
    let filler = m.fill();
    let (ok, text) = m.run(&["snapshot", "srv", "--mode", mode, "--name", &name]);
    std::fs::remove_file(&filler).unwrap();
    assert!(!ok, "a {mode} snapshot into a full disk succeeded:\n{text}");
    assert!(
        text.to_lowercase().contains("space"),
        "the error does not say the disk is full:\n{text}"
    );
    assert!(!m.snapshots.join(&name).exists());
    Outcome {
        note: format!("fails: {}", last_line(&text)),
    }
}

/// What a snapshot whose VM's QEMU was killed left: a valid snapshot (it
/// had finished first) or nothing.
fn killed_snapshot_note(m: &Matrix, ok: bool, text: &str, name: &str, cluster: bool) -> String {
    if ok {
        let mut args = vec!["inspect", name];
        if cluster {
            args.push("--cluster");
        }
        args.push("--verify");
        m.ok(&args);
        "finished before the kill; valid".to_string()
    } else {
        assert!(!m.snapshots.join(name).exists(), "{text}");
        format!("fails: {}", last_line(text))
    }
}

/// A VM's QEMU killed while it is snapshotted: the snapshot fails (or had
/// finished and is valid); the VM comes back from its base snapshot.
fn snapshot_qemu_killed(m: &mut Matrix, mode: &str) -> Outcome {
    let name = m.name(&format!("killed-{mode}"));
    let (ok, text) = m.kill_qemu_during(
        "srv",
        &["snapshot", "srv", "--mode", mode, "--name", &name],
        Duration::from_millis(400),
    );
    let note = killed_snapshot_note(m, ok, &text, &name, false);
    m.bring_back("srv");
    Outcome {
        note: format!("{note}; srv restored from its base snapshot"),
    }
}

/// A peer VM's QEMU killed during a cluster snapshot: the other VM is not
/// left paused, no partial cluster snapshot is listed.
fn cluster_snapshot_peer_killed(m: &mut Matrix) -> Outcome {
    let name = m.name("cluster-killed");
    let (ok, text) = m.kill_qemu_during(
        "cli",
        &["snapshot", "--cluster", "--name", &name],
        Duration::from_millis(600),
    );
    let note = killed_snapshot_note(m, ok, &text, &name, true);
    m.bring_back("cli");
    Outcome {
        note: format!("{note}; cli restored from its base snapshot"),
    }
}

/// A rejuvenation whose new QEMU dies after start falls back to the kept
/// copy; with the kept copy failing too, `--resume` starts the VM again.
fn rejuvenate_new_qemu_dies(m: &mut Matrix, mode: &str, fallback_fails: bool) -> Outcome {
    if !fallback_fails {
        let v = m.env.json(&[
            "rejuvenate",
            "--vm",
            "srv",
            "--mode",
            mode,
            "--inject-fault",
            "new-qemu-dies",
            "--json",
        ]);
        assert_eq!(v["reports"][0]["fell_back_to_old_binary"], true, "{v}");
        return Outcome {
            note: "fell back to the kept copy".into(),
        };
    }
    let (ok, text) = m.run(&[
        "rejuvenate",
        "--vm",
        "srv",
        "--mode",
        mode,
        "--inject-fault",
        "fallback-fails",
    ]);
    assert!(!ok && text.contains("--resume"), "{text}");
    m.ok(&["rejuvenate", "--vm", "srv", "--resume"]);
    Outcome {
        note: "fails; `--resume` started it again".into(),
    }
}

/// The phrase of an error that says what happened, for the table.
/// A restore whose new QEMU is killed mid-way: it fails (or had finished);
/// the VM comes back by restoring again.
fn restore_qemu_killed(m: &mut Matrix, mode: &str) -> Outcome {
    m.ok(&["stop", "srv"]);
    let base = m.base[0].1.clone();
    let (ok, text, killed) = m.kill_new_qemu_during(
        "srv",
        &["restore", "--wait", &base, "--mode", mode],
        Duration::from_millis(300),
    );
    assert!(killed, "no new QEMU appeared for the restore:\n{text}");
    let note = if ok {
        "finished before the kill".to_string()
    } else {
        format!("fails: {}", last_line(&text))
    };
    let again = m.restore_if_gone("srv");
    Outcome {
        note: format!("{note}{}", if again { "; restored again" } else { "" }),
    }
}

/// A restore with no room for the restored VM's files: refused before
/// anything is started.
fn restore_disk_full(m: &mut Matrix) -> Outcome {
    m.ok(&["stop", "srv"]);
    let base = m.base[0].1.clone();
    let filler = m.fill();
    let (ok, text) = m.run(&["restore", "--wait", &base, "--mode", "lazy"]);
    std::fs::remove_file(&filler).unwrap();
    assert!(!ok, "a restore onto a full disk succeeded:\n{text}");
    assert!(text.contains("disk space"), "{text}");
    m.restore_if_gone("srv");
    Outcome {
        note: "refused: error says \"not enough disk space\"; restored after".into(),
    }
}

/// A saved restart (state to disk) onto a full disk: the old QEMU goes on.
fn rejuvenate_disk_full(m: &mut Matrix) -> Outcome {
    let pid = m.pid("srv");
    let filler = m.fill();
    let (ok, text) = m.run(&["rejuvenate", "--vm", "srv", "--mode", "saved"]);
    std::fs::remove_file(&filler).unwrap();
    assert!(!ok, "a saved restart onto a full disk succeeded:\n{text}");
    assert_eq!(m.pid("srv"), pid, "the VM's QEMU changed");
    Outcome {
        note: format!("fails: {}; the old QEMU runs on", last_line(&text)),
    }
}

/// A cluster restore in which a VM's new QEMU is killed: the restore fails
/// whole (or had finished); restoring it again brings the cluster back.
fn cluster_restore_peer_killed(m: &mut Matrix) -> Outcome {
    let name = m.name("whole");
    m.ok(&["snapshot", "--cluster", "--name", &name]);
    m.ok(&["down"]);
    let (ok, text, killed) = m.kill_new_qemu_during(
        "cli",
        &["restore", "--wait", "--cluster", &name],
        Duration::from_millis(300),
    );
    assert!(killed, "no QEMU appeared for the cluster restore:\n{text}");
    let note = if ok {
        "finished before the kill".to_string()
    } else {
        format!("fails: {}", last_line(&text))
    };
    if !ok {
        // A failed cluster restore leaves nothing (its agent exits).
        assert!(text.contains("nothing was left running"), "{text}");
        let left = m.processes_left();
        assert!(left.is_empty(), "left running: {left:?}");
        assert!(m.env.shm_files().is_empty(), "{:?}", m.env.shm_files());
        m.ok(&["restore", "--wait", "--cluster", &name]);
    } else {
        // Finished, then the kill took cli's QEMU: bring it back.
        m.restore_if_gone("cli");
    }
    Outcome {
        note: format!("{note}; restored whole again"),
    }
}

/// `up` onto a full disk is refused up front, and `up` whose QEMU is
/// killed while it boots tears the whole cluster down; then `up` works.
fn up_faults(m: &mut Matrix, kill: bool) -> Outcome {
    m.ok(&["down"]);
    let spec = m.env.write_spec(SPEC);
    let spec = spec.to_str().unwrap();
    let (ok, text) = if kill {
        let (ok, text, killed) =
            m.kill_new_qemu_during("srv", &["up", spec], Duration::from_millis(300));
        assert!(killed, "no QEMU appeared for up:\n{text}");
        (ok, text)
    } else {
        let filler = m.fill();
        let r = m.run(&["up", spec]);
        std::fs::remove_file(&filler).unwrap();
        r
    };
    assert!(!ok, "up succeeded:\n{text}");
    if !kill {
        assert!(text.contains("disk space"), "{text}");
    }
    let left = m.processes_left();
    assert!(left.is_empty(), "left running: {left:?}");
    assert!(m.env.shm_files().is_empty(), "{:?}", m.env.shm_files());
    m.ok(&["up", spec]);
    for vm in VMS {
        m.wait_memtouch(vm, "memtouch after up");
    }
    Outcome {
        note: format!(
            "fails: {}; nothing left; up again works",
            if kill {
                last_line(&text)
            } else {
                "refused: error says \"not enough disk space\"".into()
            }
        ),
    }
}

/// A cluster snapshot onto a full disk fails whole; every VM runs on.
fn cluster_snapshot_disk_full(m: &mut Matrix) -> Outcome {
    let name = m.name("cluster-full");
    let filler = m.fill();
    let (ok, text) = m.run(&["snapshot", "--cluster", "--name", &name]);
    std::fs::remove_file(&filler).unwrap();
    assert!(
        !ok,
        "a cluster snapshot onto a full disk succeeded:\n{text}"
    );
    assert!(!m.snapshots.join(&name).exists(), "{text}");
    Outcome {
        note: format!("fails: {}", last_line(&text)),
    }
}

fn last_line(text: &str) -> String {
    for phrase in [
        "No space left on device",
        "QEMU exited",
        "exited",
        "killed",
        "not running",
    ] {
        if text.contains(phrase) {
            return format!("error says \"{phrase}\"");
        }
    }
    let l = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    l.chars().take(90).collect::<String>().replace('|', "/")
}

#[test]
fn fast_cells() {
    let _l = cluster_lock();
    let mut m = Matrix::new();
    m.cell("snapshot hot", "disk full", |m| {
        snapshot_disk_full(m, "hot")
    });
    m.cell("snapshot stop-copy", "disk full", |m| {
        snapshot_disk_full(m, "stop-copy")
    });
    m.cell("snapshot hot", "QEMU killed", |m| {
        snapshot_qemu_killed(m, "hot")
    });
    m.cell(
        "snapshot --cluster",
        "peer QEMU killed",
        cluster_snapshot_peer_killed,
    );
    m.cell("rejuvenate warm", "new QEMU dies after start", |m| {
        rejuvenate_new_qemu_dies(m, "warm", false)
    });
    m.cell("rejuvenate warm", "new QEMU and kept copy fail", |m| {
        rejuvenate_new_qemu_dies(m, "warm", true)
    });
    m.cell("rejuvenate saved", "disk full", rejuvenate_disk_full);
    m.cell("restore lazy", "QEMU killed", |m| {
        restore_qemu_killed(m, "lazy")
    });
    m.cell("restore lazy", "disk full", restore_disk_full);
    m.print_table();
    m.env.ok(&["down"]);
    m.env.assert_clean();
}

/// The whole matrix (`make test-faults`).
#[test]
#[ignore = "the full fault matrix: make test-faults"]
fn every_cell() {
    let _l = cluster_lock();
    let mut m = Matrix::new();
    for mode in ["hot", "stop-copy", "precopy"] {
        m.cell(&format!("snapshot {mode}"), "disk full", |m| {
            snapshot_disk_full(m, mode)
        });
        m.cell(&format!("snapshot {mode}"), "QEMU killed", |m| {
            snapshot_qemu_killed(m, mode)
        });
    }
    m.cell(
        "snapshot --cluster",
        "peer QEMU killed",
        cluster_snapshot_peer_killed,
    );
    m.cell(
        "snapshot --cluster",
        "disk full",
        cluster_snapshot_disk_full,
    );
    for mode in ["warm", "saved"] {
        for fails in [false, true] {
            let fault = if fails {
                "new QEMU and kept copy fail"
            } else {
                "new QEMU dies after start"
            };
            m.cell(&format!("rejuvenate {mode}"), fault, |m| {
                rejuvenate_new_qemu_dies(m, mode, fails)
            });
        }
    }
    m.cell("rejuvenate cold", "new QEMU and kept copy fail", |m| {
        rejuvenate_new_qemu_dies(m, "cold", true)
    });
    m.cell("rejuvenate saved", "disk full", rejuvenate_disk_full);
    for mode in ["eager", "lazy", "workingset"] {
        m.cell(&format!("restore {mode}"), "QEMU killed", |m| {
            restore_qemu_killed(m, mode)
        });
    }
    m.cell("restore lazy", "disk full", restore_disk_full);
    m.cell(
        "restore --cluster",
        "a VM's QEMU killed",
        cluster_restore_peer_killed,
    );
    m.cell("up", "disk full", |m| up_faults(m, false));
    m.cell("up", "a VM's QEMU killed while it boots", |m| {
        up_faults(m, true)
    });
    // Last: `down` with a VM whose QEMU died leaves nothing either.
    let pid = m.pid("cli");
    // SAFETY: SIGKILL to cli's QEMU, whose pid status just gave.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    m.env.ok(&["down"]);
    m.env.assert_clean();
    m.table.push(
        "| down | a VM's QEMU killed before | everything removed (assert_clean) | - |".into(),
    );
    m.print_table();
}
