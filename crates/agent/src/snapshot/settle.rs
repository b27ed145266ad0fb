//! After the pause, whatever happened: the VM runs on with its settings
//! back, the capture is joined; then the image's metrics are recorded, it
//! is committed and reported (see `super::snapshot`).

use std::time::Duration;

use serde_json::{json, Value};
use vmcsnap_capture::Captured;

use super::capture_thread::CaptureThread;
use super::qemu_steps::*;
use super::{
    commit_watch, disks, final_ram, unix_ms, unix_us, Ctx, Job, Mode, Options, Report,
    MIGRATION_TIMEOUT,
};
use crate::vm::Vm;
use crate::{log, AgentError};

/// Puts the VM back as it was (running, on the overlays if the disks were
/// frozen) and joins the capture; on failure removes what the snapshot
/// made. Returns the captured image, or the snapshot's error.
pub(super) fn settle(
    vm: &mut Vm,
    job: &mut Job,
    result: Result<(), AgentError>,
    progress: &mut dyn FnMut(&str),
) -> Result<Captured, AgentError> {
    job.access.set_point_unix_us(job.ctx.t.resume_us);
    if result.is_err() {
        undo_in_pause(&mut job.ctx);
    }
    // Whatever happened, no raised priority outlives the snapshot (the
    // pause's boost ends with `run_mode`; this finds one nobody ended).
    crate::thread_priority::undo_left(
        &crate::thread_priority::record_path(&vm.config),
        Some(vm.pid),
    );
    // Whatever happened: the VM must run on, with rejuvenation's settings
    // back to what they were.
    if result.is_err() && job.ctx.migrating {
        end_failed_migration(vm, job);
    }
    let resumed = put_back(vm, job);
    let result = with_resume(&vm.name, result, resumed);
    let captured = join_capture(&vm.name, result, job.cap.take(), progress);
    if let Err(e) = &captured {
        let _ = std::fs::remove_dir_all(&job.disks_dir);
        if !job.ctx.disk_done {
            disks::remove_overlays(&job.ctx.disks);
        }
        log(format!("snapshot {} of {} failed: {e}", job.name, vm.name));
    }
    captured
}

/// A capture waiting for the paused guest's RAM stops waiting, and a page
/// an injected fault changed is put back before the guest resumes.
fn undo_in_pause(ctx: &mut Ctx) {
    if let Some(check) = &ctx.ram_check {
        check.give_up("the snapshot failed");
    }
    if let Some(w) = ctx.untracked_write.take() {
        w.undo();
    }
}

/// Stops capturing and waits until the failed snapshot's migration ended.
fn end_failed_migration(vm: &mut Vm, job: &mut Job) {
    // Stop capturing first, in every mode: the relay then discards the
    // rest of the stream, so QEMU is never left blocked writing to a
    // capture that stopped reading. (In its completion phase QEMU writes
    // with its main loop locked: QMP, `migrate_cancel` and `cont`
    // included, would not answer until it could write again.)
    if let Some(c) = job.cap.take() {
        c.abort();
    }
    if job.ctx.mode != Mode::Hot {
        // QEMU 7.2 removes the write protection of guest RAM only when a
        // background snapshot completes: one that fails or is cancelled
        // leaves RAM protected with nobody serving the faults, and the
        // guest hangs at its next write. So a hot snapshot is never
        // cancelled but left to finish into the relay; the others are.
        if let Err(e) = vm.execute("migrate_cancel", Value::Null) {
            log(format!(
                "VM {}: cancelling the failed snapshot's migration: {e}",
                vm.name
            ));
        }
    }
    // Until the migration has ended, QEMU refuses the settings below
    // and a next snapshot.
    vm.wait_migration_end("the failed snapshot's migration", MIGRATION_TIMEOUT);
}

/// Gives back what QEMU was handed and not used, puts its settings back,
/// resumes a VM that ran, and points its configuration at the overlays
/// once the disks are frozen. Returns whether the VM could be resumed.
fn put_back(vm: &mut Vm, job: &mut Job) -> Result<(), AgentError> {
    release_unused(vm, &mut job.ctx);
    restore_settings(vm, &job.saved_params);
    if let Ok(q) = vm.qmp() {
        q.set_timeout(Duration::from_secs(10));
    }
    let resumed = if job.ctx.was_running {
        ensure_running(vm)
    } else {
        Ok(())
    };
    if resumed.is_ok() {
        crate::intent::clear(&vm.config);
    }
    if job.ctx.disk_done {
        // The VM writes to the overlays from now on; a restarted QEMU must too.
        for d in &job.ctx.disks {
            if let Some(c) = vm.config.disk_mut(&d.config_node) {
                c.path = d.overlay.clone();
            }
        }
    }
    let _ = std::fs::remove_file(&job.sock);
    resumed
}

