//! Host access to a vmcsnap cluster network.
//!
//! The cluster's VMs sit on vmcsnap's own L2 switch (10.77.0.0/24, VMs at
//! .2 and up). For operators to reach them from the host (`redis-cli -h
//! 10.77.0.2`, ssh), the switch gets a "host" port whose peer is a kernel
//! TAP interface with 10.77.0.1/24:
//!
//! ```text
//!  switch ──dials──▶ socket_path ◀── relay thread ──▶ tap "vmcs0" 10.77.0.1/24
//!  (port "host")     (unix, listening)  (this crate)   in netns vmcsnap-<tag>
//! ```
//!
//! - [`Mode::Netns`] (the default): the tap lives in a network namespace the
//!   cluster owns, named after the run directory ([`netns_name`]); nothing
//!   of the host's own network stack changes. Operators run clients in it
//!   with `vmcsnap exec -- CMD` ([`exec_in_netns`]).
//! - [`Mode::Host`]: the tap lives in the host's network stack, so every
//!   host process reaches the VMs (and one cluster per host can use it).
//!
//! The relay ([`relay`]) plays the part of QEMU's `-netdev
//! stream,server=on`: the switch connects to it, one connection at a time,
//! and reconnects after a disconnect; frames are length-prefixed
//! ([`vmcsnap_switch::framing`]).
//!
//! Module map: [`netns`] (named namespaces the iproute2 way, `exec`),
//! [`tap`] (TAP creation and configuration), `netlink` (deleting a leftover
//! interface), [`relay`] (the frame pump), [`error`].
//!
//! [`HostAccess::start`] is idempotent after a crash of the previous owner:
//! an existing namespace is reused, a leftover interface of the same name is
//! replaced and a stale socket file is replaced.

pub mod error;
mod netlink;
pub mod netns;
pub mod relay;
mod socket;
pub mod tap;

use std::net::Ipv4Addr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

pub use error::{HostNetError, Result};
pub use netns::{destroy_netns, exec_in_netns, in_netns, netns_exists, netns_name};
pub use relay::RelayStats;

use relay::{Counters, Relay};

/// The interface name used in a cluster's namespace.
pub const DEFAULT_IFNAME: &str = "vmcs0";

/// The host's address on every cluster network.
pub const HOST_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);

/// The host interface's MAC (`52:54:00:77:00:01`, in line with the VMs').
pub const HOST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x77, 0x00, 0x01];

/// Where the host interface lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// In the named network namespace (made if missing, kept by `stop`).
    Netns {
        /// The namespace's name, see [`netns_name`].
        name: String,
    },
    /// In the network namespace of the calling process (the host's).
    Host,
}

/// What [`HostAccess::start`] sets up.
#[derive(Debug, Clone)]
pub struct HostAccessConfig {
    /// Where the interface lives.
    pub mode: Mode,
    /// Interface name (at most 15 bytes), e.g. [`DEFAULT_IFNAME`].
    pub ifname: String,
    /// IPv4 address of the interface, e.g. [`HOST_ADDRESS`].
    pub address: Ipv4Addr,
    /// Prefix length, e.g. 24.
    pub prefix: u8,
    /// Ethernet address of the interface, e.g. [`HOST_MAC`].
    pub mac: [u8; 6],
    /// The unix socket the relay listens on and the switch connects to.
    pub socket_path: PathBuf,
}

impl HostAccessConfig {
    /// The defaults for a cluster: its namespace, `vmcs0`, 10.77.0.1/24,
    /// [`HOST_MAC`], listening on `socket_path`.
    pub fn for_netns(netns: impl Into<String>, socket_path: impl Into<PathBuf>) -> Self {
        HostAccessConfig {
            mode: Mode::Netns { name: netns.into() },
            ifname: DEFAULT_IFNAME.into(),
            address: HOST_ADDRESS,
            prefix: 24,
            mac: HOST_MAC,
            socket_path: socket_path.into(),
        }
    }
}

