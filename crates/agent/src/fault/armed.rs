//! The faults of a `fault-injection` build (see the module above).

use std::io::{Error, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{AgentError, RunDir};

/// A fault to inject into a snapshot's capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fail after reading this many bytes of the stream.
    CaptureErrorAfter(u64),
    /// Stop reading (without closing) after this many bytes.
    CaptureStallAfter(u64),
    /// The commit hangs until given up on, after this many seconds.
    CommitStall(u64),
    /// The handler panics once the VM is paused (a bug in the agent).
    PanicWhenPaused,
    /// Pre-copy: this page of guest RAM changes in the switch-over pause
    /// without QEMU knowing (a write its dirty tracking missed), and is put
    /// back before the guest resumes.
    PrecopyUntrackedWrite(u64),
    /// The handler stops once the VM is paused, then fails.
    HangWhenPaused,
    /// A first hot snapshot's read of guest RAM takes this many seconds
    /// longer.
    RamReadDelay(u64),
}

/// How long `hang-when-paused` holds the VM paused.
pub const HANG_WHEN_PAUSED: Duration = Duration::from_secs(60);

/// Snapshot hooks that stop once the VM is paused: `hang-when-paused`.
pub struct HangWhenPaused;

impl crate::snapshot::Hooks for HangWhenPaused {
    fn works_while_paused(&self) -> bool {
        true
    }
    fn paused(&mut self) -> Result<(), crate::AgentError> {
        crate::log("injected fault hang-when-paused: the snapshot stops with its VM paused");
        std::thread::sleep(HANG_WHEN_PAUSED);
        Err(crate::AgentError::BadRequest(
            "injected fault: the snapshot hung while its VM was paused".into(),
        ))
    }
}

/// Snapshot hooks that panic once the VM is paused: `panic-when-paused`.
pub struct PanicWhenPaused;

impl crate::snapshot::Hooks for PanicWhenPaused {
    fn works_while_paused(&self) -> bool {
        true
    }
    fn paused(&mut self) -> Result<(), crate::AgentError> {
        panic!("injected fault: the agent panicked while the VM was paused")
    }
}

/// A FAULT that is not one of the documented ones.
#[derive(Debug, thiserror::Error)]
#[error("{value:?} is not a fault vmcsnap can inject; use capture-error-after=BYTES, capture-stall-after=BYTES, commit-stall-deadline=SECONDS, precopy-untracked-write=PAGE, ram-read-delay=SECONDS, panic-when-paused or hang-when-paused")]
pub struct BadFault {
    value: String,
}

impl std::str::FromStr for Fault {
    type Err = BadFault;

    fn from_str(s: &str) -> Result<Fault, BadFault> {
        let bad = || BadFault {
            value: s.to_string(),
        };
        match s.trim() {
            "panic-when-paused" => return Ok(Fault::PanicWhenPaused),
            "hang-when-paused" => return Ok(Fault::HangWhenPaused),
            _ => {}
        }
        let (kind, n) = s.split_once('=').ok_or_else(bad)?;
        let n: u64 = n.trim().parse().map_err(|_| bad())?;
        match kind.trim() {
            "capture-error-after" => Ok(Fault::CaptureErrorAfter(n)),
            "capture-stall-after" => Ok(Fault::CaptureStallAfter(n)),
            "commit-stall-deadline" => Ok(Fault::CommitStall(n)),
            "precopy-untracked-write" => Ok(Fault::PrecopyUntrackedWrite(n)),
            "ram-read-delay" => Ok(Fault::RamReadDelay(n)),
            _ => Err(bad()),
        }
    }
}

/// A fault to inject into a rejuvenation (`rejuvenate --inject-fault`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejuvenateFault {
    /// The new QEMU dies after start (as [`Self::NewQemuDies`]; a cold
    /// restart's boot fails) and the kept copy of the previous QEMU fails
    /// too: the restart cannot finish and must be resumed or rolled back.
    FallbackFails,
    /// The new QEMU (warm or saved) is killed right after it started, before
    /// it has loaded the state: a binary that crashes after start.
    NewQemuDies,
}

