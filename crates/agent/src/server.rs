//! The agent's control socket: one thread per connection, one operation at
//! a time, and nothing a request does can take the agent down.
//!
//! ```text
//!   accept loop ──► thread per connection ──► read one Request
//!                        │
//!        ping ───────────┤ answered at once
//!        status/console ─┤ cluster free?  yes: answered from the cluster
//!                        │                no:  answered from the view taken
//!                        │                     after the last operation,
//!                        │                     with `busy` naming the one running
//!        anything else ──┴─► lock the cluster (operations queue here, in
//!                            arrival order) ─► dispatch inside catch_unwind
//! ```
//!
//! A restore answers its client once its guests run and goes on, holding
//! the cluster, until every page is loaded; meanwhile `status` shows the
//! restored VMs and their loads from the view (see [`crate::loading`]).
//!
//! A panic in a handler is a bug, but it must not cost the operator the
//! management of every VM: it is caught, the VMs the operation may have left
//! paused are put back as their intent files say (`intent_recovery::finish`, what an
//! adopting agent does too), the record is rewritten, and the request fails
//! with a message saying so. The cluster's lock is never poisoned by it, as
//! the panic is caught while the guard is still held.

use std::io::BufReader;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Instant;

use vmcsnap_control::{
    accept_request, write_reply, Busy, ConsoleResult, Reply, Request, Response, StatusResult,
};

use crate::cluster::Cluster;
use crate::dispatch::{dispatch, idle_status, AgentInfo};
use crate::{log, panic_message, AgentError, RunDir};

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
    /// Serve the metrics (Prometheus/OpenMetrics text, `GET /metrics`) on
    /// this address ([`crate::metrics`]).
    pub metrics_listen: Option<std::net::SocketAddr>,
}

/// What `status` and `console` answer while an operation holds the cluster.
struct View {
    status: StatusResult,
    consoles: Vec<(String, PathBuf)>,
    busy: Option<(String, Instant)>,
}

/// Everything the connection threads share.
struct Shared {
    run: RunDir,
    cluster: Mutex<Option<Cluster>>,
    view: Mutex<View>,
    info: AgentInfo,
    listener: UnixListener,
    /// Held for the agent's life (across exec restarts).
    lock: crate::agent_lock::AgentLock,
    /// Connections accepted and not yet done with.
    inflight: AtomicUsize,
    /// An agent started on demand became idle while other requests were
    /// in flight: the last of them to finish exits (if still idle).
    exit_due: AtomicBool,
    /// The agent is exiting: a request that reaches the cluster lock now
    /// is answered [`Reply::Exiting`] instead of being run.
    exiting: AtomicBool,
    exit_when_idle: bool,
    exe: PathBuf,
    /// Background loads of restores that answered once their guests ran.
    loads: crate::loading::Loads,
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
    let (listener, agent_lock, cluster, exit_when_idle, generation) = match &opts.resume {
        Some(path) => {
            let r = crate::handover::resume(run, path)?;
            log(format!(
                "agent {} resumed (generation {}) with {} VMs",
                std::process::id(),
                r.generation,
                r.cluster.as_ref().map_or(0, |c| c.members.len())
            ));
            (
                r.listener,
                r.lock,
                r.cluster,
                r.exit_when_idle,
                r.generation,
            )
        }
        None => {
            // Before anything else: one agent per run directory.
            let held = crate::agent_lock::AgentLock::acquire(run)?;
            let listener = bind_control(run)?;
            // VMs of an agent that died: adopt them before serving anyone
            // (what it left half-done is finished in the background: see
            // `recover`).
            let cluster = crate::cluster_record::adopt(run)?;
            (listener, held, cluster, opts.exit_when_idle, 0)
        }
    };
    std::fs::write(run.agent_pid(), format!("{}\n", std::process::id()))
        .map_err(AgentError::io("writing", run.agent_pid()))?;
    if let Some(addr) = opts.metrics_listen {
        let bound = crate::metrics_endpoint::serve(addr, crate::metrics::render)?;
        tracing::info!(address = %bound, "metrics at http://{bound}/metrics");
    }
    log(format!(
        "agent {} serving {}",
        std::process::id(),
        sock.display()
    ));
    crate::sampler::start(run.clone());
    let started = std::time::SystemTime::now();
    let info = AgentInfo {
        generation,
        started_unix_ms: crate::unix_ms(started),
    };
    let shared = Arc::new(Shared {
        run: run.clone(),
        cluster: Mutex::new(None),
        view: Mutex::new(View {
            status: idle_status(),
            consoles: vec![],
            busy: None,
        }),
        info,
        listener,
        lock: agent_lock,
        inflight: AtomicUsize::new(0),
        exit_due: AtomicBool::new(false),
        exiting: AtomicBool::new(false),
        exit_when_idle,
        exe,
        loads: crate::loading::Loads::default(),
    });
    {
        let mut guard = lock(&shared.cluster);
        *guard = cluster;
        refresh_view(&shared, &mut guard);
    }
    if opts.resume.is_none() {
        // Requests are served from now on; operations wait for the
        // recovery, `status` says what it is doing.
        let (held, holding) = std::sync::mpsc::channel();
        let sh = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("recovery".into())
            .spawn(move || recover(&sh, &held));
        match spawned {
            Ok(_) => {
                let _ = holding.recv();
            }
            Err(e) => log(format!("cannot start the recovery thread: {e}")),
        }
    }

