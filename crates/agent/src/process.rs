//! The agent's child processes and descriptors, below every layer: reaping
//! and killing a QEMU that is our child by pid only (adopted after an exec
//! handover), and the close-on-exec flag of an fd that must (or must not)
//! survive an exec.

#![allow(unsafe_code)]

use std::os::fd::RawFd;
use std::time::Duration;

pub(crate) fn set_cloexec(fd: RawFd, on: bool) -> std::io::Result<()> {
    // SAFETY: F_GETFD/F_SETFD only read and set the descriptor flags of an
    // fd this process owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let new = if on {
            flags | libc::FD_CLOEXEC
        } else {
            flags & !libc::FD_CLOEXEC
        };
        if libc::fcntl(fd, libc::F_SETFD, new) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// For an adopted QEMU (our child by pid only): its exit status if it has
/// exited, reaping it.
pub(crate) fn reap(pid: u32) -> Option<String> {
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG on a pid; writes one int we own.
    let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
    if r == pid as i32 {
        return Some(if libc::WIFEXITED(status) {
            format!("exit status: {}", libc::WEXITSTATUS(status))
        } else {
            format!("signal: {}", libc::WTERMSIG(status))
        });
    }
    // SAFETY: signal 0 only checks that the process exists.
    if r < 0 && unsafe { libc::kill(pid as i32, 0) } != 0 {
        return Some("exited".into());
    }
    None
}

/// Kills and reaps an adopted QEMU.
pub(crate) fn kill_and_reap(pid: u32) {
    // SAFETY: SIGKILL to a QEMU pid this agent started (still our child).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    for _ in 0..500 {
        if reap(pid).is_some() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
