//! Letting a QEMU that was told to quit go without waiting for its exit.
//!
//! When a process exits, the kernel unmaps its memory before its parent can
//! reap it. For a QEMU whose page tables map GiBs of guest RAM (a VM that
//! has used its memory, or that was hot-snapshotted) that takes hundreds of
//! milliseconds: about 50 ms per GiB mapped on the 2-core test host. A warm
//! restart need not wait for it: the old QEMU must only never run code of
//! its own again (no `cont`, no cleanup that could unlink the sockets the
//! new QEMU binds at the same paths: QEMU unlinks its listening sockets'
//! paths when it closes them). That is so once every thread of it is
//! exiting (`PF_EXITING` in `/proc/PID/task/TID/stat`): QEMU's own cleanup
//! (disks closed, sockets unlinked, the state writer `cat` waited for) ran
//! before it called `exit`, and what is left is the kernel's teardown.
//!
//! [`wait_exiting`] waits for that point; [`reap_in_background`] lowers the
//! exiting QEMU's CPU priority, so that its teardown yields the CPUs to the
//! new QEMU's start, and reaps it from a thread of its own, so that no
//! zombie is left. An agent that replaces its image by `exec`, or exits,
//! first waits for those reaps ([`wait_reaped`]): a child the new image
//! does not know would never be reaped. An agent killed meanwhile leaves
//! nothing running: the old QEMU is already exiting, and its new parent
//! reaps it.

use std::process::Child;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The kernel's `PF_EXITING` task flag (`include/linux/sched.h`): the task
/// is in `do_exit` and will never return to user space.
const PF_EXITING: u64 = 0x4;

/// The niceness of an exiting QEMU: its teardown runs when nothing else
/// wants the CPU.
const EXITING_NICE: i32 = 19;

/// How many reaps run in the background.
static PENDING: Mutex<usize> = Mutex::new(0);
static REAPED: Condvar = Condvar::new();

/// Whether the task whose `/proc/.../stat` text is `stat` can no longer run
/// user code: exiting, a zombie, or dead.
fn stat_exiting(stat: &str) -> bool {
    // The command name (in parentheses) may contain spaces: fields are
    // counted after its closing parenthesis. 3rd field: state; 9th: flags.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next().unwrap_or("");
    if matches!(state, "Z" | "X" | "x") {
        return true;
    }
    fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .is_some_and(|flags| flags & PF_EXITING != 0)
}

/// Whether process `pid` can no longer run code of its own: gone, a zombie,
/// or every thread of it exiting.
pub fn exiting(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|t| {
        // A thread that finished exiting meanwhile has no stat any more.
        std::fs::read_to_string(t.path().join("stat")).map_or(true, |s| stat_exiting(&s))
    })
}

/// Waits until [`exiting`]`(pid)`, polling every millisecond, at most
/// `limit`. Returns whether it is.
pub fn wait_exiting(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if exiting(pid) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lowers the CPU priority of every thread of `pid` (best effort).
fn lower_priority(pid: u32) {
    crate::thread_priority::set_process_nice(pid, EXITING_NICE);
}

/// Lowers the priority of `pid`, an exiting QEMU of VM `vm` (see
/// [`wait_exiting`]), and reaps it in a background thread: `child` if this
/// agent image started it, else by pid (a QEMU adopted after an exec
/// handover is still our child; one adopted after a crash is not, and its
/// new parent reaps it). Logs how long its exit took.
pub fn reap_in_background(vm: &str, pid: u32, child: Option<Child>) {
    lower_priority(pid);
    let t = Instant::now();
    *PENDING.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    let name = vm.to_string();
    let spawned = std::thread::Builder::new()
        .name(format!("reap-{pid}"))
        .spawn(move || {
            let status = match child {
                Some(mut c) => c.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                None => wait_pid(pid),
            };
            crate::log(format!(
                "VM {name}: the old QEMU pid {pid} exited {:.0} ms after it stopped running ({status})",
                t.elapsed().as_secs_f64() * 1000.0
            ));
            done();
        });
    if let Err(e) = spawned {
        // No thread: reap it here instead.
        crate::log(format!(
            "VM {vm}: cannot start a thread to reap QEMU pid {pid} ({e}); waiting for its exit"
        ));
        let _ = wait_pid(pid);
        done();
    }
}

/// One background reap finished.
fn done() {
    let mut n = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    *n = n.saturating_sub(1);
    REAPED.notify_all();
}

/// Waits for `pid` to exit and reaps it, if it is our child.
fn wait_pid(pid: u32) -> String {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on one pid; writes one int we own.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        if r == pid as i32 {
            return if libc::WIFEXITED(status) {
                format!("exit status: {}", libc::WEXITSTATUS(status))
            } else {
                format!("signal: {}", libc::WTERMSIG(status))
            };
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            // ECHILD: not ours (its parent reaps it).
            return format!("not our child: {e}");
        }
    }
}

/// Waits until every background reap has finished, at most `limit`;
/// returns how many are still running.
pub fn wait_reaped(limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut n = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    while *n > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        n = REAPED
            .wait_timeout(n, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    *n
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn the_stat_line_says_whether_a_task_is_exiting() {
        let line = |state: &str, flags: u64| {
            format!("4242 (qemu (x) y) {state} 1 4242 4242 0 -1 {flags} 100 0 0 0 5 3 0 0 20 0 4")
        };
        assert!(!stat_exiting(&line("S", 0x400040)));
        assert!(!stat_exiting(&line("R", 0x400140)));
        assert!(stat_exiting(&line("R", 0x400044)), "PF_EXITING");
        assert!(stat_exiting(&line("D", 0x400044)));
        assert!(stat_exiting(&line("Z", 0x400040)), "a zombie");
        assert!(stat_exiting(&line("X", 0)));
        assert!(!stat_exiting("garbage"));
    }

    #[test]
    fn a_child_that_exits_is_exiting_and_is_reaped_in_the_background() {
        let mut child = Command::new("sleep")
            .arg("600")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!exiting(pid), "a sleeping process is not exiting");
        assert!(!wait_exiting(pid, Duration::from_millis(20)));
        child.kill().unwrap();
        assert!(wait_exiting(pid, Duration::from_secs(10)));
        reap_in_background("t", pid, Some(child));
        assert_eq!(wait_reaped(Duration::from_secs(10)), 0);
        // Reaped: no zombie is left.
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    }

    #[test]
    fn a_child_known_by_pid_only_is_reaped_too() {
        let child = Command::new("sh")
            .args(["-c", "exit 3"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        // Dropping a Child does not reap it (as after an exec handover).
        drop(child);
        assert!(wait_exiting(pid, Duration::from_secs(10)));
        assert_eq!(wait_pid(pid), "exit status: 3");
        assert!(wait_pid(pid).starts_with("not our child"));
    }
}