    for conn in shared.listener.incoming() {
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                if shared.exiting.load(Ordering::SeqCst) {
                    // `turn_away_pending` made the listener non-blocking
                    // and the exit is under way: nothing more to accept
                    // (this loop used to spin, logging EAGAIN).
                    std::thread::sleep(std::time::Duration::from_millis(50));
                } else {
                    log(format!("accept failed: {e}"));
                }
                continue;
            }
        };
        let sh = Arc::clone(&shared);
        shared.inflight.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new()
            .name("request".into())
            .spawn(move || {
                serve_connection(&sh, stream);
                done_with_connection(&sh);
            });
        if let Err(e) = spawned {
            shared.inflight.fetch_sub(1, Ordering::SeqCst);
            log(format!("cannot start a thread for a request: {e}"));
        }
    }
    Ok(())
}

/// With this variable naming a file, an agent's recovery waits until the
/// file exists (at most [`HOLD_LIMIT`]) before it does anything: tests use
/// it to see the agent answer while it recovers.
pub const HOLD_RECOVERY_ENV: &str = "VMCSNAP_TEST_HOLD_RECOVERY";
const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// What a new agent finishes of its predecessor's work, in the background
/// and holding the cluster (operations wait; `status` answers from the
/// view, `busy` naming the recovery): a restore it left half-done
/// ([`crate::restore_journal`]), then what its interrupted operations
/// left (a snapshot killed mid-way left its frozen disks behind forever).
/// `held` is told once the cluster is held.
fn recover(sh: &Shared, held: &std::sync::mpsc::Sender<()>) {
    let mut guard = lock(&sh.cluster);
    let pending = crate::restore_journal::pending(&sh.run);
    let what = match &pending {
        Some(r) => format!("recovering {r}"),
        None => "recovering: removing leftovers of interrupted operations".into(),
    };
    lock(&sh.view).busy = Some((what.clone(), Instant::now()));
    let _ = held.send(());
    if let Some(r) = pending {
        if let Some(path) = std::env::var_os(HOLD_RECOVERY_ENV) {
            let t = Instant::now();
            while !std::path::Path::new(&path).exists() && t.elapsed() < HOLD_LIMIT {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        let since = Instant::now();
        crate::restore_recovery::recover(&sh.run, &mut guard, &r, &mut |c, msg| {
            log(format!("recovery: {msg}"));
            refresh_view(sh, c);
            lock(&sh.view).busy = Some((format!("{what}: {msg}"), since));
        });
    }
    match crate::gc::collect(&sh.run, &mut guard) {
        Ok(r) if !r.removed.is_empty() => log(format!(
            "removed {} leftovers of interrupted operations: {:?}",
            r.removed.len(),
            r.removed
        )),
        Ok(_) => {}
        Err(e) => log(format!(
            "cannot remove leftovers of interrupted operations: {e}"
        )),
    }
    refresh_view(sh, &mut guard);
}

/// Locks the cluster, whether or not a thread panicked while holding it
/// (which `serve_connection` prevents, but a poisoned lock must never
/// make the VMs unmanageable).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

/// After a connection's request was answered: the last connection out of
/// an agent whose exit is due (`Shared::exit_due`) makes it exit, if no
/// cluster came up meanwhile.
fn done_with_connection(sh: &Shared) {
    if sh.inflight.fetch_sub(1, Ordering::SeqCst) != 1 || !sh.exit_due.load(Ordering::SeqCst) {
        return;
    }
    let guard = lock(&sh.cluster);
    if guard.is_none() && sh.inflight.load(Ordering::SeqCst) == 0 {
        sh.exiting.store(true, Ordering::SeqCst);
        drop(guard);
        exit_idle(sh, 0);
    }
}

/// Exits an agent that has nothing left to do: its socket goes first, so
/// that the next client starts a new agent instead of reaching this one.
/// `mine` is the number of connections the caller itself still counts
/// (its own, not yet done); any other one accepted meanwhile is answered
/// first (it waits for the cluster lock, which the caller no longer holds,
/// and is told [`Reply::Exiting`]), for at most 10 s.
fn exit_idle(sh: &Shared, mine: usize) -> ! {
    sh.exiting.store(true, Ordering::SeqCst);
    let _ = std::fs::remove_file(sh.run.agent_socket());
    turn_away_pending(sh);
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while sh.inflight.load(Ordering::SeqCst) > mine && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let _ = std::fs::remove_file(sh.run.agent_pid());
    // The old QEMUs of warm restarts still exiting are ours to reap
    // (their new parent might not).
    crate::qemu_exit::wait_reaped(std::time::Duration::from_secs(10));
    log("agent exiting");
    std::process::exit(0);
}

/// Connections that reached the socket before it was removed and were
/// never accepted: each is told that its request was not read
/// ([`Reply::Exiting`]), so that its client starts a new agent and sends
/// it again (without this it saw the connection close unanswered).
fn turn_away_pending(sh: &Shared) {
    if sh.listener.set_nonblocking(true).is_err() {
        return;
    }
    while let Ok((stream, _)) = sh.listener.accept() {
        let _ = stream.set_nonblocking(false);
        let _ = write_reply(&mut &stream, &Reply::Exiting);
    }
}

/// Reads one request from `stream` and answers it.
fn serve_connection(sh: &Shared, stream: UnixStream) {
    let mut reader = BufReader::new(&stream);
    let request = match accept_request(&mut reader) {
        Ok(r) => r,
        Err(e) => {
            let _ = write_reply(
                &mut &stream,
                &Reply::Failed {
                    error: e.to_string(),
                },
            );
            return;
        }
    };
    if matches!(request, Request::Ping) {
        let result = Response::Ping(sh.info.wire());
        let _ = write_reply(&mut &stream, &Reply::done(result));
        return;
    }
    let read_only = matches!(request, Request::Status | Request::Console { .. });
    let guard = if read_only {
        match sh.cluster.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let reply = from_view(sh, &request);
                let _ = write_reply(&mut &stream, &reply);
                return;
            }
        }
    } else {
        lock(&sh.cluster)
    };
    run_locked(sh, guard, request, &stream);
}

