//! Restarting the agent without touching its VMs.
//!
//! `vmcsnap agent restart` makes the agent `execve` its own executable (a
//! newer build if it was replaced on disk) *in the same process*:
//!
//! 1. the request is answered, then the switch is frozen (its event loop
//!    stops; every socket, queue, partial frame and counter is kept, see
//!    `vmcsnap_switch::handover`);
//! 2. the control listener and the switch's sockets lose `FD_CLOEXEC`;
//!    everything else (QMP sessions, client connections) closes at exec;
//! 3. the cluster (spec, accelerator, per-VM QEMU config, pid, address,
//!    port, disk) and the frozen switch state go to `<run-dir>/handover.json`;
//! 4. exec `vmcsnap --run-dir R agent run --resume <run-dir>/handover.json`;
//! 5. the new image reads the file, takes the listener fd back, thaws the
//!    switch from the inherited fds, and adopts the QEMU processes: they
//!    kept running the whole time and are still its children (same pid).
//!
//! Guests never notice: frames sent meanwhile wait in kernel socket buffers
//! and are forwarded once the switch runs again. If the exec fails, the
//! frozen switch is resumed in place and the old image goes on serving.

#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vmcsnap_spec::{ClusterSpec, VmAddress};
use vmcsnap_switch::{FrozenState, PortId, Switch};

use crate::accel::Resolved;
use crate::cluster::Cluster;
use crate::member::Member;
use crate::process::set_cloexec;
use crate::qemu::QemuConfig;
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// Bumped whenever the file's layout changes.
pub const HANDOVER_VERSION: u32 = 1;

/// One VM as handed over.
#[derive(Debug, Serialize, Deserialize)]
struct MemberState {
    config: QemuConfig,
    pid: u32,
    started_unix_ms: u64,
    boot_ms: Option<u64>,
    qemu_log: PathBuf,
    address: VmAddress,
    port: PortId,
    disk: PathBuf,
}

/// `<run-dir>/handover.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Handover {
    version: u32,
    control_fd: RawFd,
    /// The agent lock's descriptor (`crate::agent_lock`), kept across the
    /// exec (absent from an older image's file).
    #[serde(default)]
    lock_fd: Option<RawFd>,
    exit_when_idle: bool,
    generation: u64,
    cluster: Option<ClusterState>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ClusterState {
    spec: ClusterSpec,
    accel: Resolved,
    members: Vec<MemberState>,
    switch: FrozenState,
    #[serde(default)]
    host_port: Option<PortId>,
}

/// Hands everything over to a fresh image of the agent executable. Returns
/// only if the exec failed, with the agent still serving as before.
pub fn exec_restart(
    run: &RunDir,
    listener: &UnixListener,
    lock_fd: RawFd,
    cluster: &mut Option<Cluster>,
    exit_when_idle: bool,
    generation: u64,
    exe: &Path,
) -> AgentError {
    // A QEMU exiting in the background must be reaped by this image: the
    // new one would not know it (and leave a zombie).
    let left = crate::qemu_exit::wait_reaped(Duration::from_secs(30));
    if left > 0 {
        log(format!(
            "agent restart: {left} exiting QEMU(s) not reaped after 30 s; they stay zombies until the agent exits"
        ));
    }
    let mut frozen = None;
    let state = match cluster.take() {
        None => None,
        Some(c) => {
            let (spec, accel, members, switch, host, _run) = c.into_parts();
            // The relay thread does not survive the exec; its port does.
            let host_port = host.as_ref().map(|h| h.port);
            let f = match switch.freeze() {
                Ok(f) => f,
                Err(e) => {
                    *cluster = Some(Cluster::from_parts(
                        spec,
                        accel,
                        members,
                        switch,
                        host,
                        run.clone(),
                    ));
                    return e.into();
                }
            };
            let members = members
                .into_iter()
                .map(|m| MemberState {
                    pid: m.vm.pid,
                    started_unix_ms: m
                        .vm
                        .started_at
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or(0),
                    boot_ms: m.vm.boot_ms,
                    qemu_log: m.vm.qemu_log.clone(),
                    config: m.vm.config.clone(),
                    address: m.address,
                    port: m.port,
                    disk: m.disk,
                })
                .collect();
            drop(host);
            let st = ClusterState {
                spec,
                accel,
                members,
                switch: f.state().clone(),
                host_port,
            };
            frozen = Some(f);
            Some(st)
        }
    };
    let h = Handover {
        version: HANDOVER_VERSION,
        control_fd: listener.as_raw_fd(),
        lock_fd: Some(lock_fd),
        exit_when_idle,
        generation,
        cluster: state,
    };
    let path = run.root().join("handover.json");
    let err = (|| -> Result<(), AgentError> {
        if let Some(f) = &frozen {
            f.keep_across_exec()?;
        }
        set_cloexec(listener.as_raw_fd(), false).map_err(AgentError::io(
            "keeping the control socket across exec",
            run.agent_socket(),
        ))?;
        set_cloexec(lock_fd, false).map_err(AgentError::io(
            "keeping the agent lock across exec",
            run.root().join(crate::agent_lock::FILE_NAME),
        ))?;
        std::fs::write(&path, serde_json::to_vec(&h).expect("handover serialises"))
            .map_err(AgentError::io("writing", &path))?;
        log(format!(
            "agent restart: exec {} (generation {})",
            exe.display(),
            generation + 1
        ));
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("--run-dir")
            .arg(run.root())
            .args(["agent", "run", "--resume"])
            .arg(&path);
        use std::os::unix::process::CommandExt;
        // Only returns on failure.
        Err(AgentError::io("executing", exe)(cmd.exec()))
    })()
    .unwrap_err();
    // The exec failed: carry on in this image.
    log(format!(
        "agent restart failed, continuing in the old image: {err}"
    ));
    let _ = set_cloexec(listener.as_raw_fd(), true);
    let _ = set_cloexec(lock_fd, true);
    let _ = std::fs::remove_file(&path);
    if let (Some(f), Some(st)) = (frozen, h.cluster) {
        match f.resume(crate::cluster::switch_config()) {
            Ok(switch) => {
                let members = st.members.into_iter().map(adopt).collect();
                let host = relay_again(run, &st.spec, st.host_port);
                *cluster = Some(Cluster::from_parts(
                    st.spec,
                    st.accel,
                    members,
                    switch,
                    host,
                    run.clone(),
                ));
            }
            Err(e) => log(format!("cannot resume the switch: {e}")),
        }
    }
    err
}

