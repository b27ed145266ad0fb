//! Starting a VM again whose QEMU restart did not finish.
//!
//! A warm or saved restart that got as far as saving the device state
//! leaves, when neither the new QEMU nor the kept copy of the old one can
//! take over: the state file, the RAM file (warm), the kept copy of the old
//! QEMU ([`crate::qemu_kept`]) and the `restart` intent ([`crate::intent`]).
//! A cold restart leaves the `boot` intent. From that:
//!
//! - **resume** tries the QEMU the operator names (`VMCSNAP_QEMU` of the
//!   CLI, else the installed one), then the kept copy;
//! - **rollback** tries the kept copy only: the VM goes back to the QEMU it
//!   ran before the restart.
//!
//! A new agent adopting a VM whose QEMU died mid-restart does the same as
//! resume, with the agent's own QEMU ([`crate::intent::recover_dead`]).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::intent::Intent;
use crate::qemu::QemuConfig;
use crate::rejuvenate::{installed, try_start_and_load};
use crate::vm::Vm;
use crate::{log, AgentError};

/// Which QEMU a recovery may use.
pub use vmcsnap_control::Recover as How;

/// The QEMUs to try, in order, each with the config to run it with.
/// `qemu` is the binary the operator named; `None` looks up the installed
/// one.
pub fn candidates(
    config: &QemuConfig,
    how: How,
    qemu: Option<&Path>,
) -> Result<Vec<(PathBuf, QemuConfig)>, AgentError> {
    let kept_dir = crate::qemu_kept::dir_of(config);
    let mut v = vec![];
    let mut missing = None;
    if how == How::Resume {
        match qemu {
            Some(p) => v.push((p.to_path_buf(), installed(config, p))),
            None => match crate::qemu::find_qemu() {
                Ok(p) => {
                    let c = installed(config, &p);
                    v.push((p, c))
                }
                Err(e) => missing = Some(e),
            },
        }
    }
    if let Some(k) = crate::qemu_kept::load(&kept_dir) {
        v.push((k.bin.clone(), k.config(config)));
    }
    if v.is_empty() {
        return Err(match missing {
            Some(e) => e,
            None => AgentError::BadRequest(format!(
                "VM {:?} has no kept copy of its previous QEMU to roll back to ({} is missing or incomplete); use --resume with a working QEMU",
                config.name,
                kept_dir.display()
            )),
        });
    }
    Ok(v)
}

/// Starts the VM of `config` again as `intent` (`restart` or `boot`) says,
/// trying each candidate in turn. Returns the VM and the binary that took it.
pub fn start_again(
    config: &QemuConfig,
    qemu_log: &Path,
    intent: &Intent,
    candidates: &[(PathBuf, QemuConfig)],
) -> Result<(Vm, PathBuf), AgentError> {
    let mut tried = vec![];
    for (bin, c) in candidates {
        let r = match intent {
            Intent::Restart { state, warm } => start_from_state(bin, c, qemu_log, state, *warm),
            Intent::Boot => boot_again(bin, c, qemu_log),
            Intent::Resume => {
                return Err(AgentError::BadRequest(format!(
                    "VM {:?} was not being restarted: nothing to start again",
                    config.name
                )))
            }
        };
        match r {
            Ok(vm) => return Ok((vm, bin.clone())),
            Err(e) => {
                log(format!("VM {}: {} failed: {e}", config.name, bin.display()));
                tried.push(format!("{}: {e}", bin.display()));
            }
        }
    }
    Err(AgentError::StartAgainFailed {
        vm: config.name.clone(),
        tried: tried.join("; "),
    })
}

/// A new QEMU `bin` on the saved `state`, resumed.
fn start_from_state(
    bin: &Path,
    config: &QemuConfig,
    qemu_log: &Path,
    state: &Path,
    warm: bool,
) -> Result<Vm, AgentError> {
    let mut config = config.clone();
    config.incoming = true;
    let mut vm = try_start_and_load(bin, &config, qemu_log, state, warm)?.vm;
    // See `Vm::wait_nic_accepted`: QEMU 7.2 must not start the guest before.
    vm.wait_nic_accepted()?;
    vm.execute("cont", Value::Null)?;
    Ok(vm)
}

/// A fresh boot of a VM whose cold restart did not finish.
fn boot_again(bin: &Path, config: &QemuConfig, qemu_log: &Path) -> Result<Vm, AgentError> {
    let mut config = config.clone();
    config.incoming = false;
    config.paused = false;
    let _ = std::fs::remove_file(&config.ram_file);
    let mut vm = Vm::spawn(bin, config, qemu_log.to_path_buf())?;
    vm.qmp()?;
    Ok(vm)
}

pub use vmcsnap_control::Recovered;

/// Finishes the unfinished restart of `member` (its QEMU must be gone).
pub fn recover(
    member: &mut crate::cluster::Member,
    how: How,
    qemu: Option<&Path>,
) -> Result<Recovered, AgentError> {
    let name = member.vm.name.clone();
    if member.vm.exited().is_none() {
        return Err(AgentError::BadRequest(format!(
            "VM {name:?} is running (pid {}): it has no failed restart to resume or roll back; `vmcsnap rejuvenate --vm {name}` restarts it",
            member.vm.pid
        )));
    }
    let intent = match crate::intent::get(&member.vm.config) {
        Some(i @ (Intent::Restart { .. } | Intent::Boot)) => i,
        _ => {
            return Err(AgentError::BadRequest(format!(
                "VM {name:?} exited outside a restart: nothing was kept to start it from; restore it from a snapshot (`vmcsnap restore`)"
            )))
        }
    };
    let config = member.vm.config.clone();
    let cands = candidates(&config, how, qemu)?;
    let (mut vm, bin) = start_again(&config, &member.vm.qemu_log, &intent, &cands)?;
    vm.boot_ms = member.vm.boot_ms;
    member.vm = vm;
    crate::intent::clear(&member.vm.config);
    if let Intent::Restart { state, .. } = &intent {
        let _ = std::fs::remove_file(state);
    }
    let kept_dir = crate::qemu_kept::dir_of(&member.vm.config);
    let on_kept_copy = crate::qemu_kept::runs_on(&kept_dir, member.vm.pid);
    crate::qemu_kept::drop_unless_used(&kept_dir, member.vm.pid);
    log(format!(
        "VM {name}: started again ({how:?}) on {}, pid {}",
        bin.display(),
        member.vm.pid
    ));
    Ok(Recovered {
        vm: name,
        how,
        intent: match intent {
            Intent::Boot => "boot",
            _ => "restart",
        }
        .into(),
        qemu: bin,
        on_kept_copy,
        pid: member.vm.pid,
    })
}