impl RejuvenateFault {
    /// The error the injected fault stands for.
    pub fn injected() -> crate::AgentError {
        crate::AgentError::BadRequest("injected fault: the fallback QEMU fails".into())
    }
}

impl std::str::FromStr for RejuvenateFault {
    type Err = BadFault;

    fn from_str(s: &str) -> Result<Self, BadFault> {
        match s.trim() {
            "fallback-fails" => Ok(RejuvenateFault::FallbackFails),
            "new-qemu-dies" => Ok(RejuvenateFault::NewQemuDies),
            _ => Err(BadFault {
                value: format!("{s} (rejuvenate knows fallback-fails and new-qemu-dies)"),
            }),
        }
    }
}

/// A fault to inject into a cluster restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreFault {
    /// What one VM does once every VM of the restore has loaded.
    PeersLoaded {
        /// The VM.
        vm: String,
        /// What it does.
        kind: WhenPeersLoaded,
    },
    /// `background-held-until=PATH`: every VM's page source pushes no page
    /// in the background (it serves demand faults only) until PATH exists.
    BackgroundHeldUntil(PathBuf),
    /// `start-held-until=PATH`: START reaches no VM until PATH exists.
    StartHeldUntil(PathBuf),
}

impl RestoreFault {
    /// The VM the fault names, if one.
    pub fn vm(&self) -> Option<&str> {
        match self {
            RestoreFault::PeersLoaded { vm, .. } => Some(vm),
            _ => None,
        }
    }
}

/// What the VM of a [`RestoreFault::PeersLoaded`] does once every VM has
/// loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenPeersLoaded {
    /// Its Cohort reports a failure in place of LOAD_FIN.
    CohortFails,
    /// Its QEMU is killed (SIGKILL) and no LOAD_FIN is sent.
    QemuKilled,
}

/// A restore FAULT that is not one of the documented ones.
#[derive(Debug, thiserror::Error)]
#[error("{value:?} is not a fault a cluster restore can inject; use cohort-fail-when-peers-loaded=VM, qemu-killed-when-peers-loaded=VM, background-held-until=PATH or start-held-until=PATH")]
pub struct BadRestoreFault {
    value: String,
}

impl std::str::FromStr for RestoreFault {
    type Err = BadRestoreFault;

    fn from_str(s: &str) -> Result<RestoreFault, BadRestoreFault> {
        let bad = || BadRestoreFault {
            value: s.to_string(),
        };
        let (name, arg) = s.split_once('=').ok_or_else(bad)?;
        let arg = arg.trim();
        if arg.is_empty() {
            return Err(bad());
        }
        let kind = match name {
            "cohort-fail-when-peers-loaded" => WhenPeersLoaded::CohortFails,
            "qemu-killed-when-peers-loaded" => WhenPeersLoaded::QemuKilled,
            "background-held-until" => return Ok(RestoreFault::BackgroundHeldUntil(arg.into())),
            "start-held-until" => return Ok(RestoreFault::StartHeldUntil(arg.into())),
            _ => return Err(bad()),
        };
        Ok(RestoreFault::PeersLoaded {
            vm: arg.to_string(),
            kind,
        })
    }
}

/// A reader that obeys `fault`; `abort` ends a stall.
pub struct FaultyReader<R> {
    inner: R,
    fault: Option<Fault>,
    read: u64,
    abort: Arc<AtomicBool>,
}

impl<R: Read> FaultyReader<R> {
    pub fn new(inner: R, fault: Option<Fault>, abort: Arc<AtomicBool>) -> Self {
        FaultyReader {
            inner,
            fault,
            read: 0,
            abort,
        }
    }
}

impl<R: Read> Read for FaultyReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let limit = match self.fault {
            None
            | Some(
                Fault::CommitStall(_)
                | Fault::PanicWhenPaused
                | Fault::HangWhenPaused
                | Fault::RamReadDelay(_)
                | Fault::PrecopyUntrackedWrite(_),
            ) => return self.inner.read(buf),
            Some(Fault::CaptureErrorAfter(n) | Fault::CaptureStallAfter(n)) => n,
        };
        if self.read >= limit {
            if let Some(Fault::CaptureStallAfter(_)) = self.fault {
                while !self.abort.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            return Err(Error::other(format!(
                "injected fault: the capture failed after {limit} bytes of the stream"
            )));
        }
        let room = (limit - self.read).min(buf.len() as u64) as usize;
        let n = self.inner.read(&mut buf[..room])?;
        self.read += n as u64;
        Ok(n)
    }
}

