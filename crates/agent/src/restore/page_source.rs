//! The page source of a restore (of one VM, or of each VM of a cluster
//! restore) as a process of its own, so that the guest keeps its pages
//! coming when the agent dies.
//!
//! A lazily or working-set restored guest runs before all its pages are
//! loaded: every page it touches first is a postcopy request answered by
//! the page source. Were the agent the source, a dead agent would freeze
//! the guest. So the agent, once QEMU listens for its stream, connects to
//! it and hands the socket to `vmcsnap page-source --dir DIR --detach`
//! ([`spawn`]), which, like the stream relay ([`crate::relay`]), forks, lets
//! its first process exit (init reaps it) and runs in a process group of its
//! own: a `kill -9` of the agent, or a signal to its group, does not reach
//! it. It serves QEMU from the image as the agent did in-process
//! ([`serve`]).
//!
//! Its directory (`<vm-dir>/page-source/`) holds what each side needs:
//!
//! ```text
//!  job.json       written by the agent before the start: the plan (pages
//!                 before RUN, background order), and what finishing the
//!                 restore takes (the learning inputs, the VM's record)
//!  pid            the page source's pid (its first act)
//!  observed.json  the agent's observations as it makes them (RUN sent, the
//!                 guest's start, the accessed-bit counters at the start)
//!  result.json    the page source's outcome, its last act: what it sent,
//!                 every demand fault, or why it failed
//!  control.sock   its control socket (super::control): START's hold of
//!                 the background push, the counters of what it loaded
//! ```
//!
//! While the agent lives it also reads the source's events as they happen
//! (RUN sent, pages loaded) from a pipe, the source's stdout; a source whose
//! agent went away stops writing them and serves on. The agent that ends the
//! restore (the one that started it, or the next one, which adopts the
//! restore: [`crate::restore_journal`]) reads `result.json` and makes the
//! report, the quality figures and the record of what the restore learned
//! from the files ([`super::finish`]); then it removes the directory.
//!
//! A cluster restore runs one such source per VM. What START (the
//! Coordinator's order of starts) needs of it goes through its control
//! socket ([`super::control`]): the agent holds the background push for
//! the start's quiet time just before the guest's `cont`, and reads what
//! the source had loaded when the guest started. Whichever agent serves
//! connects to it. A `kill -9` of the agent during a cluster restore:
//!
//! ```text
//!  before every VM's source runs   the next agent kills every QEMU and
//!                                  source of it and redoes it, eager-rl
//!  sources serve, some VMs wait    it adopts every VM and gives those
//!  for START (paused, or QEMU      waiting START together (hold, `cont`):
//!  loading their device state)     none is left paused
//!  every guest runs, pages load    it adopts every VM; the guests never
//!                                  noticed
//!  then, in both adopted cases     each VM's restore is finished from
//!                                  these files as its source ends
//! ```
//!
//! ([`crate::cluster_restore::adopt`]; docs/reliability.md.)

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use vmcsnap_image::PageKey;
use vmcsnap_migstream::postcopy::{
    self, BackgroundHold, PageId, PostcopyError, SourceConfig, SourceEvent, SourceReport,
};
use vmcsnap_workingset::Mode;

use super::control;
use super::pages::ImagePages;
use super::priority;
use crate::accessed::RamUse;
use crate::record::VmRecord;

/// The directory of a VM's page source, in its VM directory.
pub const DIR: &str = "page-source";

/// `<vm-dir>/page-source`.
pub fn dir_of(vm_dir: &Path) -> PathBuf {
    vm_dir.join(DIR)
}

