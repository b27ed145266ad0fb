//! Work on a VM that a new agent must finish if the old one dies midway.
//!
//! Before the agent pauses a VM it did not find paused, or takes its QEMU
//! away, it writes what it is doing to `<vm-dir>/intent.json` (atomically,
//! synced); when the work is done it removes the file. An agent that
//! adopts the VM after a crash ([`crate::cluster_record::adopt`]) reads the file
//! and finishes the work, so that no VM stays paused and no VM whose QEMU
//! was being replaced is lost:
//!
//! | intent | written | a new agent finding a live QEMU | ... finding none |
//! |---|---|---|---|
//! | `resume` | before `stop` (snapshot, rejuvenation) | ends a migration still running, resumes the guest | nothing (the VM is exited) |
//! | `restart` | once the device state is saved and synced, before the old QEMU quits | a new QEMU still loading is waited for; either QEMU is resumed | starts a new QEMU on the saved state and resumes it |
//! | `boot` | before a cold restart quits the old QEMU | resumes it if paused | boots the VM again |
//!
//! A VM the operator paused is never marked, so it is never resumed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::qemu::QemuConfig;
use crate::vm::Vm;
use crate::{log, AgentError};

/// The file in a VM's directory.
pub const INTENT_FILE: &str = "intent.json";

/// What the agent is doing to a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Intent {
    /// The agent pauses (or paused) the VM and will resume it.
    Resume,
    /// Warm or saved restart: the complete device state (and for `saved`,
    /// RAM) is in `state`; the old QEMU may be gone.
    Restart {
        /// The state file.
        state: PathBuf,
        /// Whether guest RAM stays in the shared file (warm).
        warm: bool,
    },
    /// Cold restart: the old QEMU is being replaced by a fresh boot.
    Boot,
}

fn path(config: &QemuConfig) -> PathBuf {
    config.console_log.with_file_name(INTENT_FILE)
}

/// Records `intent` for the VM of `config`, durably, before the work starts.
pub fn set(config: &QemuConfig, intent: &Intent) -> Result<(), AgentError> {
    crate::paths::write_atomic(
        &path(config),
        &serde_json::to_vec(intent).expect("intent serialises"),
    )
}

/// The work is done.
pub fn clear(config: &QemuConfig) {
    let _ = std::fs::remove_file(path(config));
}

/// The recorded intent, if any (an unreadable file counts as `resume`:
/// resuming a VM the agent paused is the safe reading).
pub fn get(config: &QemuConfig) -> Option<Intent> {
    let bytes = std::fs::read(path(config)).ok()?;
    Some(serde_json::from_slice(&bytes).unwrap_or(Intent::Resume))
}

/// Migration states in which QEMU still moves data.
const ACTIVE: &[&str] = &[
    "setup",
    "active",
    "device",
    "wait-unplug",
    "pre-switchover",
    "cancelling",
    "postcopy-active",
];

