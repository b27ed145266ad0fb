//! Starting the agent on demand.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use vmcsnap_agent::RunDir;
use vmcsnap_control::{call, ControlError, Request, Response};

/// Whether `e` means no agent is listening.
pub fn agent_absent(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<ControlError>(),
        Some(ControlError::NoAgent { .. })
    )
}

/// How long our own agent may take to answer its first ping.
const START_BOUND: Duration = Duration::from_secs(10);
/// How long, at most, after our agent lost the start to another one.
const LOST_BOUND: Duration = Duration::from_secs(30);
/// How long a CLI waits for another CLI that is starting the agent.
const START_LOCK_WAIT: Duration = Duration::from_secs(60);
/// The file CLIs lock while one of them starts the agent.
const START_LOCK: &str = "agent-start.lock";

/// The pid of the agent answering on `sock`, if one does; an agent of
/// another version is an error (starting another would not help).
fn ping(sock: &Path) -> Result<Option<u32>> {
    match call(
        sock,
        &Request::Ping,
        Some(Duration::from_secs(5)),
        &mut |_| {},
    ) {
        Ok(Response::Ping(info)) => Ok(Some(info.pid)),
        Err(e @ ControlError::VersionMismatch { .. }) => Err(e.into()),
        _ => Ok(None),
    }
}

/// Returns the pid of the agent of `run_dir`, starting one in the
/// background if none answers.
///
/// Race-free among CLI calls (issue 29: two calls that each started an
/// agent made one of them fail): the CLIs that find no agent take turns on
/// `<run-dir>/agent-start.lock`, and each looks again once it has the
/// turn, so the later ones find the agent the first one started. An agent
/// started otherwise (`vmcsnap agent run`, or one still exiting once idle)
/// holds the run directory's agent lock: ours then exits with
/// [`vmcsnap_agent::agent_lock::EXIT_ANOTHER_AGENT`], and we talk to that
/// one, or start ours again once it is gone.
pub fn ensure_agent(run_dir: &RunDir, exit_when_idle: bool) -> Result<u32> {
    let sock = run_dir.agent_socket();
    if let Some(pid) = ping(&sock)? {
        return Ok(pid);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(run_dir.root())
        .with_context(|| format!("cannot create run directory {}", run_dir.root().display()))?;
    let _turn = StartTurn::take(&run_dir.root().join(START_LOCK))?;
    if let Some(pid) = ping(&sock)? {
        return Ok(pid);
    }
    let log_path = run_dir.agent_log();
    let mut child = spawn(run_dir, exit_when_idle)?;
    let t0 = Instant::now();
    let mut deadline = t0 + START_BOUND;
    let mut lost = false;
    loop {
        if let Some(pid) = ping(&sock)? {
            return Ok(pid);
        }
        if let Ok(Some(st)) = child.try_wait() {
            if !may_start_again(st.code()) {
                let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                bail!(
                    "the agent exited at start ({st}); {}: {}",
                    log_path.display(),
                    tail.join(" | ")
                );
            }
            // Another agent holds the run directory, or ours already
            // exited idle: another agent gets as long to answer as ours
            // would have (within a bound), and once none is left (no
            // socket), ours starts again.
            if !lost {
                lost = true;
                deadline = (Instant::now() + START_BOUND).min(t0 + LOST_BOUND);
            }
            // A killed agent leaves its socket file, and holds the lock
            // until its last thread has exited (a fraction of a second):
            // once the lock is free, nobody else will answer.
            if !sock.exists() || !vmcsnap_agent::agent_lock::is_held(run_dir) {
                std::thread::sleep(Duration::from_millis(50));
                child = spawn(run_dir, exit_when_idle)?;
                lost = false;
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the agent did not answer on {} within {} s; see {}",
                sock.display(),
                START_BOUND.as_secs(),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether our agent's exit with `code` leaves the start to be tried
/// again: it lost the run directory to another agent, or it served and
/// exited once idle before our ping reached it (other CLIs' requests
/// came first: CI saw "the agent exited at start (exit status: 0)").
/// Anything else is a failure to report.
fn may_start_again(code: Option<i32>) -> bool {
    matches!(
        code,
        Some(0) | Some(vmcsnap_agent::agent_lock::EXIT_ANOTHER_AGENT)
    )
}

/// Starts `vmcsnap agent run` for `run_dir` in the background, its output
/// appended to the agent log.
fn spawn(run_dir: &RunDir, exit_when_idle: bool) -> Result<Child> {
    let log_path = run_dir.agent_log();
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("cannot open {}", log_path.display()))?;
    let exe = std::env::current_exe().context("cannot find the vmcsnap executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("--run-dir")
        .arg(run_dir.root())
        .args(["agent", "run"]);
    if exit_when_idle {
        cmd.arg("--exit-when-idle");
    }
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("cannot start the agent")
}

/// Sends `req` to the agent of `run_dir`, starting one (that exits once
/// idle) if none answers, and prints its progress lines. An agent that
/// went away between answering our ping and our connecting (it exited
/// once idle) is replaced, and the request sent again: it had never been
/// sent (the connection failed).
pub fn request_started(run_dir: &RunDir, req: &Request) -> Result<Response> {
    let sock = run_dir.agent_socket();
    let mut attempts = 0;
    loop {
        ensure_agent(run_dir, true)?;
        attempts += 1;
        match call(&sock, req, None, &mut |m| eprintln!("  {m}")) {
            Err(ControlError::NoAgent { source, .. }) if not_sent(&source) && attempts < 3 => {}
            r => return Ok(r?),
        }
    }
}

/// Whether a failure to reach the agent means the request never left:
/// the connection itself failed (the socket is gone, or nothing listens),
/// or was reset before the agent read the request.
fn not_sent(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound
            | std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
    )
}

/// This CLI's turn to start the agent: an exclusive `flock` on the start
/// lock file, released when dropped (or when the CLI dies).
struct StartTurn {
    _file: File,
}

impl StartTurn {
    /// Waits for the turn, at most [`START_LOCK_WAIT`].
    fn take(path: &Path) -> Result<StartTurn> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let deadline = Instant::now() + START_LOCK_WAIT;
        loop {
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(StartTurn { _file: file });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(e).with_context(|| format!("cannot lock {}", path.display()));
            }
            if Instant::now() > deadline {
                bail!(
                    "another vmcsnap command has been starting the agent for {} s (it holds {}); is it stuck?",
                    START_LOCK_WAIT.as_secs(),
                    path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_that_exited_idle_or_lost_the_start_is_started_again() {
        assert!(may_start_again(Some(0)));
        assert!(may_start_again(Some(
            vmcsnap_agent::agent_lock::EXIT_ANOTHER_AGENT
        )));
        assert!(!may_start_again(Some(1)));
        assert!(!may_start_again(None), "killed by a signal");
    }
}
