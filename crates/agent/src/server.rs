//! The agent's control socket and request dispatch.
//!
//! Requests are served one at a time, in arrival order: a `status` sent
//! while an `up` is booting waits for the boot to finish. That keeps every
//! operation on the cluster serialised without further locking.

use std::io::BufReader;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use serde_json::json;
use vmcsnap_control::{read_request, write_reply, ConsoleResult, Reply, Request, StatusResult};
use vmcsnap_spec::ClusterSpec;

use crate::cluster::Cluster;
use crate::{log, AgentError, RunDir};

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Its run directory.
    pub run_dir: RunDir,
    /// Exit once no cluster is up after a request (an agent started on
    /// demand by the CLI goes away with its cluster).
    pub exit_when_idle: bool,
    /// Continue from a handover file written by the previous image of this
    /// process (`vmcsnap agent restart`).
    pub resume: Option<std::path::PathBuf>,
}

/// Binds the control socket and serves requests until told to stop.
pub fn serve(opts: AgentOptions) -> Result<(), AgentError> {
    let run = &opts.run_dir;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(run.root())
        .map_err(AgentError::io("creating run directory", run.root()))?;
    let sock = run.agent_socket();
    let exe = std::env::current_exe().map_err(AgentError::io(
        "finding the agent executable",
        "/proc/self/exe",
    ))?;
    let (listener, mut cluster, exit_when_idle, generation) = match &opts.resume {
        Some(path) => {
            let (l, c, e, g) = crate::handover::resume(run, path)?;
            log(format!(
                "agent {} resumed (generation {g}) with {} VMs",
                std::process::id(),
                c.as_ref().map_or(0, |c| c.members.len())
            ));
            (l, c, e, g)
        }
        None => {
            let listener = bind_control(run)?;
            // VMs of an agent that died: adopt them before serving anyone.
            let mut cluster = crate::record::adopt(run)?;
            // ... and finish a restore it left half-done.
            crate::restore_journal::redo(run, &mut cluster);
            (listener, cluster, opts.exit_when_idle, 0)
        }
    };
    std::fs::write(run.agent_pid(), format!("{}\n", std::process::id()))
        .map_err(AgentError::io("writing", run.agent_pid()))?;
    log(format!(
        "agent {} serving {}",
        std::process::id(),
        sock.display()
    ));
    crate::sampler::start(run.clone());
    let started = std::time::SystemTime::now();

    for conn in listener.incoming() {
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                log(format!("accept failed: {e}"));
                continue;
            }
        };
        let info = AgentInfo {
            generation,
            started_unix_ms: crate::handover::unix_ms(started),
        };
        let (action, changes_state, changes_vms) = handle(stream, run, &mut cluster, &info);
        if changes_vms {
            // Whatever the request did (even if it failed midway), the
            // record says which VMs run now.
            match &cluster {
                Some(c) => {
                    if let Err(e) = c.persist() {
                        log(format!("cannot write the VM record: {e}"));
                    }
                }
                None => crate::record::clear(run),
            }
        }
        match action {
            Action::Stop => break,
            Action::Restart => {
                // Returns only if the exec failed; the old image goes on.
                let e = crate::handover::exec_restart(
                    run,
                    &listener,
                    &mut cluster,
                    exit_when_idle,
                    generation,
                    &exe,
                );
                log(format!("agent restart failed: {e}"));
                continue;
            }
            Action::Continue => {}
        }
        if exit_when_idle && changes_state && cluster.is_none() {
            break;
        }
    }
    if let Some(mut c) = cluster.take() {
        c.teardown();
    }
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(run.agent_pid());
    log("agent exiting");
    Ok(())
}

fn bind_control(run: &RunDir) -> Result<UnixListener, AgentError> {
    let sock = run.agent_socket();
    if UnixStream::connect(&sock).is_ok() {
        return Err(AgentError::Io {
            what: "another agent is already serving",
            path: sock,
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        });
    }
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(AgentError::io("binding", &sock))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))
        .map_err(AgentError::io("setting permissions of", &sock))?;
    Ok(listener)
}

