//! CPU priority (nice) of another process's threads.
//!
//! Linux keeps a nice value per thread, and a new thread inherits its
//! creator's. Used to push an exiting QEMU's teardown behind everything else
//! (`qemu_exit`) and to let a QEMU whose guest is paused for a hot snapshot
//! finish its part of the pause before other VMs' vCPUs (`Boost`).
//!
//! A boost outlives the agent that made it if that agent dies (`kill -9`)
//! during the pause: QEMU's threads, vCPUs included, would stay raised for
//! good. So [`Boost::start`] first writes the values it replaces to a file
//! (`<vm-dir>/boost.json`, synced), and whoever finds that file puts them
//! back ([`undo_left`]): the next agent when it adopts the VM, and every
//! snapshot of the VM at its start and its end.

#![allow(unsafe_code)]

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::qemu::QemuConfig;

/// The file in a VM's directory that records a boost in effect.
pub const BOOST_FILE: &str = "boost.json";

/// `<vm-dir>/boost.json` of the VM of `config`.
pub fn record_path(config: &QemuConfig) -> PathBuf {
    config.console_log.with_file_name(BOOST_FILE)
}

/// What a boost replaced: per thread of QEMU `pid`, its nice value before.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    pid: u32,
    saved: Vec<(u32, i32)>,
}

/// The thread ids of process `pid` (empty if it is gone).
pub fn threads(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

/// The nice value of thread `tid`, None if it is gone.
pub fn nice_of(tid: u32) -> Option<i32> {
    // /proc/<tid>/stat field 19 is the nice value; fields after the
    // command name (in parentheses, which may hold spaces) are plain.
    let stat = std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(16)?.parse().ok()
}

/// Sets the nice value of thread `tid`; false if not permitted or gone.
pub fn set_nice(tid: u32, nice: i32) -> bool {
    // SAFETY: setpriority takes plain integers and touches no memory of
    // ours; a thread that is gone meanwhile only makes it fail (ESRCH).
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) == 0 }
}

/// Sets every thread of `pid` to `nice` (best effort).
pub fn set_process_nice(pid: u32, nice: i32) {
    for tid in threads(pid) {
        set_nice(tid, nice);
    }
}

/// A process's threads raised to a higher priority until [`Boost::end`]
/// (or drop) puts each back; threads created meanwhile (they inherited the
/// raised value) get the value their process's main thread had.
pub struct Boost {
    record: Record,
    file: PathBuf,
}

impl Boost {
    /// Raises every thread of `pid` to `nice`, once what it replaces is
    /// recorded in `file` (see the module docs; a boost left there by an
    /// agent that died is undone first). None if that is not permitted
    /// (raising needs CAP_SYS_NICE), the record cannot be written, or the
    /// process is gone.
    pub fn start(pid: u32, nice: i32, file: &Path) -> Option<Boost> {
        undo_left(file, Some(pid));
        let saved: Vec<(u32, i32)> = threads(pid)
            .into_iter()
            .filter_map(|tid| Some((tid, nice_of(tid)?)))
            .filter(|&(_, old)| old > nice)
            .collect();
        let record = Record { pid, saved };
        let bytes = serde_json::to_vec(&record).expect("a boost record serialises");
        if let Err(e) = crate::paths::write_atomic(file, &bytes) {
            crate::log(format!("not raising QEMU {pid}'s priority: {e}"));
            return None;
        }
        let boost = Boost {
            record,
            file: file.to_path_buf(),
        };
        for &(tid, _) in &boost.record.saved {
            if !set_nice(tid, nice) {
                // Not permitted (or gone): the drop puts back what changed.
                return None;
            }
        }
        Some(boost)
    }

    /// Puts every thread back.
    pub fn end(self) {}
}

impl Drop for Boost {
    fn drop(&mut self) {
        put_back(&self.record);
        let _ = std::fs::remove_file(&self.file);
    }
}

