//! The thread that accepts QEMU's connection and captures its stream into
//! an image.

use super::*;

/// The thread that accepts QEMU's connection and captures the stream.
pub(super) struct CaptureThread {
    handle: Option<JoinHandle<Result<Captured, String>>>,
    abort: Arc<AtomicBool>,
    conn: Arc<Mutex<Option<UnixStream>>>,
    pub(super) progress: mpsc::Receiver<String>,
    result: Option<Result<Captured, String>>,
}

impl CaptureThread {
    pub(super) fn start(listener: UnixListener, final_dir: PathBuf, opts: CaptureOptions) -> CaptureThread {
        let abort = Arc::new(AtomicBool::new(false));
        let conn: Arc<Mutex<Option<UnixStream>>> = Arc::new(Mutex::new(None));
        let (tx, rx) = mpsc::channel();
        let (abort2, conn2) = (abort.clone(), conn.clone());
        let handle = std::thread::spawn(move || -> Result<Captured, String> {
            listener.set_nonblocking(true).map_err(|e| e.to_string())?;
            let deadline = Instant::now() + ACCEPT_TIMEOUT;
            let stream = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if abort2.load(Ordering::SeqCst) {
                            return Err("aborted before QEMU connected".into());
                        }
                        if Instant::now() > deadline {
                            return Err(format!("QEMU did not connect within {ACCEPT_TIMEOUT:?}"));
                        }
                        std::thread::sleep(Duration::from_micros(500));
                    }
                    Err(e) => return Err(format!("accept: {e}")),
                }
            };
            stream.set_nonblocking(false).map_err(|e| e.to_string())?;
            if let Ok(c) = stream.try_clone() {
                *conn2.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
            }
            if abort2.load(Ordering::SeqCst) {
                return Err("aborted".into());
            }
            capture(std::io::BufReader::with_capacity(1 << 20, stream), &final_dir, opts, &mut |p| {
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
            })
            .map_err(|e| e.to_string())
        });
        CaptureThread { handle: Some(handle), abort, conn, progress: rx, result: None }
    }

    pub(super) fn finished(&mut self) -> bool {
        if self.result.is_none() && self.handle.as_ref().is_some_and(|h| h.is_finished()) {
            let h = self.handle.take().expect("checked");
            self.result = Some(h.join().unwrap_or_else(|_| Err("capture thread panicked".into())));
        }
        self.result.is_some()
    }

    pub(super) fn error(&self) -> Option<&str> {
        match &self.result {
            Some(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// Waits for the capture to end (QEMU closes the stream at completion).
    pub(super) fn join(mut self) -> Result<Captured, String> {
        if let Some(h) = self.handle.take() {
            self.result = Some(h.join().unwrap_or_else(|_| Err("capture thread panicked".into())));
        }
        self.result.take().expect("joined")
    }

    /// Stops the capture (its temporary directory is removed).
    pub(super) fn abort(mut self) {
        self.abort.store(true, Ordering::SeqCst);
        if let Some(c) = self.conn.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
