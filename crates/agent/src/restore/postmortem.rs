//! What a failed restore keeps to explain itself.
//!
//! A restore that fails discards its QEMU, its runtime files and its
//! overlay, and the next restore of the VM overwrites the VM directory's
//! `qemu.log`: without a copy, the one thing that says why the destination
//! gave up (QEMU's own error on its stderr, its migration state, the events
//! it sent) is gone. So before the QEMU is discarded its run state and
//! migration status are asked for (on the open QMP session, briefly), and
//! afterwards everything goes to a directory of its own in the run
//! directory, which the error names:
//!
//! ```text
//! <run-dir>/failed-restores/<unix-ms>-<vm>/
//!   error.txt         the error the restore returned
//!   qemu-stderr.log   QEMU's stdout and stderr, whole
//!   qmp.json          its last QMP events (MIGRATION status changes with
//!                     their time stamps among them), query-status,
//!                     query-migrate and its exit status
//!   console.log       the guest's console since this QEMU started
//! ```
//!
//! Only the newest [`KEEP`] are kept. Nothing else ever reads them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use crate::vm::Vm;
use crate::RunDir;

/// The directory in the run directory.
pub const DIR: &str = "failed-restores";
/// How many failed restores are kept (the oldest go first).
pub const KEEP: usize = 20;
/// The most of the console kept.
const CONSOLE_BYTES: u64 = 1 << 20;
/// How long an exiting QEMU may take to finish its exit.
const EXIT_WAIT: Duration = Duration::from_secs(5);
/// How long a QEMU may take to answer one post-mortem query.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// What was asked of a QEMU before it was discarded.
pub struct Evidence {
    status: Value,
    migrate: Value,
}

impl Evidence {
    /// The incoming migration's status, if the QEMU still ran and said
    /// (e.g. `postcopy-paused`: it gave up on the stream but lives on).
    pub fn migration_status(&self) -> Option<&str> {
        self.migrate["status"].as_str()
    }
}

/// Asks `vm`'s QEMU, if it still runs and its QMP session is open, for its
/// run state and migration status (each bounded by [`QUERY_TIMEOUT`]).
/// A QEMU on its way out (every thread exiting: a crash, or an exit of its
/// own whose teardown of guest RAM takes a while) is first given up to
/// [`EXIT_WAIT`] to finish, so that its own exit status is known, not the
/// kill that would follow.
pub fn gather(vm: &mut Vm) -> Evidence {
    if vm.exited().is_none() && crate::qemu_exit::exiting(vm.pid) {
        let t = Instant::now();
        while vm.exited().is_none() && t.elapsed() < EXIT_WAIT {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut ask = |cmd: &str| {
        if vm.exited().is_some() {
            return json!({ "not asked": "QEMU had exited" });
        }
        match vm.execute_if_open(cmd, QUERY_TIMEOUT) {
            Ok(v) => v,
            Err(e) => json!({ "error": e.to_string() }),
        }
    };
    Evidence {
        status: ask("query-status"),
        migrate: ask("query-migrate"),
    }
}

/// Writes what explains the failed restore of `vm` (with `error`) under
/// `run`, once its QEMU is gone; returns the directory.
pub fn keep(
    run: &RunDir,
    vm: &mut Vm,
    evidence: Evidence,
    error: &str,
) -> std::io::Result<PathBuf> {
    let root = run.root().join(DIR);
    let ms = crate::unix_ms(SystemTime::now());
    let dir = root.join(format!("{ms}-{}", vm.name));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("error.txt"), format!("{error}\n"))?;
    match std::fs::copy(&vm.qemu_log, dir.join("qemu-stderr.log")) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::write(dir.join("qemu-stderr.log"), "")?;
        }
        Err(e) => return Err(e),
    }
    let events: Vec<Value> = vm
        .recent_events()
        .into_iter()
        .map(|e| json!({ "event": e.name, "data": e.data, "timestamp_us": e.timestamp_us }))
        .collect();
    let qmp = json!({
        "qemu_pid": vm.pid,
        "exit_status": vm.exited(),
        "events": events,
        "query-status": evidence.status,
        "query-migrate": evidence.migrate,
    });
    let text = serde_json::to_vec_pretty(&qmp).expect("json serialises");
    std::fs::write(dir.join("qmp.json"), text)?;
    std::fs::write(
        dir.join("console.log"),
        vm.console_since_start(CONSOLE_BYTES).unwrap_or_default(),
    )?;
    prune(&root, KEEP);
    Ok(dir)
}

/// Removes all but the newest `keep` entries of `root` (their names start
/// with their time).
fn prune(root: &Path, keep: usize) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    let mut dirs: Vec<(u64, PathBuf)> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let ms = name.split_once('-')?.0.parse().ok()?;
            Some((ms, e.path()))
        })
        .collect();
    dirs.sort();
    let n = dirs.len().saturating_sub(keep);
    for (_, d) in dirs.into_iter().take(n) {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prune_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        for ms in [5u64, 100, 20, 7] {
            std::fs::create_dir_all(d.path().join(format!("{ms}-a"))).unwrap();
        }
        std::fs::create_dir_all(d.path().join("other")).unwrap();
        prune(d.path(), 2);
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["100-a", "20-a", "other"]);
    }
}
