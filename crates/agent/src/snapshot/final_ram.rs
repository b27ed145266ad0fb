//! Pre-copy: the paused guest's RAM, hashed for the capture's check of the
//! pages QEMU sent (see `vmcsnap_capture::ram_check` and docs/snapshot.md,
//! "Pre-copy is checked against the paused guest's RAM").
//!
//! QEMU 7.2 under TCG can miss a guest write in its dirty tracking, and a
//! pre-copy stream then ends with an older copy of that page. Guest RAM is
//! a shared file under /dev/shm, so while QEMU holds the guest paused for
//! the switch-over the agent hashes every page of it ([`RamCheck::start`],
//! in threads, overlapping the disk snapshot and QEMU's last copy); when
//! the stream has ended the capture compares those hashes with the pages
//! it staged and takes every page that differs from the file. The guest is
//! resumed only after that ([`RamCheck::wait_checked`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Condvar;

use vmcsnap_capture::{CaptureError, FinalRam, FinalRamCheck, FinalRamSource, RamCheckReport};

use super::*;

/// The RAM block of guest memory: the `memory-backend-file` of every VM
/// (`id=mem`, `crate::qemu`), whose bytes are the VM's RAM file.
const RAM_BLOCK: &str = "mem";
/// At most this many threads hash RAM.
const MAX_HASH_THREADS: usize = 4;
/// How long the capture waits for RAM to be hashed.
const HASH_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Default)]
struct State {
    /// The hashed RAM, until the capture takes it.
    ram: Option<Result<FinalRam, String>>,
    /// Milliseconds the hashing took.
    hash_ms: Option<f64>,
    /// Why the snapshot gave up (the capture must not wait any more).
    gave_up: Option<String>,
    /// What the capture's check found.
    outcome: Option<Result<RamCheckReport, String>>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }
}

impl FinalRamSource for Shared {
    fn final_ram(&self) -> Result<FinalRam, String> {
        let deadline = Instant::now() + HASH_TIMEOUT;
        let mut st = self.lock();
        loop {
            if let Some(why) = &st.gave_up {
                return Err(why.clone());
            }
            if let Some(ram) = st.ram.take() {
                return ram;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the guest's RAM was not hashed within {HASH_TIMEOUT:?} of the stream's end"
                ));
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn checked(&self, outcome: Result<&RamCheckReport, &CaptureError>) {
        let outcome = outcome.cloned().map_err(|e| e.to_string());
        self.set(|s| s.outcome = Some(outcome));
    }
}

/// The agent's side of a pre-copy capture's RAM check.
pub(super) struct RamCheck {
    shared: Arc<Shared>,
}

impl RamCheck {
    /// A check, and what the capture's options take.
    pub(super) fn new() -> (RamCheck, FinalRamCheck) {
        let shared = Arc::new(Shared::default());
        let source = FinalRamCheck(shared.clone() as Arc<dyn FinalRamSource>);
        (RamCheck { shared }, source)
    }

    /// The guest is paused for the switch-over: hashes `ram_file` (guest
    /// RAM) in the background for the capture.
    pub(super) fn start(&self, ram_file: &Path) {
        let shared = self.shared.clone();
        let path = ram_file.to_path_buf();
        std::thread::spawn(move || {
            let t = Instant::now();
            let ram = hash_file(&path);
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            shared.set(|s| {
                s.ram = Some(ram);
                s.hash_ms = Some(ms);
            });
        });
    }

    /// Milliseconds hashing RAM took, once done.
    pub(super) fn hash_ms(&self) -> Option<f64> {
        self.shared.lock().hash_ms
    }

    /// The snapshot failed: a capture waiting for RAM stops waiting.
    pub(super) fn give_up(&self, why: &str) {
        let why = why.to_string();
        self.shared.set(|s| {
            s.gave_up.get_or_insert(why);
        });
    }