/// The captured image once the capture thread ends; a failed snapshot's
/// capture is stopped.
fn join_capture(
    vm: &str,
    result: Result<(), AgentError>,
    cap: Option<CaptureThread>,
    progress: &mut dyn FnMut(&str),
) -> Result<Captured, AgentError> {
    let fail = |detail: String| AgentError::Snapshot {
        vm: vm.to_string(),
        detail,
    };
    match (result, cap) {
        (Ok(()), Some(cap)) => cap
            .join(&mut |m| progress(&format!("{vm}: {m}")))
            .map_err(fail),
        (Ok(()), None) => Err(fail("the capture was stopped".into())),
        (Err(e), cap) => {
            if let Some(c) = cap {
                c.abort();
            }
            Err(e)
        }
    }
}

/// Records the snapshot's metrics in the image, commits it (within a
/// deadline) and reports it.
pub(super) fn commit(
    vm: &Vm,
    opts: Options,
    job: Job,
    mut captured: Captured,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, AgentError> {
    let stats = captured.stats().clone();
    let duration_ms = job.t_req.elapsed().as_secs_f64() * 1000.0;
    record_metrics(&job, &mut captured, duration_ms);
    let parent = parent_used(vm, &job, &mut captured);
    let deadline = commit_watch::deadline_for(stats.stream_bytes);
    let vm_name = vm.name.clone();
    let committed = match commit_watch::commit_within(captured, deadline, opts.fault, &mut |m| {
        progress(&format!("{vm_name}: {m}"))
    }) {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&job.disks_dir);
            return Err(AgentError::Snapshot {
                vm: vm.name.clone(),
                detail: format!("commit: {e}"),
            });
        }
    };
    job.access
        .finish(&committed.path, &committed.manifest.ram_blocks);
    let t = job.ctx.t;
    let report = Report {
        vm: vm.name.clone(),
        name: job.name,
        path: committed.path.clone(),
        mode: opts.mode,
        memory_mib: vm.config.memory_mib,
        downtime_ms: t.downtime_ms,
        disk_snapshot_ms: t.disk_snapshot_ms,
        pause: t.breakdown.clone(),
        duration_ms,
        stream_bytes: stats.stream_bytes,
        pages_stored: stats.pages_stored,
        pages_zero: stats.pages_zero,
        pages_guest_written: stats.pages_guest_written,
        parent,
        stream_mb_per_s: stats.stream_mb_per_s(),
        frozen_disk: job.frozen,
        frozen_disks: job.ctx.disks.iter().map(|d| d.frozen.clone()).collect(),
        overlay: job.overlay,
        reference: opts.reference,
        start_unix_us: job.start_unix_us,
        pause_start_unix_us: t.stop_us,
        pause_end_unix_us: t.resume_us,
        transient_done_unix_us: t.transient_done_us,
        complete_unix_us: unix_us(),
        ram: job.ctx.ram,
    };
    progress(&format!(
        "{}: snapshot {} committed: downtime {:.1} ms, disk {:.1} ms, total {:.1} ms",
        report.vm, report.name, report.downtime_ms, report.disk_snapshot_ms, report.duration_ms
    ));
    log(format!(
        "snapshot {} of {} ({:?}): downtime {:.1} ms, disk snapshot {:.1} ms, duration {:.1} ms, {} stream bytes",
        report.name, report.vm, report.mode, report.downtime_ms, report.disk_snapshot_ms, report.duration_ms, report.stream_bytes
    ));
    Ok(report)
}

/// The pause's timings, the working-set sample, the disk layer's and the
/// access collector's notes, the parent: into the image's metrics.
fn record_metrics(job: &Job, captured: &mut Captured, duration_ms: f64) {
    let t = &job.ctx.t;
    let m = captured.metrics_mut();
    m.downtime_ms = Some(t.downtime_ms.round() as u64);
    m.disk_snapshot_ms = Some(t.disk_snapshot_ms.round() as u64);
    m.pause = t.breakdown.clone();
    m.duration_ms = Some(duration_ms.round() as u64);
    m.other.insert(
        "downtime_us".into(),
        json!((t.downtime_ms * 1000.0).round() as u64),
    );
    // The capture's own notes (stream bytes, a parent it refused).
    let mut known = vmcsnap_control::SnapshotMetrics::read(&m.other);
    // HotRestore's WSS_sample: the sampler's mean over the last minutes.
    crate::sampler::record_in(&crate::sampler::load(&job.vm_dir), unix_ms(), &mut known);
    if let Some(d) = &job.disk_layer {
        d.record(m);
    }
    known.access_data = Some(job.access.note().to_string());
    // The capture's own note wins (a parent of another RAM layout).
    known
        .parent
        .get_or_insert_with(|| job.parent_metric.clone());
    known.record(&mut m.other);
    if let Some(ms) = job
        .ctx
        .ram_check
        .as_ref()
        .and_then(final_ram::RamCheck::hash_ms)
    {
        m.other.insert("precopy_ram_hash_ms".into(), json!(ms));
    }
}

/// The parent the image has (the capture may have refused the one decided
/// on: the snapshot is then full, which is worth a warning).
fn parent_used(vm: &Vm, job: &Job, captured: &mut Captured) -> String {
    let used = vmcsnap_control::SnapshotMetrics::read(&captured.metrics_mut().other)
        .parent
        .unwrap_or_default();
    if used != job.parent_metric {
        tracing::warn!(vm = %vm.name, parent = %used, "snapshot is full: the capture could not use its parent");
    }
    used
}
