//! CPU priority (nice) of another process's threads.
//!
//! Linux keeps a nice value per thread, and a new thread inherits its
//! creator's. Used to push an exiting QEMU's teardown behind everything else
//! (`qemu_exit`) and to let a QEMU whose guest is paused for a hot snapshot
//! finish its part of the pause before other VMs' vCPUs (`Boost`).

#![allow(unsafe_code)]

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
    pid: u32,
    saved: Vec<(u32, i32)>,
}

impl Boost {
    /// Raises every thread of `pid` to `nice`. None if that is not
    /// permitted (raising needs CAP_SYS_NICE) or the process is gone.
    pub fn start(pid: u32, nice: i32) -> Option<Boost> {
        let mut saved = Vec::new();
        for tid in threads(pid) {
            let Some(old) = nice_of(tid) else { continue };
            if old <= nice {
                continue;
            }
            if !set_nice(tid, nice) {
                drop(Boost { pid, saved });
                return None;
            }
            saved.push((tid, old));
        }
        Some(Boost { pid, saved })
    }

    /// Puts every thread back.
    pub fn end(self) {}
}

impl Drop for Boost {
    fn drop(&mut self) {
        let main = self
            .saved
            .iter()
            .find(|(t, _)| *t == self.pid)
            .map(|(_, n)| *n);
        for tid in threads(self.pid) {
            match self.saved.iter().find(|(t, _)| *t == tid) {
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

    #[test]
    fn a_boost_is_undone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        set_nice(pid, 5);
        match Boost::start(pid, -5) {
            // Root (CAP_SYS_NICE): raised, then put back.
            Some(b) => {
                assert_eq!(nice_of(pid), Some(-5));
                b.end();
                assert_eq!(nice_of(pid), Some(5));
            }
            // Not permitted: nothing changed.
            None => assert_eq!(nice_of(pid), Some(5)),
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