/// What the new image takes over.
pub struct Resumed {
    /// The control socket, listening all along.
    pub listener: UnixListener,
    /// The agent lock, held all along (taken now if the old image did not
    /// hand it over).
    pub lock: crate::agent_lock::AgentLock,
    /// The cluster, if one was up.
    pub cluster: Option<Cluster>,
    /// Whether the agent exits once idle.
    pub exit_when_idle: bool,
    /// The new image's generation.
    pub generation: u64,
}

/// In the new image: reads the handover file and rebuilds the listener, the
/// lock, the switch and the cluster.
pub fn resume(run: &RunDir, path: &Path) -> Result<Resumed, AgentError> {
    let text = std::fs::read(path).map_err(AgentError::io("reading", path))?;
    let _ = std::fs::remove_file(path);
    let h: Handover = serde_json::from_slice(&text).map_err(|e| {
        AgentError::BadRequest(format!("{}: not a handover file: {e}", path.display()))
    })?;
    if h.version != HANDOVER_VERSION {
        return Err(AgentError::BadRequest(format!(
            "{}: handover version {} but this agent speaks {HANDOVER_VERSION}; restart with the same vmcsnap version",
            path.display(),
            h.version
        )));
    }
    check_listener(h.control_fd, &run.agent_socket())?;
    // SAFETY: `check_listener` verified that the fd is open and is a unix
    // socket bound to our control socket path; it was handed over by the
    // previous image of this process and nothing else in this image owns it.
    let listener = unsafe { UnixListener::from_raw_fd(h.control_fd) };
    set_cloexec(h.control_fd, true).map_err(AgentError::io(
        "restoring close-on-exec on",
        run.agent_socket(),
    ))?;
    let lock = match h.lock_fd {
        Some(fd) => crate::agent_lock::AgentLock::inherited(run, fd)?,
        None => crate::agent_lock::AgentLock::acquire(run)?,
    };
    let cluster = match h.cluster {
        None => None,
        Some(st) => {
            let switch = Switch::thaw(st.switch, crate::cluster::switch_config())?;
            let members: Vec<Member> = st.members.into_iter().map(adopt).collect();
            // DHCP leases are not part of the frozen switch: register them again.
            for m in &members {
                if let Err(e) = switch.set_dhcp_lease(
                    m.port,
                    vmcsnap_switch::MacAddr(m.address.mac),
                    m.address.ip,
                    &m.vm.name,
                ) {
                    log(format!(
                        "VM {}: registering its DHCP lease again: {e}",
                        m.vm.name
                    ));
                }
            }
            let host = relay_again(run, &st.spec, st.host_port);
            Some(Cluster::from_parts(
                st.spec,
                st.accel,
                members,
                switch,
                host,
                run.clone(),
            ))
        }
    };
    Ok(Resumed {
        listener,
        lock,
        cluster,
        exit_when_idle: h.exit_when_idle,
        generation: h.generation + 1,
    })
}

fn relay_again(
    run: &RunDir,
    spec: &ClusterSpec,
    port: Option<PortId>,
) -> Option<crate::host_port::HostPort> {
    let port = port?;
    crate::host_port::restart_relay(run, spec.cluster.host_access, port).unwrap_or_else(|e| {
        log(format!("the host interface cannot be started again: {e}"));
        None
    })
}

fn adopt(m: MemberState) -> Member {
    let started_at = UNIX_EPOCH + Duration::from_millis(m.started_unix_ms);
    Member {
        vm: Vm::adopt(m.config, m.pid, started_at, m.boot_ms, m.qemu_log),
        address: m.address,
        port: m.port,
        disk: m.disk,
    }
}

fn check_listener(fd: RawFd, expect: &Path) -> Result<(), AgentError> {
    let bad =
        |why: String| AgentError::BadRequest(format!("inherited control socket fd {fd}: {why}"));
    // SAFETY: fcntl(F_GETFD) only reads the descriptor's flags.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad("not open".into()));
    }
    // SAFETY: the fd is open (checked above); the borrow does not outlive
    // this function and does not close it.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let sock = socket2::SockRef::from(&borrowed);
    let addr = sock
        .local_addr()
        .map_err(|e| bad(format!("not a socket ({e})")))?;
    match addr.as_pathname() {
        Some(p) if p == expect => Ok(()),
        other => Err(bad(format!(
            "bound to {other:?}, expected {}",
            expect.display()
        ))),
    }
}
