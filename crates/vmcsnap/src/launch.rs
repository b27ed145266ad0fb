//! Starting the agent on demand.

use std::fs::OpenOptions;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use vmcsnap_agent::RunDir;
use vmcsnap_control::{call, ControlError, Request};

/// Whether `e` means no agent is listening.
pub fn agent_absent(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<ControlError>(),
        Some(ControlError::NoAgent { .. })
    )
}

/// Returns the pid of the agent of `run_dir`, starting one in the
/// background if none answers.
pub fn ensure_agent(run_dir: &RunDir, exit_when_idle: bool) -> Result<u32> {
    let sock = run_dir.agent_socket();
    if let Ok(v) = call(
        &sock,
        &Request::Ping,
        Some(Duration::from_secs(5)),
        &mut |_| {},
    ) {
        return Ok(v["pid"].as_u64().unwrap_or(0) as u32);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(run_dir.root())
        .with_context(|| format!("cannot create run directory {}", run_dir.root().display()))?;
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
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("cannot start the agent")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(v) = call(
            &sock,
            &Request::Ping,
            Some(Duration::from_secs(5)),
            &mut |_| {},
        ) {
            return Ok(v["pid"].as_u64().unwrap_or(0) as u32);
        }
        if let Ok(Some(st)) = child.try_wait() {
            let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            bail!(
                "the agent exited at start ({st}); {}: {}",
                log_path.display(),
                tail.join(" | ")
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the agent did not answer on {} within 10 s; see {}",
                sock.display(),
                log_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
