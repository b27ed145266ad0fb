//! `vmcsnap`: the command-line front end. It parses arguments, makes sure
//! an agent is running, sends it one request and prints the answer; all
//! the work happens in the libraries and the agent.

mod cli;
mod fault_arg;
mod launch;
mod output;
mod output_cluster;
mod output_removal;
mod views;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use vmcsnap_agent::{AgentOptions, RunDir};
use vmcsnap_control::{call, expect_response as expect, Request, Response, StatusResult};

use cli::{AgentCmd, Cli, Command, GuestCmd, ImageCmd, SnapshotsCmd};

fn main() {
    // Like any Unix filter, end quietly when the reader of our output goes
    // away (`vmcsnap status | head`) instead of panicking in println!.
    // SAFETY: signal(2) with SIG_DFL for SIGPIPE, before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    match &cli.command {
        Command::Agent {
            cmd: AgentCmd::Run { log_format, .. },
        } => init_logging(true, log_format.unwrap_or_else(log_format_from_env)),
        _ => init_logging(false, cli::LogFormat::Text),
    }
    if let Err(e) = run(cli) {
        eprintln!("vmcsnap: error: {}", error_chain(e.chain()));
        // An agent that lost the start to another one says so by its exit
        // code: the CLI that started it talks to the other one.
        let lost = e.chain().any(|c| {
            matches!(
                c.downcast_ref::<vmcsnap_agent::AgentError>(),
                Some(vmcsnap_agent::AgentError::AnotherAgent { .. })
            )
        });
        std::process::exit(if lost {
            vmcsnap_agent::agent_lock::EXIT_ANOTHER_AGENT
        } else {
            1
        });
    }
}

