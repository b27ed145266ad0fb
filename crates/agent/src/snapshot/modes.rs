//! The pause, one function per snapshot mode: from the VM made ready to
//! pause to the guest running again (the modes: see the docs of `super`).

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use super::capture_thread::CaptureThread;
use super::qemu_steps::*;
use super::{disks, final_ram, unix_us, Ctx, Hooks, Mode, PAUSE_NICE, SNAPSHOT_BANDWIDTH};
use crate::vm::Vm;
use crate::AgentError;

/// Makes the VM ready to pause, runs `ctx.mode`'s pause, and works out the
/// downtime.
pub(super) fn run_mode(
    vm: &mut Vm,
    sock: &std::path::Path,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    let uri = make_ready(vm, sock, ctx, hooks, progress)?;
    match ctx.mode {
        Mode::Hot => run_hot(vm, uri, cap, ctx, hooks, progress)?,
        Mode::StopCopy => run_stop_copy(vm, uri, cap, ctx, hooks, progress)?,
        Mode::Precopy => run_precopy(vm, uri, cap, ctx, hooks, progress)?,
    }
    ctx.migrating = false;
    ctx.t.downtime_ms = ctx.t.resume_us.saturating_sub(ctx.t.stop_us) as f64 / 1000.0;
    if let Some(b) = &ctx.t.breakdown {
        ctx.t.disk_snapshot_ms = b.part_us("disk_snapshot") as f64 / 1000.0;
    }
    Ok(())
}

/// Outside the pause: migration settings, the stream relay, the overlays
/// (and, hot, guest RAM mapped). Returns `migrate`'s arguments.
fn make_ready(
    vm: &mut Vm,
    sock: &std::path::Path,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<Value, AgentError> {
    let mode = ctx.mode;
    vm.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": SNAPSHOT_BANDWIDTH }),
    )?;
    set_caps(vm, mode == Mode::Hot, mode == Mode::Precopy, true)?;
    take_events(vm)?;
    // QEMU writes to a relay it owns, not to our socket: see `relay`.
    // The agent's own image, by its /proc link: it stays valid while the
    // agent runs even if the file was replaced or deleted since (a rebuild
    // or a package upgrade; `current_exe` would name a "(deleted)" path).
    let exe = PathBuf::from(format!("/proc/{}/exe", std::process::id()));
    let uri = prepare_relay(vm, &exe, sock, ctx)?;
    // The overlay, opened by QEMU now: in the pause it is only put on top.
    disks::add_overlays(vm, &mut ctx.disks, ctx.stamp)?;
    if mode == Mode::Hot {
        // Whatever unmapped guest RAM since the snapshot began (or a read
        // that missed some) is made up for here, outside the pause.
        ensure_ram_mapped(vm, &*hooks, progress, Duration::ZERO, &mut ctx.ram)?;
    }
    hooks.ready()?;
    Ok(uri)
}

/// Hot: pause, freeze the disks and start the background snapshot; the
/// guest runs again once write protection is on, pages stream after.
fn run_hot(
    vm: &mut Vm,
    uri: Value,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    progress(&format!("{}: pausing for the hot snapshot", vm.name));
    // The work inside a hot pause is QEMU's (migration setup, device
    // state, write protection): ahead of other VMs' vCPUs, so that
    // the pauses of a cluster snapshot do not queue for the CPU.
    // The background copy after it runs at the VM's own priority.
    // Raised before `before_pause`, whose end a cluster snapshot's
    // VMs wait for together: nothing is left between it and `stop`.
    let boost = {
        let file = crate::thread_priority::record_path(&vm.config);
        crate::thread_priority::Boost::start(vm.pid, PAUSE_NICE, &file)
    };
    hooks.before_pause()?;
    freeze_and_migrate(vm, uri, cap, ctx, hooks)?;
    // The guest resumes once write protection is on (by QEMU
    // itself or by `cont`, as the version does it).
    ctx.t.resume_us = hot_resume(vm, ctx.dialect)?;
    drop(boost);
    ctx.t.transient_done_us = unix_us();
    hooks.running();
    let setup = migration_event_ts(vm, "setup");
    let active = migration_event_ts(vm, "active");
    if let (Some(setup), Some(active)) = (setup, active) {
        ctx.t.pause.mark("migrate_command", setup);
        ctx.t.pause.mark("qemu_setup", active);
    }
    ctx.t.breakdown = ctx.t.pause.finish("device_state", ctx.t.resume_us);
    wait_migration(vm, &["completed"], cap, hooks, progress)
}

/// Stop-copy: pause, freeze the disks, copy all of RAM, resume (a VM the
/// operator paused stays paused).
fn run_stop_copy(
    vm: &mut Vm,
    uri: Value,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    progress(&format!("{}: pausing for the stop-copy snapshot", vm.name));
    hooks.before_pause()?;
    freeze_and_migrate(vm, uri, cap, ctx, hooks)?;
    wait_migration(vm, &["completed"], cap, hooks, progress)?;
    if !ctx.was_running {
        // Paused it was, paused it stays; it lost no running time.
        ctx.t.resume_us = ctx.t.stop_us;
        ctx.t.transient_done_us = unix_us();
        hooks.running();
        return Ok(());
    }
    if let Some(done) = migration_event_ts(vm, "completed") {
        ctx.t.pause.mark("copy", done);
    }
    resume(vm, ctx, hooks)
}