/// What went wrong with a page-source process or its files.
#[derive(Debug, thiserror::Error)]
pub enum PageSourceError {
    /// A file or process call failed.
    #[error("page source: {what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `job.json` or `result.json` does not parse.
    #[error("page source: {} is unreadable ({detail}); the restore cannot be finished from it, restore the VM again", path.display())]
    BadFile {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        detail: String,
    },
    /// The snapshot cannot be read.
    #[error("page source: snapshot {}: {detail}", dir.display())]
    Image {
        /// The snapshot's directory.
        dir: PathBuf,
        /// What the reader said.
        detail: String,
    },
    /// `vmcsnap page-source` did not start.
    #[error("the page source ({exe}) could not start: {status}; see {log}", exe = exe.display(), log = log.display())]
    Start {
        /// The executable.
        exe: PathBuf,
        /// How its first process ended.
        status: std::process::ExitStatus,
        /// Its log.
        log: PathBuf,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> PageSourceError {
    let path = path.to_path_buf();
    move |source| PageSourceError::Io { what, path, source }
}

/// What the page source sends and how (read by the process).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourcePlan {
    /// The snapshot's directory.
    pub snap_dir: PathBuf,
    /// Pages sent before RUN, in order (block, page).
    pub before_run: Vec<(u32, u32)>,
    /// Background order (block, page).
    pub background: Vec<(u32, u32)>,
    /// Pages sent per demand fault at most (with its neighbours).
    pub demand_cluster: u32,
    /// Only demand faults for this long after RUN (ms); `None`: background
    /// push at once.
    pub background_after_ms: Option<u64>,
    /// Locality blocks read ahead after a demand fault's own block.
    pub prefetch_blocks: usize,
    /// Raise the fault path's CPU priority and lower the background's.
    pub priorities: bool,
    /// A cluster restore: the background is held this long once START
    /// comes (asked on the control socket by whichever agent starts it).
    #[serde(default)]
    pub start_quiet_ms: u64,
    /// A cluster restore: the background push is held from the source's
    /// start until START (at most [`HOLD_UNTIL_START_MAX`]): a VM that
    /// waits for START does not compete with the VMs still loading their
    /// working sets. START ends it ([`control::Request::Start`]).
    #[serde(default)]
    pub hold_until_start: bool,
    /// Testing (`crate::fault`, `background-held-until=PATH`): only demand
    /// faults are served while this file does not exist.
    #[serde(default)]
    pub hold_until_exists: Option<PathBuf>,
    /// Requested pages go on QEMU's postcopy-preempt channel, handed to the
    /// process as fd [`PREEMPT_FD`].
    #[serde(default)]
    pub preempt: bool,
}

/// Where the page-source process finds the preempt channel's socket.
pub const PREEMPT_FD: i32 = 3;

/// The longest a cluster restore's source holds its background push for
/// START ([`SourcePlan::hold_until_start`]); START comes within the
/// Coordinator's load deadline or the restore is abandoned.
pub const HOLD_UNTIL_START_MAX: Duration = Duration::from_secs(600);

/// What finishing the restore takes (read by whoever finishes it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FinishJob {
    /// The snapshot's name.
    pub snapshot: String,
    /// Its directory (where the record of what the restore learned goes).
    pub snap_dir: PathBuf,
    /// The restore mode.
    pub mode: Mode,
    /// Kept paused.
    pub paused: bool,
    /// Recorded as a trace.
    pub trace: bool,
    /// A cluster restore (QEMU -S, the guest started on START).
    pub prepared: bool,
    /// When the request arrived, unix µs.
    pub t0_unix_us: u64,
    /// The pages sent before RUN (block, page).
    pub before_run: Vec<(u32, u32)>,
    /// The queue the working set was the head of.
    pub queue: Vec<(u32, u32)>,
    /// The working-set size asked for.
    pub wss: u64,
    /// HotRestore's hybrid size.
    pub hybrid: u64,
    /// WSS_sample.
    pub wss_sample: Option<u64>,
    /// WSS_snapshot.
    pub wss_snapshot: u64,
    /// The working set came from an earlier restore's learning.
    pub learned: bool,
    /// The access data, as reported.
    pub access_data: String,
}

/// `job.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourceJob {
    /// For the page source.
    pub plan: SourcePlan,
    /// For whoever finishes the restore.
    pub finish: FinishJob,
    /// The restored VM as the agent records it (the next agent adopts it
    /// from this if the restore's own agent died).
    pub member: VmRecord,
}

