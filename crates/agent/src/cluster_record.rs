//! The agent's durable record of its cluster, and how a new agent adopts it.
//!
//! The agent keeps its VMs' handles ([`VmRecord`]: identity, QEMU
//! endpoint, files, pid) in
//! `<run-dir>/vms.json`, rewritten atomically (temporary file, `fsync`,
//! `rename`, `fsync` of the directory) whenever a VM is added, replaced or
//! removed. A VM is written there *before* its QEMU is started, so no QEMU
//! of ours ever runs unrecorded.
//!
//! ```text
//!  vms.json = { version, agent_pid, spec, accel, vms: [ VmRecord ] }
//!  VmRecord = { config (the QEMU command line's inputs), pid?, started_unix_ms,
//!               boot_ms?, qemu_log, address, disk }
//! ```
//!
//! An agent that starts and finds the file adopts the cluster
//! ([`adopt`]): every QEMU still running is found (by pid, checked against
//! its command line, or else by scanning `/proc` for a QEMU whose command
//! line names the VM's QMP socket: a QEMU started just before a crash whose
//! pid was never written is found too) and becomes a member again; its
//! NIC is plugged into the new switch (QEMU listens on its NIC socket, the
//! switch dials it); work a killed agent left half-done on it is finished
//! ([`crate::intent`]), and priorities it raised are put back
//! ([`crate::thread_priority`]). A VM whose QEMU is gone is kept in the cluster as
//! `exited` (its disk overlay is the user's data; `down` removes it), and
//! its runtime files (RAM file, sockets) are removed.

use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vmcsnap_spec::ClusterSpec;

use crate::accel::Resolved;
use crate::cluster::Cluster;
use crate::member::Member;
use crate::paths::write_atomic;
pub use crate::record::VmRecord;
use crate::vm::Vm;
use crate::{log, AgentError, RunDir};

/// The record's file name in the run directory.
pub const RECORD_FILE: &str = "vms.json";
/// Bumped whenever the layout changes incompatibly.
pub const RECORD_VERSION: u32 = 1;

/// `<run-dir>/vms.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// The agent that wrote it (for the log of the one that adopts).
    pub agent_pid: u32,
    /// The spec the cluster was booted from.
    pub spec: ClusterSpec,
    /// The accelerator in use.
    pub accel: Resolved,
    /// The VMs, in spec order (restored VMs after them).
    pub vms: Vec<VmRecord>,
}

/// Whether `run` holds VMs or work that an agent must take over (its agent
/// died): recorded VMs, or a restore that did not finish.
pub fn needs_agent(run: &RunDir) -> bool {
    run.root().join(RECORD_FILE).exists()
        || run
            .root()
            .join(crate::restore_journal::JOURNAL_FILE)
            .exists()
}

/// Writes the record of `cluster` plus `pending` VMs about to start.
pub fn save(run: &RunDir, cluster: &Cluster, pending: &[VmRecord]) -> Result<(), AgentError> {
    let mut vms: Vec<VmRecord> = cluster
        .members
        .iter()
        .map(|m| VmRecord::of(&m.vm, m.address, &m.disk))
        .collect();
    vms.extend(pending.iter().cloned());
    let rec = ClusterRecord {
        version: RECORD_VERSION,
        agent_pid: std::process::id(),
        spec: cluster.spec.clone(),
        accel: cluster.accel,
        vms,
    };
    write_atomic(
        &run.root().join(RECORD_FILE),
        &serde_json::to_vec_pretty(&rec).expect("record serialises"),
    )
}

/// Removes the record (the cluster is down).
pub fn clear(run: &RunDir) {
    let path = run.root().join(RECORD_FILE);
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log(format!("cannot remove {}: {e}", path.display()));
        }
    }
}

/// Reads the record, if there is one.
pub fn load(run: &RunDir) -> Result<Option<ClusterRecord>, AgentError> {
    let path = run.root().join(RECORD_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(AgentError::io("reading the VM record", &path)(e)),
    };
    let rec: ClusterRecord = serde_json::from_slice(&bytes).map_err(|e| AgentError::BadRecord {
        path: path.clone(),
        detail: e.to_string(),
    })?;
    if rec.version != RECORD_VERSION {
        return Err(AgentError::BadRecord {
            path,
            detail: format!(
                "version {} but this agent reads {RECORD_VERSION}; use the vmcsnap that wrote it",
                rec.version
            ),
        });
    }
    Ok(Some(rec))
}

/// Adopts the cluster recorded in `run`, if any: a fresh switch, every
/// live QEMU a member again (with its half-done work finished), every dead
/// one a member marked exited. Never stops or pauses a live VM.
pub fn adopt(run: &RunDir) -> Result<Option<Cluster>, AgentError> {
    let Some(rec) = load(run)? else {
        return Ok(None);
    };
    log(format!(
        "adopting cluster {} ({} VMs) recorded by agent {}",
        rec.spec.cluster.name,
        rec.vms.len(),
        rec.agent_pid
    ));
    let mut cluster = Cluster::adopted(run, rec.spec.clone(), rec.accel)?;
    for v in rec.vms {
        let name = v.config.name.clone();
        let started_at = UNIX_EPOCH + Duration::from_millis(v.started_unix_ms);
        let port = crate::member::plug(&cluster.switch, &name, &v.config.port_socket, &v.address)?;
        let qemu = crate::qemu_find::find_qemu(v.pid, &v.config.qmp_socket);
        // A snapshot's raised priorities, if its agent died in the pause
        // (see `thread_priority`).
        crate::thread_priority::undo_left(&crate::thread_priority::record_path(&v.config), qemu);
        let vm = match qemu {
            Some(pid) => {
                log(format!("VM {name}: adopting QEMU pid {pid}"));
                let mut vm = Vm::adopt(v.config, pid, started_at, v.boot_ms, v.qemu_log);
                // Nothing is done to a VM whose QEMU version vmcsnap does
                // not speak; every operation on it says why.
                match vm.dialect() {
                    Ok(_) => crate::intent_recovery::finish(&mut vm),
                    Err(e) => log(format!("VM {name}: {e}; adopted, left as it is")),
                }
                vm
            }
            None => match crate::intent_recovery::recover_dead(&v.config, &v.qemu_log) {
                Some(vm) => vm,
                None => {
                    log(format!(
                        "VM {name}: its QEMU (pid {:?}) is gone; keeping it as exited",
                        v.pid
                    ));
                    let _ = std::fs::remove_file(&v.config.ram_file);
                    let _ = std::fs::remove_file(&v.config.qmp_socket);
                    let _ = std::fs::remove_file(v.config.sample_socket());
                    Vm::dead(
                        v.config,
                        v.pid.unwrap_or(0),
                        started_at,
                        v.boot_ms,
                        v.qemu_log,
                    )
                }
            },
        };
        let mut member = Member {
            vm,
            address: v.address,
            port,
            disk: v.disk,
        };
        member.refresh_disk();
        cluster.members.push(member);
    }
    save(run, &cluster, &[])?;
    Ok(Some(cluster))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_record_is_an_error_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let run = RunDir::new(d.path());
        std::fs::write(d.path().join(RECORD_FILE), b"{ not json").unwrap();
        let e = load(&run).unwrap_err().to_string();
        assert!(e.contains(RECORD_FILE), "{e}");
        std::fs::remove_file(d.path().join(RECORD_FILE)).unwrap();
        assert!(load(&run).unwrap().is_none());
    }
}
