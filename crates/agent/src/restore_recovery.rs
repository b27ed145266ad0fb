//! Restores an agent did not finish, finished or redone by the next one.
//!
//! Before a restore starts a QEMU the agent writes
//! `<run-dir>/restoring.json` (atomically, `crate::restore_journal`); when
//! the restore has ended, successfully or not, it removes the file. An
//! agent that starts and finds the file (its predecessor died mid-restore,
//! e.g. by `kill -9`) serves at once and, in the background, holding the
//! cluster ([`recover`]):
//!
//! - **adopts** a restore of one VM whose page source (a process of its
//!   own: [`crate::restore::page_source`]) still serves, or has finished,
//!   while its QEMU lives: the guest ran on throughout; the VM joins the
//!   cluster and the restore is finished from the page source's files
//!   ([`crate::restore::adopt`]);
//! - **adopts** a cluster restore whose every VM is so: every VM joins the
//!   cluster, those still waiting for START are started together, and each
//!   VM's restore is finished likewise ([`crate::cluster_restore::adopt`]);
//! - otherwise **redoes** it: every QEMU and page source of the VMs being
//!   restored is killed (a QEMU already running in postcopy would wait
//!   forever for its missing pages), those VMs leave the adopted cluster (a
//!   cluster restore: the whole cluster, which the restore had created), and
//!   the restore runs again, `eager` (`eager-rl` for a cluster: every page
//!   loaded before any guest starts), from the same snapshot. That is a
//!   restore whose page source (for a cluster, any VM's) had not started,
//!   or had died too, or whose adoption failed: a guest that had started
//!   loses what it did since.
//!
//! QEMU 7.2's postcopy recovery (`migrate-recover`) would let a new agent
//! resume a dead source's feed; vmcsnap does not use it.

use crate::cluster::Cluster;
use crate::restore_journal::{end, Restoring};
use crate::{log, AgentError, RunDir};

/// Kills the QEMU of `vm` in `run`, whether the cluster knows it or not.
fn kill_qemu(run: &RunDir, cluster: &mut Option<Cluster>, vm: &str) {
    if let Some(c) = cluster.as_mut() {
        if c.member_mut(vm).is_ok() {
            let _ = c.stop_vm(vm);
        }
    }
    let sock = run.vm_dir(vm).join("qmp.sock");
    // kill_and_reap waits for each; a QEMU that survives SIGKILL (stuck in
    // the kernel) is not waited for forever.
    for _ in 0..3 {
        let Some(pid) = crate::qemu_find::find_qemu(None, &sock) else {
            break;
        };
        log(format!(
            "VM {vm}: killing QEMU pid {pid} of an interrupted restore"
        ));
        crate::process::kill_and_reap(pid);
    }
}

/// Redoes a restore the previous agent did not finish (see the module
/// documentation).
fn redo(run: &RunDir, cluster: &mut Option<Cluster>, r: &Restoring) -> Result<(), AgentError> {
    log(format!(
        "redoing a restore the previous agent did not finish: {r:?}"
    ));
    let mut progress = |m: &str| log(format!("redo: {m}"));
    match r {
        Restoring::Vm { snapshot, vm } => {
            kill_qemu(run, cluster, vm);
            crate::restore::adopt::stop_page_source(run, vm);
            let opts = crate::restore::Options {
                snapshot: snapshot.clone(),
                mode: vmcsnap_workingset::Mode::Eager,
                wss: crate::restore::WssChoice::Auto,
                paused: false,
                trace: false,
                no_background: false,
                priorities: true,
                start_quiet: std::time::Duration::ZERO,
                prefetch_blocks: crate::restore::pages::PREFETCH_BLOCKS,
                preempt: false,
                cluster: None,
                observer: None,
            };
            crate::restore::restore(cluster, run, opts, None, &mut progress).map(|_| ())
        }
        Restoring::Cluster { snapshot, vms } => {
            for vm in vms {
                kill_qemu(run, cluster, vm);
                crate::restore::adopt::stop_page_source(run, vm);
            }
            if let Some(mut c) = cluster.take() {
                c.teardown();
            }
            let opts = crate::cluster_restore::Options {
                snapshot: snapshot.clone(),
                mode: crate::cluster_restore::Mode::EagerRl,
                priorities: true,
                start_quiet: crate::restore::CLUSTER_START_QUIET,
                fault: None,
            };
            crate::cluster_restore::restore_cluster(cluster, run, opts, None, &mut progress)
                .map(|_| ())
        }
    }
}

/// An adoption's result; one that failed is redone.
fn adopted_or_redo(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    r: &Restoring,
    adopted: Result<(), AgentError>,
    note: &mut dyn FnMut(&mut Option<Cluster>, &str),
) -> Result<(), AgentError> {
    match adopted {
        Ok(()) => Ok(()),
        Err(e) => {
            log(format!("adopting {r} failed ({e}); redoing it"));
            note(cluster, &format!("adopting failed ({e}); redoing it"));
            redo(run, cluster, r)
        }
    }
}

/// Finishes the restore `r` the previous agent did not (see the module
/// documentation): adopts a VM whose page source serves on, else redoes
/// the restore. `note` is told what happens, with the cluster as it is
/// then. Errors are logged: the agent serves on regardless.
pub fn recover(
    run: &RunDir,
    cluster: &mut Option<Cluster>,
    r: &Restoring,
    note: &mut dyn FnMut(&mut Option<Cluster>, &str),
) {
    let result = match r {
        Restoring::Vm { vm, .. } => match crate::restore::adopt::adoptable(run, vm) {
            Some((job, pid)) => {
                log(format!(
                    "adopting {r}: its guest runs on its page source (QEMU pid {pid})"
                ));
                let adopted = crate::restore::adopt::adopt(run, cluster, &job, pid, note);
                adopted_or_redo(run, cluster, r, adopted.map(|_| ()), note)
            }
            None => {
                note(cluster, "redoing it (eager) from its snapshot");
                redo(run, cluster, r)
            }
        },
        Restoring::Cluster { snapshot, vms } => {
            match crate::cluster_restore::adopt::adoptable(run, vms) {
                Some(jobs) => {
                    log(format!(
                        "adopting {r}: every VM's page source serves on, every QEMU lives"
                    ));
                    note(cluster, "adopting every VM: their page sources serve on");
                    let adopted =
                        crate::cluster_restore::adopt::adopt(run, cluster, snapshot, &jobs, note);
                    adopted_or_redo(run, cluster, r, adopted, note)
                }
                None => {
                    note(
                        cluster,
                        "not every VM has a page source and a QEMU: redoing it (eager-rl) from its snapshot",
                    );
                    redo(run, cluster, r)
                }
            }
        }
    };
    match result {
        Ok(()) => log(format!("recovered: {r}")),
        Err(e) => log(format!("recovering {r} failed: {e}")),
    }
    end(run);
    let vms = match r {
        Restoring::Vm { vm, .. } => std::slice::from_ref(vm),
        Restoring::Cluster { vms, .. } => vms.as_slice(),
    };
    for vm in vms {
        let _ = std::fs::remove_dir_all(crate::restore::page_source::dir_of(&run.vm_dir(vm)));
    }
    match cluster {
        Some(c) => {
            if let Err(e) = c.persist() {
                log(format!("cannot write the VM record: {e}"));
            }
        }
        None => crate::cluster_record::clear(run),
    }
}
