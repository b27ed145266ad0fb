//! A new agent taking over the restore of one VM whose agent died while
//! its page source ([`super::page_source`]) served on.
//!
//! ```text
//!  restoring.json (Vm) ─▶ page-source/job.json, source running or done,
//!                         QEMU alive?
//!     yes ─▶ the VM joins the cluster (one made from the snapshot if none
//!            was recorded), its NIC on the new switch; the record is
//!            written; wait for the source's result; finish the restore
//!            (report, quality if the start was observed, the record of what
//!            it learned) ─▶ journal ends
//!     no  ─▶ the restore is redone (crate::restore_journal)
//! ```
//!
//! The guest never stops: it ran on its page source all along.

use std::time::{Duration, UNIX_EPOCH};

use vmcsnap_spec::ClusterSpec;

use super::control::Control;
use super::job::{fail, Report};
use super::page_source::{self, Ended, SourceJob};
use super::run::saved_vm;
use super::{feed, finish};
use crate::cluster::Cluster;
use crate::member::Member;
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// A restore of `vm` that can be adopted: its job, and its QEMU's pid.
pub fn adoptable(run: &RunDir, vm: &str) -> Option<(SourceJob, u32)> {
    let dir = page_source::dir_of(&run.vm_dir(vm));
    let job = page_source::read_job(&dir).ok()??;
    let serving = page_source::running(&dir).is_some()
        || matches!(page_source::read_result(&dir), Ok(Some(Ended::Done(_))));
    if !serving {
        return None;
    }
    let pid = crate::qemu_find::find_qemu(job.member.pid, &job.member.config.qmp_socket)?;
    Some((job, pid))
}

/// Kills the page source of `vm`, if one runs, and waits until it is gone
/// (a restore about to be redone must not share its directory with it).
pub fn stop_page_source(run: &RunDir, vm: &str) {
    let dir = page_source::dir_of(&run.vm_dir(vm));
    for _ in 0..250 {
        let Some(pid) = page_source::running(&dir) else {
            break;
        };
        log(format!(
            "VM {vm}: killing the page source pid {pid} of a restore"
        ));
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).expect("a pid is positive"),
            rustix::process::Signal::KILL,
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Makes the restored VM of `job` (QEMU `qemu_pid`) a member of `cluster`,
/// creating the cluster from the snapshot if none was recorded.
pub fn join(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    job: &SourceJob,
    qemu_pid: u32,
) -> Result<(), AgentError> {
    let rec = &job.member;
    let name = rec.config.name.clone();
    let img = crate::frozen_disks::open_image(&job.finish.snap_dir)
        .map_err(|e| fail(&name, format!("its snapshot: {e}")))?;
    let saved = saved_vm(&img, &job.finish.snapshot)?;
    if cluster.is_none() {
        let spec = ClusterSpec {
            cluster: saved.cluster.clone(),
            vm: vec![],
        };
        *cluster = Some(Cluster::adopted(run, spec, saved.qemu.accel)?);
    }
    let c = cluster.as_mut().expect("set above");
    if !c.spec.vm.iter().any(|v| v.name == name) {
        c.spec.vm.push(saved.spec.clone());
    }
    if c.members.iter().any(|m| m.vm.name == name) {
        // Recorded by an agent that adopted it before and died too.
        return Ok(());
    }
    let port = crate::member::plug(&c.switch, &name, &rec.config.port_socket, &rec.address)?;
    let started_at = UNIX_EPOCH + Duration::from_millis(rec.started_unix_ms);
    log(format!(
        "VM {name}: adopting QEMU pid {qemu_pid} of a restore"
    ));
    let vm = Vm::adopt(
        rec.config.clone(),
        qemu_pid,
        started_at,
        None,
        rec.qemu_log.clone(),
    );
    c.members.push(Member {
        vm,
        address: rec.address,
        port,
        disk: rec.disk.clone(),
    });
    c.persist()
}

/// Adopts the restore of `job` (see the module docs) and finishes it once
/// its page source ends. `note` is told (with the cluster) once the VM is a
/// member and the wait begins.
pub fn adopt(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    job: &SourceJob,
    qemu_pid: u32,
    note: &mut dyn FnMut(&mut Option<Cluster>, &str),
) -> Result<Report, AgentError> {
    join(run, cluster, job, qemu_pid)?;
    finish_adopted(run, cluster, job, note)
}

/// Waits for the page source of the adopted VM of `job` (a member of
/// `cluster` already) to end, and finishes its restore.
pub fn finish_adopted(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    job: &SourceJob,
    note: &mut dyn FnMut(&mut Option<Cluster>, &str),
) -> Result<Report, AgentError> {
    let name = job.member.config.name.clone();
    let dir = page_source::dir_of(&run.vm_dir(&name));
    let source = page_source::running(&dir);
    note(
        cluster,
        &match source {
            Some(pid) => format!("VM {name} runs; its page source (pid {pid}) loads its pages"),
            None => format!("VM {name} runs; its page source has ended"),
        },
    );
    let out = match page_source::wait_ended(&dir) {
        Ended::Done(out) => out,
        Ended::Failed { detail, .. } => {
            return Err(fail(
                &name,
                format!("its page source failed after the agent died: {detail}"),
            ))
        }
    };
    let mut obs = page_source::read_observed(&dir);
    if obs.latency_ms.is_none() {
        // Its agent died before it saw the guest start: the report's
        // latency is then when RUN was sent, if that was seen.
        log(format!(
            "restore of {name}: its start was not observed; the report's latency is RUN sent"
        ));
        obs.latency_ms = Some(obs.run_sent_ms.unwrap_or(0.0));
    }
    let member = cluster
        .as_mut()
        .ok_or_else(|| fail(&name, "its cluster is gone"))?
        .member_mut(&name)?;
    // The counters now: later than the full load by at most the poll of
    // `wait_ended` (20 ms), or by the time this agent took to start.
    let at_full_load = obs
        .at_start
        .and_then(|_| finish::ram_use_now(member.vm.pid, &member.vm.config.ram_file));
    feed::wait_completed(&mut member.vm)?;
    let mut report = finish::report(&finish::Finishing {
        vm: &name,
        job: &job.finish,
        obs: &obs,
        out: &out,
        at_full_load,
    })?;
    report.overlay = job.member.disk.clone();
    log(format!(
        "restore {} of {name} ({}) finished after an agent crash: latency {:.1} ms, {} demand faults, full load {:.1} ms",
        report.snapshot,
        report.mode.name(),
        report.restore_latency_ms,
        report.demand_faults,
        report.full_load_ms
    ));
    Ok(report)
}

/// Where an adopted VM of a cluster restore is on its way to running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiting {
    /// Its guest runs (its agent sent START's `cont`).
    Running,
    /// Loaded, paused, waiting for START.
    ForStart,
}

