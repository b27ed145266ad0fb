//! The restore itself: see the module docs of [`crate::restore`].

use std::path::Path;
use std::time::{Instant, SystemTime};

use vmcsnap_image::Image;
use vmcsnap_spec::ClusterSpec;
use vmcsnap_workingset::{self as ws, Mode};

use super::feed::feed;
use super::job::{
    fail, unix_us, Job, Options, Planned, Report, RestoreEvent, Saved, WssChoice, LOCALITY_WINDOW,
};
use super::pages::image_order;
use super::ws_inputs;
use crate::cluster::Cluster;
use crate::member::Member;
use crate::qemu;
use crate::stored_config::{StoredConfigError, StoredVmConfig};
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// What the snapshot `img` (named `snapshot` in errors) records of its VM.
pub fn saved_vm(img: &Image, snapshot: &str) -> Result<Saved, AgentError> {
    let bad = |e: StoredConfigError| AgentError::BadRequest(format!("snapshot {snapshot:?} {e}"));
    let c = StoredVmConfig::from_manifest(img.manifest()).map_err(bad)?;
    Ok(Saved {
        spec: c.spec().map_err(bad)?.clone(),
        address: c.address().map_err(bad)?,
        qemu: c.qemu,
        cluster: c.cluster,
    })
}

/// Restores `opts.snapshot` into `cluster` (creating a cluster of its own
/// if none is up).
///
/// With `early`, the request answers once the guest runs (see
/// [`crate::loading`]) and this goes on until every page is loaded.
pub fn restore(
    cluster: &mut Option<Cluster>,
    run: &RunDir,
    opts: Options,
    early: Option<&crate::loading::Ctx<'_>>,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, AgentError> {
    let request_us = unix_us(SystemTime::now());
    let root = run.snapshots_dir();
    let dir = root.join(&opts.snapshot);
    if !vmcsnap_image::manifest::is_plain_name(&opts.snapshot) || !dir.join("manifest").is_file() {
        return Err(AgentError::BadRequest(format!(
            "no snapshot named {:?} in {} (see `vmcsnap snapshots`)",
            opts.snapshot,
            root.display()
        )));
    }
    let img = crate::frozen_disks::open_image(&dir)
        .map_err(|e| AgentError::BadRequest(format!("snapshot {:?}: {e}", opts.snapshot)))?;
    let saved = saved_vm(&img, &opts.snapshot)?;
    let name = saved.qemu.name.clone();
    if let Some(c) = cluster.as_ref() {
        if c.members.iter().any(|m| m.vm.name == name) {
            return Err(AgentError::BadRequest(format!(
                "VM {name:?} is running in cluster {:?}: stop it first (`vmcsnap stop {name}`)",
                c.spec.cluster.name
            )));
        }
    }
    // Will it fit? Checked before anything is created.
    let cluster_name = cluster
        .as_ref()
        .map_or(&saved.cluster.name, |c| &c.spec.cluster.name);
    let demand =
        crate::capacity::demand(run, cluster_name, [(name.as_str(), saved.qemu.memory_mib)]);
    crate::capacity::ensure(crate::capacity::Start::Restore(&name), &demand, run)?;
    // The cluster to join.
    let created = cluster.is_none();
    if created {
        let spec = ClusterSpec {
            cluster: saved.cluster.clone(),
            vm: vec![saved.spec.clone()],
        };
        *cluster = Some(Cluster::empty(run, spec, saved.qemu.accel)?);
    }
    let c = cluster.as_mut().expect("set above");
    // Should the agent die before this restore ends, the next one redoes it.
    if let Err(e) = crate::restore_journal::begin(
        run,
        &crate::restore_journal::Restoring::Vm {
            snapshot: opts.snapshot.clone(),
            vm: name.clone(),
        },
    ) {
        if created {
            if let Some(mut c) = cluster.take() {
                c.teardown();
            }
        }
        return Err(e);
    }
    let (result, early_clock) = match early {
        None => (
            restore_into(
                &c.switch.clone(),
                &c.spec.cluster.name.clone(),
                run,
                &opts,
                &dir,
                progress,
            ),
            None,
        ),
        Some(ctx) => {
            let shown = super::early::Shown::of(c, run, &saved, request_us);
            super::early::answering(ctx, shown, opts.clone(), |opts| {
                restore_into(
                    &c.switch.clone(),
                    &c.spec.cluster.name.clone(),
                    run,
                    opts,
                    &dir,
                    progress,
                )
            })
        }
    };
    crate::restore_journal::end(run);
    // Only now: should this agent die before the journal's end, the next
    // one finishes the restore from the page source's files.
    let _ = std::fs::remove_dir_all(super::page_source::dir_of(&run.vm_dir(&name)));
    match result {
        Ok((member, mut report)) => {
            // A restore that answered early set the clock as its guest
            // started; the others do it now.
            report.clock = Some(
                early_clock
                    .unwrap_or_else(|| crate::guest_clock::sync(&member.vm.config, opts.paused)),
            );
            if !c.spec.vm.iter().any(|v| v.name == name) {
                c.spec.vm.push(saved.spec.clone());
            }
            c.members.push(member);
            Ok(report)
        }
        Err(e) => {
            if created {
                if let Some(mut c) = cluster.take() {
                    c.teardown();
                }
            }
            Err(e)
        }
    }
}

