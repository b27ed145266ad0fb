//! Booting and tearing down a cluster.
//!
//! `up` is all-or-nothing: if any step fails (a missing program, a VM that
//! exits or never prints its ready marker), everything already started is
//! torn down before the error is returned, so a failed `up` leaves no QEMU
//! process, socket or shared-memory file behind.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use vmcsnap_control::{StatusResult, UpResult, VmStatus, VmUp};
use vmcsnap_spec::{ClusterSpec, VmAddress};
use vmcsnap_switch::{Switch, SwitchConfig, SwitchHandle};

use crate::accel::{self, Resolved};
use crate::member::{plug, Member};
use crate::qemu::{self, QemuConfig};
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// A running cluster.
pub struct Cluster {
    /// The spec it was booted from.
    pub spec: ClusterSpec,
    /// The accelerator in use.
    pub accel: Resolved,
    /// The VMs, in spec order.
    pub members: Vec<Member>,
    /// The switch.
    pub switch: SwitchHandle,
    /// The host's interface on the cluster network, if the spec asks for one.
    pub host: Option<crate::host_port::HostPort>,
    run: RunDir,
}

/// What every VM of an `up` is launched with.
struct Launch<'a> {
    qemu_bin: &'a std::path::Path,
    dialect: vmcsnap_migstream::Dialect,
    assets: &'a vmcsnap_guest::GuestAssets,
}

