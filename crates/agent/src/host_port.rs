//! The host's interface on the cluster network (`[cluster] host_access`).
//!
//! With `host_access = "netns"` (the default) the cluster owns a network
//! namespace, `vmcsnap-<run-dir tag>`, holding a tap interface with
//! 10.77.0.1/24; `vmcsnap exec -- CMD` runs commands in it. With `"host"`
//! the interface is in the host's own network stack. Either way a relay
//! thread (`vmcsnap_hostnet`) listens on `<cluster-dir>/host.sock` like a
//! QEMU NIC, and the switch dials it as the port [`HOST_PORT`]. The relay
//! lives in the agent: an agent that adopts a cluster, or the new image of
//! an exec handover, starts it again (the namespace stays).

use vmcsnap_hostnet::{HostAccess, HostAccessConfig, Mode};
use vmcsnap_spec::HostAccess as Choice;
use vmcsnap_switch::{PortId, SwitchHandle};

use crate::{log, AgentError, RunDir};

/// The switch port of the host interface (VM names start with a letter,
/// so it never collides with one).
pub const HOST_PORT: &str = "_host";

/// The running host interface of a cluster.
#[derive(Debug)]
pub struct HostPort {
    access: HostAccess,
    /// Its switch port.
    pub port: PortId,
}

/// The namespace of the cluster in `run`.
pub fn netns(run: &RunDir) -> String {
    vmcsnap_hostnet::netns_name(&run.tag())
}

fn config(run: &RunDir, choice: Choice) -> Option<HostAccessConfig> {
    let socket = run.cluster_dir().join("host.sock");
    match choice {
        Choice::None => None,
        Choice::Netns => Some(HostAccessConfig::for_netns(netns(run), socket)),
        Choice::Host => {
            let mut c = HostAccessConfig::for_netns(String::new(), socket);
            c.mode = Mode::Host;
            Some(c)
        }
    }
}

/// Starts the host interface the spec asks for and plugs it into `switch`.
pub fn start(
    run: &RunDir,
    choice: Choice,
    switch: &SwitchHandle,
) -> Result<Option<HostPort>, AgentError> {
    let Some(cfg) = config(run, choice) else {
        return Ok(None);
    };
    std::fs::create_dir_all(run.cluster_dir())
        .map_err(AgentError::io("creating", run.cluster_dir()))?;
    let socket = cfg.socket_path.clone();
    let access = HostAccess::start(cfg)?;
    let port = match switch.add_port(HOST_PORT, &socket) {
        Ok(p) => p,
        Err(e) => {
            let _ = access.stop();
            return Err(e.into());
        }
    };
    log(format!(
        "host interface {} on the cluster network ({choice:?})",
        vmcsnap_hostnet::HOST_ADDRESS
    ));
    Ok(Some(HostPort { access, port }))
}

/// Starts the relay again for a switch that already has the host port
/// (an exec handover keeps the port, not the relay thread).
pub fn restart_relay(
    run: &RunDir,
    choice: Choice,
    port: PortId,
) -> Result<Option<HostPort>, AgentError> {
    let Some(cfg) = config(run, choice) else {
        return Ok(None);
    };
    Ok(Some(HostPort {
        access: HostAccess::start(cfg)?,
        port,
    }))
}

/// Stops the relay and removes the interface; with `destroy`, the
/// namespace too (`down`).
pub fn stop(
    run: &RunDir,
    choice: Choice,
    host: Option<HostPort>,
    switch: &SwitchHandle,
    destroy: bool,
) {
    if let Some(h) = host {
        let _ = switch.remove_port(h.port);
        if let Err(e) = h.access.stop() {
            log(format!("stopping the host interface: {e}"));
        }
    }
    if destroy && choice == Choice::Netns {
        if let Err(e) = vmcsnap_hostnet::destroy_netns(&netns(run)) {
            log(format!("removing network namespace {}: {e}", netns(run)));
        }
    }
}