/// Restores the snapshot in `dir` as a new VM on `switch`, in the cluster
/// named `cluster_name`; returns the member to add to the cluster. Can run
/// in several threads at once (a cluster restore).
pub fn restore_into(
    switch: &vmcsnap_switch::SwitchHandle,
    cluster_name: &str,
    run: &RunDir,
    opts: &Options,
    dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(Member, Report), AgentError> {
    let t0 = Instant::now();
    let t0_wall = SystemTime::now();
    let img = crate::frozen_disks::open_image(dir)
        .map_err(|e| AgentError::BadRequest(format!("snapshot {:?}: {e}", opts.snapshot)))?;
    let saved = saved_vm(&img, &opts.snapshot)?;
    let name = saved.qemu.name.clone();
    let qemu_bin = qemu::find_qemu()?;
    let qemu_img = qemu::find_qemu_img()?;
    // Before anything starts: can this QEMU load the snapshot's stream?
    let dialect = check_versions(&img, &opts.snapshot, &qemu_bin)?;
    check_preempt(opts.preempt, dialect)?;
    // Every writable disk from its own frozen copy, never a live file.
    let frozen = crate::disk_set::frozen_for(&saved.qemu, &img.manifest().disks)
        .map_err(|e| fail(&name, e))?;
    if let Some(f) = frozen.iter().find(|f| !f.path.is_file()) {
        return Err(fail(
            &name,
            format!("its frozen disk {} is gone", f.path.display()),
        ));
    }
    let planned = plan(&img, opts, dir)?;
    // In a cluster restore every VM would say the same about the assets.
    let assets = if opts.cluster.is_some() {
        vmcsnap_guest::ensure_assets(&vmcsnap_guest::default_cache_root(), &mut |_| {})?
    } else {
        vmcsnap_guest::ensure_assets(&vmcsnap_guest::default_cache_root(), progress)?
    };
    let job = Job {
        opts,
        img: &img,
        snap_dir: dir,
        saved,
        qemu_bin,
        dialect,
        qemu_img,
        frozen,
        assets,
        planned,
        t0,
        t0_wall,
    };
    let (member, report) = start_and_feed(switch, cluster_name, run, &job, progress)?;
    log(format!(
        "restore {} of {name} ({}): latency {:.1} ms, {} pages before start, {} demand faults, full load {:.1} ms",
        opts.snapshot,
        opts.mode.name(),
        report.restore_latency_ms,
        report.ws_pages,
        report.demand_faults,
        report.full_load_ms
    ));
    Ok((member, report))
}

/// The release of `bin`, if it can load the stream of the snapshot in
/// `img` ([`super::versions`]); otherwise one error naming both versions.
pub fn check_versions(
    img: &Image,
    snapshot: &str,
    bin: &Path,
) -> Result<vmcsnap_migstream::Dialect, AgentError> {
    let taken = &img.manifest().qemu.version;
    let bad = |e: super::versions::VersionError| AgentError::BadRequest(e.to_string());
    let into = super::versions::binary_version(snapshot, bin).map_err(bad)?;
    let d = super::versions::check(snapshot, taken, &into, bin).map_err(bad)?;
    if release_differs(taken, d) {
        log(format!(
            "restore {snapshot}: taken under QEMU {taken}, restored into QEMU {into} ({})",
            bin.display()
        ));
    }
    Ok(d)
}

/// A restore that asks for the postcopy-preempt channel needs a release
/// that has one vmcsnap speaks ([`vmcsnap_migstream::Dialect::postcopy_preempt`]).
fn check_preempt(preempt: bool, dialect: vmcsnap_migstream::Dialect) -> Result<(), AgentError> {
    if preempt && !dialect.postcopy_preempt() {
        return Err(AgentError::BadRequest(format!(
            "--preempt needs QEMU 10.0 (its postcopy-preempt channel), but this restore would run {dialect}: restore without --preempt, or name a QEMU 10.0 binary with VMCSNAP_QEMU"
        )));
    }
    Ok(())
}

fn release_differs(taken: &str, into: vmcsnap_migstream::Dialect) -> bool {
    super::versions::release_of(taken) != Some(into)
}

/// The working-set size a `workingset` restore of the snapshot in `dir`
/// asks for (pages), before any revision: what the newest earlier restore
/// learned, else HotRestore's hybrid size.
pub fn hybrid_size(dir: &Path) -> Result<u64, AgentError> {
    let img = crate::frozen_disks::open_image(dir)
        .map_err(|e| AgentError::BadRequest(format!("snapshot {}: {e}", dir.display())))?;
    Ok(ws_inputs::read(&img, dir).auto_size(Mode::Workingset))
}

fn plan(img: &Image, opts: &Options, dir: &Path) -> Result<Planned, AgentError> {
    let bad = |e: String| AgentError::BadRequest(format!("snapshot {:?}: {e}", opts.snapshot));
    let order = image_order(img).map_err(|e| bad(e.to_string()))?;
    let block_pages: Vec<u32> = (0..img.ram_blocks().len() as u32)
        .map(|b| img.ram_block_pages(b))
        .collect();
    let inputs = ws_inputs::read(img, dir);
    let wss = match opts.wss {
        WssChoice::Auto => inputs.auto_size(opts.mode),
        WssChoice::Pages(n) => n,
    };
    let mut queue = inputs.queue(opts.mode);
    if opts.mode == Mode::Workingset {
        // No host kernel told which pages the guest reads: the rest of the
        // size goes to the pages around those it wrote (zero pages cost
        // nothing on demand and are left out).
        let target = usize::try_from(wss).unwrap_or(usize::MAX);
        ws::fill_by_locality(&mut queue, &block_pages, target, LOCALITY_WINDOW, |k| {
            matches!(img.resolve(k), Ok((_, vmcsnap_image::PageState::Stored(_))))
        });
    }
    let input = ws::PlanInput {
        block_pages: &block_pages,
        image_order: &order,
        queue: &queue,
        wss,
        wss_sample: inputs.wss_sample,
    };
    let plan = ws::make_plan(opts.mode, &input).map_err(|e| bad(e.to_string()))?;
    let hybrid = inputs.hybrid();
    Ok(Planned {
        plan,
        queue,
        wss,
        hybrid,
        wss_sample: inputs.wss_sample,
        wss_snapshot: inputs.wss_snapshot,
        learned: inputs.learned.is_some() && opts.mode == Mode::Workingset,
        access: inputs.access,
    })
}

fn start_and_feed(
    switch: &vmcsnap_switch::SwitchHandle,
    cluster_name: &str,
    run: &RunDir,
    job: &Job,
    progress: &mut dyn FnMut(&str),
) -> Result<(Member, Report), AgentError> {
    let Job {
        opts,
        img,
        saved,
        assets,
        ..
    } = job;
    let name = saved.qemu.name.clone();
    let dir = run.vm_dir(&name);
    std::fs::create_dir_all(&dir).map_err(AgentError::io("creating", &dir))?;
    let stamp = crate::unix_ms(SystemTime::now());
    // Each frozen chain is hard-linked into a directory of the VM's own
    // (`super::disks`).
    let disk_dir = dir.join(format!("disk-{stamp}"));
    std::fs::create_dir_all(&disk_dir).map_err(AgentError::io("creating", &disk_dir))?;
    let overlays = super::disks::prepare(&job.qemu_img, &job.frozen, &disk_dir, stamp)
        .map_err(|e| fail(&name, e))?;
    let overlay = overlays
        .first()
        .map(|o| o.1.clone())
        .ok_or_else(|| fail(&name, "the snapshot's VM has no writable disk"))?;
    let mut config = saved.qemu.clone();
    config.ram_file = run.shm_path(cluster_name, &name);
    let _ = std::fs::remove_file(&config.ram_file);
    if let Some(dev) = config.image.as_mut() {
        // An image VM keeps its own kernel (if any) and the seed and
        // workload its snapshot froze; its ports move to the new directory.
        dev.qga_socket = dir.join("qga.sock");
        dev.events_log = dir.join("events.log");
    } else {
        config.kernel = Some(assets.kernel.clone());
        config.initrd = Some(assets.initrd.clone());
    }
    config.console_log = dir.join("console.log");
    config.qmp_socket = dir.join("qmp.sock");
    config.port_socket = dir.join("port.sock");
    for (node, o) in &overlays {
        if let Some(d) = config.disk_mut(node) {
            d.path = o.clone();
        }
    }
    config.incoming = true;
    // A cluster restore starts its guests on START (`cont`).
    config.paused = opts.paused || opts.cluster.is_some();
    (config.data_dir, config.module_dir) = qemu::installation_dirs(&job.qemu_bin);
    // The firmware the snapshot recorded, whatever this QEMU ships.
    config.bios = super::firmware::write_from_image(img, &dir).map_err(|e| fail(&name, e))?;
    let mem = img
        .ram_block_id("mem")
        .map(|b| img.ram_blocks()[b as usize].used_length);
    // The RAM the snapshot had, padding included (VMs launched under TCG
    // before the padding was dropped have 8 KiB more than `memory_mib`).
    if let Some(pad) = mem.and_then(|m| ram_pad_kib_of(m, config.memory_mib)) {
        config.ram_pad_kib = Some(pad);
    }
    if mem != Some(config.ram_kib() * 1024) {
        let _ = std::fs::remove_file(&overlay);
        return Err(fail(&name, format!(
            "the image's RAM block \"mem\" has {mem:?} bytes but this VM would get {} ({} accelerator): restore on a host like the one the snapshot was taken on",
            config.ram_kib() * 1024,
            config.accel.name()
        )));
    }
    let port = crate::member::plug(switch, &name, &config.port_socket, &saved.address)?;
    if let Some(c) = &opts.cluster {
        let _ = c.events.send(RestoreEvent::PortReady(port));
    }
    let mut vm = match Vm::spawn(&job.qemu_bin, config.clone(), dir.join("qemu.log")) {
        Ok(vm) => vm,
        Err(e) => {
            let _ = switch.remove_port(port);
            let _ = std::fs::remove_file(&overlay);
            return Err(e);
        }
    };
    progress(&format!(
        "{name}: restoring {} ({}), QEMU pid {}",
        opts.snapshot,
        opts.mode.name(),
        vm.pid
    ));
    // Not before QEMU has accepted the switch's connection (QEMU 7.2
    // crashes starting a guest before: `Vm::wait_nic_accepted`).
    if let Err(e) = vm.wait_nic_accepted() {
        log(format!("VM {name}: asking QEMU about its NIC: {e}"));
    }
    let mut record =
        crate::record::VmRecord::pending(&vm.config, &vm.qemu_log, saved.address, &overlay);
    record.pid = Some(vm.pid);
    match feed(&mut vm, job, record, progress) {
        Ok(mut report) => {
            report.overlay = overlay.clone();
            let member = Member {
                vm,
                address: saved.address,
                port,
                disk: overlay,
            };
            Ok((member, report))
        }
        Err(e) => {
            // What QEMU says of it, while it can (an abandoned restore is
            // no failure of its own: nothing to explain).
            let evidence = (!matches!(e, AgentError::Abandoned { .. }))
                .then(|| super::postmortem::gather(&mut vm));
            // A QEMU that exited by itself says why in its log (e.g. a
            // stream it rejected) or the guest's console (e.g. a panic).
            // (Unless this restore stopped it: an abandoned one.)
            let e = match vm.exited() {
                Some(status) if !matches!(e, AgentError::Abandoned { .. }) => {
                    let mut detail = match &e {
                        AgentError::Restore { detail, .. } => detail.clone(),
                        e => e.to_string(),
                    };
                    detail += &format!("; QEMU exited ({status})");
                    let log = crate::vm::tail(&vm.qemu_log, 1500);
                    if !log.trim().is_empty() {
                        detail += &format!("; its log ends:\n{}\n", log.trim_end());
                    }
                    // Only what this QEMU printed: the console log goes on
                    // from the VM's earlier incarnations (its boot, earlier
                    // restores), whose lines would mislead here.
                    detail += &match vm.console_since_start(1500) {
                        Some(c) => format!("; the guest console ends:\n{}\n", c.trim_end()),
                        None => format!("; {}", crate::vm::CONSOLE_EMPTY),
                    };
                    fail(&name, detail)
                }
                _ => e,
            };
            log(format!(
                "restore of {name} failed, discarding its QEMU: {e}"
            ));
            // Its state is worthless, and a postcopy destination whose
            // source is gone does not quit on request (7 s of QMP timeout
            // and grace for nothing).
            vm.discard("its restore failed, its state is worthless");
            let e = match evidence {
                Some(ev) => keep_postmortem(run, &mut vm, ev, e),
                None => e,
            };
            let _ = switch.remove_port(port);
            config.remove_runtime_files();
            let _ = std::fs::remove_file(&overlay);
            Err(e)
        }
    }
}

/// Keeps what explains the failed restore of `vm` ([`super::postmortem`])
/// and names where in the error.
fn keep_postmortem(
    run: &RunDir,
    vm: &mut Vm,
    evidence: super::postmortem::Evidence,
    e: AgentError,
) -> AgentError {
    let mut detail = match &e {
        AgentError::Restore { detail, .. } => detail.clone(),
        e => e.to_string(),
    };
    // A QEMU that was still running when the restore failed (one that
    // exited is quoted above) may have said why, e.g. a postcopy
    // destination that paused on an error of its own.
    if let Some(status) = evidence.migration_status() {
        detail += &format!("; QEMU was still running (migration {status})");
        let log = crate::vm::tail(&vm.qemu_log, 1500);
        if !log.trim().is_empty() {
            detail += &format!(", its log ends:\n{}\n", log.trim_end());
        }
    }
    match super::postmortem::keep(run, vm, evidence, &detail) {
        Ok(dir) => {
            detail += &format!(
                "; kept for its post-mortem in {}: QEMU's stderr (qemu-stderr.log), its last QMP events and migration state (qmp.json), the guest console (console.log)",
                dir.display()
            );
            fail(&vm.name, detail)
        }
        Err(err) => {
            log(format!(
                "VM {}: cannot keep the failed restore's post-mortem in {}: {err}",
                vm.name,
                run.root().join(super::postmortem::DIR).display()
            ));
            e
        }
    }
}

/// The KiB a snapshot's RAM block of `ram_bytes` has beyond `memory_mib`
/// (`QemuConfig::ram_pad_kib`), if it is a plausible padding: whole KiB,
/// at most 1 MiB. Anything else is left to the size check, which names it.
fn ram_pad_kib_of(ram_bytes: u64, memory_mib: u64) -> Option<u64> {
    let pad = ram_bytes.checked_sub(memory_mib.checked_mul(1 << 20)?)?;
    (pad % 1024 == 0 && pad <= 1 << 20).then_some(pad / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::job::{Quality, Spread};

    #[test]
    fn a_snapshot_keeps_the_ram_padding_it_was_taken_with() {
        let mib = 1u64 << 20;
        assert_eq!(ram_pad_kib_of(256 * mib, 256), Some(0));
        assert_eq!(ram_pad_kib_of(256 * mib + 8192, 256), Some(8), "old TCG VM");
        assert_eq!(ram_pad_kib_of(255 * mib, 256), None, "smaller");
        assert_eq!(ram_pad_kib_of(256 * mib + 100, 256), None, "not whole KiB");
        assert_eq!(ram_pad_kib_of(300 * mib, 256), None, "another VM's");
        assert_eq!(ram_pad_kib_of(0, u64::MAX), None);
    }

    #[test]
    fn quality_ratios() {
        let q = Quality::new(500.0, 100, 80, 20);
        assert!((q.hit_rate - 0.8).abs() < 1e-9 && (q.accuracy - 0.8).abs() < 1e-9);
        let q = Quality::new(500.0, 100, 150, 0);
        assert_eq!(q.used, 100, "never more used than loaded");
        let q = Quality::new(0.0, 0, 0, 0);
        assert_eq!((q.hit_rate, q.accuracy), (0.0, 0.0));
    }

    #[test]
    fn spread_is_nearest_rank() {
        assert_eq!(Spread::of(&[]), None);
        let s = Spread::of(&[3.0]).unwrap();
        assert_eq!((s.p50, s.p90, s.max), (3.0, 3.0, 3.0));
        let v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let s = Spread::of(&v).unwrap();
        assert_eq!((s.p50, s.p90, s.max), (5.0, 9.0, 10.0));
    }

    #[test]
    fn preempt_is_refused_on_qemu_7_2_naming_the_way_out() {
        use vmcsnap_migstream::Dialect;
        assert!(check_preempt(false, Dialect::Qemu7_2).is_ok());
        assert!(check_preempt(true, Dialect::Qemu10_0).is_ok());
        let e = check_preempt(true, Dialect::Qemu7_2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("QEMU 10.0") && e.contains("without --preempt"),
            "{e}"
        );
    }
}
