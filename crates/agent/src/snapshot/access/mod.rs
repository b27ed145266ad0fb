//! Which guest pages were accessed, reads included, around a snapshot:
//! DAMON's monitoring of QEMU's guest-RAM mapping, written as
//! `<snapshot>/access/accessed.json` ([`vmcsnap_workingset::access`]).
//!
//! [`Collector::start`] runs when the request arrives: if the host kernel's
//! DAMON is usable ([`vmcsnap_damon::probe`]), it creates one kdamond with
//! `fvaddr` operations over exactly the mapping of the VM's RAM file in
//! QEMU's address space, and a thread that asks for the accessed regions
//! once per aggregation interval and records when each page was first seen
//! accessed. QEMU reads every page of guest RAM through that same mapping
//! to copy it (and, for a first hot snapshot, to populate it), which DAMON
//! cannot tell from the guest's accesses: so only what is seen from one
//! aggregation interval after the copy ended counts
//! ([`Collector::set_point_unix_us`], called then, with the snapshot point:
//! the end of the pause). The thread keeps collecting until `window` after
//! the copy, then stops and removes its kdamond and, once
//! [`Collector::finish`] named the committed snapshot, writes the file (a
//! temporary name in `access/`, renamed). The snapshot does not wait for
//! it: a restore that starts before the file exists restores without it.
//! Dropping the collector (a failed snapshot) stops the kdamond and writes
//! nothing. Its `tracker` turns the readings into the file's runs.
//!
//! Times in the file are ms after the snapshot point, so the first ones
//! are at least the copy's duration. Only one kdamond at a time is
//! vmcsnap's (a second snapshot while one collects goes without access
//! data), and only a kdamond vmcsnap created is ever written to; DAMON is
//! left as found, on error too (see [`Config::marker`]).
//!
//! The DAMON root is `/sys/kernel/mm/damon/admin`; tests point the
//! [`ROOT_ENV`] variable at a fake tree.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmcsnap_damon::{MonitorAttrs, Target};
use vmcsnap_image::RamBlock;
use vmcsnap_workingset::access::{AccessRun, AccessedPages, FILE, FORMAT};

use crate::log;

mod tracker;
use tracker::Tracker;

/// Environment variable naming another DAMON admin directory: for tests
/// only (a fake sysfs tree). Production uses [`vmcsnap_damon::DEFAULT_ROOT`].
pub const ROOT_ENV: &str = "VMCSNAP_DAMON_ROOT";
/// The access window when the request does not name one.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10);
/// Readings in a row that may fail before the collection gives up.
const MAX_READ_ERRORS: u32 = 3;
/// Guest page size (x86).
pub(crate) const PAGE: u64 = 4096;

/// Set while vmcsnap's one kdamond exists (see [`Collector::start`]).
static SLOT: AtomicBool = AtomicBool::new(false);

/// Where the collector looks for DAMON and how it samples.
#[derive(Debug, Clone)]
pub struct Config {
    /// The DAMON admin directory.
    pub root: PathBuf,
    /// Monitoring attributes (aggregation = how often regions are read).
    pub attrs: MonitorAttrs,
    /// How long after the copy to keep collecting; zero: off.
    pub window: Duration,
    /// A file that says which kdamond this agent created (`PID START`:
    /// its target and range) while it exists, so that an agent restarted
    /// after being killed mid-collection removes it ([`MARKER`]).
    pub marker: Option<PathBuf>,
}

/// The marker file's name in the run directory (see [`Config::marker`]).
pub const MARKER: &str = "damon-kdamond";

impl Config {
    /// The production configuration ([`ROOT_ENV`] aside) for `window`, the
    /// marker in `run_dir`.
    pub fn new(window: Duration, run_dir: &Path) -> Config {
        let root = std::env::var_os(ROOT_ENV)
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from(vmcsnap_damon::DEFAULT_ROOT), PathBuf::from);
        Config {
            root,
            attrs: MonitorAttrs::default(),
            window,
            marker: Some(run_dir.join(MARKER)),
        }
    }
}

/// What the thread is told from outside.
#[derive(Default)]
struct Control {
    /// The snapshot point, when known.
    point: Option<Instant>,
    /// Accesses count from here on (see the module documentation).
    clean_from: Option<Instant>,
    /// The committed snapshot and its RAM blocks, once [`Collector::finish`] ran.
    dest: Option<(PathBuf, Vec<RamBlock>)>,
    /// The snapshot failed: stop, write nothing.
    cancel: bool,
}

