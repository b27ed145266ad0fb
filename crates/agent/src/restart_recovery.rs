//! Starting a VM again whose QEMU restart did not finish.
//!
//! A warm or saved restart that got as far as saving the device state
//! leaves, when neither the new QEMU nor the kept copy of the old one can
//! take over: the state file, the RAM file (warm), the kept copy of the old
//! QEMU ([`crate::qemu_kept`]) and the `restart` intent ([`crate::intent`]).
//! A cold restart leaves the `boot` intent. From that:
//!
//! - **resume** tries the QEMU the operator names (`VMCSNAP_QEMU` of the
//!   CLI, else the installed one), then the kept copy. A named QEMU whose
//!   release cannot load what the kept copy's release saved (a microvm VM
//!   from 10.0 to 7.2, [`crate::qemu_crossing::check`]) is refused before
//!   anything starts; the installed one is then skipped, with a log line;
//! - **rollback** tries the kept copy only: the VM goes back to the QEMU it
//!   ran before the restart.
//!
//! A new agent adopting a VM whose QEMU died mid-restart does the same as
//! resume, with the agent's own QEMU ([`crate::intent_recovery::recover_dead`]).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::intent::Intent;
use crate::qemu::QemuConfig;
use crate::qemu_restart::{installed, try_start_and_load};
use crate::vm::Vm;
use crate::{log, AgentError};

/// Which QEMU a recovery may use.
pub use vmcsnap_control::Recover as How;