/// The operation a fault is armed for: names its file under
/// `<run-dir>/faults/`.
#[derive(Debug, Clone, Copy)]
pub enum Armed<'a> {
    /// `vmcsnap snapshot VM`.
    Snapshot(&'a str),
    /// `vmcsnap rejuvenate --vm VM` (`Some`) or `--all` (`None`).
    Rejuvenate(Option<&'a str>),
    /// `vmcsnap restore --cluster`.
    ClusterRestore,
}

impl Armed<'_> {
    /// The fault's file in `run`.
    pub fn path(&self, run: &RunDir) -> PathBuf {
        let name = match self {
            Armed::Snapshot(vm) => format!("snapshot-{vm}"),
            Armed::Rejuvenate(Some(vm)) => format!("rejuvenate-{vm}"),
            Armed::Rejuvenate(None) => "rejuvenate-all".to_string(),
            Armed::ClusterRestore => "cluster-restore".to_string(),
        };
        run.root().join("faults").join(name)
    }
}

/// Arms `fault` for the next `what` of the agent of `run` (which takes it
/// when that operation starts). The run directory must exist.
pub fn arm(run: &RunDir, what: Armed<'_>, fault: &str) -> std::io::Result<()> {
    let path = what.path(run);
    if let Some(dir) = path.parent() {
        match std::fs::create_dir(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    }
    std::fs::write(path, fault)
}

/// Removes a fault armed for `what` that no operation took (the request
/// failed before it started).
pub fn disarm(run: &RunDir, what: Armed<'_>) {
    let _ = std::fs::remove_file(what.path(run));
}

/// The fault armed for `what`, removed from its file (a fault applies to
/// one operation); `None` if none is armed.
fn take<T: std::str::FromStr>(run: &RunDir, what: Armed<'_>) -> Result<Option<T>, AgentError>
where
    T::Err: std::fmt::Display,
{
    let path = what.path(run);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(AgentError::io("reading the armed fault", path)(e)),
    };
    std::fs::remove_file(&path).map_err(AgentError::io("taking the armed fault", &path))?;
    let fault = text
        .parse()
        .map_err(|e: T::Err| AgentError::BadRequest(e.to_string()))?;
    tracing::warn!(fault = %text.trim(), path = %path.display(), "injecting an armed fault");
    Ok(Some(fault))
}

/// The fault armed for a snapshot of `vm`.
pub fn take_snapshot(run: &RunDir, vm: &str) -> Result<Option<Fault>, AgentError> {
    take(run, Armed::Snapshot(vm))
}

/// The fault armed for a rejuvenation of `vm` (`None`: all VMs).
pub fn take_rejuvenate(
    run: &RunDir,
    vm: Option<&str>,
) -> Result<Option<RejuvenateFault>, AgentError> {
    take(run, Armed::Rejuvenate(vm))
}

/// The fault armed for a cluster restore.
pub fn take_cluster_restore(run: &RunDir) -> Result<Option<RestoreFault>, AgentError> {
    take(run, Armed::ClusterRestore)
}

/// `ram-read-delay`: how much longer a first hot snapshot's RAM read takes.
pub fn ram_read_delay(fault: Option<Fault>) -> Duration {
    match fault {
        Some(Fault::RamReadDelay(s)) => Duration::from_secs(s),
        _ => Duration::ZERO,
    }
}

/// The capture's waits (for progress, for QEMU's connection) while a
/// fault that runs into them is armed (`capture-stall-after`,
/// `ram-read-delay`): 5 s instead of 30, so that a test of them does not
/// wait half a minute each time. What they guard is the same.
pub fn short_capture_waits(fault: Option<Fault>) -> Option<Duration> {
    match fault {
        Some(Fault::CaptureStallAfter(_) | Fault::RamReadDelay(_)) => Some(Duration::from_secs(5)),
        _ => None,
    }
}

/// `commit-stall-deadline`: the deadline of a commit that hangs.
pub fn commit_stall(fault: Option<Fault>) -> Option<Duration> {
    match fault {
        Some(Fault::CommitStall(s)) => Some(Duration::from_secs(s)),
        _ => None,
    }
}

/// `precopy-untracked-write`: the page changed in the switch-over pause.
pub fn precopy_untracked_write(fault: Option<Fault>) -> Option<u64> {
    match fault {
        Some(Fault::PrecopyUntrackedWrite(page)) => Some(page),
        _ => None,
    }
}

/// The snapshot hooks of `panic-when-paused` and `hang-when-paused`.
pub fn paused_hooks(fault: Option<Fault>) -> Option<Box<dyn crate::snapshot::Hooks>> {
    match fault {
        Some(Fault::PanicWhenPaused) => Some(Box::new(PanicWhenPaused)),
        Some(Fault::HangWhenPaused) => Some(Box::new(HangWhenPaused)),
        _ => None,
    }
}

/// Whether a rejuvenation's new QEMU is killed before it loads (both
/// rejuvenation faults).
pub fn new_qemu_dies(fault: Option<RejuvenateFault>) -> bool {
    fault.is_some()
}

/// `fallback-fails`: the error that stands for a failed start of the
/// kept QEMU (and of a cold restart's boot).
pub fn fallback_failure(fault: Option<RejuvenateFault>) -> Option<AgentError> {
    (fault == Some(RejuvenateFault::FallbackFails)).then(RejuvenateFault::injected)
}

/// The VM a restore fault names, if one.
pub fn restore_fault_vm(fault: &Option<RestoreFault>) -> Option<&str> {
    fault.as_ref().and_then(RestoreFault::vm)
}

/// What `vm` does once every VM has loaded, if the fault names it.
pub fn when_peers_loaded(fault: &Option<RestoreFault>, vm: &str) -> Option<WhenPeersLoaded> {
    match fault {
        Some(RestoreFault::PeersLoaded { vm: v, kind }) if v == vm => Some(*kind),
        _ => None,
    }
}

/// `background-held-until=PATH`.
pub fn background_held_until(fault: &Option<RestoreFault>) -> Option<PathBuf> {
    match fault {
        Some(RestoreFault::BackgroundHeldUntil(p)) => Some(p.clone()),
        _ => None,
    }
}

/// `start-held-until=PATH`.
pub fn start_held_until(fault: &Option<RestoreFault>) -> Option<PathBuf> {
    match fault {
        Some(RestoreFault::StartHeldUntil(p)) => Some(p.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_faults_and_refuses_the_rest() {
        assert_eq!(
            "capture-error-after=4096".parse::<Fault>().unwrap(),
            Fault::CaptureErrorAfter(4096)
        );
        assert_eq!(
            "capture-stall-after=0".parse::<Fault>().unwrap(),
            Fault::CaptureStallAfter(0)
        );
        assert_eq!(
            "commit-stall-deadline=3".parse::<Fault>().unwrap(),
            Fault::CommitStall(3)
        );
        assert_eq!(
            "precopy-untracked-write=0".parse::<Fault>().unwrap(),
            Fault::PrecopyUntrackedWrite(0)
        );
        assert_eq!(
            "ram-read-delay=35".parse::<Fault>().unwrap(),
            Fault::RamReadDelay(35)
        );
        assert_eq!(
            "hang-when-paused".parse::<Fault>().unwrap(),
            Fault::HangWhenPaused
        );
        for bad in [
            "capture-error-after",
            "capture-error-after=x",
            "disk-full=1",
            "",
        ] {
            let e = bad.parse::<Fault>().unwrap_err().to_string();
            assert!(
                e.contains("not a fault") && e.contains("capture-error-after=BYTES"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn parses_the_documented_restore_faults_and_refuses_the_rest() {
        assert_eq!(
            "cohort-fail-when-peers-loaded=r1"
                .parse::<RestoreFault>()
                .unwrap(),
            RestoreFault::PeersLoaded {
                vm: "r1".into(),
                kind: WhenPeersLoaded::CohortFails
            }
        );
        assert_eq!(
            "qemu-killed-when-peers-loaded= r2 "
                .parse::<RestoreFault>()
                .unwrap(),
            RestoreFault::PeersLoaded {
                vm: "r2".into(),
                kind: WhenPeersLoaded::QemuKilled
            }
        );
        assert_eq!(
            "background-held-until=/t/go"
                .parse::<RestoreFault>()
                .unwrap(),
            RestoreFault::BackgroundHeldUntil("/t/go".into())
        );
        assert_eq!(
            "start-held-until=/t/go".parse::<RestoreFault>().unwrap(),
            RestoreFault::StartHeldUntil("/t/go".into())
        );
        for bad in [
            "cohort-fail-when-peers-loaded",
            "cohort-fail-when-peers-loaded=",
            "qemu-killed-when-peers-loaded= ",
            "start-held-until=",
            "capture-error-after=1",
            "",
        ] {
            let e = bad.parse::<RestoreFault>().unwrap_err().to_string();
            assert!(
                e.contains("not a fault")
                    && e.contains("cohort-fail-when-peers-loaded=VM")
                    && e.contains("qemu-killed-when-peers-loaded=VM"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn an_error_fault_delivers_exactly_its_bytes_then_fails() {
        let data = vec![7u8; 10_000];
        let abort = Arc::new(AtomicBool::new(false));
        let mut r = FaultyReader::new(&data[..], Some(Fault::CaptureErrorAfter(4_321)), abort);
        let mut got = Vec::new();
        let e = r.read_to_end(&mut got).unwrap_err();
        assert_eq!(got.len(), 4_321);
        assert!(e.to_string().contains("injected fault"), "{e}");
    }

    #[test]
    fn a_stall_lasts_until_aborted() {
        let data = std::io::Cursor::new(vec![7u8; 100]);
        let abort = Arc::new(AtomicBool::new(false));
        let mut r = FaultyReader::new(data, Some(Fault::CaptureStallAfter(10)), abort.clone());
        let mut buf = [0u8; 64];
        assert_eq!(r.read(&mut buf).unwrap(), 10);
        let t = std::time::Instant::now();
        let stalled = std::thread::spawn(move || r.read(&mut buf).map_err(|e| e.to_string()));
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !stalled.is_finished(),
            "a stalled read returned before the abort"
        );
        abort.store(true, Ordering::SeqCst);
        assert!(stalled
            .join()
            .unwrap()
            .unwrap_err()
            .contains("injected fault"));
        assert!(t.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn no_fault_is_a_plain_reader() {
        let data: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let mut r = FaultyReader::new(&data[..], None, Arc::new(AtomicBool::new(false)));
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, data);
    }
    #[test]
    fn an_armed_fault_is_taken_once_and_a_bad_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        assert_eq!(take_snapshot(&run, "a").unwrap(), None);
        arm(&run, Armed::Snapshot("a"), "capture-error-after=7").unwrap();
        assert_eq!(
            take_snapshot(&run, "b").unwrap(),
            None,
            "armed for a, not b"
        );
        assert_eq!(
            take_snapshot(&run, "a").unwrap(),
            Some(Fault::CaptureErrorAfter(7))
        );
        assert_eq!(take_snapshot(&run, "a").unwrap(), None, "taken once");
        arm(&run, Armed::Rejuvenate(None), "new-qemu-dies").unwrap();
        assert_eq!(
            take_rejuvenate(&run, None).unwrap(),
            Some(RejuvenateFault::NewQemuDies)
        );
        arm(&run, Armed::ClusterRestore, "disk-full=1").unwrap();
        let e = take_cluster_restore(&run).unwrap_err().to_string();
        assert!(
            e.contains("not a fault a cluster restore can inject"),
            "{e}"
        );
        arm(&run, Armed::Snapshot("a"), "x").unwrap();
        disarm(&run, Armed::Snapshot("a"));
        assert_eq!(take_snapshot(&run, "a").unwrap(), None, "disarmed");
    }
}