type Shared = Arc<(Mutex<Control>, Condvar)>;

/// One snapshot's access-data collection (or the reason there is none).
pub struct Collector {
    note: String,
    shared: Shared,
    thread: Option<JoinHandle<()>>,
}

impl Collector {
    /// Starts collecting for QEMU process `pid` whose guest RAM is the file
    /// `ram_file`, if DAMON is usable; else a collector that only carries
    /// the reason ([`Collector::note`]). Never fails the snapshot.
    pub fn start(vm: &str, pid: u32, ram_file: &Path, config: Config) -> Collector {
        let shared: Shared = Arc::default();
        let (note, thread) = match begin(vm, pid, ram_file, &config, &shared) {
            Ok(thread) => ("damon".to_string(), Some(thread)),
            Err(why) => (format!("none: {why}"), None),
        };
        log(format!("snapshot of {vm}: access data: {note}"));
        Collector {
            note,
            shared,
            thread,
        }
    }

    /// `"damon"`, or `"none: <why>"`: for the manifest's
    /// `metrics.other["access_data"]`.
    pub fn note(&self) -> &str {
        &self.note
    }

    /// The copy is over: the snapshot point was `at` (the end of the pause).
    /// Accesses count from one aggregation interval after now, and the
    /// window runs from there.
    pub fn set_point(&self, at: Instant) {
        let now = Instant::now();
        self.tell(|c| {
            c.point = Some(at.min(now));
            c.clean_from = Some(now);
        });
    }

    /// [`Collector::set_point`] from a wall-clock time (µs since the Unix
    /// epoch, as the snapshot's pause is measured); 0: now. Called when
    /// QEMU's copy of guest RAM has completed.
    pub fn set_point_unix_us(&self, unix_us: u64) {
        let ago = super::unix_us().saturating_sub(unix_us);
        let now = Instant::now();
        let at = if unix_us == 0 {
            now
        } else {
            now.checked_sub(Duration::from_micros(ago)).unwrap_or(now)
        };
        self.set_point(at);
    }

    /// The snapshot is committed at `dir`: the thread writes the file there
    /// when the window is over (now, if it already is) and ends by itself.
    pub fn finish(mut self, dir: &Path, ram_blocks: &[RamBlock]) {
        self.tell(|c| {
            let now = Instant::now();
            c.point.get_or_insert(now);
            c.clean_from.get_or_insert(now);
            c.dest = Some((dir.to_path_buf(), ram_blocks.to_vec()));
        });
        // Detached: the snapshot does not wait for the window's tail.
        self.thread.take();
    }

    fn tell(&self, f: impl FnOnce(&mut Control)) {
        let (m, cv) = &*self.shared;
        if let Ok(mut c) = m.lock() {
            f(&mut c);
        }
        cv.notify_all();
    }
}

impl Drop for Collector {
    /// Without [`Collector::finish`]: the snapshot failed; stop the kdamond
    /// (waiting for it) and write nothing.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.tell(|c| c.cancel = true);
            let _ = t.join();
        }
    }
}

/// Checks, finds the mapping, creates the kdamond, starts the thread.
fn begin(
    vm: &str,
    pid: u32,
    ram_file: &Path,
    config: &Config,
    shared: &Shared,
) -> Result<JoinHandle<()>, String> {
    if config.window.is_zero() {
        return Err("off (access window 0)".into());
    }
    if SLOT.swap(true, Ordering::SeqCst) {
        return Err("DAMON is collecting for another snapshot (one at a time)".into());
    }
    let release = |why: String| {
        SLOT.store(false, Ordering::SeqCst);
        why
    };
    let marker = config.marker.as_deref();
    if let Some(m) = marker {
        reclaim_leftover(&config.root, m);
    }
    // On the real root, a kernel built without vaddr monitoring is known
    // from its configuration: its DAMON (maybe the host's own) is never
    // opened.
    let availability = (config.root == Path::new(vmcsnap_damon::DEFAULT_ROOT))
        .then(kernel_config)
        .flatten()
        .and_then(|c| vmcsnap_damon::from_kernel_config(&c))
        .unwrap_or_else(|| vmcsnap_damon::probe(&config.root));
    if !availability.is_usable() {
        return Err(release(format!("DAMON {availability}")));
    }
    let (start, end) = find_mapping(pid, ram_file).map_err(release)?;
    let root = config.root.clone();
    if let Some(m) = marker {
        // Before the kdamond exists: an agent killed during the setup
        // still leaves a marker for its successor.
        if let Err(e) = fs::write(m, format!("{pid} {start}\n")) {
            return Err(release(format!("writing {}: {e}", m.display())));
        }
    }
    let setup = vmcsnap_damon::plan_setup(
        Target {
            pid,
            range: Some((start, end)),
        },
        &config.attrs,
    )
    .and_then(|plan| vmcsnap_damon::apply(&root, &plan));
    if let Err(e) = setup {
        stop_kdamond(&root, marker);
        return Err(release(format!("DAMON setup failed: {e}")));
    }
    let run = Run {
        vm: vm.to_string(),
        root,
        marker: config.marker.clone(),
        aggr: Duration::from_micros(config.attrs.aggr_us),
        window: config.window,
        tracker: Tracker::new(start, end),
        shared: shared.clone(),
    };
    let spawned = std::thread::Builder::new()
        .name(format!("access-{vm}"))
        .spawn(move || run.run());
    spawned.map_err(|e| {
        stop_kdamond(&config.root, marker);
        release(format!("cannot start the collector thread: {e}"))
    })
}