/// What the serve loop does after a request.
enum Action {
    Continue,
    Stop,
    Restart,
}

/// Facts about this agent image, for `ping`.
struct AgentInfo {
    generation: u64,
    started_unix_ms: u64,
}

/// Serves one connection; returns whether the agent should stop, and
/// whether the request was one that starts or ends a cluster (an agent
/// started on demand exits when such a request leaves no cluster up).
fn handle(
    stream: UnixStream,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    info: &AgentInfo,
) -> (Action, bool, bool) {
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return (Action::Continue, false, false),
    });
    let mut out = stream;
    let request = match read_request(&mut reader) {
        Ok(r) => r,
        Err(e) => {
            let _ = write_reply(
                &mut out,
                &Reply::Failed {
                    error: e.to_string(),
                },
            );
            return (Action::Continue, false, false);
        }
    };
    let changes_state = matches!(
        request,
        Request::Up { .. }
            | Request::Down
            | Request::Rejuvenate { .. }
            | Request::Restore { .. }
            | Request::ClusterRestore { .. }
    );
    // Requests after which the VM record is rewritten (a snapshot moves a
    // VM to a new disk overlay; a stop removes one).
    let changes_vms = changes_state
        || matches!(
            request,
            Request::Snapshot { .. } | Request::ClusterSnapshot { .. } | Request::Stop { .. }
        );
    let mut stop = false;
    let restart = matches!(request, Request::RestartAgent);
    let result = {
        let mut progress = |m: &str| {
            let _ = write_reply(
                &mut out.try_clone().expect("clone"),
                &Reply::Progress {
                    message: m.to_string(),
                },
            );
        };
        dispatch(request, run, cluster, &mut stop, info, &mut progress)
    };
    let reply = match result {
        Ok(result) => Reply::Done { result },
        Err(e) => {
            log(format!("request failed: {e}"));
            Reply::Failed {
                error: e.to_string(),
            }
        }
    };
    let _ = write_reply(&mut out, &reply);
    let action = if stop {
        Action::Stop
    } else if restart {
        Action::Restart
    } else {
        Action::Continue
    };
    (action, changes_state, changes_vms)
}

