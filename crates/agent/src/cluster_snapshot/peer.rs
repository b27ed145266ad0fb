//! One VM's part in a cluster snapshot: the protocol peer's worker, the
//! thread that snapshots the VM when told to, and the hooks that cut the
//! VM's network exactly around its pause.
//!
//! Per VM two threads run: the protocol peer (`vmcsnap_coord::snapshot::run_peer`)
//! and this module's [`snapshot_thread`], which owns the VM. The peer's
//! [`Worker`] only sends commands to the snapshot thread, which reports
//! back into the peer's inbox (`TransientDone`, `FullDone`, `Failed`).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::barrier::{BarrierWait, StopBarrier, STOP_BARRIER_BOUND};

use vmcsnap_coord::snapshot::{PeerInput, PeerWorker};
use vmcsnap_switch::{CutReport, PortId, PrepareReport, SwitchHandle};

use crate::member::Member;
use crate::snapshot::{self, Hooks};
use crate::{AgentError, RunDir};

/// How long the switch waits, with the VM's port held, for its QEMU to read
/// what was already written to it before the VM is paused. Bounded so that a
/// guest that does not take frames cannot stall the snapshot; hits are
/// counted in the report.
pub const CUT_DRAIN_BOUND: Duration = Duration::from_millis(20);

/// Why a snapshot thread should stop before or while snapshotting.
pub type Cancel = Arc<Mutex<Option<String>>>;

/// What the peer asks of the snapshot thread.
pub enum WorkerCmd {
    /// Take the snapshot now.
    Start,
    /// The cluster snapshot was abandoned.
    Abandon,
}

/// The peer's worker: hands the protocol's actions to the snapshot thread.
pub struct Worker {
    /// To the snapshot thread.
    pub start: Sender<WorkerCmd>,
    /// Set on abandon; the running snapshot polls it.
    pub cancel: Cancel,
    /// Progress lines.
    pub progress: Sender<String>,
    /// The VM.
    pub vm: String,
}

impl PeerWorker for Worker {
    fn start_snapshot(&mut self) {
        let _ = self.start.send(WorkerCmd::Start);
    }
    fn end_coloring(&mut self) {}
    fn complete(&mut self) {}
    fn abandon(&mut self, reason: &str) {
        *self.cancel.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
        let _ = self.start.send(WorkerCmd::Abandon);
        let _ = self
            .progress
            .send(format!("{}: abandoning its snapshot ({reason})", self.vm));
    }
}

/// What one VM's snapshot thread did.
#[derive(Debug, Default)]
pub struct VmOutcome {
    /// The VM.
    pub vm: String,
    /// Its snapshot, if it completed.
    pub report: Option<snapshot::Report>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The switch's drain wait before the pause.
    pub prepare: Option<PrepareReport>,
    /// What the switch read from the VM after the pause.
    pub cut: Option<CutReport>,
    /// Its wait at the stop barrier, between its cut prepared and its stop.
    pub barrier: Option<BarrierWait>,
}

/// Everything a snapshot thread needs besides the VM.
pub struct Job {
    /// The per-VM snapshot's options (mode, name, target, config).
    pub opts: snapshot::Options,
    /// The switch.
    pub switch: SwitchHandle,
    /// Commands from the worker.
    pub commands: Receiver<WorkerCmd>,
    /// The peer's inbox, to report into.
    pub inbox: Sender<PeerInput>,
    /// Set when the snapshot is abandoned.
    pub cancel: Cancel,
    /// Progress lines.
    pub progress: Sender<String>,
    /// Told once the snapshot is prepared (`Ok(vm)`) or failed preparing.
    pub ready: Sender<Result<String, String>>,
    /// Cut probes before the pause (see [`Options::cut_probes`](super::Options::cut_probes)).
    pub cut_probes: u32,
    /// Hot and stop-copy: every VM's cut is prepared before any VM stops.
    pub barrier: Option<Arc<StopBarrier>>,
}

