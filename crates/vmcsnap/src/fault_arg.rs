//! Testing: the hidden `--inject-fault FAULT` of `snapshot`, `rejuvenate`
//! and `restore --cluster`, only in a build with the `fault-injection`
//! feature (the test command's). It never travels in the request: the CLI
//! arms the fault in the agent's run directory
//! (`vmcsnap_agent::fault::arm`), the agent takes it when the operation
//! starts, and the CLI removes one the operation did not take. Without the
//! feature the option does not exist and arming does nothing.

use vmcsnap_agent::RunDir;

#[cfg(feature = "fault-injection")]
use vmcsnap_agent::fault::Armed;

/// `--inject-fault` of `snapshot VM`.
#[cfg(feature = "fault-injection")]
#[derive(Debug, clap::Args)]
pub struct SnapshotFault {
    /// Testing: make this snapshot's capture fail (capture-error-after=BYTES) or stop
    /// reading (capture-stall-after=BYTES) part-way, or its commit hang until given up on
    /// after SECONDS (commit-stall-deadline=SECONDS), to check what a failure leaves; or,
    /// pre-copy, change page PAGE of guest RAM behind QEMU's back in the switch-over pause
    /// (precopy-untracked-write=PAGE, put back before the guest resumes); or make a first
    /// hot snapshot's read of guest RAM SECONDS longer (ram-read-delay=SECONDS).
    #[arg(long, hide = true, value_name = "FAULT", conflicts_with = "cluster")]
    pub inject_fault: Option<String>,
}

/// `--inject-fault` of `rejuvenate`.
#[cfg(feature = "fault-injection")]
#[derive(Debug, clap::Args)]
pub struct RejuvenateFault {
    /// Testing: kill the new QEMU right after it started (new-qemu-dies: the kept copy
    /// takes over), or fail both it and the kept copy (fallback-fails), to check what a
    /// failed restart leaves and that --resume/--rollback recover it.
    #[arg(long, hide = true, value_name = "FAULT")]
    pub inject_fault: Option<String>,
}

/// `--inject-fault` of `restore --cluster`.
#[cfg(feature = "fault-injection")]
#[derive(Debug, clap::Args)]
pub struct RestoreFault {
    /// Testing, with --cluster: make VM's Cohort fail in place of LOAD_FIN once every VM
    /// has loaded (cohort-fail-when-peers-loaded=VM), to check what an abandoned restore
    /// leaves; or hold the background push (background-held-until=PATH) or START
    /// (start-held-until=PATH) until PATH exists, to kill the agent at that stage.
    #[arg(long, hide = true, value_name = "FAULT", requires = "cluster")]
    pub inject_fault: Option<String>,
}

/// A fault armed for one operation: removed when dropped unless the agent
/// took it.
#[cfg(feature = "fault-injection")]
pub struct ArmedFault(Option<std::path::PathBuf>);

#[cfg(feature = "fault-injection")]
impl Drop for ArmedFault {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(feature = "fault-injection")]
fn arm(run: &RunDir, fault: &Option<String>, what: Armed<'_>) -> anyhow::Result<ArmedFault> {
    use anyhow::Context;
    let Some(fault) = fault else {
        return Ok(ArmedFault(None));
    };
    vmcsnap_agent::fault::arm(run, what, fault)
        .with_context(|| format!("arming --inject-fault at {}", what.path(run).display()))?;
    Ok(ArmedFault(Some(what.path(run))))
}

#[cfg(feature = "fault-injection")]
impl SnapshotFault {
    /// Arms the fault for the next snapshot of `vm`.
    pub fn arm(&self, run: &RunDir, vm: &str) -> anyhow::Result<ArmedFault> {
        arm(run, &self.inject_fault, Armed::Snapshot(vm))
    }
}

#[cfg(feature = "fault-injection")]
impl RejuvenateFault {
    /// Arms the fault for the next rejuvenation of `vm` (`None`: all).
    pub fn arm(&self, run: &RunDir, vm: Option<&str>) -> anyhow::Result<ArmedFault> {
        arm(run, &self.inject_fault, Armed::Rejuvenate(vm))
    }
}

#[cfg(feature = "fault-injection")]
impl RestoreFault {
    /// Arms the fault for the next cluster restore.
    pub fn arm(&self, run: &RunDir) -> anyhow::Result<ArmedFault> {
        arm(run, &self.inject_fault, Armed::ClusterRestore)
    }
}

/// No option in this build.
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, clap::Args)]
pub struct SnapshotFault {}

/// No option in this build.
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, clap::Args)]
pub struct RejuvenateFault {}

/// No option in this build.
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, clap::Args)]
pub struct RestoreFault {}

/// Nothing armed.
#[cfg(not(feature = "fault-injection"))]
pub struct ArmedFault;

#[cfg(not(feature = "fault-injection"))]
impl SnapshotFault {
    /// Nothing to arm.
    pub fn arm(&self, _run: &RunDir, _vm: &str) -> anyhow::Result<ArmedFault> {
        Ok(ArmedFault)
    }
}

#[cfg(not(feature = "fault-injection"))]
impl RejuvenateFault {
    /// Nothing to arm.
    pub fn arm(&self, _run: &RunDir, _vm: Option<&str>) -> anyhow::Result<ArmedFault> {
        Ok(ArmedFault)
    }
}

#[cfg(not(feature = "fault-injection"))]
impl RestoreFault {
    /// Nothing to arm.
    pub fn arm(&self, _run: &RunDir) -> anyhow::Result<ArmedFault> {
        Ok(ArmedFault)
    }
}
