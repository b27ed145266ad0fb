//! A new agent taking over a cluster restore whose agent died while the
//! VMs' page sources (processes of their own: `crate::restore::page_source`)
//! served on.
//!
//! ```text
//!  restoring.json (Cluster) ─▶ every VM: page-source/job.json, its source
//!                              running or done, its QEMU alive?
//!     no  ─▶ redone, eager-rl (crate::restore_journal)
//!     yes ─▶ every VM joins the cluster, its NIC on the new switch
//!            ─▶ VMs still waiting for START (the agent died before the
//!               Coordinator's START reached them, or while QEMU loaded their
//!               device state): their frames logged at the cut queued
//!               again, START given to all of them together (background
//!               held for the quiet time, `cont`)
//!            ─▶ each VM's restore finished as its page source ends (report,
//!               the record of what it learned) ─▶ journal ends
//! ```
//!
//! The Coordinator's order of starts died with the agent: the VMs that had
//! not got START start together, as a ring would (each one's peers then run
//! by the time it sends to them, give or take the `cont`s of the others),
//! rather than the restore failing with guests that already run (their work
//! would be lost). No VM is left paused: one that cannot be started makes
//! the adoption fail, and the restore is then redone (every QEMU of it
//! killed first).

use std::collections::HashMap;
use std::path::Path;

use crate::cluster::Cluster;
use crate::restore::adopt::{self as vm_adopt, Waiting};
use crate::restore::page_source::SourceJob;
use crate::{log, AgentError, RunDir};

/// Every VM's restore, if every one can be adopted (see the module docs):
/// its job and its QEMU's pid.
pub fn adoptable(run: &RunDir, vms: &[String]) -> Option<Vec<(SourceJob, u32)>> {
    vms.iter().map(|vm| vm_adopt::adoptable(run, vm)).collect()
}

/// Adopts the cluster restore of `snapshot` whose VMs' restores are `jobs`
/// (see the module docs). `note` is told what happens.
pub fn adopt(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    snapshot: &str,
    jobs: &[(SourceJob, u32)],
    note: &mut dyn FnMut(&mut Option<Cluster>, &str),
) -> Result<(), AgentError> {
    for (job, pid) in jobs {
        vm_adopt::join(run, cluster, job, *pid)?;
    }
    let waiting = start_waiting(run, cluster, snapshot, jobs)?;
    if !waiting.is_empty() {
        note(
            cluster,
            &format!("VMs {} were waiting for START: started", waiting.join(", ")),
        );
    }
    let mut faults = 0;
    for (job, _) in jobs {
        let r = vm_adopt::finish_adopted(run, cluster, job, note)?;
        faults += r.demand_faults;
    }
    log(format!(
        "cluster restore {snapshot} finished after an agent crash: {} VMs ({} started by this agent), {faults} demand faults",
        jobs.len(),
        waiting.len()
    ));
    Ok(())
}

/// Starts, together, the VMs of `jobs` that wait for START; returns their
/// names.
fn start_waiting(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    snapshot: &str,
    jobs: &[(SourceJob, u32)],
) -> Result<Vec<String>, AgentError> {
    let c = cluster
        .as_mut()
        .ok_or_else(|| AgentError::BadRequest("the adopted cluster is gone".into()))?;
    let mut waiting = Vec::new();
    for (job, _) in jobs {
        let name = &job.member.config.name;
        let m = c.member_mut(name)?;
        match vm_adopt::waiting(&mut m.vm)? {
            Waiting::Running => m.vm.config.paused = false,
            Waiting::ForStart => waiting.push(job),
        }
    }
    if waiting.is_empty() {
        c.persist()?;
        return Ok(vec![]);
    }
    let mut replay = replay_frames(run, snapshot);
    let mut ports = Vec::new();
    for job in &waiting {
        let name = &job.member.config.name;
        let port = c.member_mut(name)?.port;
        let frames = replay.remove(name).unwrap_or_default();
        // Held until its guest runs, as the first agent did (cohort.rs).
        if let Err(e) = c.switch.hold(port) {
            log(format!("cluster restore: holding {name}'s port: {e}"));
        }
        if !frames.is_empty() {
            match c.switch.inject(port, frames) {
                Ok(r) => log(format!(
                    "{name}: {} frames in flight at the cut queued for it again ({} dropped)",
                    r.queued, r.dropped
                )),
                Err(e) => log(format!("cluster restore: replaying to {name}: {e}")),
            }
        }
        ports.push(port);
    }
    for job in &waiting {
        let m = c.member_mut(&job.member.config.name)?;
        vm_adopt::start(&mut m.vm, job, run)?;
    }
    for (job, port) in waiting.iter().zip(ports) {
        let m = c.member_mut(&job.member.config.name)?;
        vm_adopt::started(&mut m.vm, job, run)?;
        let _ = c
            .switch
            .wait_connected(port, 1, std::time::Duration::from_secs(5));
        if let Err(e) = c.switch.release(port) {
            log(format!("cluster restore: releasing a port: {e}"));
        }
    }
    c.persist()?;
    Ok(waiting
        .iter()
        .map(|j| j.member.config.name.clone())
        .collect())
}

/// The frames logged at the cut of cluster snapshot `snapshot`, by
/// receiver (none if they cannot be read: logged, the start goes on).
fn replay_frames(run: &RunDir, snapshot: &str) -> HashMap<String, Vec<Vec<u8>>> {
    let dir = crate::cluster_snapshot::resolve(run, Path::new(snapshot));
    let frames = vmcsnap_image::cluster::check_cluster_committed(&dir)
        .map_err(|e| AgentError::BadRequest(e.to_string()))
        .and_then(|m| super::replay_frames(&dir, &m));
    frames.unwrap_or_else(|e| {
        log(format!(
            "cluster restore {snapshot}: the frames logged at the cut are not replayed: {e}"
        ));
        HashMap::new()
    })
}