/// What the agent saw of the guest's way to running (`observed.json`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Observed {
    /// Request to RUN sent.
    pub run_sent_ms: Option<f64>,
    /// Request to the guest running.
    pub latency_ms: Option<f64>,
    /// In a cluster restore, request to START.
    pub start_received_ms: Option<f64>,
    /// In a cluster restore, request to the device state loaded (the VM
    /// ready for START, LOAD_FIN sent).
    #[serde(default)]
    pub loaded_ms: Option<f64>,
    /// Request to QEMU listening for the stream and the page source
    /// started: from here to `run_sent_ms` the working set is sent.
    #[serde(default)]
    pub qemu_ready_ms: Option<f64>,
    /// In a cluster restore: its source had pushed pages in the
    /// background before START (it holds them until START).
    #[serde(default)]
    pub background_before_start: bool,
    /// Memory-image bytes read before the start.
    pub bytes_before: u64,
    /// Pages loaded before the start (a cluster restore).
    pub pages_before: u64,
    /// When the accessed bits were cleared at the start (unix µs), and the
    /// RAM counters then.
    pub at_start: Option<(u64, RamUse)>,
    /// QEMU threads raised.
    pub qemu_threads_raised: Option<usize>,
}

/// What the page source did (`result.json` when it succeeded).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// When it started sending, unix µs.
    pub started_unix_us: u64,
    /// Pages of the VM.
    pub pages_total: u64,
    /// Pages sent before RUN.
    pub pages_before_run: u64,
    /// Page bytes read and sent before RUN (zero pages count 0).
    pub bytes_before_run: u64,
    /// Demand faults: ms since RUN, block, page.
    pub demand: Vec<(f64, u32, u32)>,
    /// Pages sent because of demand faults.
    pub pages_on_demand: u64,
    /// Pages pushed in the background.
    pub pages_background: u64,
    /// Requested pages sent on the postcopy-preempt channel.
    #[serde(default)]
    pub pages_on_preempt: u64,
    /// Per requested page: its request's arrival to its record written,
    /// ms (see [`SourceReport::demand_served`]).
    #[serde(default)]
    pub demand_served_ms: Vec<f64>,
    /// From its start until the last page was sent, ms.
    pub all_sent_after_ms: f64,
    /// Memory-image bytes read in all (what the control socket's counters
    /// said last).
    #[serde(default)]
    pub bytes_read: u64,
    /// Pages read in all.
    #[serde(default)]
    pub pages_read: u64,
}

impl Outcome {
    /// From the postcopy source's report, started at `started`.
    pub fn of(rep: &SourceReport, started: SystemTime) -> Outcome {
        Outcome {
            started_unix_us: super::job::unix_us(started),
            pages_total: rep.pages_total,
            pages_before_run: rep.pages_before_run,
            bytes_before_run: rep.bytes_before_run,
            demand: rep
                .demand
                .iter()
                .map(|(d, id)| (d.as_secs_f64() * 1000.0, id.block, id.page))
                .collect(),
            pages_on_demand: rep.pages_on_demand,
            pages_background: rep.pages_background,
            pages_on_preempt: rep.pages_on_preempt,
            demand_served_ms: rep
                .demand_served
                .iter()
                .map(|d| d.as_secs_f64() * 1000.0)
                .collect(),
            all_sent_after_ms: rep.all_sent_after.as_secs_f64() * 1000.0,
            bytes_read: 0,
            pages_read: 0,
        }
    }
}

/// How a page source ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ended", rename_all = "lowercase")]
pub enum Ended {
    /// Every page sent, the destination done.
    Done(Outcome),
    /// It failed; `own`: by its own fault (a corrupt page, a bad plan), not
    /// because its QEMU went away.
    Failed {
        /// Why.
        detail: String,
        /// The source's own failure.
        own: bool,
    },
}

