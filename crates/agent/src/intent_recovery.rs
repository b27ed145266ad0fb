//! What an agent that adopts a VM does with the intent it finds
//! (`<vm-dir>/intent.json`, [`crate::intent`], whose table says what each
//! intent leads to): finishes the work on a live QEMU ([`finish`]), or starts
//! again a VM whose QEMU died mid-restart ([`recover_dead`]).

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::intent::{clear, get, Intent};
use crate::qemu::QemuConfig;
use crate::vm::Vm;
use crate::{log, AgentError};

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
                if let Err(e) = crate::qemu_restart::load_state(vm, state, *warm) {
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
