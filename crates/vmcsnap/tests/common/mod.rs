//! Helpers shared by the end-to-end tests: run the real `vmcsnap` binary
//! against real QEMU, each test in its own run directory.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Booting clusters is CPU-heavy under TCG on two cores: one test at a time.
static CLUSTER_LOCK: Mutex<()> = Mutex::new(());

/// Serialises the tests that boot VMs.
pub fn cluster_lock() -> MutexGuard<'static, ()> {
    CLUSTER_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// One test's run directory; tears down whatever is left on drop.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub extra_env: Vec<(String, String)>,
}

impl Env {
    pub fn new() -> Env {
        Env {
            dir: tempfile::Builder::new()
                .prefix("vmcsnap-t")
                .tempdir_in("/tmp")
                .unwrap(),
            extra_env: vec![],
        }
    }

    /// A run directory whose agent and CLI run `qemu` (`VMCSNAP_QEMU`).
    pub fn with_qemu(qemu: &Path) -> Env {
        let mut e = Env::new();
        e.extra_env
            .push(("VMCSNAP_QEMU".into(), qemu.display().to_string()));
        e
    }

    pub fn run_dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn write_spec(&self, text: &str) -> PathBuf {
        let p = self.dir.path().join("spec.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    /// The `vmcsnap` command with this run directory and environment.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_vmcsnap"));
        c.arg("--run-dir").arg(self.run_dir()).args(args);
        for (k, v) in &self.extra_env {
            c.env(k, v);
        }
        c
    }

    pub fn vmcsnap(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run vmcsnap")
    }

    /// Runs vmcsnap; `None` (after killing it) if it has not ended within
    /// `limit`. Its output is read while it runs, so it never blocks on a
    /// full pipe.
    pub fn vmcsnap_within(&self, args: &[&str], limit: Duration) -> Option<Output> {
        let mut child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run vmcsnap");
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let out = drain(Box::new(child.stdout.take().expect("piped")));
        let err = drain(Box::new(child.stderr.take().expect("piped")));
        let t = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().expect("wait for vmcsnap") {
                break st;
            }
            if t.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        Some(Output {
            status,
            stdout: out.join().expect("stdout reader"),
            stderr: err.join().expect("stderr reader"),
        })
    }

    /// Runs vmcsnap and insists on success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.vmcsnap(args);
        assert!(
            out.status.success(),
            "vmcsnap {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let text = self.ok(args);
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("bad JSON from {args:?}: {e}: {text}"))
    }

    /// A full snapshot of `vm` in `mode` named `name`, which must succeed
    /// and be reported under that name; returns the report.
    pub fn full_snapshot(&self, vm: &str, mode: &str, name: &str) -> serde_json::Value {
        let r = self.json(&[
            "snapshot", vm, "--mode", mode, "--full", "--name", name, "--json",
        ]);
        assert_eq!(r["name"], name, "{r}");
        r
    }

    pub fn console(&self, vm: &str) -> String {
        self.ok(&["console", vm])
    }

    /// Waits (bounded, never a pass/fail threshold) until `pred` holds on
    /// the console of `vm`; returns the console text.
    pub fn wait_console(
        &self,
        vm: &str,
        what: &str,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let text = self.console(vm);
            if pred(&text) {
                return text;
            }
            if Instant::now() > deadline {
                panic!(
                    "VM {vm}: gave up waiting for {what}; console:\n{}",
                    tail(&text, 3000)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Files under /dev/shm that belong to this run directory's agent.
    pub fn shm_files(&self) -> Vec<PathBuf> {
        let tag = vmcsnap_agent::RunDir::new(self.run_dir()).tag();
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("vmcsnap-{tag}-"))
            })
            .collect()
    }

    /// Every socket file under the run directory.
    pub fn sockets(&self) -> Vec<PathBuf> {
        use std::os::unix::fs::FileTypeExt;
        let mut found = vec![];
        let mut stack = vec![self.run_dir().to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let ft = e.file_type().unwrap();
                if ft.is_dir() {
                    stack.push(e.path());
                } else if ft.is_socket() {
                    found.push(e.path());
                }
            }
        }
        found
    }

    /// Processes whose command line mentions this run directory (QEMUs and agent).
    pub fn processes(&self) -> Vec<u32> {
        let needle = self.run_dir().to_string_lossy().into_owned();
        let mut pids = vec![];
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if pid == std::process::id() {
                continue;
            }
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                if String::from_utf8_lossy(&cmd).contains(&needle) {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Asserts nothing of this run directory is left running or lying around.
    pub fn assert_clean(&self) {
        // The agent exits right after answering; give it a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.processes().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            self.processes(),
            Vec::<u32>::new(),
            "processes left running"
        );
        assert_eq!(self.sockets(), Vec::<PathBuf>::new(), "sockets left behind");
        assert_eq!(
            self.shm_files(),
            Vec::<PathBuf>::new(),
            "shared-memory files left behind"
        );
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failed test says what its agent saw (CI keeps no run dir).
            let log = std::fs::read_to_string(self.run_dir().join("agent.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!(
                "--- last lines of the agent log ---\n{}\n---",
                tail.join("\n")
            );
        }
        let _ = self.vmcsnap(&["down"]);
        for pid in self.processes() {
            // SAFETY: kill(2) with a pid we just read; worst case ESRCH.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        for f in self.shm_files() {
            let _ = std::fs::remove_file(f);
        }
        // A test that failed before `down` must not leave the cluster's
        // network namespace behind either.
        let _ = vmcsnap_hostnet::destroy_netns(&vmcsnap_hostnet::netns_name(
            &vmcsnap_agent::RunDir::new(self.run_dir()).tag(),
        ));
    }
}