/// Answers `status` or `console` from the view while an operation runs.
fn from_view(sh: &Shared, request: &Request) -> Reply {
    let view = lock(&sh.view);
    match request {
        Request::Status => {
            let mut status = view.status.clone();
            sh.loads.apply(&mut status);
            status.busy = view.busy.as_ref().map(|(what, since)| Busy {
                request: what.clone(),
                for_s: since.elapsed().as_secs_f64(),
            });
            Reply::done(Response::Status(status))
        }
        Request::Console { vm, tail_bytes } => {
            match view.consoles.iter().find(|(name, _)| name == vm) {
                Some((_, path)) => Reply::done(Response::Console(ConsoleResult {
                    vm: vm.clone(),
                    path: path.clone(),
                    text: crate::vm::tail(path, *tail_bytes),
                })),
                None => Reply::Failed {
                    error: AgentError::NoSuchVm(vm.clone()).to_string(),
                },
            }
        }
        _ => Reply::Failed {
            error: "internal: not a read-only request".into(),
        },
    }
}

/// Runs `request` with the cluster held, then does what it asks of the
/// agent itself (stop, restart, exit when idle).
fn run_locked(
    sh: &Shared,
    mut guard: MutexGuard<'_, Option<Cluster>>,
    request: Request,
    stream: &UnixStream,
) {
    if sh.exiting.load(Ordering::SeqCst) {
        // Accepted just before the socket went: never run, so the client
        // sends it again to a new agent.
        let _ = write_reply(&mut &*stream, &Reply::Exiting);
        return;
    }
    let what = describe(&request);
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
    let read_only = matches!(request, Request::Status | Request::Console { .. });
    let restart = matches!(request, Request::RestartAgent);
    // Requests after which an agent started on demand (`--exit-when-idle`)
    // goes away if no cluster is up.
    let then_idle = changes_state
        || matches!(
            request,
            Request::SnapshotsDelete { .. } | Request::SnapshotsPrune { .. }
        );
    if !read_only {
        lock(&sh.view).busy = Some((what.clone(), Instant::now()));
    }
    let mut stop = false;
    let early = ConnEarly {
        sh,
        stream,
        replied: AtomicBool::new(false),
        writing: Mutex::new(()),
    };
    let mut progress = |m: &str| {
        let _w = lock(&early.writing);
        if early.replied.load(Ordering::SeqCst) {
            return;
        }
        let _ = write_reply(
            &mut &*stream,
            &Reply::Progress {
                message: m.to_string(),
            },
        );
    };
    let ctx = crate::loading::Ctx {
        early: &early,
        loads: sh.loads.clone(),
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        dispatch(
            request,
            &sh.run,
            &mut guard,
            &mut stop,
            &sh.info,
            &ctx,
            &mut progress,
        )
    }));
    let (reply, panicked) = match outcome {
        Ok(Ok(result)) => (Reply::done(result), false),
        Ok(Err(e)) => {
            log(format!("request failed: {e}"));
            (
                Reply::Failed {
                    error: e.to_string(),
                },
                false,
            )
        }
        Err(payload) => {
            let msg = panic_message(payload.as_ref());
            tracing::error!("bug: {what} panicked: {msg}");
            put_back(&mut guard);
            let error = format!(
                "the agent hit a bug during `{what}` ({msg}); it keeps serving, and the VMs that \
                 operation had paused were resumed as their intent files say: check `vmcsnap \
                 status`, and report the bug with the agent's log"
            );
            (Reply::Failed { error }, true)
        }
    };
    if changes_vms || panicked {
        // Whatever the request did (even if it failed midway), the record
        // says which VMs run now.
        match guard.as_ref() {
            Some(c) => {
                if let Err(e) = c.persist() {
                    log(format!("cannot write the VM record: {e}"));
                }
            }
            None => crate::cluster_record::clear(&sh.run),
        }
    }
    if !read_only {
        refresh_view(sh, &mut guard);
    }
    let idle = sh.exit_when_idle && then_idle && guard.is_none();
    // Other requests in flight (queued behind this one) are served first:
    // the last of them makes the agent exit (`done_with_connection`).
    let others = sh.inflight.load(Ordering::SeqCst) > 1;
    if idle && others && !stop {
        sh.exit_due.store(true, Ordering::SeqCst);
    }
    if stop || (idle && !others) {
        if let Some(mut c) = guard.take() {
            c.teardown();
        }
        // The socket goes before the reply: a client's next command, sent
        // once it has the reply, must not reach this agent (it would be
        // cut off mid-way by the exit) but start a new one.
        sh.exiting.store(true, Ordering::SeqCst);
        let _ = std::fs::remove_file(sh.run.agent_socket());
        early.finish(&what, &reply);
        drop(guard);
        exit_idle(sh, 1);
    }
    early.finish(&what, &reply);
    if restart {
        // Returns only if the exec failed; the old image goes on.
        let e = crate::handover::exec_restart(
            &sh.run,
            &sh.listener,
            sh.lock.fd(),
            &mut guard,
            sh.exit_when_idle,
            sh.info.generation,
            &sh.exe,
        );
        log(format!("agent restart failed: {e}"));
        refresh_view(sh, &mut guard);
    }
}

