//! One VM's part in a cluster restore: the Cohort's worker and the thread
//! that restores the VM (`restore::restore_into`) with its start held by a
//! start gate until the Coordinator's START.

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use vmcsnap_coord::restore::{CohortInput, CohortWorker};
use vmcsnap_switch::SwitchHandle;

use crate::fault::WhenPeersLoaded;
use crate::member::Member;
use crate::restore::{self, InCluster, RestoreEvent, StartGate};
use crate::{AgentError, RunDir};

/// What the worker asks of the restore thread.
pub enum Cmd {
    /// LOAD: start restoring (the working set first, then the rest).
    Load,
    /// The restore was abandoned before it began.
    Abandon,
}

/// The Cohort's worker: LOAD starts the restore thread, START opens the
/// gate, abandon aborts the gate (a VM already running is stopped by the
/// caller afterwards).
pub struct Worker {
    /// To the restore thread.
    pub cmds: Sender<Cmd>,
    /// The VM's start gate.
    pub gate: StartGate,
    /// Testing (`crate::fault`, `start-held-until=PATH`): START opens the
    /// gate only once this file exists.
    pub start_held_until: Option<PathBuf>,
}

impl CohortWorker for Worker {
    fn load(&mut self) {
        let _ = self.cmds.send(Cmd::Load);
    }
    fn start(&mut self) {
        let Some(path) = self.start_held_until.clone() else {
            self.gate.open();
            return;
        };
        crate::log(format!(
            "cluster restore: injected fault start-held-until: START waits for {}",
            path.display()
        ));
        let gate = self.gate.clone();
        std::thread::spawn(move || {
            while !path.exists() && !gate.is_aborted() {
                std::thread::sleep(Duration::from_millis(50));
            }
            gate.open();
        });
    }
    fn abandon(&mut self, _reason: &str) {
        self.gate.abort();
        let _ = self.cmds.send(Cmd::Abandon);
    }
}

/// Everything a restore thread needs.
pub struct Job {
    /// The VM.
    pub vm: String,
    /// Its snapshot inside the cluster snapshot.
    pub dir: PathBuf,
    /// Per-VM restore options (mode, working-set size).
    pub opts: restore::Options,
    /// The gate (shared with the worker).
    pub gate: StartGate,
    /// Commands from the worker.
    pub cmds: Receiver<Cmd>,
    /// The Cohort's inbox.
    pub inbox: Sender<CohortInput>,
    /// The switch the VM joins.
    pub switch: SwitchHandle,
    /// The cluster's name (RAM file names).
    pub cluster: String,
    /// Frames logged at the cut for this VM, replayed once it runs.
    pub replay: Vec<Vec<u8>>,
    /// Progress lines.
    pub progress: Sender<String>,
    /// Where `status` reads the VM's load from, if anywhere.
    pub loads: Option<crate::loading::Loads>,
    /// The VMs of the restore that have loaded.
    pub loaded: Arc<LoadedCount>,
    /// The injected fault for this VM (`crate::fault`): what it does in
    /// place of LOAD_FIN once this many VMs have loaded.
    pub when_peers_loaded: Option<(WhenPeersLoaded, usize)>,
    /// Testing: the page source's background push waits for this file.
    pub hold_background_until: Option<PathBuf>,
}

/// How many VMs of a cluster restore have loaded (for the injected faults
/// `*-when-peers-loaded`, see `crate::fault`).
#[derive(Default)]
pub struct LoadedCount {
    n: Mutex<usize>,
    changed: Condvar,
}

impl LoadedCount {
    fn add(&self) {
        *self.n.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.changed.notify_all();
    }