/// How long QEMU may still take to load the device state of a VM whose
/// agent died while it did.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the adopted `vm` is: waits while QEMU still loads the device state
/// (its page source sent RUN, or will).
pub fn waiting(vm: &mut Vm) -> Result<Waiting, AgentError> {
    let t = std::time::Instant::now();
    loop {
        let st = vm.execute("query-status", serde_json::Value::Null)?;
        match st["status"].as_str().unwrap_or("") {
            "running" => return Ok(Waiting::Running),
            "inmigrate" if t.elapsed() < PREPARE_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20))
            }
            "inmigrate" => {
                return Err(fail(
                    &vm.name,
                    format!("QEMU did not load the device state within {PREPARE_TIMEOUT:?}"),
                ))
            }
            "paused" | "prelaunch" => return Ok(Waiting::ForStart),
            other => {
                return Err(fail(
                    &vm.name,
                    format!("its QEMU is {other:?}, neither running nor waiting for START"),
                ))
            }
        }
    }
}

/// START for an adopted VM that waited for it, as its agent would have
/// given it: the background push held for the start's quiet time, `cont`.
/// [`started`] then records the start.
pub fn start(vm: &mut Vm, job: &SourceJob, run: &RunDir) -> Result<(), AgentError> {
    let dir = page_source::dir_of(&run.vm_dir(&vm.name));
    let mut obs = page_source::read_observed(&dir);
    obs.start_received_ms = Some(ms_since(job.finish.t0_unix_us));
    page_source::write_observed(&dir, &obs);
    let _ = page_source::start(&dir, &mut Control::new(&dir), job.plan.start_quiet_ms);
    vm.execute("cont", serde_json::Value::Null)?;
    Ok(())
}

/// Records the start of a VM [`start`]ed by this agent, once its guest
/// runs: when (RESUME), the accessed-bit counters then, and what its page
/// source had loaded by then.
pub fn started(vm: &mut Vm, job: &SourceJob, run: &RunDir) -> Result<(), AgentError> {
    let dir = page_source::dir_of(&run.vm_dir(&vm.name));
    let ev = vm.qmp()?.wait_event("RESUME", Duration::from_secs(60));
    let resumed_us = match ev {
        Ok(e) => e.timestamp_us,
        Err(e) => {
            // The event may have come before this connection listened.
            if waiting(vm)? != Waiting::Running {
                return Err(fail(&vm.name, format!("the guest did not start: {e}")));
            }
            super::job::unix_us(std::time::SystemTime::now())
        }
    };
    let mut obs = page_source::read_observed(&dir);
    if crate::accessed::clear(vm.pid).is_ok() {
        obs.at_start = finish::ram_use_now(vm.pid, &vm.config.ram_file);
    }
    obs.latency_ms = Some(resumed_us.saturating_sub(job.finish.t0_unix_us) as f64 / 1000.0);
    if let Some(n) = page_source::counters(&dir, &mut Control::new(&dir)) {
        (obs.bytes_before, obs.pages_before) = (n.bytes_read, n.pages_read);
    }
    page_source::write_observed(&dir, &obs);
    vm.config.paused = false;
    Ok(())
}

fn ms_since(t0_unix_us: u64) -> f64 {
    super::job::unix_us(std::time::SystemTime::now()).saturating_sub(t0_unix_us) as f64 / 1000.0
}