impl Cluster {
    /// Boots every VM of `spec` and returns once all are ready.
    pub fn up(
        run: &RunDir,
        spec: ClusterSpec,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Cluster, AgentError> {
        let qemu_bin = qemu::find_qemu()?;
        // An unknown QEMU is refused before anything is created.
        let dialect = crate::cpu_model::binary_dialect(&qemu_bin)?;
        qemu::find_qemu_img()?;
        let (accel, note) = accel::resolve(spec.cluster.accel)?;
        if let Some(note) = note {
            log(&note);
            progress(&note);
        }
        // Everything that can be checked is checked before anything starts.
        let demand = crate::capacity::demand(
            run,
            &spec.cluster.name,
            spec.vm.iter().map(|v| (v.name.as_str(), v.memory_mib)),
        );
        crate::capacity::ensure(crate::capacity::Start::Up, &demand, run)?;
        for vm in &spec.vm {
            if let vmcsnap_spec::GuestKind::Image(g) = vm.kind() {
                crate::image_vm::check(&g)
                    .map_err(|e| AgentError::BadRequest(format!("VM {}: {e}", vm.name)))?;
            }
        }
        let assets = vmcsnap_guest::ensure_assets(&vmcsnap_guest::default_cache_root(), progress)?;

        let mut cluster = Cluster::empty(run, spec, accel)?;
        match cluster.boot(&qemu_bin, dialect, &assets, progress) {
            Ok(()) => Ok(cluster),
            Err(e) => {
                log(format!("up failed, tearing down: {e}"));
                cluster.teardown();
                Err(e)
            }
        }
    }

    fn boot(
        &mut self,
        qemu_bin: &std::path::Path,
        dialect: vmcsnap_migstream::Dialect,
        assets: &vmcsnap_guest::GuestAssets,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), AgentError> {
        let spec = self.spec.clone();
        for (vm_spec, address) in spec.vm.iter().zip(spec.addressing()) {
            let launch = Launch {
                qemu_bin,
                dialect,
                assets,
            };
            self.launch(&launch, vm_spec, address, progress)?;
        }
        // A QEMU version vmcsnap does not speak fails `up` now, before
        // anything is asked of a VM (its QMP greeting names the version).
        for m in &mut self.members {
            m.vm.dialect()?;
        }
        progress(&format!(
            "booting {} VMs ({})",
            self.members.len(),
            self.accel.name()
        ));
        self.wait_ready(Duration::from_secs(spec.cluster.boot_timeout_s), progress)?;
        for m in &mut self.members {
            m.vm.qmp()?;
        }
        Ok(())
    }

    /// Prepares one VM's files and starts its QEMU (recorded first: no
    /// QEMU of ours runs unrecorded).
    fn launch(
        &mut self,
        launch: &Launch,
        vm_spec: &vmcsnap_spec::VmSpec,
        address: VmAddress,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), AgentError> {
        let spec = self.spec.clone();
        let dir = self.run.vm_dir(&vm_spec.name);
        std::fs::create_dir_all(&dir).map_err(AgentError::io("creating", &dir))?;
        let image = match vm_spec.kind() {
            vmcsnap_spec::GuestKind::Lab => None,
            vmcsnap_spec::GuestKind::Image(g) => Some((
                crate::image_vm::prepare(&spec, vm_spec, &g, &address, &dir, progress)?,
                g.machine,
            )),
        };
        let disk = match &image {
            Some((p, _)) => p.disks[0].path.clone(),
            None => {
                let disk = dir.join("data.qcow2");
                progress(&format!(
                    "{}: creating {} MiB data disk",
                    vm_spec.name, vm_spec.disk_mib
                ));
                vmcsnap_guest::make_data_disk(&disk, vm_spec.disk_mib, &vm_spec.name)?;
                disk
            }
        };
        let ram_file = self.run.shm_path(&spec.cluster.name, &vm_spec.name);
        let _ = std::fs::remove_file(&ram_file);
        let mut config = self.lab_config(launch, vm_spec, &address, &dir, ram_file, &disk)?;
        let port = plug(&self.switch, &vm_spec.name, &config.port_socket, &address)?;
        let mut kernel_release = crate::cpu_model::lab_kernel_release(&launch.assets.dir);
        if let Some((p, machine)) = image {
            kernel_release = p.kernel_release;
            config.machine = machine;
            config.kernel = p.kernel;
            config.initrd = p.initrd;
            config.cmdline = p.cmdline;
            config.disks = p.disks;
            config.image = Some(p.devices);
        }
        config.cpu =
            crate::cpu_model::choose(self.accel, launch.dialect, kernel_release.as_deref());
        let qemu_log = dir.join("qemu.log");
        crate::cluster_record::save(
            &self.run,
            self,
            &[crate::record::VmRecord::pending(
                &config, &qemu_log, address, &disk,
            )],
        )?;
        let vm = Vm::spawn(launch.qemu_bin, config, qemu_log)?;
        log(format!(
            "VM {}: started QEMU pid {} ({})",
            vm.name,
            vm.pid,
            self.accel.name()
        ));
        self.members.push(Member {
            vm,
            address,
            port,
            disk,
        });
        self.persist()
    }

    /// The QEMU configuration of a lab VM launched now (an image VM's
    /// devices replace its boot and disks).
    fn lab_config(
        &self,
        launch: &Launch,
        vm_spec: &vmcsnap_spec::VmSpec,
        address: &VmAddress,
        dir: &std::path::Path,
        ram_file: std::path::PathBuf,
        disk: &std::path::Path,
    ) -> Result<QemuConfig, AgentError> {
        let workload =
            self.spec
                .expand_workload(&vm_spec.name)
                .map_err(|source| AgentError::Spec {
                    path: "spec".into(),
                    source,
                })?;
        let mut config = QemuConfig {
            name: vm_spec.name.clone(),
            accel: self.accel,
            memory_mib: vm_spec.memory_mib,
            vcpus: vm_spec.vcpus,
            ram_file,
            machine: qemu::Machine::Microvm,
            cpu: None,
            kernel: Some(launch.assets.kernel.clone()),
            initrd: Some(launch.assets.initrd.clone()),
            cmdline: lab_cmdline(vm_spec, address, &workload)?,
            console_log: dir.join("console.log"),
            qmp_socket: dir.join("qmp.sock"),
            disks: vec![qemu::DiskConfig::qcow2(qemu::DISK_NODE, disk)],
            image: None,
            port_socket: dir.join("port.sock"),
            mac: address.mac_string(),
            incoming: false,
            paused: false,
            data_dir: None,
            module_dir: None,
            bios: None,
            ram_pad_kib: Some(0),
            microvm_pic: Some(false),
            cpr_ready: false,
            cpr_channel: None,
        };
        (config.data_dir, config.module_dir) = qemu::installation_dirs(launch.qemu_bin);
        Ok(config)
    }

    /// Waits until every member's guest is ready, or `timeout`.
    fn wait_ready(
        &mut self,
        timeout: Duration,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), AgentError> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut waiting = 0;
            for m in &mut self.members {
                let was = m.vm.boot_ms.is_some();
                if m.vm.poll_ready(vmcsnap_guest::READY_MARKER)? {
                    if !was {
                        let ms = m.vm.boot_ms.unwrap_or(0);
                        log(format!("VM {}: ready after {ms} ms", m.vm.name));
                        progress(&format!("{}: ready after {ms} ms", m.vm.name));
                    }
                } else {
                    waiting += 1;
                }
            }
            if waiting == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let m = self
                    .members
                    .iter()
                    .find(|m| m.vm.boot_ms.is_none())
                    .expect("one is waiting");
                return Err(AgentError::BootTimeout {
                    vm: m.vm.name.clone(),
                    secs: timeout.as_secs(),
                    console: last_lines(&m.vm.console_for_error(4000), 15),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A cluster with a switch and no VM yet (a restore without a cluster
    /// up adds its VM to it).
    pub fn empty(run: &RunDir, spec: ClusterSpec, accel: Resolved) -> Result<Cluster, AgentError> {
        let cluster_dir = run.cluster_dir();
        // Never take the files of a QEMU that still runs (a cluster whose
        // agent died and whose record is gone).
        let stray = crate::qemu_find::qemus_using(&cluster_dir);
        if !stray.is_empty() {
            return Err(AgentError::StrayQemu {
                dir: cluster_dir,
                pids: stray,
            });
        }
        if cluster_dir.exists() {
            // Left over from an earlier cluster of this run directory: only
            // logs remain there after a clean `down`.
            std::fs::remove_dir_all(&cluster_dir)
                .map_err(AgentError::io("removing", &cluster_dir))?;
        }
        let switch = Switch::start_with(switch_config())?;
        let host = match crate::host_port::start(run, spec.cluster.host_access, &switch) {
            Ok(h) => h,
            Err(e) => {
                switch.stop();
                return Err(e);
            }
        };
        Ok(Cluster {
            spec,
            accel,
            members: Vec::new(),
            switch,
            host,
            run: run.clone(),
        })
    }

    /// A cluster whose VMs a new agent adopts ([`crate::cluster_record::adopt`]):
    /// a fresh switch, and nothing in the cluster directory is touched.
    pub fn adopted(
        run: &RunDir,
        spec: ClusterSpec,
        accel: Resolved,
    ) -> Result<Cluster, AgentError> {
        let switch = Switch::start_with(switch_config())?;
        // The relay died with the old agent; the namespace is still there.
        let host =
            crate::host_port::start(run, spec.cluster.host_access, &switch).unwrap_or_else(|e| {
                log(format!("the host interface cannot be started again: {e}"));
                None
            });
        Ok(Cluster {
            spec,
            accel,
            members: Vec::new(),
            switch,
            host,
            run: run.clone(),
        })
    }

    /// Writes the durable record of the cluster's VMs (see [`crate::record`]).
    pub fn persist(&self) -> Result<(), AgentError> {
        crate::cluster_record::save(&self.run, self, &[])?;
        // A VM runs again where one was stopped: the record names it now.
        for m in &self.members {
            if let Some(dir) = m.vm.config.console_log.parent() {
                crate::vm_disks::unmark_stopped(dir);
            }
        }
        Ok(())
    }

    /// Stops one VM: its QEMU, RAM file, sockets and switch port go; its
    /// disk overlays and logs stay in its directory, marked so that no
    /// `gc` takes them (see `vm_disks`). The rest of the cluster runs on.
    pub fn stop_vm(&mut self, vm: &str) -> Result<(), AgentError> {
        let i = self
            .members
            .iter()
            .position(|m| m.vm.name == vm)
            .ok_or_else(|| AgentError::NoSuchVm(vm.to_string()))?;
        // Marked before it leaves the record: a crash in between leaves a
        // member with a stale mark (which the next `gc` removes), never a
        // stopped VM's disks unmarked.
        if let Some(dir) = self.members[i].vm.config.console_log.parent() {
            crate::vm_disks::mark_stopped(dir)?;
        }
        let mut m = self.members.remove(i);
        m.vm.shutdown();
        if let Err(e) = self.switch.remove_port(m.port) {
            log(format!("stop {vm}: removing its switch port: {e}"));
        }
        m.vm.config.remove_runtime_files();
        crate::intent::clear(&m.vm.config);
        log(format!("VM {vm}: stopped"));
        self.persist()
    }

    /// Reassembles a cluster (after an agent restart).
    pub fn from_parts(
        spec: ClusterSpec,
        accel: Resolved,
        members: Vec<Member>,
        switch: SwitchHandle,
        host: Option<crate::host_port::HostPort>,
        run: RunDir,
    ) -> Cluster {
        Cluster {
            spec,
            accel,
            members,
            switch,
            host,
            run,
        }
    }

    /// Takes a cluster apart without stopping anything (for an agent restart).
    #[allow(clippy::type_complexity)]
    pub fn into_parts(
        self,
    ) -> (
        ClusterSpec,
        Resolved,
        Vec<Member>,
        SwitchHandle,
        Option<crate::host_port::HostPort>,
        RunDir,
    ) {
        (
            self.spec,
            self.accel,
            self.members,
            self.switch,
            self.host,
            self.run,
        )
    }

    /// What `up` reports.
    pub fn up_result(&self) -> UpResult {
        UpResult {
            cluster: self.spec.cluster.name.clone(),
            vms: self
                .members
                .iter()
                .map(|m| VmUp {
                    name: m.vm.name.clone(),
                    pid: m.vm.pid,
                    boot_ms: m.vm.boot_ms.unwrap_or(0),
                    accel: self.accel.name().to_string(),
                    ip: m.address.cidr(),
                    mac: m.address.mac_string(),
                })
                .collect(),
        }
    }

    /// Per-VM state and the switch's counters.
    pub fn status(&mut self) -> StatusResult {
        let vms = self
            .members
            .iter_mut()
            .map(|m| VmStatus {
                name: m.vm.name.clone(),
                pid: m.vm.pid,
                state: m.vm.run_state(),
                ip: m.address.cidr(),
                mac: m.address.mac_string(),
                memory_mib: m.vm.config.memory_mib,
                uptime_s: m.vm.started.elapsed().as_secs_f64(),
                port: m.vm.name.clone(),
                load: None,
            })
            .collect();
        let switch = self.switch.stats().ok();
        StatusResult {
            cluster: Some(self.spec.cluster.name.clone()),
            accel: Some(self.accel.name().to_string()),
            agent_pid: std::process::id(),
            vms,
            switch,
            busy: None,
        }
    }

    /// The member named `vm`.
    pub fn member_mut(&mut self, vm: &str) -> Result<&mut Member, AgentError> {
        self.members
            .iter_mut()
            .find(|m| m.vm.name == vm)
            .ok_or_else(|| AgentError::NoSuchVm(vm.to_string()))
    }

    /// Restarts the QEMU of `vm` (or of every VM, in parallel) in `mode`.
    /// A VM whose restart fails is reported in the error; the others are
    /// still restarted.
    pub fn rejuvenate(
        &mut self,
        vm: Option<&str>,
        mode: crate::rejuvenate::Mode,
        qemu: Option<&std::path::Path>,
        fault: Option<crate::fault::RejuvenateFault>,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Vec<crate::rejuvenate::Report>, AgentError> {
        let qemu_bin = match qemu {
            Some(q) => q.to_path_buf(),
            None => qemu::find_qemu()?,
        };
        if let Some(name) = vm {
            self.member_mut(name)?;
        }
        let switch = self.switch.clone();
        let selected: Vec<&mut Member> = self
            .members
            .iter_mut()
            .filter(|m| vm.is_none_or(|n| m.vm.name == n))
            .collect();
        progress(&format!(
            "rejuvenating {} VM(s), mode {mode:?}",
            selected.len()
        ));
        let results: Vec<Result<crate::rejuvenate::Report, AgentError>> = std::thread::scope(|s| {
            let handles: Vec<_> = selected
                .into_iter()
                .map(|m| {
                    let (switch, qemu_bin) = (switch.clone(), qemu_bin.clone());
                    let name = m.vm.name.clone();
                    let h = s.spawn(move || {
                        crate::rejuvenate::rejuvenate(m, &switch, &qemu_bin, mode, fault)
                    });
                    (name, h)
                })
                .collect();
            // A restart that panics (a bug) is one VM's error: the others'
            // reports still count.
            handles
                .into_iter()
                .map(|(name, h)| {
                    h.join().unwrap_or_else(|p| {
                        Err(AgentError::BadRequest(format!(
                            "the agent hit a bug restarting VM {name}: {}",
                            crate::panic_message(p.as_ref())
                        )))
                    })
                })
                .collect()
        });
        let mut reports = Vec::new();
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(rep) => {
                    progress(&format!("{}: downtime {:.1} ms", rep.vm, rep.downtime_ms));
                    if let Some(reason) = &rep.fallback_reason {
                        progress(&format!(
                            "{}: the new QEMU failed ({reason}); the VM runs on the kept copy of its previous QEMU",
                            rep.vm
                        ));
                    }
                    reports.push(rep);
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        if !errors.is_empty() {
            return Err(AgentError::BadRequest(errors.join("; ")));
        }
        Ok(reports)
    }

    /// Starts again `vm` (or every VM) whose restart failed, from what the
    /// restart kept ([`crate::restart_recovery`]).
    pub fn recover(
        &mut self,
        vm: Option<&str>,
        how: crate::restart_recovery::How,
        qemu: Option<&std::path::Path>,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Vec<crate::restart_recovery::Recovered>, AgentError> {
        if let Some(name) = vm {
            let m = self.member_mut(name)?;
            return Ok(vec![crate::restart_recovery::recover(m, how, qemu)?]);
        }
        let mut stranded: Vec<&mut Member> = vec![];
        for m in self.members.iter_mut() {
            if m.vm.exited().is_some() && crate::intent::get(&m.vm.config).is_some() {
                stranded.push(m);
            }
        }
        if stranded.is_empty() {
            return Err(AgentError::BadRequest(
                "no VM of the cluster has a failed restart to resume or roll back".into(),
            ));
        }
        let mut done = vec![];
        let mut errors = vec![];
        for m in stranded {
            progress(&format!("starting {} again ({how:?})", m.vm.name));
            match crate::restart_recovery::recover(m, how, qemu) {
                Ok(r) => done.push(r),
                Err(e) => errors.push(e.to_string()),
            }
        }
        if !errors.is_empty() {
            return Err(AgentError::BadRequest(errors.join("; ")));
        }
        Ok(done)
    }

    /// Stops every QEMU, the switch, and removes sockets, RAM files and
    /// disks (every disk file of the VMs' directories: `vm_disks`). Console and QEMU logs stay in the cluster directory until the
    /// next `up`. Never fails; problems are logged.
    pub fn teardown(&mut self) {
        for m in &mut self.members {
            m.vm.shutdown();
        }
        crate::host_port::stop(
            &self.run,
            self.spec.cluster.host_access,
            self.host.take(),
            &self.switch,
            true,
        );
        self.switch.stop();
        for m in &self.members {
            m.vm.config.remove_runtime_files();
            crate::intent::clear(&m.vm.config);
            let _ = std::fs::remove_dir_all(crate::qemu_kept::dir_of(&m.vm.config));
            // Every disk the VM writes (its extra disks' overlays too).
            let writable = m.vm.config.disks.iter().filter(|d| !d.read_only);
            for disk in std::iter::once(&m.disk).chain(writable.map(|d| &d.path)) {
                if let Err(e) = std::fs::remove_file(disk) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        log(format!("teardown: cannot remove {}: {e}", disk.display()));
                    }
                }
            }
        }
        // Shared-memory files of VMs that never got as far as a member.
        for v in &self.spec.vm {
            let _ = std::fs::remove_file(self.run.shm_path(&self.spec.cluster.name, &v.name));
        }
        self.members.clear();
        // Every disk the VMs wrote: the current overlays (a snapshot's
        // `data-<ms>.qcow2`) and what they back on (see `vm_disks`), and
        // those of VMs stopped before.
        let removed = crate::vm_disks::remove_unused(
            &self.run.cluster_dir(),
            &[],
            crate::vm_disks::StoppedDisks::Remove,
        )
        .removed;
        if !removed.is_empty() {
            log(format!("teardown: removed the VMs' disks {removed:?}"));
        }
        crate::cluster_record::clear(&self.run);
    }
}

/// The lab guest's kernel command line, which carries its workload (base64,
/// so at most about 1.4 KB of it); empty for an image VM, whose command line
/// comes from its image and whose workload goes by fw_cfg, without that
/// limit (`image_vm`).
fn lab_cmdline(
    vm_spec: &vmcsnap_spec::VmSpec,
    address: &VmAddress,
    workload: &str,
) -> Result<String, AgentError> {
    if vm_spec.is_image() {
        return Ok(String::new());
    }
    Ok(vmcsnap_guest::try_kernel_cmdline(
        &vm_spec.name,
        &address.cidr(),
        workload,
    )?)
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    lines[start..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The environment variable naming a directory to capture every VM's
/// traffic into (docs/architecture.md, "Capturing the traffic").
pub const PCAP_DIR_ENV: &str = "VMCSNAP_PCAP_DIR";

/// The switch's settings: with `VMCSNAP_PCAP_DIR` set (in the agent's
/// environment, which the CLI's on-demand agent inherits), every frame of
/// every VM goes to `<dir>/<vm>.pcapng` as well.
pub fn switch_config() -> SwitchConfig {
    let capture_dir = std::env::var_os(PCAP_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .and_then(|d| match std::fs::create_dir_all(&d) {
            Ok(()) => {
                log(format!(
                    "capturing every VM's traffic into {} ({PCAP_DIR_ENV})",
                    d.display()
                ));
                Some(d)
            }
            Err(e) => {
                log(format!(
                    "{PCAP_DIR_ENV}={}: cannot create it, not capturing: {e}",
                    d.display()
                ));
                None
            }
        });
    // The switch answers DHCP for the cluster subnet (stock images ask for
    // their address); the lab guest's static address is the same one.
    let dhcp = vmcsnap_switch::DhcpConfig::default();
    SwitchConfig {
        capture_dir,
        dhcp: Some(dhcp),
        ..SwitchConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 29): `up` refused an image VM's 6 KB workload with
    /// "kernel command line would be 8155 bytes, the limit is 2047": the
    /// lab guest's command line was built for every VM.
    #[test]
    fn an_image_vms_workload_is_not_held_to_the_lab_command_line() {
        let workload = "echo 0123456789abcdef\n".repeat(300);
        assert!(workload.len() > 6000);
        let spec = |extra: &str| {
            let text = format!(
                "[cluster]\nname='c'\n[[vm]]\nname='w'\nmemory_mib=512\n{extra}workload = {workload:?}\n"
            );
            ClusterSpec::from_toml_str(&text, 64).unwrap()
        };
        let image = spec("image_recipe='base'\n");
        let address = image.addressing()[0];
        let w = image.expand_workload("w").unwrap();
        assert_eq!(w, workload);
        assert_eq!(lab_cmdline(&image.vm[0], &address, &w).unwrap(), "");
        // The lab guest still has the limit, and says so.
        let lab = spec("");
        let e = lab_cmdline(&lab.vm[0], &address, &w)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the limit is 2047"), "{e}");
    }
}