/// Each thread of the record's process back to its value, threads created
/// since to the main thread's.
fn put_back(record: &Record) {
    let pid = record.pid;
    let main = record
        .saved
        .iter()
        .find(|(t, _)| *t == pid)
        .map(|(_, n)| *n);
    for tid in threads(pid) {
        match record.saved.iter().find(|(t, _)| *t == tid) {
            Some((_, old)) => {
                set_nice(tid, *old);
            }
            None => {
                if let Some(n) = main {
                    set_nice(tid, n);
                }
            }
        }
    }
}

/// Undoes a boost recorded in `file` that nobody ended (its agent died),
/// if it was of QEMU `pid` (the VM's QEMU now; `None` if it has none), and
/// removes the file. True if threads were put back.
pub fn undo_left(file: &Path, pid: Option<u32>) -> bool {
    let Ok(bytes) = std::fs::read(file) else {
        return false;
    };
    let record: Option<Record> = serde_json::from_slice(&bytes).ok();
    let undone = match record {
        // A QEMU that is gone (or was replaced) took its priorities along.
        Some(r) if Some(r.pid) == pid && !threads(r.pid).is_empty() => {
            put_back(&r);
            crate::log(format!(
                "QEMU {}: its threads' priorities, raised by a snapshot whose agent died, are back to what they were",
                r.pid
            ));
            true
        }
        _ => false,
    };
    let _ = std::fs::remove_file(file);
    undone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_sets_a_threads_nice_value() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert_eq!(threads(pid), vec![pid]);
        let before = nice_of(pid).unwrap();
        // Lowering priority is always permitted.
        set_process_nice(pid, (before + 5).min(19));
        assert_eq!(nice_of(pid), Some((before + 5).min(19)));
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(nice_of(pid), None);
    }

    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    }

    #[test]
    fn a_boost_is_undone() {
        let mut child = sleeper();
        let pid = child.id();
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join(BOOST_FILE);
        set_nice(pid, 5);
        match Boost::start(pid, -5, &file) {
            // Root (CAP_SYS_NICE): raised, then put back.
            Some(b) => {
                assert_eq!(nice_of(pid), Some(-5));
                assert!(file.exists(), "recorded while in effect");
                b.end();
                assert_eq!(nice_of(pid), Some(5));
            }
            // Not permitted: nothing changed.
            None => assert_eq!(nice_of(pid), Some(5)),
        }
        assert!(!file.exists(), "no record once ended");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Raising needs CAP_SYS_NICE: skip (saying so) where it is missing.
    fn may_raise(pid: u32) -> bool {
        let before = nice_of(pid).unwrap();
        let ok = set_nice(pid, before - 1);
        set_nice(pid, before);
        if !ok {
            eprintln!("skipped: raising a priority needs CAP_SYS_NICE");
        }
        ok
    }

    #[test]
    fn a_boost_whose_agent_died_is_undone_by_whoever_finds_it() {
        let mut child = sleeper();
        let pid = child.id();
        if !may_raise(pid) {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join(BOOST_FILE);
        set_nice(pid, 3);
        // The agent dies during the pause: its boost is never ended.
        std::mem::forget(Boost::start(pid, -7, &file).unwrap());
        assert_eq!(nice_of(pid), Some(-7));
        // A later boost (the next snapshot) undoes it first, so that its own
        // end puts back the value from before the first one.
        let b = Boost::start(pid, -7, &file).unwrap();
        assert_eq!(nice_of(pid), Some(-7));
        b.end();
        assert_eq!(nice_of(pid), Some(3), "not the dead agent's -7");
        // The next agent, on adoption.
        std::mem::forget(Boost::start(pid, -7, &file).unwrap());
        assert!(undo_left(&file, Some(pid)));
        assert_eq!(nice_of(pid), Some(3));
        assert!(!file.exists());
        assert!(!undo_left(&file, Some(pid)), "nothing left to undo");
        // A record of another QEMU (replaced since) touches nothing.
        std::mem::forget(Boost::start(pid, -7, &file).unwrap());
        set_nice(pid, 4);
        assert!(!undo_left(&file, Some(pid + 1)));
        assert_eq!(nice_of(pid), Some(4));
        assert!(!file.exists(), "a stale record goes");
        let _ = child.kill();
        let _ = child.wait();
    }
}