/// The running kernel's build configuration, from `/proc/config.gz` or
/// `/boot/config-RELEASE` (`None` if neither is there).
fn kernel_config() -> Option<String> {
    if let Ok(gz) = fs::File::open("/proc/config.gz") {
        let mut text = String::new();
        if std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(gz), &mut text).is_ok() {
            return Some(text);
        }
    }
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    fs::read_to_string(format!("/boot/config-{}", release.trim())).ok()
}

/// If `marker` names the kdamond that exists under `root` (same target
/// pid and range start), an earlier agent of this run directory created
/// it and died before removing it: remove it now. A marker that names
/// another configuration is stale and removed alone; someone else's
/// kdamond is left as it is.
fn reclaim_leftover(root: &Path, marker: &Path) {
    let Ok(text) = fs::read_to_string(marker) else {
        return;
    };
    let read = |rel: &str| {
        fs::read_to_string(root.join(rel))
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let mut it = text.split_whitespace();
    let (pid, start) = (it.next().unwrap_or("-"), it.next().unwrap_or("-"));
    let target = "kdamonds/0/contexts/0/targets/0";
    let ours = read("kdamonds/nr_kdamonds") == "1"
        && read(&format!("{target}/pid_target")) == pid
        && read(&format!("{target}/regions/0/start")) == start;
    if ours {
        log(format!(
            "access data: removing the kdamond an earlier agent left (target pid {pid})"
        ));
        stop_kdamond(root, Some(marker));
    } else {
        let _ = fs::remove_file(marker);
    }
}

/// The address range `[start, end)` where `pid` maps `ram_file` from
/// offset 0, from `/proc/PID/maps`.
fn find_mapping(pid: u32, ram_file: &Path) -> Result<(u64, u64), String> {
    let maps_path = format!("/proc/{pid}/maps");
    let maps = fs::read_to_string(&maps_path).map_err(|e| format!("reading {maps_path}: {e}"))?;
    parse_mapping(&maps, ram_file).ok_or_else(|| {
        format!(
            "no mapping of {} in {maps_path} (is the VM's RAM a shared file?)",
            ram_file.display()
        )
    })
}

/// The mapping of `file` at file offset 0 in the text of a `maps` file.
fn parse_mapping(maps: &str, file: &Path) -> Option<(u64, u64)> {
    let want = file.to_str()?;
    maps.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let range = f.next()?;
        let offset = f.nth(1)?;
        let path = f.nth(2)?;
        if path != want || u64::from_str_radix(offset, 16).ok()? != 0 {
            return None;
        }
        let (a, b) = range.split_once('-')?;
        Some((
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        ))
    })
}

/// Writes the stop plan one entry at a time (the kdamond may have stopped
/// by itself when QEMU exited: `off` then fails, `nr_kdamonds` must still
/// be written), then removes the marker.
fn stop_kdamond(root: &Path, marker: Option<&Path>) {
    for w in vmcsnap_damon::plan_stop() {
        if let Err(e) = vmcsnap_damon::apply(root, std::slice::from_ref(&w)) {
            log(format!("access data: stopping DAMON: {e}"));
        }
    }
    if let Some(m) = marker {
        let _ = fs::remove_file(m);
    }
}

/// The collector thread's state.
struct Run {
    vm: String,
    root: PathBuf,
    marker: Option<PathBuf>,
    aggr: Duration,
    window: Duration,
    tracker: Tracker,
    shared: Shared,
}