impl Ended {
    /// From the postcopy source's result.
    pub fn of(r: &Result<SourceReport, PostcopyError>, started: SystemTime) -> Ended {
        match r {
            Ok(rep) => Ended::Done(Outcome::of(rep, started)),
            Err(e) => Ended::Failed {
                detail: e.to_string(),
                own: matches!(
                    e,
                    PostcopyError::PageSource { .. } | PostcopyError::InvalidConfig { .. }
                ),
            },
        }
    }
}

/// The source's events as the agent reads them from its stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Wire {
    /// The PACKAGED blob with RUN is written.
    RunSent,
    /// Pages written so far.
    Progress {
        /// Written.
        sent: u64,
        /// Of.
        total: u64,
    },
    /// The last page is written.
    AllSent,
}

impl Wire {
    /// The source event it stands for.
    pub fn event(self) -> SourceEvent {
        match self {
            Wire::RunSent => SourceEvent::RunSent,
            Wire::Progress { sent, total } => SourceEvent::Progress { sent, total },
            Wire::AllSent => SourceEvent::AllSent,
        }
    }
}

const JOB: &str = "job.json";
const PID: &str = "pid";
const OBSERVED: &str = "observed.json";
const RESULT: &str = "result.json";

/// Writes `bytes` to `dir/name` through a temporary file and a rename (no
/// fsync: these files matter while the processes live, not across a host
/// crash, and the agent writes some while a guest waits).
fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), PageSourceError> {
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io("writing", &tmp))?;
    let path = dir.join(name);
    std::fs::rename(&tmp, &path).map_err(io("renaming to", &path))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, PageSourceError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("reading", path)(e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| PageSourceError::BadFile {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })
}

/// Creates the directory afresh and writes the job into it.
pub fn write_job(dir: &Path, job: &SourceJob) -> Result<(), PageSourceError> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    write_file(dir, JOB, &serde_json::to_vec(job).expect("job serialises"))
}

/// The job in `dir`, if any.
pub fn read_job(dir: &Path) -> Result<Option<SourceJob>, PageSourceError> {
    read_json(&dir.join(JOB))
}

/// Records what the agent saw so far (best effort: a restore whose agent
/// lives does not need the file).
pub fn write_observed(dir: &Path, o: &Observed) {
    if let Err(e) = write_file(dir, OBSERVED, &serde_json::to_vec(o).expect("serialises")) {
        crate::log(format!("{e}"));
    }
}

/// What the restore's agent saw before it died (nothing if it wrote
/// nothing).
pub fn read_observed(dir: &Path) -> Observed {
    read_json(&dir.join(OBSERVED))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// How the page source ended, if it has.
pub fn read_result(dir: &Path) -> Result<Option<Ended>, PageSourceError> {
    read_json(&dir.join(RESULT))
}

/// What the page source of `dir` has read so far: asked on its control
/// socket, or, once it has ended, from its result. `None` (logged) if
/// neither says.
pub fn counters(dir: &Path, c: &mut control::Control) -> Option<control::Counters> {
    let e = match c.ask(control::Request::Counters) {
        Ok(n) => return Some(n),
        Err(e) => e,
    };
    match read_result(dir) {
        Ok(Some(Ended::Done(o))) => Some(control::Counters {
            bytes_read: o.bytes_read,
            pages_read: o.pages_read,
            background_begun: o.pages_background > 0,
        }),
        _ => {
            crate::log(format!("{e}"));
            None
        }
    }
}

/// START for the page source of `dir`: ends its hold until START and
/// holds the background push for `ms` (the start's quiet time) from now;
/// nothing to do for a source that has pushed every page.
pub fn start(dir: &Path, c: &mut control::Control, ms: u64) -> Option<control::Counters> {
    let r = c.ask(control::Request::Start { ms });
    if let Err(e) = &r {
        if !matches!(read_result(dir), Ok(Some(Ended::Done(_)))) {
            crate::log(format!("{e}"));
        }
    }
    r.ok()
}

/// The pid of the page source serving from `dir`, if it still runs.
pub fn running(dir: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(dir.join(PID))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    let dir = dir.as_os_str().as_encoded_bytes();
    let is_ours = args.contains(&&b"page-source"[..]) && args.contains(&dir);
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true);
    (is_ours && !zombie).then_some(pid)
}

