//! One agent per run directory, whoever starts it.
//!
//! Two CLI calls that found no agent used to start one each: both checked
//! that nothing answered on `agent.sock`, and the second either found the
//! first bound and exited ("another agent is already serving", failing its
//! CLI call), or, checking just before the first bound, removed the first
//! one's socket and bound its own, leaving two agents adopting the same
//! VMs. Now an agent holds an exclusive `flock` on `<run-dir>/agent.lock`
//! for its whole life, taken before it touches the socket or a VM, and
//! writes its pid into the file. An agent that cannot take the lock exits
//! with [`AgentError::AnotherAgent`] (exit code [`EXIT_ANOTHER_AGENT`]),
//! and the CLI that started it connects to the holder instead
//! (`vmcsnap::launch`). The kernel drops the lock when the agent dies, even
//! by `kill -9`. Across an exec restart (`crate::handover`) the descriptor
//! is inherited, so the lock is never released in between.
//!
//! The descriptor is close-on-exec: no QEMU or relay the agent starts
//! inherits it (a child still holding it after the agent's death would
//! keep every later agent out).

#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use crate::{AgentError, RunDir};

/// The exit code of `vmcsnap agent run` when another agent holds the lock
/// (`EX_TEMPFAIL`): the CLI that started it then talks to that one.
pub const EXIT_ANOTHER_AGENT: i32 = 75;
/// The lock file's name in the run directory.
pub const FILE_NAME: &str = "agent.lock";

/// The held lock: dropped (closed) only when the agent exits.
#[derive(Debug)]
pub struct AgentLock {
    file: File,
}

impl AgentLock {
    /// Takes the lock of `run`, or fails with [`AgentError::AnotherAgent`]
    /// naming the holder's pid if another process holds it.
    pub fn acquire(run: &RunDir) -> Result<AgentLock, AgentError> {
        let path = lock_path(run);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(AgentError::io("opening", &path))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(AgentError::AnotherAgent {
                    pid: holder(&mut file),
                    socket: run.agent_socket(),
                });
            }
            return Err(AgentError::io("locking", &path)(e));
        }
        // Written over the old content, then cut: never empty.
        let write = |f: &mut File| -> std::io::Result<()> {
            let line = format!("{}\n", std::process::id());
            f.seek(SeekFrom::Start(0))?;
            f.write_all(line.as_bytes())?;
            f.set_len(line.len() as u64)
        };
        write(&mut file).map_err(AgentError::io("writing", &path))?;
        Ok(AgentLock { file })
    }

    /// The lock held by the previous image of this process (an exec
    /// restart), as descriptor `fd`: checked to be `run`'s lock file, and
    /// made close-on-exec again.
    pub fn inherited(run: &RunDir, fd: RawFd) -> Result<AgentLock, AgentError> {
        let path = lock_path(run);
        let want = std::fs::metadata(&path).map_err(AgentError::io("reading", &path))?;
        // SAFETY: fstat on a descriptor number; the struct is plain data
        // the call fills in (or an error is returned and it is not read).
        let st = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            (libc::fstat(fd, &mut st) == 0).then_some(st)
        };
        match st {
            Some(st) if st.st_dev == want.dev() && st.st_ino == want.ino() => {}
            _ => {
                return Err(AgentError::BadRequest(format!(
                    "inherited descriptor {fd} is not the agent lock {}",
                    path.display()
                )))
            }
        }
        // SAFETY: the previous image of this process left this descriptor
        // open for us (checked above); nothing else in this image owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        crate::process::set_cloexec(fd, true)
            .map_err(AgentError::io("restoring close-on-exec on", &path))?;
        Ok(AgentLock { file })
    }

    /// Its descriptor (kept open across an exec restart).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Whether some process holds `run`'s agent lock now (a live agent, or
/// one whose threads are still exiting). Probed with a shared lock taken
/// and dropped at once; an agent starting in that instant fails its own
/// and exits [`EXIT_ANOTHER_AGENT`], which its starter handles by trying
/// again.
pub fn is_held(run: &RunDir) -> bool {
    let Ok(file) = File::open(lock_path(run)) else {
        return false;
    };
    // SAFETY: flock on a descriptor this function owns; closing it (drop)
    // releases a lock we got.
    let got = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
    !got
}

/// The pid the holder of the lock wrote in `file`; a holder that has just
/// taken it may not have written it yet, so a moment is allowed for that.
fn holder(file: &mut File) -> Option<u32> {
    for _ in 0..50 {
        let mut text = String::new();
        if file.seek(SeekFrom::Start(0)).is_ok() && file.read_to_string(&mut text).is_ok() {
            if let Some(line) = text.strip_suffix('\n') {
                if let Ok(pid) = line.trim().parse() {
                    return Some(pid);
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    None
}

fn lock_path(run: &RunDir) -> PathBuf {
    run.root().join(FILE_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holders_pid_until_the_first_goes() {
        let d = tempfile::tempdir().unwrap();
        let run = RunDir::new(d.path());
        let first = AgentLock::acquire(&run).unwrap();
        match AgentLock::acquire(&run) {
            Err(AgentError::AnotherAgent { pid, .. }) => {
                assert_eq!(pid, Some(std::process::id()))
            }
            other => panic!("a second lock was not refused: {other:?}"),
        }
        drop(first);
        let again = AgentLock::acquire(&run).unwrap();
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(again.fd(), libc::F_GETFD) };
        assert!(flags & libc::FD_CLOEXEC != 0, "inherited by children");
    }

    #[test]
    fn is_held_says_whether_an_agent_holds_the_lock_and_takes_none() {
        let d = tempfile::tempdir().unwrap();
        let run = RunDir::new(d.path());
        assert!(!is_held(&run), "no lock file");
        let held = AgentLock::acquire(&run).unwrap();
        assert!(is_held(&run));
        drop(held);
        assert!(!is_held(&run), "released");
        AgentLock::acquire(&run).expect("the probe kept the lock");
    }
}