impl Run {
    fn run(mut self) {
        let error = self.collect();
        stop_kdamond(&self.root, self.marker.as_deref());
        SLOT.store(false, Ordering::SeqCst);
        if let Some(e) = &error {
            log(format!(
                "snapshot of {}: access data: collection ended early: {e}",
                self.vm
            ));
        }
        let Some((point, dir, blocks)) = self.wait_dest() else {
            return;
        };
        let runs = self.tracker.runs(point, &blocks);
        let pages: u64 = runs.iter().map(|r| u64::from(r.pages)).sum();
        match write_file(&dir, runs) {
            Ok(()) => log(format!(
                "snapshot of {}: access data: {pages} pages accessed, written to {}",
                self.vm,
                dir.join(FILE).display()
            )),
            Err(e) => log(format!("snapshot of {}: access data: {e}", self.vm)),
        }
    }

    /// Refreshes and reads the regions once per aggregation interval until
    /// the window after the copy is over or the snapshot failed. A reading
    /// counts only if it was asked for one aggregation interval after the
    /// copy (the interval it reports then holds no copy).
    fn collect(&mut self) -> Option<String> {
        let mut read_errors = 0;
        loop {
            let started = Instant::now();
            let clean = self
                .control(|c| c.clean_from)
                .flatten()
                .is_some_and(|t| started >= t + self.aggr);
            if let Err(e) = vmcsnap_damon::apply(&self.root, &vmcsnap_damon::plan_refresh()) {
                return Some(e.to_string());
            }
            match vmcsnap_damon::read_tried_regions(
                &self.root,
                vmcsnap_damon::KDAMOND,
                vmcsnap_damon::CONTEXT,
                vmcsnap_damon::SCHEME,
            ) {
                Ok(regions) => {
                    read_errors = 0;
                    if clean {
                        self.tracker.observe(&regions, Instant::now());
                    }
                }
                // A region directory can vanish while it is read if the
                // kernel refills the list meanwhile: skip that reading.
                Err(e) if read_errors < MAX_READ_ERRORS => {
                    read_errors += 1;
                    log(format!(
                        "snapshot of {}: access data: {e} (skipped)",
                        self.vm
                    ));
                }
                Err(e) => return Some(e.to_string()),
            }
            // Sleep to the next aggregation (a real kernel's refresh write
            // already waited for one), or until told to stop.
            let (m, cv) = &*self.shared;
            let Ok(mut c) = m.lock() else {
                return Some("lock poisoned".into());
            };
            loop {
                if c.cancel {
                    return None;
                }
                let now = Instant::now();
                if c.clean_from
                    .is_some_and(|t| now >= t + self.aggr + self.window)
                {
                    return None;
                }
                let next = started + self.aggr;
                if now >= next {
                    break;
                }
                c = match cv.wait_timeout(c, next - now) {
                    Ok((c, _)) => c,
                    Err(_) => return Some("lock poisoned".into()),
                };
            }
        }
    }

    fn control<T>(&self, f: impl FnOnce(&Control) -> T) -> Option<T> {
        self.shared.0.lock().ok().map(|c| f(&c))
    }

    /// Waits for [`Collector::finish`] (or a cancel: `None`).
    fn wait_dest(&self) -> Option<(Instant, PathBuf, Vec<RamBlock>)> {
        let (m, cv) = &*self.shared;
        let mut c = m.lock().ok()?;
        loop {
            if c.cancel {
                return None;
            }
            if let Some((dir, blocks)) = c.dest.take() {
                return Some((c.point?, dir, blocks));
            }
            c = cv.wait(c).ok()?;
        }
    }
}

/// `<dir>/access/accessed.json`, through a temporary name and a rename.
fn write_file(dir: &Path, runs: Vec<AccessRun>) -> Result<(), String> {
    let data = AccessedPages {
        format: FORMAT,
        source: "damon".into(),
        runs,
    };
    let file = dir.join(FILE);
    let parent = file.parent().unwrap_or(dir);
    let tmp = parent.join(".accessed.json.tmp");
    fs::create_dir_all(parent)
        .and_then(|()| fs::write(&tmp, data.to_bytes()))
        .and_then(|()| fs::rename(&tmp, &file))
        .map_err(|e| {
            let _ = fs::remove_file(&tmp);
            format!(
                "writing {}: {e} (the snapshot restores without access data)",
                file.display()
            )
        })
}

#[cfg(test)]
mod tests;