/// QEMU 10.0's `qemu-system-x86_64`, installed beside the system's 7.2 by
/// `scripts/install-qemu.sh 10.0` (idempotent: a second run only prints the
/// path). Never a silent skip: a test that needs it fails if it cannot be
/// installed, naming why.
pub fn qemu10() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install-qemu.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg("10.0")
            .output()
            .expect("run scripts/install-qemu.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "scripts/install-qemu.sh 10.0 failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = PathBuf::from(stdout.lines().last().unwrap_or("").trim());
        assert!(
            path.is_file(),
            "install-qemu.sh printed {path:?}, no such file"
        );
        path
    })
    .clone()
}

/// Pages of RAM block `mem` in the image that differ from `reference`
/// (the guest RAM file as it was during the snapshot's pause), with the
/// image's stored and zero page counts.
pub fn mismatched_pages(dir: &Path, reference: &Path) -> (Vec<usize>, u64, u64) {
    let img = vmcsnap_agent::frozen_disks::open_image(dir).unwrap();
    let id = img.ram_block_id("mem").expect("RAM block mem");
    let ps = img.page_size();
    let reference = std::fs::read(reference).unwrap();
    let pages = img.ram_block_pages(id) as usize;
    assert_eq!(reference.len(), pages * ps, "reference size vs RAM block");
    let mut image = vec![0xAAu8; pages * ps];
    let (stored, zero) = img
        .read_ram_block(id, &mut image)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mismatches = (0..pages)
        .filter(|p| image[p * ps..(p + 1) * ps] != reference[p * ps..(p + 1) * ps])
        .collect();
    (mismatches, stored, zero)
}

/// Compares every page of RAM block `mem` in the image with `reference`
/// (the guest RAM file as it was during the snapshot's pause).
pub fn compare_with_reference(dir: &Path, reference: &Path) -> (u64, u64) {
    let (mismatches, stored, zero) = mismatched_pages(dir, reference);
    assert!(
        mismatches.is_empty(),
        "{}: {} of {} pages differ from the RAM at the pause (first: {:?})",
        dir.display(),
        mismatches.len(),
        std::fs::metadata(reference).map_or(0, |m| m.len() / 4096),
        &mismatches[..mismatches.len().min(10)]
    );
    (stored, zero)
}

/// Guest uptime in seconds from the last `vmcsnap-stat` line.
pub fn uptime(console: &str) -> f64 {
    console
        .lines()
        .rev()
        .filter(|l| l.starts_with("vmcsnap-stat"))
        .find_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("uptime=")?.parse().ok())
        })
        .expect("no vmcsnap-stat line")
}

pub fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    &s[start..]
}

/// How many status lines memtouch has printed.
pub fn memtouch_lines(console: &str) -> usize {
    console
        .lines()
        .filter(|l| l.starts_with("memtouch: t="))
        .count()
}

/// The last `key=<number>` value on lines starting with `prefix`.
pub fn last_field(console: &str, prefix: &str, key: &str) -> Option<u64> {
    console
        .lines()
        .rev()
        .filter(|l| l.starts_with(prefix))
        .find_map(|l| field(l, key))
}

/// `key=<number>` in one line.
pub fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}
