//! What each control request does, once the server has decided to run it.
//!
//! [`dispatch`] runs with the cluster locked: operations that change VMs are
//! serialised; `ping`, and `status` or `console` while an operation runs,
//! are answered by the server without the lock (see `server`).

use std::time::Duration;

use vmcsnap_control::{
    AgentInfo as Info, ClusterDown, ConsoleResult, RecoverResult, RejuvenateResult, Request,
    Response, StatusResult, Stopped,
};
use vmcsnap_spec::ClusterSpec;

use crate::cluster::Cluster;
use crate::{AgentError, RunDir};

/// Facts about this agent image, for `ping`.
pub(crate) struct AgentInfo {
    pub generation: u64,
    pub started_unix_ms: u64,
}

impl AgentInfo {
    /// As the wire carries it.
    pub(crate) fn wire(&self) -> Info {
        Info {
            pid: std::process::id(),
            generation: self.generation,
            started_unix_ms: self.started_unix_ms,
        }
    }
}

/// The result of a request with nothing up: what `status` says then.
pub(crate) fn idle_status() -> StatusResult {
    StatusResult {
        cluster: None,
        accel: None,
        agent_pid: std::process::id(),
        vms: vec![],
        switch: None,
        busy: None,
    }
}

/// Why a request failed: the agent's error, or one of deleting snapshots,
/// which only a request does (the VM layer and the operations never delete
/// snapshots, so [`AgentError`] does not carry it).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// What every operation fails with.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// Deleting or pruning snapshots failed.
    #[error(transparent)]
    Removal(#[from] crate::snapshot_removal::RemovalError),
}

/// The longest `--start-quiet-ms` a restore accepts (a larger one is a typo,
/// and an unbounded one overflowed the agent's deadline arithmetic).
const MAX_START_QUIET_MS: u64 = 600_000;

fn check_start_quiet(ms: Option<u64>) -> Result<(), AgentError> {
    match ms {
        Some(ms) if ms > MAX_START_QUIET_MS => Err(AgentError::BadRequest(format!(
            "--start-quiet-ms {ms} is out of range (0-{MAX_START_QUIET_MS})"
        ))),
        _ => Ok(()),
    }
}

pub(crate) fn dispatch(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    stop: &mut bool,
    info: &AgentInfo,
    ctx: &crate::loading::Ctx<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, RequestError> {
    match request {
        Request::Ping => Ok(Response::Ping(info.wire())),
        Request::RestartAgent => {
            progress("handing over to a new agent image (VMs keep running)");
            Ok(Response::RestartAgent(info.wire()))
        }
        request @ Request::Up { .. } => Ok(up(request, run, cluster, progress)?),
        Request::Status => match cluster {
            Some(c) => Ok(Response::Status(c.status())),
            None => Ok(Response::Status(idle_status())),
        },
        Request::Console { vm, tail_bytes } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            let m = c.member_mut(&vm)?;
            Ok(Response::Console(ConsoleResult {
                vm: vm.clone(),
                path: m.vm.config.console_log.clone(),
                text: m.vm.console_tail(tail_bytes),
            }))
        }
        request @ Request::Rejuvenate { .. } => Ok(rejuvenate(request, run, cluster, progress)?),
        request @ Request::Snapshot { .. } => Ok(snapshot(request, run, cluster, progress)?),
        request @ Request::ClusterSnapshot { .. } => {
            Ok(cluster_snapshot(request, run, cluster, progress)?)
        }
        request @ Request::Restore { .. } => Ok(restore(request, run, cluster, ctx, progress)?),
        request @ Request::ClusterRestore { .. } => {
            Ok(cluster_restore(request, run, cluster, ctx, progress)?)
        }
        Request::Stop { vm } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            c.stop_vm(&vm)?;
            Ok(Response::Stop(Stopped { vm }))
        }
        Request::Down => {
            let mut c = cluster.take().ok_or(AgentError::NoCluster)?;
            let name = c.spec.cluster.name.clone();
            progress(&format!("stopping {} VMs", c.members.len()));
            c.teardown();
            tracing::info!(cluster = %name, "down {name}");
            Ok(Response::Down(ClusterDown { cluster: name }))
        }
        Request::Gc => Ok(Response::Gc(crate::gc::collect(run, cluster)?)),
        Request::PauseLimit { vm } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            let m = c.member_mut(&vm)?;
            Ok(Response::PauseLimit(crate::snapshot::limit::measure(
                &mut m.vm,
            )?))
        }
        Request::SnapshotsDelete { names } => Ok(Response::SnapshotsDelete(
            crate::snapshot_removal::delete(run, cluster, &names)?,
        )),
        Request::SnapshotsPrune { keep, vm, dry_run } => {
            let opts = crate::snapshot_removal::PruneOptions { keep, vm, dry_run };
            Ok(Response::SnapshotsDelete(crate::snapshot_removal::prune(
                run, cluster, &opts,
            )?))
        }
        Request::Shutdown => {
            if let Some(c) = cluster {
                return Err(AgentError::AlreadyUp(c.spec.cluster.name.clone()).into());
            }
            *stop = true;
            Ok(Response::Shutdown(info.wire()))
        }
    }
}

