//! Faults injected on purpose, for the tests of what a failed snapshot or
//! cluster restore leaves behind.
//!
//! A failure in the middle of a migration is hard to provoke from outside
//! (a disk that fills or hangs while the image is written), yet it is the
//! case where a careless failure path leaves a guest paused. A snapshot
//! request may therefore carry a fault (the CLI's hidden `vmcsnap snapshot
//! VM --inject-fault FAULT`), which that snapshot's capture obeys:
//!
//! | FAULT | what the capture does |
//! |---|---|
//! | `capture-error-after=BYTES` | reads BYTES of QEMU's stream, then fails as a full disk would |
//! | `capture-stall-after=BYTES` | reads BYTES, then stops reading without closing, as a hung disk would |
//! | `commit-stall-deadline=SECONDS` | the image's commit hangs (as fsync on a hung disk) until the agent gives up on it, after SECONDS |
//! | `panic-when-paused` | the request's handler panics right after the VM was paused, as a bug in the agent would |
//! | `precopy-untracked-write=PAGE` | pre-copy only: in the switch-over pause, page PAGE of guest RAM is changed through the RAM file, a write QEMU's dirty tracking never sees (as TCG can miss one); the original bytes are put back before the guest resumes |
//! | `ram-read-delay=SECONDS` | a first hot snapshot's read of guest RAM (before the pause) takes SECONDS longer, as it does for a large guest on a busy host |
//! | `hang-when-paused` | the request's handler stops for [`HANG_WHEN_PAUSED`] right after the VM was paused (in a hot snapshot, with QEMU's priority raised), then fails: time for a test to kill the agent there |
//!
//! A cluster restore may carry a [`RestoreFault`] (the CLI's hidden
//! `vmcsnap restore --cluster SNAP --inject-fault FAULT`):
//!
//! | FAULT | what the restore does |
//! |---|---|
//! | `cohort-fail-when-peers-loaded=VM` | VM's Cohort, once VM is loaded, waits until every other VM is loaded too, then reports a failure in place of LOAD_FIN |
//! | `qemu-killed-when-peers-loaded=VM` | at the same moment, VM's QEMU is killed (SIGKILL) as a crash would, and no LOAD_FIN is sent: the restore has to notice the dead QEMU by itself |
//!
//! | `background-held-until=PATH` | every VM's page source pushes no page in the background (demand faults only) until PATH exists: the guests run while most of their pages are still to load |
//! | `start-held-until=PATH` | START reaches no VM until PATH exists (the Coordinator sent it; the Cohort's worker waits): every VM is loaded and paused, waiting for START |
//!
//! With VM in a ring (or every other VM after it on the restore line), no
//! guest can have started when the failure comes: every other VM is
//! abandoned while paused, waiting for START, which a real failure hits
//! only by chance. The last two leave time for a test to kill the agent
//! at those stages of a cluster restore (docs/reliability.md).
//!
//! An unknown FAULT is refused, so a typo cannot silently test nothing.

use std::io::{Error, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
}