/// Logs of the agent and the libraries (`tracing`, and the `log` calls of
/// the switch and coordinator through its bridge) go to stderr: the agent
/// logs at `info` (its stderr is `<run-dir>/agent.log`), the CLI only
/// warnings. `VMCSNAP_LOG` (e.g. `debug`, `vmcsnap_switch=debug`) overrides.
fn init_logging(agent: bool, format: cli::LogFormat) {
    let default = if agent { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("VMCSNAP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_target(agent);
    let _ = match format {
        cli::LogFormat::Text => fmt.try_init(),
        cli::LogFormat::Json => fmt.json().try_init(),
    };
}

/// The log format of an agent without `--log-format`:
/// `VMCSNAP_LOG_FORMAT` (`json` or `text`), text if unset or unknown.
fn log_format_from_env() -> cli::LogFormat {
    match std::env::var("VMCSNAP_LOG_FORMAT").as_deref() {
        Ok("json") => cli::LogFormat::Json,
        _ => cli::LogFormat::Text,
    }
}

/// The whole cause chain on one line, skipping a cause whose text the
/// message before it already includes (many messages embed their source).
fn error_chain<'a>(chain: impl Iterator<Item = &'a (dyn std::error::Error + 'static)>) -> String {
    let mut out = String::new();
    for e in chain {
        let text = e.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

fn run(cli: Cli) -> Result<()> {
    let run_dir = RunDir::new(cli.run_dir.clone().unwrap_or_else(RunDir::default_root));
    match cli.command {
        Command::Up { spec, json } => up(&run_dir, &spec, json),
        Command::Status { json } => {
            let sock = run_dir.agent_socket();
            let status: StatusResult = match request(&sock, &Request::Status) {
                Ok(r) => expect!(r, Response::Status)?,
                Err(e) if launch::agent_absent(&e) => StatusResult {
                    cluster: None,
                    accel: None,
                    agent_pid: 0,
                    vms: vec![],
                    switch: None,
                    busy: None,
                },
                Err(e) => return Err(e),
            };
            output::status(&status, json)
        }
        Command::Console { vm, bytes } => {
            let v = request(
                &run_dir.agent_socket(),
                &Request::Console {
                    vm,
                    tail_bytes: bytes,
                },
            )?;
            let c = expect!(v, Response::Console)?;
            print!("{}", c.text);
            Ok(())
        }
        Command::Down { json } => {
            let d = expect!(
                request(&run_dir.agent_socket(), &Request::Down)?,
                Response::Down
            )?;
            output::json_or(json, &d, || println!("cluster {} is down", d.cluster))
        }
        Command::Gc { json } => {
            let sock = run_dir.agent_socket();
            let r = match call(&sock, &Request::Gc, None, &mut |m| eprintln!("  {m}")) {
                Ok(v) => expect!(v, Response::Gc)?,
                // No agent, hence no VM and no operation: collect here.
                Err(e @ vmcsnap_control::ControlError::NoAgent { .. }) => {
                    if vmcsnap_agent::cluster_record::needs_agent(&run_dir) {
                        expect!(request(&sock, &Request::Gc)?, Response::Gc)?
                    } else {
                        let _ = e;
                        vmcsnap_agent::gc::collect(&run_dir, &mut None)?
                    }
                }
                Err(e) => return Err(e.into()),
            };
            output::json_or(json, &r, || {
                for p in &r.removed {
                    println!("removed {}", p.display());
                }
                for p in &r.kept_in_use {
                    println!(
                        "kept {} (a running VM's disk or a snapshot's frozen disk reads from it)",
                        p.display()
                    );
                }
                for p in &r.kept_stopped {
                    println!(
                        "kept {} (its VM was stopped, not removed: `vmcsnap down` removes it)",
                        p.display()
                    );
                }
                if r.removed.is_empty() {
                    println!("nothing to remove");
                }
            })
        }
        Command::Rejuvenate {
            vm,
            all: _,
            mode,
            qemu,
            resume,
            rollback,
            fault,
            json,
        } => {
            let recover = match (resume, rollback) {
                (true, _) => Some(vmcsnap_control::Recover::Resume),
                (_, true) => Some(vmcsnap_control::Recover::Rollback),
                _ => None,
            };
            let _armed = fault.arm(&run_dir, vm.as_deref())?;
            let req = Request::Rejuvenate {
                vm,
                mode,
                qemu: match qemu {
                    Some(q) => Some(absolute_qemu(&q, "--qemu")?),
                    None => qemu_from_env()?,
                },
                recover,
            };
            match request(&run_dir.agent_socket(), &req)? {
                Response::Recover(r) => output::json_or(json, &r, || output::recovered(&r)),
                other => {
                    let r = expect!(other, Response::Rejuvenate)?;
                    output::json_or(json, &r, || output::rejuvenate(&r))
                }
            }
        }
        Command::Snapshot {
            vm: None,
            cluster: true,
            mode,
            name,
            no_cut_probes,
            json,
            ..
        } => {
            let v = request(
                &run_dir.agent_socket(),
                &Request::ClusterSnapshot {
                    mode,
                    name,
                    no_cut_probes,
                },
            )?;
            output_cluster::json_or_snapshot(json, &*expect!(v, Response::ClusterSnapshot)?)
        }
        Command::Snapshot {
            vm,
            mode,
            name,
            reference,
            fault,
            storage,
            full,
            block_pages,
            access_window,
            json,
            ..
        } => {
            let vm = vm.context("name the VM to snapshot, or give --cluster")?;
            let reference =
                reference.map(|r| std::env::current_dir().map(|d| d.join(&r)).unwrap_or(r));
            let _armed = fault.arm(&run_dir, &vm)?;
            let v = request(
                &run_dir.agent_socket(),
                &Request::Snapshot {
                    vm,
                    mode,
                    name,
                    reference,
                    storage,
                    full,
                    block_pages,
                    access_window_s: Some(access_window),
                },
            )?;
            let r = expect!(v, Response::Snapshot)?;
            output::json_or(json, &r, || output::snapshot(&r))
        }
        Command::PauseLimit { vm, json } => {
            let v = request(&run_dir.agent_socket(), &Request::PauseLimit { vm })?;
            let r = expect!(v, Response::PauseLimit)?;
            output::json_or(json, &r, || {
                println!(
                    "{}: QEMU's own background snapshot paused it {:.1} ms ({} MiB; its setup, {:.1} ms, ran while the guest did)",
                    r.vm, r.downtime_ms, r.memory_mib, r.setup_while_running_ms
                )
            })
        }
        Command::Restore {
            snapshot,
            cluster: true,
            mode,
            no_priorities,
            start_quiet,
            fault,
            wait,
            json,
            ..
        } => {
            let mode = match mode {
                Some(m) => m.parse().map_err(anyhow::Error::msg)?,
                None => vmcsnap_control::ClusterRestoreMode::HotrestoreRl,
            };
            let _armed = fault.arm(&run_dir)?;
            let v = launch::request_started(
                &run_dir,
                &Request::ClusterRestore {
                    snapshot,
                    mode,
                    no_priorities,
                    start_quiet_ms: start_quiet,
                    wait,
                },
            )?;
            output_cluster::json_or_restore(json, v)
        }
        Command::Restore {
            snapshot,
            mode,
            wss,
            paused,
            trace,
            no_background,
            no_priorities,
            start_quiet,
            prefetch_blocks,
            preempt,
            wait,
            json,
            ..
        } => {
            let mode = match mode {
                Some(m) => m.parse().map_err(anyhow::Error::msg)?,
                None => vmcsnap_control::RestoreMode::Workingset,
            };
            let wss = match wss.as_str() {
                "auto" => None,
                n => Some(
                    n.parse::<u64>()
                        .with_context(|| format!("--wss {n:?}: give a number of pages or auto"))?,
                ),
            };
            let v = launch::request_started(
                &run_dir,
                &Request::Restore {
                    snapshot,
                    mode,
                    wss,
                    paused,
                    trace,
                    no_background,
                    no_priorities,
                    start_quiet_ms: start_quiet,
                    prefetch_blocks,
                    preempt,
                    wait,
                },
            )?;
            output::restore(json, v)
        }
        Command::Stop { vm, json } => {
            let v = request(&run_dir.agent_socket(), &Request::Stop { vm })?;
            let s = expect!(v, Response::Stop)?;
            output::json_or(json, &s, || println!("VM {} stopped", s.vm))
        }
        Command::AnalyzeWs { snapshot, json } => {
            output::analyze_ws(&run_dir.snapshots_dir().join(&snapshot), json)
        }
        Command::Snapshots { cmd, json } => match cmd {
            None => output::snapshots(&run_dir.snapshots_dir(), json),
            Some(SnapshotsCmd::List { json }) => output::snapshots(&run_dir.snapshots_dir(), json),
            Some(SnapshotsCmd::Delete { names, json }) => {
                removal(&run_dir, &Request::SnapshotsDelete { names }, json)
            }
            Some(SnapshotsCmd::Prune {
                keep,
                vm,
                dry_run,
                json,
            }) => removal(
                &run_dir,
                &Request::SnapshotsPrune { keep, vm, dry_run },
                json,
            ),
        },
        Command::Inspect {
            snapshot,
            cluster,
            rdg,
            dot,
            verify,
            json,
        } => {
            let dir = if snapshot.components().count() == 1 && !snapshot.exists() {
                run_dir.snapshots_dir().join(&snapshot)
            } else {
                snapshot
            };
            if rdg {
                output_cluster::rdg(&dir, dot.as_deref(), json)
            } else if cluster || vmcsnap_agent::image::cluster::is_cluster_snapshot(&dir) {
                output_cluster::inspect(&dir, verify, json)
            } else {
                output::inspect(&dir, verify, json)
            }
        }
        Command::Availability { t_vmm, t_os, json } => availability(&run_dir, t_vmm, t_os, json),
        Command::StreamRelay { to, detach } => {
            if detach {
                vmcsnap_agent::relay::detach().context("stream relay: detaching")?;
            }
            let o = vmcsnap_agent::relay::relay(std::io::stdin().lock(), &to)
                .context("stream relay")?;
            if o.discarded > 0 {
                eprintln!(
                    "vmcsnap stream-relay: the agent went away; discarded {} bytes",
                    o.discarded
                );
            }
            Ok(())
        }
        Command::PageSource { dir, detach } => page_source(&dir, detach),
        Command::Exec { argv } => exec(&run_dir, &argv),
        Command::Agent { cmd } => match cmd {
            AgentCmd::Run {
                exit_when_idle,
                resume,
                metrics_listen,
                log_format: _,
            } => vmcsnap_agent::serve(AgentOptions {
                run_dir,
                exit_when_idle,
                resume,
                metrics_listen: metrics_listen
                    .map_or_else(metrics_listen_from_env, |a| Ok(Some(a)))?,
            })
            .context("agent failed"),
            AgentCmd::Restart => {
                let sock = run_dir.agent_socket();
                // Without a hello: an agent of any version restarts onto the
                // vmcsnap installed now (the way out of a version mismatch).
                let before = vmcsnap_control::restart_agent(&sock, &mut |m| eprintln!("  {m}"))?;
                // The new image answers on the same socket once it has taken over.
                let deadline = Instant::now() + std::time::Duration::from_secs(30);
                loop {
                    if let Ok(Response::Ping(v)) = call(
                        &sock,
                        &Request::Ping,
                        Some(std::time::Duration::from_secs(5)),
                        &mut |_| {},
                    ) {
                        if v.generation > before {
                            println!(
                                "agent restarted: pid {}, generation {}",
                                v.pid, v.generation
                            );
                            return Ok(());
                        }
                    }
                    if Instant::now() > deadline {
                        anyhow::bail!(
                            "the agent did not come back within 30 s; see {}",
                            run_dir.agent_log().display()
                        );
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
            AgentCmd::Start => {
                let pid = launch::ensure_agent(&run_dir, false)?;
                println!(
                    "agent running, pid {pid}, socket {}",
                    run_dir.agent_socket().display()
                );
                Ok(())
            }
            AgentCmd::Stop => {
                request(&run_dir.agent_socket(), &Request::Shutdown)?;
                println!("agent stopped");
                Ok(())
            }
        },
        Command::Guest {
            cmd: GuestCmd::Build { json },
        } => {
            let t = Instant::now();
            let root = vmcsnap_guest::default_cache_root();
            let a = vmcsnap_guest::ensure_assets(&root, &mut |m| eprintln!("{m}"))?;
            let v = views::GuestBuildView {
                dir: &a.dir,
                initrd: &a.initrd,
                kernel: &a.kernel,
                key: &a.key,
                seconds: t.elapsed().as_secs_f64(),
            };
            output::json_or(json, &v, || {
                println!(
                    "guest assets {} in {:.1} s: {}",
                    a.key,
                    t.elapsed().as_secs_f64(),
                    a.dir.display()
                )
            })
        }
        Command::Image { cmd } => image(cmd),
    }
}

fn image(cmd: ImageCmd) -> Result<()> {
    use vmcsnap_guest::image;
    let root = vmcsnap_guest::default_cache_root();
    match cmd {
        ImageCmd::Build {
            name,
            suite,
            packages,
            json,
        } => {
            let recipe = image::ImageRecipe::named(&name, &packages)?.with_suite(suite);
            let t = Instant::now();
            let b = image::ensure_image(&root, &recipe, &mut |m| eprintln!("{m}"))?;
            output::json_or(json, &serde_json::to_value(&b)?, || {
                println!(
                    "image {} {} ({}) in {:.1} s: {}",
                    b.name,
                    b.suite,
                    b.key,
                    t.elapsed().as_secs_f64(),
                    b.dir.display()
                );
                println!("  disk    {}", b.disk.display());
                println!("  kernel  {} ({})", b.kernel.display(), b.kernel_version);
                println!("  initrd  {}", b.initrd.display());
                println!("  cmdline {}", b.cmdline);
            })
        }
        ImageCmd::List { json } => {
            let list = image::list_images(&root)?;
            output::json_or(json, &serde_json::to_value(&list)?, || {
                if list.is_empty() {
                    println!("no images in {}", root.display());
                }
                for i in &list {
                    println!(
                        "{:<12} {:<8} {} {:>5} MiB on disk  kernel {}  built in {:.0} s  packages: {}",
                        i.name,
                        i.suite,
                        i.key,
                        i.disk_bytes >> 20,
                        i.kernel_version,
                        i.build_seconds,
                        if i.packages.is_empty() {
                            "-".to_string()
                        } else {
                            i.packages.join(",")
                        }
                    );
                }
            })
        }
    }
}

fn up(run_dir: &RunDir, spec: &Path, json: bool) -> Result<()> {
    let text = std::fs::read_to_string(spec)
        .with_context(|| format!("cannot read spec {}", spec.display()))?;
    let spec_path = std::fs::canonicalize(spec).unwrap_or_else(|_| spec.to_path_buf());
    // Reject a bad spec here, before any agent or QEMU starts.
    vmcsnap_spec::ClusterSpec::from_toml_str(&text, vmcsnap_guest::MIN_MEMORY_MIB)
        .with_context(|| format!("{}", spec.display()))?;
    let v = launch::request_started(
        run_dir,
        &Request::Up {
            spec_path,
            spec_toml: text,
        },
    )?;
    let up = expect!(v, Response::Up)?;
    output::json_or(json, &up, || output::up(&up))
}

/// `snapshots delete` and `snapshots prune`: through the agent (started
/// for it if none runs), which serialises them with snapshots and restores.
fn removal(run_dir: &RunDir, req: &Request, json: bool) -> Result<()> {
    let v = launch::request_started(run_dir, req)?;
    output_removal::removal(&expect!(v, Response::SnapshotsDelete)?, json)
}

/// `vmcsnap exec -- CMD`: CMD in the run directory's cluster namespace.
fn exec(run_dir: &RunDir, argv: &[std::ffi::OsString]) -> Result<()> {
    use std::os::unix::process::ExitStatusExt;
    let ns = vmcsnap_hostnet::netns_name(&run_dir.tag());
    if !vmcsnap_hostnet::netns_exists(&ns) {
        anyhow::bail!(
            "no cluster with host access is up in {} (no network namespace {ns}); `vmcsnap up` one first",
            run_dir.root().display()
        );
    }
    let status = vmcsnap_hostnet::exec_in_netns(&ns, argv)?;
    // Like a shell: the command's exit code, or 128 + the signal that killed it.
    std::process::exit(
        status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)),
    )
}

fn availability(run_dir: &RunDir, t_vmm: f64, t_os: f64, json: bool) -> Result<()> {
    use crate::views::{AvailabilityRow, AvailabilityView};
    use vmcsnap_agent::availability::{availability, measured_from_log, Kind};
    if !(t_vmm > 0.0 && t_os > 0.0) {
        anyhow::bail!("--t-vmm and --t-os must be positive numbers of days");
    }
    let path = run_dir.rejuvenation_log();
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let m = measured_from_log(&text);
    let Some(d_os) = m.os_reboot else {
        anyhow::bail!(
            "no cold rejuvenation measured in {} yet (it gives the OS reboot time): run `vmcsnap rejuvenate --all --mode cold` first",
            path.display()
        );
    };
    let day = 86_400.0;
    let modes = [
        (Kind::Warm, m.warm),
        (Kind::Cold, m.cold),
        (Kind::Saved, m.saved),
    ]
    .into_iter()
    .map(|(mode, d)| AvailabilityRow {
        availability: d.map(|(_, d)| availability(mode, d, d_os, t_vmm * day, t_os * day)),
        downtime_s: d.map(|(_, d)| d),
        mode,
        vms: d.map(|(n, _)| n),
    })
    .collect();
    let v = AvailabilityView {
        modes,
        os_reboot_s: d_os,
        t_os_days: t_os,
        t_vmm_days: t_vmm,
    };
    output::json_or(json, &v, || {
        println!(
            "T_vmm = {t_vmm} days, T_os = {t_os} days, D_os = {d_os:.3} s (measured cold reboot)"
        );
        println!(
            "{:<6} {:>4} {:>12} {:>14}",
            "MODE", "VMS", "DOWNTIME_S", "AVAILABILITY"
        );
        for r in &v.modes {
            let mode = views::kind_name(r.mode);
            match (r.availability, r.vms) {
                (Some(a), Some(n)) => println!(
                    "{:<6} {:>4} {:>12.3} {:>14.7}",
                    mode,
                    n,
                    r.downtime_s.unwrap_or(0.0),
                    a
                ),
                _ => println!(
                    "{:<6}    - not measured: run `vmcsnap rejuvenate --all --mode {mode}`",
                    mode
                ),
            }
        }
    })
}

/// Sends `req` to the agent of the run directory holding `sock`. If no
/// agent answers but the run directory records VMs (their agent died), a
/// new agent is started first: it adopts them, and the request goes to it.
/// The metrics address of an agent without `--metrics-listen`:
/// `VMCSNAP_METRICS_LISTEN`, which an agent started on demand or restarted
/// in place inherits.
fn metrics_listen_from_env() -> Result<Option<std::net::SocketAddr>> {
    match std::env::var("VMCSNAP_METRICS_LISTEN") {
        Ok(a) if !a.is_empty() => a.parse().map(Some).with_context(|| {
            format!("VMCSNAP_METRICS_LISTEN={a:?} is no address: give IP:PORT, e.g. 127.0.0.1:9187")
        }),
        _ => Ok(None),
    }
}

/// `VMCSNAP_QEMU` as the CLI sees it, as an absolute path: the agent runs
/// with its own environment and working directory, so the CLI resolves it.
fn qemu_from_env() -> Result<Option<PathBuf>> {
    let Some(q) = std::env::var_os("VMCSNAP_QEMU").map(PathBuf::from) else {
        return Ok(None);
    };
    absolute_qemu(&q, "VMCSNAP_QEMU").map(Some)
}

/// `q` (a path, or a name looked up on PATH) as an absolute path, for the
/// agent; `what` names where it came from in errors.
fn absolute_qemu(q: &Path, what: &str) -> Result<PathBuf> {
    let found = if q.components().count() > 1 {
        std::env::current_dir()?.join(q)
    } else {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(q))
            .find(|p| p.is_file())
            .with_context(|| format!("{what}={}: no such program on PATH", q.display()))?
    };
    if !found.is_file() {
        anyhow::bail!("{what}={}: no such file", q.display());
    }
    Ok(found)
}

fn request(sock: &Path, req: &Request) -> Result<Response> {
    match call(sock, req, None, &mut |m| eprintln!("  {m}")) {
        Err(e) if matches!(e, vmcsnap_control::ControlError::NoAgent { .. }) => {
            let run_dir = RunDir::new(sock.parent().unwrap_or(Path::new(".")));
            if !vmcsnap_agent::cluster_record::needs_agent(&run_dir) {
                return Err(e.into());
            }
            eprintln!("  no agent answers but {} records VMs or an unfinished restore: starting an agent to take them over", run_dir.root().display());
            launch::request_started(&run_dir, req)
        }
        r => Ok(r?),
    }
}

/// `vmcsnap page-source`: QEMU's incoming stream is stdin, the agent reads
/// the events from stdout.
fn page_source(dir: &std::path::Path, detach: bool) -> Result<()> {
    use std::os::fd::AsFd;
    use vmcsnap_agent::restore::page_source;
    // Its agent may go away (the event pipe breaks) and so may QEMU (the
    // stream does): both are errors it handles, not a reason to die
    // without a result, as SIGPIPE's default (set for the CLI) would.
    // SAFETY: signal(2) with SIG_IGN, before this command starts a thread.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    if detach {
        page_source::detach(dir).context("page source: detaching")?;
    }
    let fd = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .context("page source: its stream (stdin)")?;
    let stream = std::os::unix::net::UnixStream::from(fd);
    let ended = page_source::serve(dir, stream, std::io::stdout().lock())?;
    match ended {
        page_source::Ended::Done(_) => Ok(()),
        page_source::Ended::Failed { detail, .. } => anyhow::bail!("page source: {detail}"),
    }
}
