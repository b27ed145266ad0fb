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

use super::page_source::{self, Ended, SourceJob};
use super::run::{fail, saved_vm, Report};
use super::{feed, finish};
use crate::cluster::{Cluster, Member};
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
    let pid = crate::record::find_qemu(job.member.pid, &job.member.config.qmp_socket)?;
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
fn join(
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
    let port = crate::cluster::plug(&c.switch, &name, &rec.config.port_socket, &rec.address)?;
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
    let name = job.member.config.name.clone();
    join(run, cluster, job, qemu_pid)?;
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