    /// Waits until `all` VMs have loaded (true) or `gate` is decided first
    /// (false: the restore went on or was abandoned without this VM).
    fn wait_for(&self, all: usize, gate: &StartGate) -> bool {
        let mut n = self.n.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if *n >= all {
                return true;
            }
            if gate.is_open() || gate.is_aborted() {
                return false;
            }
            n = self
                .changed
                .wait_timeout(n, Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// What a restore thread did.
pub struct Outcome {
    /// The VM.
    pub vm: String,
    /// The member and its report, or why not.
    pub result: Result<(Member, restore::Report), String>,
    /// When the guest started (unix µs).
    pub started_unix_us: Option<u64>,
    /// Frames of the channel state replayed to it.
    pub replayed: u64,
}

/// A VM restored: its member, its report, when its guest started (unix
/// µs) and the frames replayed to it.
pub type Restored = (Member, restore::Report, Option<u64>, u64);

/// Waits for LOAD, restores the VM, reports to the Cohort as it goes, and
/// replays the VM's logged frames once its guest runs.
pub fn restore_thread(run: &RunDir, mut job: Job) -> Outcome {
    let mut out = Outcome {
        vm: job.vm.clone(),
        result: Err("abandoned before LOAD".into()),
        started_unix_us: None,
        replayed: 0,
    };
    match job.cmds.recv() {
        Ok(Cmd::Load) => {}
        Ok(Cmd::Abandon) | Err(_) => return out,
    }
    let (ev_tx, ev_rx) = mpsc::channel::<RestoreEvent>();
    job.opts.cluster = Some(InCluster {
        dir: job.dir.clone(),
        gate: job.gate.clone(),
        events: ev_tx,
        hold_background_until: job.hold_background_until.clone(),
    });
    let (inbox, switch, vm, replay) = (
        job.inbox.clone(),
        job.switch.clone(),
        job.vm.clone(),
        std::mem::take(&mut job.replay),
    );
    let progress = job.progress.clone();
    let (loaded, fault, gate) = (job.loaded.clone(), job.when_peers_loaded, job.gate.clone());
    let loads = job.loads.clone();
    let (result, (started, replayed)) = std::thread::scope(|s| {
        // Restore events → Cohort inputs; the replay once the guest runs.
        let fwd = s.spawn(move || {
            let (mut started, mut replayed, mut port) = (None, 0, None);
            for ev in ev_rx {
                match ev {
                    RestoreEvent::PortReady(p) => {
                        // Hold the port and queue the replay first: frames
                        // that peers send once they run come after it, in
                        // order (a replayed segment behind newer ones would
                        // look lost to TCP and be retransmitted).
                        port = Some(p);
                        if let Err(e) = switch.hold(p) {
                            crate::log(format!("cluster restore: holding {vm}'s port: {e}"));
                        }
                        replayed = replay_to(&switch, p, &vm, &replay, &progress);
                    }
                    RestoreEvent::Loaded { qemu_pid } => {
                        loaded.add();
                        match fault {
                            None => {
                                let _ = inbox.send(CohortInput::Loaded);
                            }
                            Some((kind, all)) => {
                                if loaded.wait_for(all, &gate) {
                                    inject(kind, &vm, all, qemu_pid, &inbox);
                                }
                            }
                        }
                    }
                    RestoreEvent::Started(us) => {
                        started = Some(us);
                        if let Some(p) = port {
                            // The switch dials the new QEMU; a port released
                            // before it is connected would drop the replay.
                            let _ = switch.wait_connected(p, 1, std::time::Duration::from_secs(5));
                            if let Err(e) = switch.release(p) {
                                crate::log(format!("cluster restore: releasing {vm}'s port: {e}"));
                            }
                        }
                        let _ = inbox.send(CohortInput::Started { unix_us: us });
                    }
                    RestoreEvent::AllLoaded => {
                        if let Some(l) = &loads {
                            l.done(&vm);
                        }
                        let _ = inbox.send(CohortInput::Restored);
                    }
                    RestoreEvent::Loading { sent, total } => {
                        if let Some(l) = &loads {
                            l.set(&vm, sent, total);
                        }
                    }
                }
            }
            (started, replayed)
        });
        let progress = job.progress.clone();
        let r = restore::restore_into(
            &job.switch,
            &job.cluster,
            run,
            &job.opts,
            &job.dir,
            &mut |line| {
                let _ = progress.send(line.to_string());
            },
        );
        job.opts.cluster = None; // closes the event channel: the forwarder ends
        (r, fwd.join().expect("restore event forwarder panicked"))
    });
    out.started_unix_us = started;
    out.replayed = replayed;
    match result {
        Ok(x) => out.result = Ok(x),
        Err(e) => {
            let msg = match e {
                AgentError::Abandoned { during, .. } => format!("{}: abandoned {during}", job.vm),
                e => format!("{}: {e}", job.vm),
            };
            let _ = job.inbox.send(CohortInput::Failed(msg.clone()));
            out.result = Err(msg);
        }
    }
    out
}

/// The injected fault, once all `all` VMs have loaded: in place of LOAD_FIN
/// the Cohort fails, or the VM's QEMU is killed as a crash would (and the
/// restore must notice that by itself).
#[cfg(feature = "fault-injection")]
fn inject(kind: WhenPeersLoaded, vm: &str, all: usize, qemu_pid: u32, inbox: &Sender<CohortInput>) {
    match kind {
        WhenPeersLoaded::CohortFails => {
            let _ = inbox.send(CohortInput::Failed(format!(
                "{vm}: injected fault cohort-fail-when-peers-loaded: failed in place of LOAD_FIN once all {all} VMs had loaded"
            )));
        }
        WhenPeersLoaded::QemuKilled => {
            crate::log(format!("cluster restore: injected fault qemu-killed-when-peers-loaded: killing {vm}'s QEMU (pid {qemu_pid})"));
            // SAFETY: SIGKILL to the QEMU this restore started for `vm`. It
            // is the agent's child and is reaped only when its restore ends,
            // which has just reported it loaded and waits for START; only a
            // restore that failed on its own in this instant could have
            // reaped it (a test-only fault).
            unsafe { libc::kill(qemu_pid as i32, libc::SIGKILL) };
        }
    }
}

/// No fault in this build (`WhenPeersLoaded` is empty).
#[cfg(not(feature = "fault-injection"))]
fn inject(kind: WhenPeersLoaded, _: &str, _: usize, _: u32, _: &Sender<CohortInput>) {
    match kind {}
}

/// Queues `frames` for `vm`'s port (held, so they wait for the guest in
/// order): what was in flight to it at the cut.
fn replay_to(
    switch: &SwitchHandle,
    port: vmcsnap_switch::PortId,
    vm: &str,
    frames: &[Vec<u8>],
    progress: &Sender<String>,
) -> u64 {
    if frames.is_empty() {
        return 0;
    }
    match switch.inject(port, frames.to_vec()) {
        Ok(r) => {
            let _ = progress.send(format!(
                "{vm}: {} frames in flight at the cut queued for it ({} dropped)",
                r.queued, r.dropped
            ));
            r.queued
        }
        Err(e) => {
            crate::log(format!(
                "cluster restore: replaying to {vm}: {}",
                AgentError::from(e)
            ));
            0
        }
    }
}