fn dispatch(
    request: Request,
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    stop: &mut bool,
    info: &AgentInfo,
    progress: &mut dyn FnMut(&str),
) -> Result<serde_json::Value, AgentError> {
    match request {
        Request::Ping => Ok(json!({
            "pid": std::process::id(), "generation": info.generation, "started_unix_ms": info.started_unix_ms,
        })),
        Request::RestartAgent => {
            progress("handing over to a new agent image (VMs keep running)");
            Ok(json!({ "pid": std::process::id(), "generation": info.generation }))
        }
        Request::Up {
            spec_path,
            spec_toml,
        } => {
            if let Some(c) = cluster {
                return Err(AgentError::AlreadyUp(c.spec.cluster.name.clone()));
            }
            let mut spec = ClusterSpec::from_toml_str(&spec_toml, vmcsnap_guest::MIN_MEMORY_MIB)
                .map_err(|source| AgentError::Spec {
                    path: spec_path.clone(),
                    source,
                })?;
            // Paths in a spec (images, kernels, keys) are relative to it.
            if let Some(dir) = spec_path.parent().filter(|d| d.is_absolute()) {
                spec.resolve_relative_paths(dir);
            }
            log(format!(
                "up {} from {}",
                spec.cluster.name,
                spec_path.display()
            ));
            let c = Cluster::up(run, spec, progress)?;
            let result = to_json(&c.up_result());
            *cluster = Some(c);
            Ok(result)
        }
        Request::Status => match cluster {
            Some(c) => Ok(to_json(&c.status())),
            None => Ok(to_json(&StatusResult {
                cluster: None,
                accel: None,
                agent_pid: std::process::id(),
                vms: vec![],
                switch: serde_json::Value::Null,
            })),
        },
        Request::Console { vm, tail_bytes } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            let m = c.member_mut(&vm)?;
            Ok(to_json(&ConsoleResult {
                vm: vm.clone(),
                path: m.vm.config.console_log.clone(),
                text: m.vm.console_tail(tail_bytes),
            }))
        }
        Request::Rejuvenate { vm, mode } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            let mode: crate::rejuvenate::Mode = mode.parse().map_err(AgentError::BadRequest)?;
            let t = std::time::Instant::now();
            let reports = c.rejuvenate(vm.as_deref(), mode, progress)?;
            let total_ms = t.elapsed().as_secs_f64() * 1000.0;
            let unix_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let result = json!({
                "unix_ms": unix_ms, "mode": mode, "n": reports.len(), "total_ms": total_ms, "reports": reports,
            });
            append(&run.rejuvenation_log(), &format!("{result}\n"))?;
            Ok(result)
        }
        Request::Snapshot {
            vm,
            mode,
            name,
            reference,
            fault,
        } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            let mode: crate::snapshot::Mode = mode.parse().map_err(AgentError::BadRequest)?;
            let fault = fault
                .map(|f| f.parse())
                .transpose()
                .map_err(|e: crate::fault::BadFault| AgentError::BadRequest(e.to_string()))?;
            let vm_config = crate::cluster_snapshot::vm_config(c, &vm)?;
            let m = c.member_mut(&vm)?;
            let opts = crate::snapshot::Options {
                mode,
                name,
                reference,
                fault,
                vm_config,
                target: None,
            };
            let report =
                crate::snapshot::snapshot(m, run, opts, &mut crate::snapshot::NoHooks, progress)?;
            Ok(to_json(&report))
        }
        Request::ClusterSnapshot {
            mode,
            name,
            no_cut_probes,
        } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            let mode: crate::snapshot::Mode = mode.parse().map_err(AgentError::BadRequest)?;
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
            let report = crate::cluster_snapshot::snapshot_cluster(c, run, opts, progress)?;
            Ok(to_json(&report))
        }
        Request::Restore {
            snapshot,
            mode,
            wss,
            paused,
            trace,
            no_background,
            no_priorities,
            start_quiet_ms,
        } => {
            let mode: vmcsnap_workingset::Mode = mode.parse().map_err(AgentError::BadRequest)?;
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
                cluster: None,
            };
            let report = crate::restore::restore(cluster, run, opts, progress)?;
            Ok(to_json(&report))
        }
        Request::ClusterRestore {
            snapshot,
            mode,
            no_priorities,
            start_quiet_ms,
            fault,
        } => {
            let mode: crate::cluster_restore::Mode =
                mode.parse().map_err(AgentError::BadRequest)?;
            let fault = fault.map(|f| f.parse()).transpose().map_err(
                |e: crate::fault::BadRestoreFault| AgentError::BadRequest(e.to_string()),
            )?;
            let opts = crate::cluster_restore::Options {
                snapshot,
                mode,
                priorities: !no_priorities,
                start_quiet: start_quiet_ms
                    .map_or(crate::restore::CLUSTER_START_QUIET, Duration::from_millis),
                fault,
            };
            let report = crate::cluster_restore::restore_cluster(cluster, run, opts, progress)?;
            Ok(to_json(&report))
        }
        Request::Stop { vm } => {
            let c = cluster.as_mut().ok_or(AgentError::NoCluster)?;
            c.stop_vm(&vm)?;
            Ok(json!({ "vm": vm }))
        }
        Request::Down => {
            let mut c = cluster.take().ok_or(AgentError::NoCluster)?;
            let name = c.spec.cluster.name.clone();
            progress(&format!("stopping {} VMs", c.members.len()));
            c.teardown();
            log(format!("down {name}"));
            Ok(json!({ "cluster": name }))
        }
        Request::Shutdown => {
            if let Some(c) = cluster {
                return Err(AgentError::AlreadyUp(c.spec.cluster.name.clone()));
            }
            *stop = true;
            Ok(json!({ "pid": std::process::id() }))
        }
    }
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

fn to_json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).expect("results serialise")
}