/// An adopted, live QEMU: finishes what its intent says.
pub fn finish(vm: &mut Vm) {
    let Some(intent) = get(&vm.config) else {
        return;
    };
    log(format!(
        "VM {}: finishing the work a previous agent left: {intent:?}",
        vm.name
    ));
    let status = vm.run_state();
    let migration = vm
        .execute("query-migrate", Value::Null)
        .ok()
        .and_then(|v| v["status"].as_str().map(str::to_string));
    let migrating = migration.as_deref().is_some_and(|s| ACTIVE.contains(&s));
    if status == "inmigrate" {
        // A new QEMU of a restart: let it load (it reads the state file
        // itself), or give it the state if it never got the command.
        if let Intent::Restart { state, warm } = &intent {
            if !migrating && migration.as_deref() != Some("completed") {
                if let Err(e) = crate::rejuvenate::load_state(vm, state, *warm) {
                    log(format!(
                        "VM {}: loading the saved state into the adopted QEMU: {e}",
                        vm.name
                    ));
                }
            }
        }
        vm.wait_migration_end("the restart's state load", Duration::from_secs(600));
    } else if migrating {
        // An outgoing migration of a snapshot or a state save whose reader
        // died with the old agent. A hot snapshot's relay discards what is
        // left, so it completes (and QEMU lifts its write protection); the
        // others are cancelled.
        let bg = vm
            .execute("query-migrate-capabilities", Value::Null)
            .ok()
            .and_then(|caps| {
                caps.as_array()?
                    .iter()
                    .find(|c| c["capability"] == "background-snapshot")
                    .map(|c| c["state"] == true)
            })
            .unwrap_or(false);
        if !bg {
            let _ = vm.execute("migrate_cancel", Value::Null);
        }
        vm.wait_migration_end("the interrupted migration", Duration::from_secs(600));
    }
    let status = vm.run_state();
    if matches!(
        status.as_str(),
        "paused" | "postmigrate" | "finish-migrate" | "prelaunch"
    ) {
        match vm.execute("cont", Value::Null) {
            Ok(_) => log(format!(
                "VM {}: resumed (it was {status}, paused by an agent that died)",
                vm.name
            )),
            Err(e) => log(format!("VM {}: cannot resume it ({status}): {e}", vm.name)),
        }
    }
    clear(&vm.config);
}

/// A VM whose QEMU is gone: if it was in the middle of a restart, start it
/// again (from the saved state, or by booting it); else `None`.
pub fn recover_dead(config: &QemuConfig, qemu_log: &Path) -> Option<Vm> {
    let intent = get(config)?;
    let name = config.name.clone();
    let result = match &intent {
        Intent::Resume => {
            clear(config);
            return None;
        }
        Intent::Restart { .. } => {
            log(format!(
                "VM {name}: its QEMU died during a restart; starting a new one on the saved state"
            ));
            start_again(config, qemu_log, &intent)
        }
        Intent::Boot => {
            log(format!(
                "VM {name}: its QEMU died during a cold restart; booting it again"
            ));
            start_again(config, qemu_log, &intent)
        }
    };
    match result {
        Ok(vm) => {
            clear(config);
            if let Intent::Restart { state, .. } = &intent {
                let _ = std::fs::remove_file(state);
            }
            Some(vm)
        }
        Err(e) => {
            // The intent stays: a later agent may try again; the error is
            // in the log and the VM shows as exited.
            log(format!("VM {name}: could not be started again: {e}"));
            None
        }
    }
}

/// The installed QEMU, then the kept copy of the previous one.
fn start_again(config: &QemuConfig, qemu_log: &Path, intent: &Intent) -> Result<Vm, AgentError> {
    use crate::restart_recovery as r;
    let candidates = r::candidates(config, intent, r::How::Resume, None)?;
    r::start_again(config, qemu_log, intent, &candidates).map(|(vm, _)| vm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intents_round_trip_and_clear() {
        let d = tempfile::tempdir().unwrap();
        let mut c: QemuConfig = serde_json::from_value(serde_json::json!({
            "name": "a", "accel": "tcg", "memory_mib": 128, "vcpus": 1, "ram_file": "/dev/shm/x",
            "kernel": "/k", "initrd": "/i", "cmdline": "", "console_log": "/x/console.log",
            "qmp_socket": "/x/q", "disk": "/x/d", "port_socket": "/x/p", "mac": "52:54:00:00:00:01",
            "incoming": false,
        }))
        .unwrap();
        c.console_log = d.path().join("console.log");
        assert_eq!(get(&c), None);
        let i = Intent::Restart {
            state: d.path().join("restart.state"),
            warm: true,
        };
        set(&c, &i).unwrap();
        assert_eq!(get(&c), Some(i));
        clear(&c);
        assert_eq!(get(&c), None);
        std::fs::write(d.path().join(INTENT_FILE), b"garbage").unwrap();
        assert_eq!(
            get(&c),
            Some(Intent::Resume),
            "an unreadable intent is read as resume"
        );
    }
}