/// Prepares the VM's snapshot, says so on `ready`, waits for the worker's
/// start (or abandon) and takes the snapshot.
pub fn snapshot_thread(member: &mut Member, run: &RunDir, job: Job) -> VmOutcome {
    let vm = member.vm.name.clone();
    let mut out = VmOutcome {
        vm: vm.clone(),
        ..VmOutcome::default()
    };
    let mut hooks = CutHooks {
        switch: job.switch.clone(),
        port: member.port,
        inbox: job.inbox.clone(),
        cancel: job.cancel.clone(),
        progress: job.progress.clone(),
        vm: vm.clone(),
        prepare: None,
        cut: None,
        commands: job.commands,
        ready: Some(job.ready),
        probes: job.cut_probes,
        barrier: job.barrier,
        barrier_wait: None,
    };
    let progress = job.progress.clone();
    let result = snapshot::snapshot(member, run, job.opts, &mut hooks, &mut |line| {
        let _ = progress.send(line.to_string());
    });
    out.prepare = hooks.prepare;
    out.cut = hooks.cut;
    out.barrier = hooks.barrier_wait;
    if let (Some(b), None) = (&hooks.barrier, hooks.barrier_wait) {
        // Failed or abandoned before its cut was prepared.
        b.leave();
    }
    match result {
        Ok(report) => {
            out.report = Some(report);
            let _ = job.inbox.send(PeerInput::FullDone);
        }
        Err(e) => {
            out.error = Some(e.to_string());
            match hooks.ready.take() {
                // Failed while preparing: the protocol has not started.
                Some(ready) => {
                    let _ = ready.send(Err(format!("{vm}: {e}")));
                }
                None => {
                    let _ = job.inbox.send(PeerInput::Failed(format!("{vm}: {e}")));
                }
            }
        }
    }
    out
}

/// Cuts the VM's network at its pause: hold its port and let its QEMU read
/// everything already written to it, pause, read everything it had written
/// (pre-snapshot frames) and mark it post-snapshot; release the port once
/// the VM runs again. See `vmcsnap_switch::mediator`.
struct CutHooks {
    switch: SwitchHandle,
    port: PortId,
    inbox: Sender<PeerInput>,
    cancel: Cancel,
    progress: Sender<String>,
    vm: String,
    prepare: Option<PrepareReport>,
    cut: Option<CutReport>,
    commands: Receiver<WorkerCmd>,
    ready: Option<Sender<Result<String, String>>>,
    /// Cut probes before the pause (`vmcsnap_switch::mediator::probe`).
    probes: u32,
    /// Where the VM waits, its cut prepared, for every VM's (`barrier`).
    barrier: Option<Arc<StopBarrier>>,
    /// Once it arrived there.
    barrier_wait: Option<BarrierWait>,
}

impl Hooks for CutHooks {
    fn ready(&mut self) -> Result<(), AgentError> {
        if let Some(r) = self.ready.take() {
            let _ = r.send(Ok(self.vm.clone()));
        }
        match self.commands.recv() {
            Ok(WorkerCmd::Start) => Ok(()),
            Ok(WorkerCmd::Abandon) | Err(_) => Err(AgentError::Snapshot {
                vm: self.vm.clone(),
                detail: "abandoned before it started".into(),
            }),
        }
    }

    fn before_pause(&mut self) -> Result<(), AgentError> {
        self.prepare = Some(self.switch.prepare_cut_with(
            self.port,
            CUT_DRAIN_BOUND,
            self.probes,
        )?);
        if let Some(b) = &self.barrier {
            let cancel = self.cancel.clone();
            let wait = b.arrive(STOP_BARRIER_BOUND, &|| {
                cancel.lock().unwrap_or_else(|p| p.into_inner()).clone()
            });
            self.barrier_wait = Some(wait);
            if !wait.complete {
                tracing::warn!(
                    vm = %self.vm,
                    waited_us = wait.waited_us,
                    "stop barrier: going on without every VM's cut prepared"
                );
            }
            if let Some(why) = self.cancelled() {
                return Err(AgentError::Snapshot {
                    vm: self.vm.clone(),
                    detail: format!("cancelled: {why}"),
                });
            }
        }
        Ok(())
    }

    fn works_while_paused(&self) -> bool {
        true
    }

    fn paused(&mut self) -> Result<(), AgentError> {
        if self.prepare.is_none() {
            // Pre-copy: QEMU paused the VM by itself; hold the port now.
            self.prepare = Some(self.switch.prepare_cut_with(
                self.port,
                CUT_DRAIN_BOUND,
                self.probes,
            )?);
        }
        self.cut = Some(self.switch.cut(self.port)?);
        Ok(())
    }

    fn running(&mut self) {
        if let Err(e) = self.switch.release(self.port) {
            crate::log(format!(
                "VM {}: releasing its switch port after the cut: {e}",
                self.vm
            ));
        }
        let _ = self
            .progress
            .send(format!("{}: transient snapshot done", self.vm));
        let _ = self.inbox.send(PeerInput::TransientDone);
    }

    fn cancelled(&self) -> Option<String> {
        self.cancel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
