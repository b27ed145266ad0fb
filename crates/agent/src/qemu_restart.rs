//! Starting a new QEMU on a saved state, and the migration steps every
//! restart of a VM's QEMU shares (a rejuvenation, its `cpr-transfer` mode,
//! a restart a new agent or `rejuvenate --resume` finishes): the migration
//! capabilities, loading the state, waiting for a migration or a QMP event.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::vm::Vm;
use crate::AgentError;

/// How long a save or load may take before the restart is abandoned.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);

/// How long each part of a restart took.
#[derive(Default)]
pub(crate) struct Timings {
    pub downtime_ms: f64,
    pub save_ms: f64,
    pub restart_ms: f64,
    pub load_ms: f64,
    pub quit_ms: f64,
    pub start_ms: f64,
    pub resume_ms: f64,
    /// Set when the new QEMU failed and the kept copy took over.
    pub fallback_reason: Option<String>,
}

/// The capabilities of a VMM restart's migration. `postcopy-ram` is turned
/// off: a VM restored through postcopy still has it on, and the stream of
/// an outgoing migration would then announce postcopy; `postcopy-preempt`
/// with it (QEMU refuses it without postcopy-ram).
pub(crate) fn caps(ignore_shared: bool) -> Value {
    json!({ "capabilities": [
        { "capability": "x-ignore-shared", "state": ignore_shared },
        { "capability": "postcopy-preempt", "state": false },
        { "capability": "postcopy-blocktime", "state": false },
        { "capability": "postcopy-ram", "state": false },
        { "capability": "return-path", "state": false },
    ] })
}

/// A new QEMU with the saved state loaded, and how long that took.
pub(crate) struct Started {
    /// The VM on its new QEMU, paused.
    pub vm: Vm,
    /// Starting the QEMU to its QMP socket answering.
    pub start_ms: f64,
    /// `migrate-incoming` to `completed`.
    pub load_ms: f64,
}

/// `config` for `bin` run from its installation, with that installation's
/// firmware and modules (a VM that fell back carries the kept copy's).
pub(crate) fn installed(config: &crate::qemu::QemuConfig, bin: &Path) -> crate::qemu::QemuConfig {
    crate::qemu::for_installation(config, bin)
}

pub(crate) fn try_start_and_load(
    bin: &Path,
    config: &crate::qemu::QemuConfig,
    qemu_log: &Path,
    state: &Path,
    warm: bool,
) -> Result<Started, AgentError> {
    start_checked_and_load(bin, config, qemu_log, state, warm, None)
}

/// [`try_start_and_load`], refusing a QEMU whose QMP greeting names a
/// release `crossing` cannot reach before anything is loaded into it.
pub(crate) fn start_checked_and_load(
    bin: &Path,
    config: &crate::qemu::QemuConfig,
    qemu_log: &Path,
    state: &Path,
    warm: bool,
    crossing: Option<&crate::qemu_crossing::Crossing>,
) -> Result<Started, AgentError> {
    let t = Instant::now();
    let mut vm = Vm::spawn(bin, config.clone(), qemu_log.to_path_buf())?;
    let greeted = vm.qmp().map(|_| t.elapsed());
    let checked = greeted.and_then(|started| match crossing {
        Some(c) => c.check_greeting(&mut vm).map(|()| started),
        None => Ok(started),
    });
    let loaded = checked.and_then(|started| {
        let t = Instant::now();
        load_state(&mut vm, state, warm).map(|()| (started, t.elapsed()))
    });
    match loaded {
        Ok((started, loaded)) => Ok(Started {
            vm,
            start_ms: started.as_secs_f64() * 1000.0,
            load_ms: loaded.as_secs_f64() * 1000.0,
        }),
        Err(e) => {
            // The state file is kept; this QEMU's half-loaded state is
            // worthless, and the retry with the previous binary waits.
            vm.discard("loading the saved state into it failed");
            Err(e)
        }
    }
}

/// Loads the device state (and for a saved restart, RAM) in `state` into
/// `vm`, a QEMU started with `-incoming defer`.
pub(crate) fn load_state(vm: &mut Vm, state: &Path, warm: bool) -> Result<(), AgentError> {
    vm.execute("migrate-set-capabilities", caps(warm))?;
    vm.execute(
        "migrate-incoming",
        json!({ "uri": format!("exec:cat {}", shell_quote(state)) }),
    )?;
    wait_migration(vm, "loading state")
}

/// Waits for the QMP event `name` and returns its timestamp (µs).
pub(crate) fn event_ts(vm: &mut Vm, name: &str) -> Result<u64, AgentError> {
    let vm_name = vm.name.clone();
    let ev = vm
        .qmp()?
        .wait_event(name, Duration::from_secs(10))
        .map_err(|source| AgentError::Qmp {
            vm: vm_name,
            source,
        })?;
    Ok(ev.timestamp_us)
}

/// Polls `query-migrate` until it completes; fails on `failed`/`cancelled`.
pub(crate) fn wait_migration(vm: &mut Vm, what: &str) -> Result<(), AgentError> {
    wait_migration_every(vm, what, Duration::from_millis(1))
}

/// [`wait_migration`], polling every `poll`.
pub(crate) fn wait_migration_every(
    vm: &mut Vm,
    what: &str,
    poll: Duration,
) -> Result<(), AgentError> {
    let deadline = Instant::now() + MIGRATION_TIMEOUT;
    loop {
        let st = vm.execute("query-migrate", Value::Null)?;
        match st["status"].as_str().unwrap_or("") {
            "completed" => return Ok(()),
            "failed" | "cancelled" => {
                return Err(AgentError::Migration {
                    vm: vm.name.clone(),
                    what: what.to_string(),
                    detail: st["error-desc"]
                        .as_str()
                        .unwrap_or("no detail from QEMU")
                        .to_string(),
                })
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(AgentError::Migration {
                vm: vm.name.clone(),
                what: what.to_string(),
                detail: format!("not finished after {MIGRATION_TIMEOUT:?}"),
            });
        }
        std::thread::sleep(poll);
    }
}

pub(crate) fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}