    /// Waits (the guest paused) until the capture has checked its pages
    /// against RAM; fails if the check failed, the capture ended in error
    /// or stalled.
    pub(super) fn wait_checked(&self, cap: &mut CaptureThread) -> Result<RamCheckReport, String> {
        cap.arm(true);
        let result = loop {
            {
                let st = self.shared.lock();
                if let Some(outcome) = &st.outcome {
                    break outcome.clone();
                }
                let _ = self
                    .shared
                    .changed
                    .wait_timeout(st, Duration::from_millis(5));
            }
            if let Some(e) = cap.stalled() {
                break Err(e);
            }
            if cap.finished() {
                // Finished without telling: it failed before the check.
                let st = self.shared.lock();
                break match (&st.outcome, cap.error()) {
                    (Some(o), _) => o.clone(),
                    (None, Some(e)) => Err(format!("capture: {e}")),
                    (None, None) => Err("the capture ended without checking its pages".into()),
                };
            }
        };
        cap.arm(false);
        result
    }
}

impl Drop for RamCheck {
    fn drop(&mut self) {
        self.give_up("the snapshot ended");
    }
}

/// Hashes every page of guest RAM in `path`.
fn hash_file(path: &Path) -> Result<FinalRam, String> {
    let file =
        File::open(path).map_err(|e| format!("opening guest RAM {}: {e}", path.display()))?;
    let len = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_HASH_THREADS) as u64;
    let ps = page_size() as u64;
    let per = (len / ps).div_ceil(threads).max(1) * ps;
    // Each share in a thread of its own, at the priority of a hot pause's
    // QEMU work (where permitted): this is guest downtime, and other VMs'
    // vCPUs can wait for it.
    let shares: Vec<Result<Vec<u128>, std::io::Error>> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..threads)
            .map(|i| (i * per, per.min(len.saturating_sub(i * per))))
            .filter(|&(_, n)| n > 0)
            .map(|(at, n)| {
                let file = &file;
                s.spawn(move || {
                    pause_priority();
                    vmcsnap_capture::ram_check::hash_pages(file, at, n, ps as usize, 1)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a hashing thread panicked")))
            })
            .collect()
    });
    let mut hashes = Vec::with_capacity((len / ps) as usize);
    for share in shares {
        hashes.extend(share.map_err(|e| format!("reading guest RAM {}: {e}", path.display()))?);
    }
    if len % ps != 0 {
        return Err(format!(
            "guest RAM {} is {len} bytes, not a whole number of pages",
            path.display()
        ));
    }
    Ok(FinalRam {
        block: RAM_BLOCK.into(),
        file,
        file_offset: 0,
        hashes,
    })
}

/// Raises the calling thread to [`PAUSE_NICE`] (best effort: needs
/// CAP_SYS_NICE). Only the agent's own hashing threads, which end with it.
fn pause_priority() {
    // SAFETY: gettid takes nothing and returns the caller's thread id.
    let tid = unsafe { libc::gettid() };
    crate::thread_priority::set_nice(tid as u32, PAUSE_NICE);
}

/// Guest pages are 4 KiB (x86).
fn page_size() -> usize {
    4096
}

/// `precopy-untracked-write=PAGE`: the bytes of a page changed behind
/// QEMU's back, to put back before the guest resumes.
pub(super) struct UntrackedWrite {
    file: File,
    at: u64,
    original: Vec<u8>,
}

impl UntrackedWrite {
    /// Changes `page` of guest RAM in `ram_file` (every byte inverted).
    pub(super) fn make(ram_file: &Path, page: u64) -> Result<UntrackedWrite, AgentError> {
        let io = || AgentError::io("changing a page of guest RAM in", ram_file);
        let file = File::options()
            .read(true)
            .write(true)
            .open(ram_file)
            .map_err(io())?;
        let at = page * page_size() as u64;
        let mut original = vec![0u8; page_size()];
        file.read_exact_at(&mut original, at).map_err(io())?;
        let changed: Vec<u8> = original.iter().map(|b| !b).collect();
        file.write_all_at(&changed, at).map_err(io())?;
        Ok(UntrackedWrite { file, at, original })
    }

    /// Puts the page back as it was.
    pub(super) fn undo(self) {
        if let Err(e) = self.file.write_all_at(&self.original, self.at) {
            log(format!(
                "putting back the page changed by the injected fault: {e}"
            ));
        }
    }
}