/// The QEMUs to try, in order, each with the config to run it with.
/// `qemu` is the binary the operator named; `None` looks up the installed
/// one.
pub fn candidates(
    config: &QemuConfig,
    intent: &Intent,
    how: How,
    qemu: Option<&Path>,
) -> Result<Vec<(PathBuf, QemuConfig)>, AgentError> {
    let kept_dir = crate::qemu_kept::dir_of(config);
    let kept = crate::qemu_kept::load(&kept_dir);
    let old_bin = kept.as_ref().map(|k| k.bin.as_path());
    let mut v = vec![];
    let mut missing = None;
    if how == How::Resume {
        match qemu {
            Some(p) => {
                if let Some(why) = refused_crossing(config, intent, old_bin, p) {
                    return Err(AgentError::BadRequest(format!(
                        "{why}; nothing was started: `vmcsnap rejuvenate --vm {} --rollback` starts it on the kept copy, or name a QEMU of that release in VMCSNAP_QEMU",
                        config.name
                    )));
                }
                v.push((p.to_path_buf(), installed(config, p)))
            }
            None => match crate::qemu::find_qemu() {
                Ok(p) => match refused_crossing(config, intent, old_bin, &p) {
                    Some(why) => log(format!("{why}; trying the kept copy only")),
                    None => {
                        let c = installed(config, &p);
                        v.push((p, c))
                    }
                },
                Err(e) => missing = Some(e),
            },
        }
    }
    if let Some(k) = kept {
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

/// Why `bin` cannot load the state of the unfinished restart `intent`,
/// saved by the QEMU release of `old_bin` (the kept copy of the QEMU the VM
/// ran): `None` if it can, for a cold restart's fresh boot, or when a
/// release cannot be read (the load itself then tells).
fn refused_crossing(
    config: &QemuConfig,
    intent: &Intent,
    old_bin: Option<&Path>,
    bin: &Path,
) -> Option<String> {
    use crate::qemu_crossing::{binary_version, check, dialect_of};
    let mode = match intent {
        Intent::Restart { warm: true, .. } => vmcsnap_control::RejuvenateMode::Warm,
        Intent::Restart { warm: false, .. } => vmcsnap_control::RejuvenateMode::Saved,
        Intent::Boot | Intent::Resume => return None,
    };
    let name = &config.name;
    let from = dialect_of(name, binary_version(old_bin?).ok()?).ok()?;
    let to = dialect_of(name, binary_version(bin).ok()?).ok()?;
    match check(name, config.machine, mode, from, to) {
        Ok(()) => None,
        Err(crate::qemu_crossing::CrossingError::Refused { why, .. }) => Some(format!(
            "VM {name:?}: {} is {to}, which cannot load the state {from} saved ({why})",
            bin.display()
        )),
        Err(e) => Some(e.to_string()),
    }
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
    member: &mut crate::member::Member,
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
    let cands = candidates(&config, &intent, how, qemu)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn config(dir: &Path, machine: &str) -> QemuConfig {
        serde_json::from_value(serde_json::json!({
            "name": "a", "accel": "tcg", "memory_mib": 64, "vcpus": 1,
            "ram_file": dir.join("ram"), "kernel": "/k", "machine": machine,
            "console_log": dir.join("console.log"), "qmp_socket": dir.join("qmp.sock"),
            "disks": [], "port_socket": dir.join("port.sock"),
            "mac": "52:54:00:00:00:01", "incoming": false
        }))
        .unwrap()
    }

    /// A stand-in for a QEMU binary that only answers `--version`.
    fn fake_qemu(path: &Path, version: &str) {
        std::fs::write(
            path,
            format!("#!/bin/sh\necho 'QEMU emulator version {version} (test)'\n"),
        )
        .unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A kept copy of a QEMU of release `version` for the VM of `config`.
    fn keep_fake(config: &QemuConfig, version: &str) {
        let dir = crate::qemu_kept::dir_of(config);
        std::fs::create_dir_all(&dir).unwrap();
        fake_qemu(&dir.join("qemu-system-x86_64"), version);
        let origin = crate::qemu_kept::Origin {
            installed: "/usr/bin/qemu-system-x86_64".into(),
            data_dir: None,
        };
        std::fs::write(dir.join("kept.json"), serde_json::to_vec(&origin).unwrap()).unwrap();
    }

    fn warm() -> Intent {
        Intent::Restart {
            state: "/nowhere/state".into(),
            warm: true,
        }
    }

    /// Regression test: `rejuvenate --resume` with a named QEMU that cannot
    /// load the saved state (a microvm VM saved by 10.0, resumed on 7.2)
    /// used to try it anyway: the load failed in QEMU, then the kept copy
    /// was tried. It is refused before anything starts, naming both
    /// releases and the way out.
    #[test]
    fn a_resume_on_a_release_that_cannot_load_the_state_is_refused_before_starting() {
        let d = tempfile::tempdir().unwrap();
        let c = config(d.path(), "microvm");
        keep_fake(&c, "10.0.2");
        let q7 = d.path().join("qemu72");
        fake_qemu(&q7, "7.2.19");
        let e = candidates(&c, &warm(), How::Resume, Some(&q7))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is QEMU 7.2, which cannot load the state QEMU 10.0 saved"),
            "{e}"
        );
        assert!(
            e.contains("nothing was started") && e.contains("--rollback"),
            "{e}"
        );
        // A rollback uses the kept copy alone.
        let v = candidates(&c, &warm(), How::Rollback, Some(&q7)).unwrap();
        assert_eq!(v.len(), 1);
        assert!(v[0].0.ends_with("qemu-kept/qemu-system-x86_64"));
    }

    #[test]
    fn resumes_that_qemu_can_make_keep_the_named_binary_first() {
        let d = tempfile::tempdir().unwrap();
        let q10 = d.path().join("qemu10");
        fake_qemu(&q10, "10.0.2");
        let q7 = d.path().join("qemu72");
        fake_qemu(&q7, "7.2.19");
        // An upgrade of a microvm VM, a q35 VM either way, a cold restart's
        // boot either way.
        for (machine, kept, named, intent) in [
            ("microvm", "7.2.19", &q10, warm()),
            ("q35", "10.0.2", &q7, warm()),
            ("microvm", "10.0.2", &q7, Intent::Boot),
        ] {
            let dir = d
                .path()
                .join(format!("{machine}-{kept}-{intent:?}").replace('/', "_"));
            std::fs::create_dir_all(&dir).unwrap();
            let c = config(&dir, machine);
            keep_fake(&c, kept);
            let v = candidates(&c, &intent, How::Resume, Some(named)).unwrap();
            assert_eq!(v.len(), 2, "{machine} {kept} {intent:?}");
            assert_eq!(&v[0].0, named);
        }
    }
}