/// Pre-copy: live `migrate` until QEMU pauses for the switch-over; the
/// disks are frozen in that pause, the last pages sent and checked
/// against the paused guest's RAM, then the guest resumes.
fn run_precopy(
    vm: &mut Vm,
    uri: Value,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
    progress: &mut dyn FnMut(&str),
) -> Result<(), AgentError> {
    progress(&format!("{}: live pre-copy", vm.name));
    ctx.migrating = true;
    cap.expect_connection();
    vm.execute("migrate", uri)?;
    wait_migration(vm, &["pre-switchover"], cap, hooks, progress)?;
    let seen = unix_us();
    ctx.t.stop_us = event_ts(vm, "STOP")?;
    ctx.t.pause.start(ctx.t.stop_us);
    ctx.t.pause.mark("switchover", seen);
    if let Some(page) = crate::fault::precopy_untracked_write(ctx.fault) {
        ctx.untracked_write = Some(final_ram::UntrackedWrite::make(&vm.config.ram_file, page)?);
    }
    // Guest RAM stays as it is now until `cont`: hash it meanwhile.
    if let Some(check) = &ctx.ram_check {
        check.start(&vm.config.ram_file);
    }
    hooks.paused()?;
    copy_reference(vm, ctx)?;
    ctx.t.pause.mark("agent", unix_us());
    vm.execute("transaction", disks::transaction(&ctx.disks))?;
    let t_disk = unix_us();
    disk_snapshot_done(ctx);
    ctx.t.pause.mark("disk_snapshot", t_disk);
    vm.execute("migrate-continue", json!({ "state": "pre-switchover" }))?;
    wait_migration(vm, &["completed"], cap, hooks, progress)?;
    if let Some(done) = migration_event_ts(vm, "completed") {
        ctx.t.pause.mark("copy", done);
    }
    check_final_ram(vm, cap, ctx)?;
    if let Some(w) = ctx.untracked_write.take() {
        w.undo();
    }
    resume(vm, ctx, hooks)
}

/// Hot and stop-copy: `stop` (unless the VM is paused already), the disk
/// snapshot and `migrate`, sent at once when nothing runs between them.
fn freeze_and_migrate(
    vm: &mut Vm,
    uri: Value,
    cap: &mut CaptureThread,
    ctx: &mut Ctx,
    hooks: &mut dyn Hooks,
) -> Result<(), AgentError> {
    // Nothing to do between `stop` and the disk snapshot: send the
    // three commands at once (no round trip inside the pause).
    let was_running = ctx.was_running;
    let all_at_once = was_running && !hooks.works_while_paused() && ctx.reference.is_none();
    let mut commands = vec![
        ("transaction", disks::transaction(&ctx.disks)),
        ("migrate", uri),
    ];
    if all_at_once {
        commands.insert(0, ("stop", Value::Null));
    } else if was_running {
        vm.execute("stop", Value::Null)?;
        let stopped = unix_us();
        ctx.t.stop_us = event_ts(vm, "STOP")?;
        ctx.t.pause.start(ctx.t.stop_us);
        ctx.t.pause.mark("stop", stopped);
    } else {
        ctx.t.stop_us = unix_us();
        ctx.t.pause.start(ctx.t.stop_us);
    }
    if !all_at_once {
        hooks.paused()?;
        copy_reference(vm, ctx)?;
        ctx.t.pause.mark("agent", unix_us());
    }
    cap.expect_connection();
    let mut replies = vm.execute_pipelined(commands)?;
    let (migrate, _) = replies.pop().expect("a reply per command");
    let (disk, t_disk) = replies.pop().expect("a reply per command");
    // Set before any error returns: a migration that started must be
    // waited for whatever else failed.
    ctx.migrating = migrate.is_ok();
    if let Some((stopped, t)) = replies.pop() {
        stopped?;
        ctx.t.stop_us = event_ts(vm, "STOP")?;
        ctx.t.pause.start(ctx.t.stop_us);
        ctx.t.pause.mark("stop", t);
    }
    disk?;
    disk_snapshot_done(ctx);
    ctx.t.pause.mark("disk_snapshot", t_disk);
    migrate?;
    Ok(())
}

/// Pre-copy: waits for the check of the captured pages against the paused
/// guest's RAM (`final_ram`).
fn check_final_ram(vm: &Vm, cap: &mut CaptureThread, ctx: &mut Ctx) -> Result<(), AgentError> {
    let Some(check) = &ctx.ram_check else {
        return Ok(());
    };
    let found = check
        .wait_checked(cap)
        .map_err(|detail| AgentError::Snapshot {
            vm: vm.name.clone(),
            detail,
        })?;
    ctx.t.pause.mark("ram_check", unix_us());
    if found.pages_patched > 0 {
        tracing::warn!(
            vm = %vm.name,
            pages_patched = found.pages_patched,
            first_pages = ?found.first_patched,
            "pre-copy: QEMU's stream missed guest writes; those pages were taken from the paused guest's RAM"
        );
    }
    Ok(())
}

/// Stop-copy and pre-copy: `cont` once QEMU has finished the migration;
/// the pause ends at QEMU's RESUME.
fn resume(vm: &mut Vm, ctx: &mut Ctx, hooks: &mut dyn Hooks) -> Result<(), AgentError> {
    cont_when_finalized(vm)?;
    ctx.t.resume_us = event_ts(vm, "RESUME")?;
    ctx.t.transient_done_us = unix_us();
    hooks.running();
    ctx.t.breakdown = ctx.t.pause.finish("resume", ctx.t.resume_us);
    Ok(())
}
