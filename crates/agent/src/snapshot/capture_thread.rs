//! The thread that accepts QEMU's connection and captures its stream into
//! an image, and the watchdog that stops it when it stalls.
//!
//! A capture stalls when the disk under the image hangs: it stops reading,
//! the relay stops reading, and QEMU blocks writing its stream. While it
//! blocks, a stop-copy guest stays paused, a hot guest waits at its next
//! write fault, and in its completion phase QEMU holds its main loop lock,
//! so not even QMP answers. So the watchdog does not ask QEMU anything: if
//! the capture takes no bytes and writes nothing for [`STALL_TIMEOUT`]
//! while armed (while QEMU is expected to send, and while the image is
//! written after the stream), it shuts the capture's socket. The relay then
//! discards the rest of the stream, QEMU finishes or fails its migration,
//! and the snapshot fails with [`CaptureThread::stalled`]'s message.

use std::sync::atomic::AtomicU64;

use super::*;
use crate::fault::{Fault, FaultyReader};

/// What the capture thread, its watchdog and the snapshot share.
#[derive(Default)]
struct Shared {
    abort: Arc<AtomicBool>,
    /// QEMU's connection, to shut it from outside the capture thread.
    conn: Mutex<Option<UnixStream>>,
    /// Bytes of the stream taken so far.
    received: AtomicU64,
    /// Progress reports of the capture (it reports while writing the image).
    reports: AtomicU64,
    /// Whether the watchdog counts a lack of progress as a stall.
    armed: AtomicBool,
    /// Set by the watchdog when it stopped a stalled capture.
    stalled: AtomicBool,
    /// Set when the capture thread has returned.
    ended: AtomicBool,
    /// When QEMU was asked to connect (`migrate` sent): the accept
    /// deadline counts from then, not from the capture's start, which in a
    /// cluster snapshot precedes the protocol (and every VM's first read
    /// of its RAM, 32 s under load once) by any time.
    connect_asked: Mutex<Option<Instant>>,
}

