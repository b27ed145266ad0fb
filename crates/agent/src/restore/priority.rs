//! Scheduling priorities of a restore's fault path.
//!
//! After RUN a vCPU that touches a page not yet loaded is blocked until
//! the page arrives, and the page goes through five threads: QEMU's fault
//! thread (`fault-default`) reads the userfault and sends a request on the
//! return path, the agent's `postcopy-rp` thread reads it, the sender
//! writes the page, QEMU's `postcopy/listen` thread places it, and the vCPU
//! wakes. On a busy host every hop waits for a CPU behind the guests' vCPU
//! threads (and behind the other restores' background loading). Those
//! threads do little work each, so they get a higher priority than the
//! vCPUs; the sender gets it only while it serves requests, and runs at the
//! normal priority (or lower) while it pushes background pages, so that
//! background loading never takes CPU time from running guests first.
//!
//! Raising a priority needs `CAP_SYS_NICE` (root); without it nothing is
//! changed and the restore runs as before ([`Priorities::available`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmcsnap_migstream::postcopy::Work;
use vmcsnap_migstream::Dialect;

/// The fault path's priorities, if this process may raise them (checked
/// once).
pub(super) fn priorities() -> Option<Priorities> {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    (*AVAILABLE.get_or_init(Priorities::available)).then_some(Priorities::DEFAULT)
}

/// QEMU's threads on the fault path (`-name ...,debug-threads=on`), as
/// each release names them (10.0 renamed its migration threads `mig/...`).
pub fn qemu_fault_path_threads(dialect: Dialect) -> [&'static str; 2] {
    match dialect {
        Dialect::Qemu7_2 => ["fault-default", "postcopy/listen"],
        Dialect::Qemu10_0 => ["mig/dst/fault", "mig/dst/listen"],
    }
}

/// Nice values per kind of work (lower = more CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priorities {
    /// The sender while it serves requests, its return-path reader, and
    /// QEMU's fault-path threads.
    pub fault_path: i32,
    /// The sender while it pushes background pages after RUN (in a cluster
    /// restore also while the VM waits for START).
    pub background: i32,
    /// The sender before RUN (the working set).
    pub preload: i32,
}

impl Priorities {
    /// The defaults: fault path -10, background +10, preload 0 (measured
    /// in docs/restore.md, "CPU priorities").
    pub const DEFAULT: Priorities = Priorities {
        fault_path: -10,
        background: 10,
        preload: 0,
    };

    /// Whether this process may raise priorities (it tries, on itself).
    pub fn available() -> bool {
        let now = current_nice();
        set_current_thread(now - 1).is_ok() && set_current_thread(now).is_ok()
    }

    /// The nice value for `work`.
    pub fn for_work(&self, work: Work) -> i32 {
        match work {
            Work::Preload => self.preload,
            Work::Demand => self.fault_path,
            Work::Background => self.background,
        }
    }
}

fn current_nice() -> i32 {
    // SAFETY: getpriority has no memory effects; errno is reset first so
    // that a legitimate -1 is told apart from an error (treated as 0).
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, 0);
        if n == -1 && *libc::__errno_location() != 0 {
            0
        } else {
            n
        }
    }
}

/// Sets the calling thread's nice value.
pub fn set_current_thread(nice: i32) -> std::io::Result<()> {
    set_thread(0, nice)
}

fn set_thread(tid: u32, nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority has no memory effects; PRIO_PROCESS with a thread
    // id (or 0 = the caller) changes that one thread on Linux.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Gives QEMU `pid`'s fault-path threads (those of its release
/// `dialect`) nice value `nice` as soon as they exist (QEMU starts them
/// when it processes POSTCOPY_LISTEN and ends them when postcopy ends);
/// looks for them until both are found, `within` has passed or `stop` is
/// set. Returns how many were changed.
pub fn raise_qemu_fault_path(
    pid: u32,
    dialect: Dialect,
    nice: i32,
    within: Duration,
    stop: &AtomicBool,
) -> usize {
    let names = qemu_fault_path_threads(dialect);
    let end = Instant::now() + within;
    let mut done: Vec<u32> = Vec::new();
    let tasks = format!("/proc/{pid}/task");
    while done.len() < names.len() && Instant::now() < end && !stop.load(Ordering::Relaxed) {
        let Ok(dir) = std::fs::read_dir(&tasks) else {
            break;
        };
        for entry in dir.flatten() {
            let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            if done.contains(&tid) || !is_named(&entry.path(), &names) {
                continue;
            }
            if set_thread(tid, nice).is_ok() {
                done.push(tid);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    done.len()
}

fn is_named(task: &Path, names: &[&str]) -> bool {
    std::fs::read_to_string(task.join("comm")).is_ok_and(|c| names.contains(&c.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_kinds_map_to_their_priorities() {
        let p = Priorities {
            fault_path: -7,
            background: 3,
            preload: 1,
        };
        assert_eq!(p.for_work(Work::Demand), -7);
        assert_eq!(p.for_work(Work::Background), 3);
        assert_eq!(p.for_work(Work::Preload), 1);
    }

    #[test]
    fn threads_are_found_by_name_and_changed() {
        // Threads of this process named like QEMU's (lowering a priority
        // needs no privilege), under each release's names.
        for d in Dialect::ALL {
            threads_of_release_are_found(d);
        }
    }

    fn threads_of_release_are_found(dialect: Dialect) {
        let stop = AtomicBool::new(false);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = std::sync::Mutex::new(rx);
        std::thread::scope(|s| {
            let mut tids = Vec::new();
            let [fault, listen] = qemu_fault_path_threads(dialect);
            for name in [fault, listen, "CPU 0/TCG"] {
                let (tid_tx, tid_rx) = std::sync::mpsc::channel();
                let rx = &rx;
                std::thread::Builder::new()
                    .name(name.into())
                    .spawn_scoped(s, move || {
                        // SAFETY: gettid has no memory effects.
                        tid_tx.send(unsafe { libc::gettid() } as u32).unwrap();
                        let _ = rx.lock().unwrap().recv();
                    })
                    .unwrap();
                tids.push(tid_rx.recv().unwrap());
            }
            let nice = current_nice() + 3;
            let n = raise_qemu_fault_path(
                std::process::id(),
                dialect,
                nice,
                Duration::from_secs(5),
                &stop,
            );
            assert_eq!(n, 2);
            let nice_of = |tid: u32| {
                // SAFETY: getpriority has no memory effects.
                unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }
            };
            assert_eq!((nice_of(tids[0]), nice_of(tids[1])), (nice, nice));
            assert_ne!(nice_of(tids[2]), nice, "the vCPU thread is left alone");
            drop(tx);
        });
        // Nothing to find: returns once stopped.
        stop.store(true, Ordering::Relaxed);
        assert_eq!(
            raise_qemu_fault_path(
                std::process::id(),
                Dialect::Qemu7_2,
                0,
                Duration::from_secs(60),
                &stop
            ),
            0
        );
    }

    #[test]
    fn lowering_the_own_priority_always_works() {
        // A thread of its own: nice values are per thread on Linux.
        std::thread::spawn(|| {
            let before = current_nice();
            set_current_thread(before + 1).unwrap();
            assert_eq!(current_nice(), before + 1);
        })
        .join()
        .unwrap();
    }
}
