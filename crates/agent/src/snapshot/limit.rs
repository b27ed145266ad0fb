//! The floor of a hot snapshot's pause on this host: QEMU's own background
//! snapshot of the VM with nothing else done.
//!
//! `migrate` with `background-snapshot` straight to `/dev/null` (through
//! `cat`): no `stop` by vmcsnap, no disk snapshot, no relay, no capture.
//! QEMU then sets the migration up while the guest runs and pauses it only
//! to save device state and turn on write protection. That pause is what
//! vmcsnap's hot pause is measured against (`vmcsnap pause-limit`); nothing
//! is kept, and the guest runs on.

use super::*;

/// What [`measure`] found.
pub use vmcsnap_control::PauseLimitReport as LimitReport;

/// Runs QEMU's own background snapshot of `vm` into `/dev/null`.
pub fn measure(vm: &mut Vm) -> Result<LimitReport, AgentError> {
    if vm.run_state() != "running" {
        return Err(AgentError::BadRequest(format!(
            "VM {} is not running: the pause limit is measured on a running guest (`vmcsnap status`)",
            vm.name
        )));
    }
    let t = Instant::now();
    let saved = vm.execute("query-migrate-parameters", Value::Null)?;
    let result = run(vm, t);
    restore_settings(vm, &saved);
    if result.is_err() {
        // QEMU resumes the guest itself; make sure of it.
        let _ = ensure_running(vm);
    }
    result
}

fn run(vm: &mut Vm, t: Instant) -> Result<LimitReport, AgentError> {
    vm.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": SNAPSHOT_BANDWIDTH }),
    )?;
    set_caps(vm, true, false, true)?;
    take_events(vm)?;
    vm.execute("migrate", json!({ "uri": "exec:cat > /dev/null" }))?;
    let resume_us = wait_resume(vm)?;
    let stop_us = event_ts(vm, "STOP")?;
    let setup = migration_event_ts(vm, "setup");
    let active = migration_event_ts(vm, "active");
    vm.wait_migration_end("the pause-limit snapshot", MIGRATION_TIMEOUT);
    let st = vm.execute("query-migrate", Value::Null)?;
    if st["status"] != "completed" {
        return Err(AgentError::Migration {
            vm: vm.name.clone(),
            what: "pause-limit snapshot".into(),
            detail: st["error-desc"]
                .as_str()
                .unwrap_or("it did not complete")
                .to_string(),
        });
    }
    let ms = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1000.0;
    Ok(LimitReport {
        vm: vm.name.clone(),
        memory_mib: vm.config.memory_mib,
        downtime_ms: ms(stop_us, resume_us),
        setup_while_running_ms: match (setup, active) {
            (Some(s), Some(a)) => ms(s, a),
            _ => 0.0,
        },
        duration_ms: t.elapsed().as_secs_f64() * 1000.0,
    })
}
