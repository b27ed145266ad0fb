//! A VM with its place on the network: the handle every per-VM operation
//! (snapshot, restore, rejuvenate) works on, whichever cluster it is in, and
//! plugging a VM into the switch.

use std::path::PathBuf;

use vmcsnap_spec::VmAddress;
use vmcsnap_switch::{PortId, SwitchHandle};

use crate::vm::Vm;
use crate::{log, AgentError};

/// A VM of the cluster with its place on the network.
pub struct Member {
    /// The QEMU process.
    pub vm: Vm,
    /// Address and MAC.
    pub address: VmAddress,
    /// Its switch port.
    pub port: PortId,
    /// Its data disk.
    pub disk: PathBuf,
}

impl Member {
    /// Learns from QEMU which file each disk is written to now (a snapshot
    /// that an agent died in may have put an overlay on top since the
    /// record was written): a block device whose backing chain contains a
    /// recorded file has that disk's new top. Keeps what it has if QEMU
    /// does not say.
    pub fn refresh_disk(&mut self) {
        if self.vm.exited().is_some() {
            return;
        }
        let Ok(chains) = crate::block_chains::device_chains(&mut self.vm) else {
            return;
        };
        let chains: Vec<Vec<PathBuf>> = chains.into_iter().map(|c| c.files).collect();
        let name = self.vm.name.clone();
        for d in self.vm.config.disks.iter_mut().filter(|d| !d.read_only) {
            let Some(chain) = chains.iter().find(|c| c.contains(&d.path)) else {
                continue;
            };
            if chain[0] != d.path {
                log(format!(
                    "VM {name}: disk {} is written to {} now (recorded: {})",
                    d.node,
                    chain[0].display(),
                    d.path.display()
                ));
                if self.disk == d.path {
                    self.disk = chain[0].clone();
                }
                d.path = chain[0].clone();
            }
        }
    }
}

/// Plugs a VM into the switch: a port that dials the VM's NIC socket
/// (QEMU listens there), and the VM's DHCP lease on it.
pub fn plug(
    switch: &SwitchHandle,
    vm: &str,
    socket: &std::path::Path,
    address: &VmAddress,
) -> Result<PortId, AgentError> {
    let port = switch.add_port(vm, socket)?;
    if let Err(e) =
        switch.set_dhcp_lease(port, vmcsnap_switch::MacAddr(address.mac), address.ip, vm)
    {
        let _ = switch.remove_port(port);
        return Err(e.into());
    }
    Ok(port)
}