impl Shared {
    /// Stops the capture: the reader ends, QEMU's connection is shut.
    fn stop(&self) {
        self.abort.store(true, Ordering::SeqCst);
        if let Some(c) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// When the capture thread returns, or panics: shuts QEMU's connection
/// and sets [`Shared::ended`].
///
/// The connection's clone in [`Shared::conn`] kept the socket open after
/// a capture that failed (a full disk), so QEMU went on writing into a
/// socket nobody read. A stop-copy sends most of guest RAM with QEMU's
/// main loop locked: QEMU blocked there, and the snapshot ended with "timed
/// out after 120s waiting for the reply to query-migrate" instead of the
/// disk-full error (fault_matrix's stop-copy × disk full cell, in CI).
/// Shut, QEMU's next write fails and its migration ends at once. After a
/// capture that succeeded QEMU has closed its end already.
struct EndGuard(Arc<Shared>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        let conn = self.0.conn.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(c) = conn {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.0.ended.store(true, Ordering::SeqCst);
    }
}

/// The thread that accepts QEMU's connection and captures the stream.
pub(super) struct CaptureThread {
    handle: Option<JoinHandle<Result<Captured, String>>>,
    shared: Arc<Shared>,
    stall: Duration,
    pub(super) progress: mpsc::Receiver<String>,
    result: Option<Result<Captured, String>>,
}

impl CaptureThread {
    /// Starts capturing from `listener` into `final_dir`, watched for
    /// stalls of `stall` (see the module doc). QEMU must connect within
    /// `accept` of [`CaptureThread::expect_connection`].
    pub(super) fn start(
        listener: UnixListener,
        final_dir: PathBuf,
        opts: CaptureOptions,
        fault: Option<Fault>,
        stall: Duration,
        accept: Duration,
    ) -> CaptureThread {
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel();
        let sh = shared.clone();
        let handle = std::thread::spawn(move || -> Result<Captured, String> {
            let _end = EndGuard(sh.clone());
            let stream = accept_qemu(&listener, &sh, accept)?;
            stream.set_nonblocking(false).map_err(|e| e.to_string())?;
            if let Ok(c) = stream.try_clone() {
                *sh.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
            }
            if sh.abort.load(Ordering::SeqCst) {
                return Err("aborted".into());
            }
            let stream = Counting {
                inner: FaultyReader::new(stream, fault, sh.abort.clone()),
                shared: sh.clone(),
            };
            capture(
                std::io::BufReader::with_capacity(1 << 20, stream),
                &final_dir,
                opts,
                &mut |p| {
                    sh.reports.fetch_add(1, Ordering::Relaxed);
                    let what = match p.phase {
                        Phase::Receiving => "receiving",
                        Phase::WritingImage => "writing image",
                        Phase::Done => "image complete",
                    };
                    let _ = tx.send(format!(
                        "{what}: {} MiB of stream, {} pages written, {:.1} s",
                        p.stream_bytes >> 20,
                        p.pages_written,
                        p.elapsed.as_secs_f64()
                    ));
                },
            )
            .map_err(|e| e.to_string())
        });
        let sh = shared.clone();
        std::thread::spawn(move || watchdog(&sh, stall));
        CaptureThread {
            handle: Some(handle),
            shared,
            stall,
            progress: rx,
            result: None,
        }
    }

    /// QEMU is asked to connect now (just before `migrate`): from now on
    /// it has the accept timeout to do so.
    pub(super) fn expect_connection(&self) {
        let mut asked = self
            .shared
            .connect_asked
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        asked.get_or_insert_with(Instant::now);
    }

    /// Whether a lack of progress counts as a stall from now on: armed
    /// while QEMU is expected to send.
    pub(super) fn arm(&self, on: bool) {
        self.shared.armed.store(on, Ordering::SeqCst);
    }

    /// The error to report if the watchdog stopped a stalled capture.
    pub(super) fn stalled(&self) -> Option<String> {
        self.shared.stalled.load(Ordering::SeqCst).then(|| {
            format!(
                "the capture made no progress for {:?} after {} MiB of QEMU's stream and was stopped: is the disk the image goes to hung or full?",
                self.stall,
                self.shared.received.load(Ordering::Relaxed) >> 20
            )
        })
    }

    pub(super) fn finished(&mut self) -> bool {
        if self.result.is_none() && self.handle.as_ref().is_some_and(|h| h.is_finished()) {
            let h = self.handle.take().expect("checked");
            self.result = Some(
                h.join()
                    .unwrap_or_else(|_| Err("capture thread panicked".into())),
            );
        }
        self.result.is_some()
    }

    pub(super) fn error(&self) -> Option<&str> {
        match &self.result {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// Waits for the capture to end (QEMU closes the stream at completion)
    /// and the image to be written, passing on its progress; armed, so a
    /// capture stuck on a hung disk fails the snapshot instead of holding
    /// it forever.
    pub(super) fn join(mut self, progress: &mut dyn FnMut(&str)) -> Result<Captured, String> {
        self.arm(true);
        while !self.finished() {
            for m in self.progress.try_iter() {
                progress(&m);
            }
            if let Some(e) = self.stalled() {
                self.abort();
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        for m in self.progress.try_iter() {
            progress(&m);
        }
        let result = self.result.take().expect("finished");
        match self.stalled() {
            Some(e) if result.is_err() => Err(e),
            _ => result,
        }
    }

    /// Stops the capture (its temporary directory is removed) and waits
    /// for it a little: a capture stuck writing to a hung disk is left
    /// behind rather than holding up the guest's resumption.
    pub(super) fn abort(mut self) {
        self.shared.stop();
        let t = Instant::now();
        while !self.finished() {
            if t.elapsed() > ABORT_WAIT {
                crate::log(format!(
                    "the stopped capture has not ended after {ABORT_WAIT:?}; leaving it behind"
                ));
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Waits for QEMU's connection on `listener`: for as long as QEMU has not
/// been asked to connect, then for at most `timeout` after that.
fn accept_qemu(
    listener: &UnixListener,
    sh: &Shared,
    timeout: Duration,
) -> Result<UnixStream, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    loop {
        match listener.accept() {
            Ok((s, _)) => return Ok(s),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if sh.abort.load(Ordering::SeqCst) {
                    return Err("aborted before QEMU connected".into());
                }
                let asked = *sh.connect_asked.lock().unwrap_or_else(|p| p.into_inner());
                if asked.is_some_and(|t| t.elapsed() > timeout) {
                    return Err(format!(
                        "QEMU did not connect within {timeout:?} of being asked to"
                    ));
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            Err(e) => return Err(format!("accept: {e}")),
        }
    }
}

/// How long [`CaptureThread::abort`] waits for the capture to end.
const ABORT_WAIT: Duration = Duration::from_secs(5);

/// Stops the capture once it has made no progress for `stall` while armed;
/// ends with the capture.
fn watchdog(sh: &Shared, stall: Duration) {
    let progress = || {
        (
            sh.received.load(Ordering::Relaxed),
            sh.reports.load(Ordering::Relaxed),
        )
    };
    let mut seen = (progress(), Instant::now());
    while !sh.ended.load(Ordering::SeqCst) && !sh.abort.load(Ordering::SeqCst) {
        let now = progress();
        if now != seen.0 || !sh.armed.load(Ordering::SeqCst) {
            seen = (now, Instant::now());
        } else if seen.1.elapsed() > stall {
            crate::log(format!(
                "the capture made no progress for {stall:?}; stopping it"
            ));
            sh.stalled.store(true, Ordering::SeqCst);
            sh.stop();
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Counts the bytes read through it.
struct Counting<R> {
    inner: R,
    shared: Arc<Shared>,
}

impl<R: std::io::Read> std::io::Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.shared.received.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(dir: &std::path::Path, accept: Duration) -> (CaptureThread, PathBuf) {
        let sock = dir.join("cap.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let cap = CaptureThread::start(
            listener,
            dir.join("img"),
            CaptureOptions::new(vmcsnap_capture::CaptureMode::StopCopy, "t"),
            None,
            Duration::from_secs(60),
            accept,
        );
        (cap, sock)
    }

    fn ended(cap: &mut CaptureThread) -> bool {
        let t = Instant::now();
        while !cap.finished() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        cap.finished()
    }

    /// Regression (cluster_restore_agent_killed.rs under load): a cluster
    /// snapshot's captures start before the protocol; every VM's first
    /// read of its RAM took 32 s, and the 30 s accept timeout, counted
    /// from the capture's start, had passed before `migrate` was sent:
    /// "QEMU did not connect within 30s" on both VMs.
    #[test]
    fn the_accept_timeout_counts_from_the_request_to_connect() {
        let d = tempfile::tempdir().unwrap();
        let (mut cap, sock) = started(d.path(), Duration::from_millis(50));
        std::thread::sleep(Duration::from_millis(300));
        assert!(!cap.finished(), "timed out before QEMU was asked");
        cap.expect_connection();
        let mut qemu = UnixStream::connect(&sock).unwrap();
        use std::io::Write;
        let _ = qemu.write_all(b"not a migration stream");
        drop(qemu);
        assert!(ended(&mut cap));
        let e = cap.error().expect("garbage is an error").to_string();
        assert!(!e.contains("did not connect"), "{e}");
    }

    /// Regression: QEMU's writes after a failed capture must fail, not
    /// block (see [`EndGuard`]).
    #[test]
    fn qemu_writing_into_a_failed_capture_is_cut_off() {
        let d = tempfile::tempdir().unwrap();
        let (mut cap, sock) = started(d.path(), Duration::from_secs(10));
        cap.expect_connection();
        let mut qemu = UnixStream::connect(&sock).unwrap();
        qemu.set_write_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        use std::io::Write;
        let _ = qemu.write_all(b"not a migration stream");
        assert!(ended(&mut cap));
        assert!(cap.error().is_some(), "garbage is an error");
        let chunk = vec![0u8; 1 << 20];
        let e = (0..64)
            .find_map(|_| qemu.write_all(&chunk).err())
            .expect("64 MiB went into a capture that had failed");
        assert!(
            matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset),
            "QEMU's write blocked or failed otherwise: {e}"
        );
    }

    #[test]
    fn qemu_that_never_connects_once_asked_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let (mut cap, _sock) = started(d.path(), Duration::from_millis(50));
        cap.expect_connection();
        assert!(ended(&mut cap));
        let e = cap.error().expect("an error").to_string();
        assert!(e.contains("did not connect within"), "{e}");
    }
}