/// Boots the cluster of a spec.
fn up(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, AgentError> {
    let Request::Up {
        spec_path,
        spec_toml,
    } = request
    else {
        unreachable!("dispatch routes only Up here")
    };
    if let Some(c) = cluster {
        return Err(AgentError::AlreadyUp(c.spec.cluster.name.clone()));
    }
    let mut spec = ClusterSpec::from_toml_str(&spec_toml, vmcsnap_guest::MIN_MEMORY_MIB).map_err(
        |source| AgentError::Spec {
            path: spec_path.clone(),
            source,
        },
    )?;
    // Paths in a spec (images, kernels, keys) are relative to it.
    if let Some(dir) = spec_path.parent().filter(|d| d.is_absolute()) {
        spec.resolve_relative_paths(dir);
    }
    tracing::info!(
        cluster = %spec.cluster.name,
        spec = %spec_path.display(),
        "up {} from {}",
        spec.cluster.name,
        spec_path.display()
    );
    let c = Cluster::up(run, spec, progress)?;
    let result = Response::Up(c.up_result());
    *cluster = Some(c);
    Ok(result)
}

/// Restarts the QEMU of one VM or of all, or recovers a failed restart.
fn rejuvenate(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, AgentError> {
    let Request::Rejuvenate {
        vm,
        mode,
        qemu,
        recover,
    } = request
    else {
        unreachable!("dispatch routes only Rejuvenate here")
    };
    let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
    let qemu = qemu
        .map(|q| crate::qemu::find_program(&q, "qemu-system-x86"))
        .transpose()?;
    if let Some(how) = recover {
        let recovered = c.recover(vm.as_deref(), how, qemu.as_deref(), progress)?;
        return Ok(Response::Recover(RecoverResult { recovered }));
    }
    let fault = crate::fault::take_rejuvenate(run, vm.as_deref())?;
    let vm_field = vm.as_deref().unwrap_or("*");
    let _span =
        tracing::info_span!("rejuvenate", operation = "rejuvenate", vm = %vm_field).entered();
    let t = std::time::Instant::now();
    let reports = c.rejuvenate(vm.as_deref(), mode, qemu.as_deref(), fault, progress)?;
    crate::metrics::record_rejuvenations(&reports);
    let total_ms = t.elapsed().as_secs_f64() * 1000.0;
    let unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let result = RejuvenateResult {
        unix_ms,
        mode,
        n: reports.len(),
        total_ms,
        reports,
    };
    let line = serde_json::to_string(&result).expect("reports serialise");
    append(&run.rejuvenation_log(), &format!("{line}\n"))?;
    Ok(Response::Rejuvenate(result))
}

/// Snapshots one VM.
fn snapshot(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, AgentError> {
    let Request::Snapshot {
        vm,
        mode,
        name,
        reference,
        storage,
        full,
        block_pages,
        access_window_s,
    } = request
    else {
        unreachable!("dispatch routes only Snapshot here")
    };
    let storage = storage.unwrap_or_default();
    let mut writer = crate::snapshot::writer_options(storage);
    if let Some(n) = block_pages {
        crate::snapshot::set_block_pages(&mut writer, n)?;
    }
    let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
    let fault = crate::fault::take_snapshot(run, &vm)?;
    let vm_config = crate::cluster_snapshot::vm_config(c, &vm)?;
    let m = c.member_mut(&vm)?;
    let opts = crate::snapshot::Options {
        mode,
        name,
        reference,
        fault,
        vm_config,
        target: None,
        writer,
        full,
        disk_layer: storage.disk_layer(),
        access_window: access_window_s.map_or(
            crate::snapshot::access::DEFAULT_WINDOW,
            std::time::Duration::from_secs,
        ),
    };
    let mut hooks: Box<dyn crate::snapshot::Hooks> =
        crate::fault::paused_hooks(fault).unwrap_or_else(|| Box::new(crate::snapshot::NoHooks));
    let _span = tracing::info_span!(
        "snapshot",
        operation = "snapshot",
        vm = %vm,
        snapshot = opts.name.as_deref().unwrap_or("(default name)")
    )
    .entered();
    let report = crate::snapshot::snapshot(m, run, opts, hooks.as_mut(), progress)?;
    crate::metrics::record_snapshot(&report);
    Ok(Response::Snapshot(Box::new(report)))
}

/// Snapshots every VM of the cluster at once (HotSnap).
fn cluster_snapshot(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, AgentError> {
    let Request::ClusterSnapshot {
        mode,
        name,
        no_cut_probes,
    } = request
    else {
        unreachable!("dispatch routes only ClusterSnapshot here")
    };
    let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
    let cut_probes = if no_cut_probes {
        0
    } else {
        vmcsnap_switch::mediator::probe::PROBES_BEFORE_PAUSE
    };
    let opts = crate::cluster_snapshot::Options {
        mode,
        name,
        cut_probes,
    };
    let _span = tracing::info_span!(
        "cluster_snapshot",
        operation = "cluster-snapshot",
        snapshot = opts.name.as_deref().unwrap_or("(default name)")
    )
    .entered();
    let report = crate::cluster_snapshot::snapshot_cluster(c, run, opts, progress)?;
    crate::metrics::record_cluster_snapshot(&report);
    Ok(Response::ClusterSnapshot(Box::new(report)))
}

/// Restores one VM from its snapshot.
fn restore(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    ctx: &crate::loading::Ctx<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, AgentError> {
    let Request::Restore {
        snapshot,
        mode,
        wss,
        paused,
        trace,
        no_background,
        no_priorities,
        start_quiet_ms,
        prefetch_blocks,
        preempt,
        wait,
    } = request
    else {
        unreachable!("dispatch routes only Restore here")
    };
    check_start_quiet(start_quiet_ms)?;
    let prefetch_blocks = match prefetch_blocks {
        None => crate::restore::pages::PREFETCH_BLOCKS,
        Some(n) if n <= crate::restore::pages::MAX_PREFETCH_BLOCKS => n as usize,
        Some(n) => {
            return Err(AgentError::BadRequest(format!(
                "--prefetch-blocks {n}: give 0 to {}",
                crate::restore::pages::MAX_PREFETCH_BLOCKS
            )))
        }
    };
    let wss = wss.map_or(
        crate::restore::WssChoice::Auto,
        crate::restore::WssChoice::Pages,
    );
    let opts = crate::restore::Options {
        snapshot,
        mode,
        wss,
        paused,
        trace,
        no_background,
        priorities: !no_priorities,
        start_quiet: Duration::from_millis(start_quiet_ms.unwrap_or(0)),
        prefetch_blocks,
        preempt,
        cluster: None,
        observer: None,
    };
    let early = (!wait).then_some(ctx);
    let _span =
        tracing::info_span!("restore", operation = "restore", snapshot = %opts.snapshot).entered();
    let report = crate::restore::restore(cluster, run, opts, early, progress)?;
    crate::metrics::record_restore(&report);
    Ok(Response::Restore(Box::new(report)))
}

/// Restores a whole cluster snapshot (HotRestore).
fn cluster_restore(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    ctx: &crate::loading::Ctx<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<Response, AgentError> {
    let Request::ClusterRestore {
        snapshot,
        mode,
        no_priorities,
        start_quiet_ms,
        wait,
    } = request
    else {
        unreachable!("dispatch routes only ClusterRestore here")
    };
    check_start_quiet(start_quiet_ms)?;
    let fault = crate::fault::take_cluster_restore(run)?;
    let opts = crate::cluster_restore::Options {
        snapshot,
        mode,
        priorities: !no_priorities,
        start_quiet: start_quiet_ms
            .map_or(crate::restore::CLUSTER_START_QUIET, Duration::from_millis),
        fault,
    };
    let early = (!wait).then_some(ctx);
    let _span = tracing::info_span!(
        "cluster_restore",
        operation = "cluster-restore",
        snapshot = %opts.snapshot
    )
    .entered();
    let report = crate::cluster_restore::restore_cluster(cluster, run, opts, early, progress)?;
    crate::metrics::record_cluster_restore(&report);
    Ok(Response::ClusterRestore(Box::new(report)))
}

fn append(path: &std::path::Path, text: &str) -> Result<(), AgentError> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(AgentError::io("appending to", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: huge numbers from a request overflowed `Instant + Duration`
    /// in the agent (as `boot_timeout_s` did); they are refused up front.
    #[test]
    fn start_quiet_is_bounded() {
        assert!(check_start_quiet(None).is_ok());
        assert!(check_start_quiet(Some(MAX_START_QUIET_MS)).is_ok());
        let e = check_start_quiet(Some(u64::MAX)).unwrap_err().to_string();
        assert!(
            e.contains("--start-quiet-ms") && e.contains("out of range"),
            "{e}"
        );
    }
}