/// The connection of a request that may answer before it ends (see
/// [`crate::loading`]).
struct ConnEarly<'a> {
    sh: &'a Shared,
    stream: &'a UnixStream,
    replied: AtomicBool,
    /// Progress lines and the early answer are written by different threads.
    writing: Mutex<()>,
}

impl crate::loading::Early for ConnEarly<'_> {
    fn reply(&self, result: Response) {
        let _w = lock(&self.writing);
        if !self.replied.swap(true, Ordering::SeqCst) {
            let _ = write_reply(&mut &*self.stream, &Reply::done(result));
        }
    }

    fn show(&self, cluster: &str, accel: &str, vms: Vec<vmcsnap_control::VmStatus>) {
        let mut view = lock(&self.sh.view);
        crate::loading::merge(&mut view.status, cluster, accel, vms);
    }
}

impl ConnEarly<'_> {
    /// Sends the request's reply, unless it answered early: then only the
    /// log has its outcome.
    fn finish(&self, what: &str, reply: &Reply) {
        let _w = lock(&self.writing);
        if !self.replied.load(Ordering::SeqCst) {
            let _ = write_reply(&mut &*self.stream, reply);
            return;
        }
        match reply {
            Reply::Failed { error } => tracing::error!(
                request = what,
                "failed after it had answered (its guests ran): {error}"
            ),
            _ => tracing::info!(request = what, "done; it had answered once its guests ran"),
        }
    }
}