/// A running host interface and its relay. Dropping it stops it too.
#[derive(Debug)]
pub struct HostAccess {
    cfg: HostAccessConfig,
    stop_tx: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl HostAccess {
    /// Makes the namespace (netns mode, if missing), the tap and the
    /// listening socket, and starts the relay.
    pub fn start(cfg: HostAccessConfig) -> Result<HostAccess> {
        tap::validate_ifname(&cfg.ifname)?;
        let netns = match &cfg.mode {
            Mode::Netns { name } => {
                netns::ensure_netns(name)?;
                Some(name.clone())
            }
            Mode::Host => None,
        };
        let spec = tap::TapSpec {
            ifname: cfg.ifname.clone(),
            mac: cfg.mac,
            ip: cfg.address,
            prefix: cfg.prefix,
            own_namespace: netns.is_some(),
        };
        // The listener first: if another live owner holds the socket, we
        // must not have replaced its interface.
        let listener = socket::listen(&cfg.socket_path)?;
        let tap_and_pipe = netns::in_netns(netns.as_deref(), move || tap::create(&spec))
            .and_then(|tap| Ok((tap, pipe()?)));
        let (tap, (stop_rx, stop_tx)) = match tap_and_pipe {
            Ok(v) => v,
            Err(e) => {
                drop(listener);
                socket::remove_if_socket(&cfg.socket_path);
                return Err(e);
            }
        };
        let counters = Arc::new(Counters::default());
        let relay = Relay {
            tap,
            listener,
            stop: stop_rx,
            counters: counters.clone(),
            ifname: cfg.ifname.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("hostnet-relay".into())
            .spawn(move || relay.run())
            .map_err(|source| HostNetError::Thread {
                what: "hostnet-relay",
                source,
            })?;
        log::info!(
            "host access up: {} {}/{} in {}, switch socket {:?}",
            cfg.ifname,
            cfg.address,
            cfg.prefix,
            netns.as_deref().unwrap_or("the host's network stack"),
            cfg.socket_path
        );
        Ok(HostAccess {
            cfg,
            stop_tx: Some(stop_tx),
            thread: Some(thread),
            counters,
        })
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &HostAccessConfig {
        &self.cfg
    }

    /// The relay's counters.
    pub fn stats(&self) -> RelayStats {
        self.counters.snapshot()
    }

    /// Stops the relay, closes the switch connection, removes the tap and
    /// the socket file. The namespace stays (see [`destroy_netns`]).
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        // Closing the write end of the stop pipe wakes the relay (POLLHUP).
        let Some(tx) = self.stop_tx.take() else {
            return Ok(());
        };
        drop(tx);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        socket::remove_if_socket(&self.cfg.socket_path);
        // The tap is not persistent: closing its file (the relay's) removed
        // it. Check, in case the kernel kept it for another holder.
        let netns = match &self.cfg.mode {
            Mode::Netns { name } => Some(name.clone()),
            Mode::Host => None,
        };
        let ifname = self.cfg.ifname.clone();
        if let Some(name) = &netns {
            if !netns::netns_exists(name) {
                return Ok(());
            }
        }
        netns::in_netns(netns.as_deref(), move || {
            if let Some(index) = tap::ifindex(&ifname) {
                netlink::delete_link(index).map_err(|e| {
                    HostNetError::io(format!("cannot delete interface {ifname}"), e)
                })?;
            }
            Ok(())
        })?;
        log::info!("host access down: {}", self.cfg.ifname);
        Ok(())
    }
}

impl Drop for HostAccess {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            log::warn!("stopping host access {}: {e}", self.cfg.ifname);
        }
    }
}

/// The interfaces of the named namespace (or, for `None`, the caller's).
pub fn interfaces(netns: Option<&str>) -> Result<Vec<String>> {
    netns::in_netns(netns, || Ok(tap::interface_names()))
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(HostNetError::last_os("cannot create a pipe"));
    }
    // SAFETY: both fds were just returned by pipe2 and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
