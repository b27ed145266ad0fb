//! Committing a captured image with a deadline.
//!
//! The commit fsyncs every file of the image, then renames it into place.
//! On a disk that hangs (a dead NFS server, a failing device) fsync never
//! returns; as the agent serves one request at a time, a commit waited on
//! forever would hold the snapshot request and every later request with it
//! (`status`, `down`), although the VM itself runs on. So the commit runs
//! in a thread of its own, watched:
//!
//! ```text
//!   request thread                      commit thread
//!   ──────────────                      ─────────────
//!   spawn ─────────────────────────────► commit_unless(cancelled)
//!   wait, progress every 5 s               fsync memory.img, pages.idx, ...
//!   deadline passed:                       (hangs on the disk)
//!     set `cancelled`                      ...
//!     wait up to 5 s for the thread        check `cancelled` before rename:
//!     fail the snapshot                      set → remove the temporary
//!                                            directory, commit nothing
//! ```
//!
//! A commit given up on never appears later: the image library checks
//! `cancelled` before the rename. If the disk never answers, the thread
//! and the temporary directory stay until the agent exits (`cleanup_stale`
//! removes the directory at the next agent start).
//!
//! The deadline is generous: [`COMMIT_BASE`] plus the image's size at
//! [`COMMIT_MIN_RATE`]. The fault `commit-stall-deadline=SECONDS`
//! (`crate::fault`) makes the commit hang until cancelled, with a deadline
//! of SECONDS, for the tests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use vmcsnap_capture::{Captured, CommittedInfo};

use crate::fault::Fault;

/// The part of a commit's deadline that does not depend on its size.
pub const COMMIT_BASE: Duration = Duration::from_secs(120);
/// The slowest disk the deadline allows for (bytes/s).
pub const COMMIT_MIN_RATE: u64 = 16 << 20;
/// How often a long commit reports that it still waits.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How long a cancelled commit gets to clean up before it is left behind.
const CANCEL_WAIT: Duration = Duration::from_secs(5);

/// The deadline for committing an image of `bytes`.
pub fn deadline_for(bytes: u64) -> Duration {
    COMMIT_BASE + Duration::from_secs(bytes / COMMIT_MIN_RATE)
}

/// Commits `captured` within `deadline` (or the fault's); the error says
/// what happened. `fault` = `commit-stall-deadline` hangs the commit until
/// it is given up on.
pub fn commit_within(
    captured: Captured,
    deadline: Duration,
    fault: Option<Fault>,
    progress: &mut dyn FnMut(&str),
) -> Result<CommittedInfo, String> {
    let (deadline, stall) = match crate::fault::commit_stall(fault) {
        Some(stalled) => (stalled, true),
        None => (deadline, false),
    };
    let cancelled = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let flag = cancelled.clone();
    let spawned = std::thread::Builder::new()
        .name("image-commit".into())
        .spawn(move || {
            while stall && !flag.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = tx.send(captured.commit_unless(&flag).map_err(|e| e.to_string()));
        });
    if let Err(e) = spawned {
        return Err(format!("starting the commit thread: {e}"));
    }
    let t = Instant::now();
    loop {
        match rx.recv_timeout(PROGRESS_EVERY.min(deadline.saturating_sub(t.elapsed()))) {
            Ok(r) => return r,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err("the commit thread ended without a result".into())
            }
            Err(mpsc::RecvTimeoutError::Timeout) if t.elapsed() < deadline => {
                progress(&format!(
                    "committing the image: waiting for the disk to complete its writes ({:.0} s)",
                    t.elapsed().as_secs_f64()
                ));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => break,
        }
    }
    cancelled.store(true, Ordering::SeqCst);
    let left = match rx.recv_timeout(CANCEL_WAIT) {
        // It renamed the image into place just before it saw the flag: the
        // snapshot is committed, late.
        Ok(Ok(info)) => return Ok(info),
        Ok(Err(_)) | Err(mpsc::RecvTimeoutError::Disconnected) => "",
        Err(mpsc::RecvTimeoutError::Timeout) => {
            crate::log(format!("the image commit given up on has not ended after {CANCEL_WAIT:?}; leaving it behind"));
            " (its temporary directory goes once the disk answers, or at the next agent start)"
        }
    };
    Err(format!(
        "committing the image did not finish within {deadline:?}: the disk under the snapshots directory does not complete \
         its writes (hung?); the VM runs on and no snapshot was kept{left}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_grows_with_the_image() {
        assert_eq!(deadline_for(0), COMMIT_BASE);
        assert_eq!(
            deadline_for(16 << 30),
            COMMIT_BASE + Duration::from_secs(1024)
        );
    }
}