/// After a panic: what an adopting agent does for every live VM (learn its
/// disk's top from QEMU; resume it if an interrupted operation paused it, as
/// its intent file says).
fn put_back(cluster: &mut Option<Cluster>) {
    let Some(c) = cluster.as_mut() else { return };
    for m in &mut c.members {
        let name = m.vm.name.clone();
        let fix = || {
            // The operation may have moved a disk to a new overlay.
            m.refresh_disk();
            crate::intent_recovery::finish(&mut m.vm);
        };
        if catch_unwind(AssertUnwindSafe(fix)).is_err() {
            tracing::error!("VM {name}: putting it back after a panic panicked too");
        }
    }
}

/// Takes the view `status` and `console` answer from while the cluster is
/// busy, and clears `busy`.
fn refresh_view(sh: &Shared, cluster: &mut Option<Cluster>) {
    let (status, consoles) = match cluster.as_mut() {
        Some(c) => {
            let status = catch_unwind(AssertUnwindSafe(|| c.status())).unwrap_or_else(|_| {
                tracing::error!("bug: status panicked");
                idle_status()
            });
            let consoles = c
                .members
                .iter()
                .map(|m| (m.vm.name.clone(), m.vm.config.console_log.clone()));
            (status, consoles.collect())
        }
        None => (idle_status(), vec![]),
    };
    let mut view = lock(&sh.view);
    view.status = status;
    view.consoles = consoles;
    view.busy = None;
}

/// A request as the operator would name it.
fn describe(request: &Request) -> String {
    match request {
        Request::Ping => "ping".into(),
        Request::RestartAgent => "agent restart".into(),
        Request::Up { spec_path, .. } => format!("up {}", spec_path.display()),
        Request::Status => "status".into(),
        Request::Console { vm, .. } => format!("console {vm}"),
        Request::Rejuvenate {
            vm, mode, recover, ..
        } => {
            let vm = vm.as_deref().unwrap_or("--all");
            match recover {
                Some(vmcsnap_control::Recover::Resume) => format!("rejuvenate {vm} --resume"),
                Some(vmcsnap_control::Recover::Rollback) => format!("rejuvenate {vm} --rollback"),
                None => format!("rejuvenate {vm} --mode {mode}"),
            }
        }
        Request::Snapshot { vm, mode, .. } => format!("snapshot {vm} --mode {mode}"),
        Request::ClusterSnapshot { mode, .. } => format!("snapshot --cluster --mode {mode}"),
        Request::PauseLimit { vm } => format!("pause-limit {vm}"),
        Request::Restore { snapshot, mode, .. } => format!("restore {snapshot} --mode {mode}"),
        Request::ClusterRestore { snapshot, mode, .. } => {
            format!("restore --cluster {snapshot} --mode {mode}")
        }
        Request::Stop { vm } => format!("stop {vm}"),
        Request::Down => "down".into(),
        Request::Gc => "gc".into(),
        Request::SnapshotsDelete { names } => format!("snapshots delete {}", names.join(" ")),
        Request::SnapshotsPrune { keep, vm, dry_run } => format!(
            "snapshots prune --keep {keep}{}{}",
            vm.as_ref()
                .map(|v| format!(" --vm {v}"))
                .unwrap_or_default(),
            if *dry_run { " --dry-run" } else { "" }
        ),
        Request::Shutdown => "agent stop".into(),
    }
}