/// Waits until the page source of `dir` has ended (its result written, or
/// its process gone), and returns how.
pub fn wait_ended(dir: &Path) -> Ended {
    loop {
        match read_result(dir) {
            Ok(Some(e)) => return e,
            Err(e) => {
                return Ended::Failed {
                    detail: e.to_string(),
                    own: false,
                }
            }
            Ok(None) => {}
        }
        if running(dir).is_none() {
            // It may have written its result just before it exited.
            return match read_result(dir) {
                Ok(Some(e)) => e,
                _ => Ended::Failed {
                    detail: format!(
                        "the page source ended without a result (see {})",
                        log_of(dir).display()
                    ),
                    own: false,
                },
            };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The page source's stderr, next to its directory (kept after a restore).
pub fn log_of(dir: &Path) -> PathBuf {
    dir.with_file_name("page-source.log")
}

/// Starts `exe page-source --dir dir --detach` on `stream` (QEMU's
/// incoming socket, connected) and, with `preempt`, QEMU's preempt channel
/// (the second connection) as fd [`PREEMPT_FD`]; waits for it to detach.
/// Returns the read end of its event pipe.
#[allow(unsafe_code)]
pub fn spawn(
    exe: &Path,
    dir: &Path,
    stream: UnixStream,
    preempt: Option<UnixStream>,
) -> Result<std::fs::File, PageSourceError> {
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| io("creating a pipe for", dir)(e.into()))?;
    let log = log_of(dir);
    let stderr = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(io("opening", &log))?;
    let status = {
        let mut cmd = Command::new(exe);
        cmd.arg("page-source")
            .arg("--dir")
            .arg(dir)
            .arg("--detach")
            .stdin(Stdio::from(OwnedFd::from(stream)))
            .stdout(Stdio::from(write_end))
            .stderr(Stdio::from(stderr))
            .process_group(0);
        if let Some(p) = &preempt {
            let fd = p.as_raw_fd();
            // SAFETY: runs in the child between fork and exec, where only
            // async-signal-safe calls are allowed: dup2 is one, and it
            // leaves the new fd open across exec (no FD_CLOEXEC).
            unsafe {
                cmd.pre_exec(move || {
                    let r = if fd == PREEMPT_FD {
                        // Already there: only its FD_CLOEXEC must go.
                        libc::fcntl(fd, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(fd, PREEMPT_FD)
                    };
                    if r == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        // The command (holding the pipe's write end) is dropped at the end
        // of this block: the reader then sees EOF once the source ends.
        cmd.status().map_err(io("starting", exe))?
    };
    if !status.success() {
        return Err(PageSourceError::Start {
            exe: exe.to_path_buf(),
            status,
            log,
        });
    }
    Ok(std::fs::File::from(read_end))
}

/// Forks; the child returns and the parent writes the child's pid to
/// `dir/pid` and exits: once the agent sees the first process end, the pid
/// file names the page source (`page-source --detach`). For the start of
/// the command, before it starts any thread.
#[allow(unsafe_code)]
pub fn detach(dir: &Path) -> Result<(), PageSourceError> {
    // SAFETY: called by the page-source command at its start, while the
    // process has a single thread, so the child may run any code.
    match unsafe { libc::fork() } {
        -1 => Err(io("forking for", dir)(std::io::Error::last_os_error())),
        0 => Ok(()),
        pid => {
            let code = match write_file(dir, PID, format!("{pid}\n").as_bytes()) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("vmcsnap page-source: {e}");
                    1
                }
            };
            // SAFETY: `_exit` ends the parent without running destructors
            // or atexit handlers, which belong to the child now.
            unsafe { libc::_exit(code) }
        }
    }
}

/// Reads the source's events from `events` (its stdout) until it ends,
/// calling `on` for each; then returns how it ended.
pub fn follow(dir: &Path, events: std::fs::File, on: &mut dyn FnMut(SourceEvent)) -> Ended {
    for line in BufReader::new(events).lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str::<Wire>(&line) {
            Ok(w) => on(w.event()),
            Err(e) => crate::log(format!("page source: an event line {line:?}: {e}")),
        }
    }
    wait_ended(dir)
}

/// The preempt channel [`spawn`] left at fd [`PREEMPT_FD`], once.
#[allow(unsafe_code)]
fn preempt_channel() -> std::io::Result<UnixStream> {
    // SAFETY: fcntl(F_GETFD) only asks whether the fd is open.
    if unsafe { libc::fcntl(PREEMPT_FD, libc::F_GETFD) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the fd is open, and nothing else in this process owns it:
    // `spawn` put it there for this call, which runs once per process.
    let s = unsafe { UnixStream::from_raw_fd(PREEMPT_FD) };
    s.peer_addr()?; // a unix socket, connected
    Ok(s)
}

/// Testing: holds the background push while `path` does not exist.
fn hold_until_exists(path: PathBuf, hold: BackgroundHold) {
    eprintln!(
        "injected fault: the background push waits for {}",
        path.display()
    );
    std::thread::spawn(move || {
        while !path.exists() {
            control::hold_at_least(&hold, Instant::now() + Duration::from_millis(500));
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

/// The page source's own work (`vmcsnap page-source`): serves `stream`
/// from the job in `dir`, writes its events to `events` while someone
/// reads them, and its result to `dir` at the end.
pub fn serve(dir: &Path, stream: UnixStream, events: impl Write) -> Result<Ended, PageSourceError> {
    write_file(dir, PID, format!("{}\n", std::process::id()).as_bytes())?;
    let job = read_job(dir)?.ok_or_else(|| PageSourceError::BadFile {
        path: dir.join(JOB),
        detail: "missing".into(),
    })?;
    let plan = &job.plan;
    let bad = |detail: String| PageSourceError::Image {
        dir: plan.snap_dir.clone(),
        detail,
    };
    let img = crate::frozen_disks::open_image(&plan.snap_dir).map_err(|e| bad(e.to_string()))?;
    let device_state = img.device_state().map_err(|e| bad(e.to_string()))?;
    let id = |&(block, page): &(u32, u32)| PageId { block, page };
    let hold = BackgroundHold::default();
    if plan.hold_until_start {
        hold.hold_until(Instant::now() + HOLD_UNTIL_START_MAX);
    }
    let scfg = SourceConfig {
        before_run: plan.before_run.iter().map(id).collect(),
        demand_cluster: plan.demand_cluster,
        background: plan.background.iter().map(id).collect(),
        background_after: plan.background_after_ms.map(Duration::from_millis),
        ..super::pages::source_config(&img, device_state, hold.clone())
    };
    let keys: Vec<PageKey> = plan
        .before_run
        .iter()
        .map(|&(b, p)| PageKey::new(b, p))
        .collect();
    let mut pages =
        ImagePages::new(&img, &keys, plan.prefetch_blocks).map_err(|e| bad(e.to_string()))?;
    let background_begun = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    control::listen(
        dir,
        control::Served {
            bytes: pages.bytes_read.clone(),
            pages: pages.pages_read.clone(),
            background_begun: background_begun.clone(),
            hold: hold.clone(),
        },
    )
    .map_err(|e| io("listening on the control socket in", dir)(std::io::Error::other(e)))?;
    if let Some(path) = plan.hold_until_exists.clone() {
        hold_until_exists(path, hold);
    }
    let began = background_begun.clone();
    let prio = super::priority::priorities().filter(|_| plan.priorities);
    if let Some(p) = prio {
        let _ = priority::set_current_thread(p.fault_path);
    }
    let mut out = Some(events);
    // The first report always goes (the agent's `status` shows the load
    // from it), later ones at most every 200 ms.
    let mut last_progress: Option<Instant> = None;
    let preempt = if plan.preempt {
        Some(preempt_channel().map_err(io("taking the preempt channel (fd 3) in", dir))?)
    } else {
        None
    };
    let started = SystemTime::now();
    let mut on_event = |ev| {
        if let SourceEvent::Work(postcopy::Work::Background) = &ev {
            began.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        if let (SourceEvent::Work(w), Some(p)) = (&ev, prio) {
            let _ = priority::set_current_thread(p.for_work(*w));
        }
        let wire = match ev {
            SourceEvent::RunSent => Wire::RunSent,
            SourceEvent::AllSent => Wire::AllSent,
            SourceEvent::Progress { sent, total }
                if last_progress.is_none_or(|t| t.elapsed() > Duration::from_millis(200))
                    || sent == total =>
            {
                last_progress = Some(Instant::now());
                Wire::Progress { sent, total }
            }
            _ => return,
        };
        // Once the agent is gone (a broken pipe) its events go nowhere.
        let line = serde_json::to_string(&wire).expect("serialises") + "\n";
        if let Some(w) = out.as_mut() {
            if w.write_all(line.as_bytes())
                .and_then(|()| w.flush())
                .is_err()
            {
                out = None;
            }
        }
    };
    let r = match preempt {
        Some(p) => postcopy::run_source_preempt(&scfg, &mut pages, stream, p, &mut on_event),
        None => postcopy::run_source(&scfg, &mut pages, stream, &mut on_event),
    };
    drop(out);
    let mut ended = Ended::of(&r, started);
    if let Ended::Done(o) = &mut ended {
        o.bytes_read = pages.bytes_read.load(std::sync::atomic::Ordering::Relaxed);
        o.pages_read = pages.pages_read.load(std::sync::atomic::Ordering::Relaxed);
    }
    write_file(
        dir,
        RESULT,
        &serde_json::to_vec(&ended).expect("serialises"),
    )?;
    Ok(ended)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_round_trip_and_a_missing_one_is_none() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read_result(d.path()).unwrap(), None);
        let e = Ended::Done(Outcome {
            started_unix_us: 5,
            pages_total: 10,
            demand: vec![(1.5, 0, 7)],
            ..Outcome::default()
        });
        write_file(d.path(), RESULT, &serde_json::to_vec(&e).unwrap()).unwrap();
        assert_eq!(read_result(d.path()).unwrap(), Some(e));
        std::fs::write(d.path().join(RESULT), b"{").unwrap();
        let err = read_result(d.path()).unwrap_err().to_string();
        assert!(err.contains(RESULT), "{err}");
    }

    #[test]
    fn a_dead_page_source_without_a_result_is_a_failure() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        std::fs::create_dir(&dir).unwrap();
        // A pid that is not a page source (this test process).
        std::fs::write(dir.join(PID), format!("{}\n", std::process::id())).unwrap();
        assert_eq!(running(&dir), None);
        match wait_ended(&dir) {
            Ended::Failed { detail, own } => {
                assert!(!own);
                assert!(detail.contains("without a result"), "{detail}");
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn a_live_page_source_is_recognised_by_its_command_line() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        std::fs::create_dir(&dir).unwrap();
        // Stands in for `vmcsnap page-source --dir DIR`: `read` is a
        // builtin, so no child carries the same command line.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("read x")
            .arg("page-source")
            .arg(&dir)
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        std::fs::write(dir.join(PID), format!("{}\n", child.id())).unwrap();
        let t = Instant::now();
        while running(&dir).is_none() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(running(&dir), Some(child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(running(&dir), None);
    }

    #[test]
    fn wire_events_stand_for_source_events() {
        for w in [
            Wire::RunSent,
            Wire::AllSent,
            Wire::Progress { sent: 3, total: 9 },
        ] {
            let line = serde_json::to_string(&w).unwrap();
            assert_eq!(serde_json::from_str::<Wire>(&line).unwrap(), w);
        }
        assert_eq!(Wire::RunSent.event(), SourceEvent::RunSent);
    }
}
