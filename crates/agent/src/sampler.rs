//! The working-set sampler: HotRestore's WSS_sample, measured while VMs run
//! normally.
//!
//! Every [`INTERVAL`] the agent measures each running VM over a [`WINDOW`]
//! two ways at once:
//!
//! * **touched pages, reads included**: it clears QEMU's accessed bits and
//!   reads the `Referenced` count of the guest-RAM mapping at the window's
//!   end ([`crate::accessed`]);
//! * **written pages**: QEMU's `calc-dirty-rate` page sampling (QEMU hashes
//!   512 sampled pages per GiB at the start and end of the window and
//!   counts those that changed; it sees writes only), through a second QMP
//!   monitor (`cluster/<vm>/sample.sock`) so that it never interleaves with
//!   requests on the main one.
//!
//! Both go to `cluster/<vm>/wss-samples.json`, the newest [`KEEP`] of them.
//! A snapshot stores the mean touched count as `wss_sample_pages` (the
//! written count where the accessed bits could not be read), the mean
//! written count as `wss_sample_written_pages`, and the newest touched
//! count, the window just before the snapshot point, as
//! `wss_snapshot_touched_pages`: during the snapshot itself QEMU's copy
//! reads every page, so the accessed bits cannot tell the guest's reads
//! then. A VM that has not been sampled yet gets none of these, and the
//! restore falls back to the snapshot's own count of written pages.
//!
//! A VM that is paused, or migrating in either direction (a snapshot, or
//! a restore still loading pages through postcopy), is skipped, and a
//! sample during which a migration began is dropped: QEMU's sampling would
//! fault in a restore's missing pages and the clear would spoil the
//! restore's own measurement.
//!
//! Cost: one clear of QEMU's accessed bits per interval (a few ms of QEMU
//! time per 256 MiB; see docs/restore.md for the measured guest slowdown).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use vmcsnap_qmp::QmpClient;

use crate::{log, RunDir};

/// File name of the sampler's QMP socket in a VM's directory (the VM
/// layer's: QEMU is started with it).
pub use crate::qemu::SAMPLER_SOCKET as SOCKET_NAME;
/// File name of the samples in a VM's directory.
pub const SAMPLES_NAME: &str = "wss-samples.json";
/// Time between two samplings of a VM.
pub const INTERVAL: Duration = Duration::from_secs(10);
/// The sampling window (`calc-time`; whole seconds).
pub const WINDOW: Duration = Duration::from_secs(2);
/// Samples kept per VM.
pub const KEEP: usize = 12;

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// When it ended (Unix ms).
    pub unix_ms: u64,
    /// Pages dirtied during the window (QEMU's sampling: writes only).
    pub pages: u64,
    /// Pages touched during the window, reads included (accessed bits;
    /// `None` where they could not be read).
    #[serde(default)]
    pub touched: Option<u64>,
}

/// The samples of the VM whose directory is `vm_dir` (empty if none).
pub fn load(vm_dir: &Path) -> Vec<Sample> {
    std::fs::read(vm_dir.join(SAMPLES_NAME))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The mean written count of `samples`, if there are any.
pub fn mean_pages(samples: &[Sample]) -> Option<u64> {
    mean(samples.iter().map(|s| s.pages))
}

/// The mean touched count (reads included) of the samples that have one.
pub fn mean_touched(samples: &[Sample]) -> Option<u64> {
    mean(samples.iter().filter_map(|s| s.touched))
}

fn mean(values: impl Iterator<Item = u64>) -> Option<u64> {
    let (mut sum, mut n) = (0f64, 0u32);
    for v in values {
        sum += v as f64;
        n += 1;
    }
    (n > 0).then(|| (sum / f64::from(n)).round() as u64)
}

/// A newest sample older than this does not stand for the snapshot point.
pub const SNAPSHOT_SAMPLE_MAX_AGE_MS: u64 = 3 * INTERVAL.as_millis() as u64;

/// Puts what `samples` say into a snapshot's metrics taken at `now_ms`
/// (see the module's documentation for the keys).
pub fn record_in(samples: &[Sample], now_ms: u64, metrics: &mut vmcsnap_control::SnapshotMetrics) {
    let touched = mean_touched(samples);
    if let Some(p) = touched.or(mean_pages(samples)) {
        metrics.wss_sample_pages = Some(p);
        metrics.wss_samples = Some(samples.len() as u64);
    }
    if let Some(p) = mean_pages(samples) {
        metrics.wss_sample_written_pages = Some(p);
    }
    if let Some(newest) = samples
        .last()
        .filter(|s| now_ms.saturating_sub(s.unix_ms) <= SNAPSHOT_SAMPLE_MAX_AGE_MS)
        .and_then(|s| s.touched)
    {
        metrics.wss_snapshot_touched_pages = Some(newest);
    }
}

/// Starts the sampler thread for the VMs under `run`'s cluster directory.
/// It runs for the life of the agent.
pub fn start(run: RunDir) {
    let spawned = std::thread::Builder::new()
        .name("wss-sampler".into())
        .spawn(move || loop {
            std::thread::sleep(INTERVAL);
            let Ok(dir) = std::fs::read_dir(run.cluster_dir()) else {
                continue;
            };
            for vm_dir in dir.flatten().map(|e| e.path()) {
                let sock = vm_dir.join(SOCKET_NAME);
                if !sock.exists() {
                    continue;
                }
                if let Err(e) = sample_one(&vm_dir, &sock) {
                    // A VM that is restarting or stopping: try again next time.
                    if std::env::var_os("VMCSNAP_SAMPLER_DEBUG").is_some() {
                        log(format!("sampler: {}: {e}", vm_dir.display()));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        log(format!("cannot start the working-set sampler: {e}"));
    }
}

fn sample_one(vm_dir: &Path, sock: &Path) -> Result<(), String> {
    let mut q = QmpClient::connect(sock, Duration::from_millis(500)).map_err(|e| e.to_string())?;
    q.set_timeout(Duration::from_secs(5));
    // Never while the VM migrates: a restore's destination would fault in
    // every page QEMU's sampling reads (hundreds of demand faults, counted
    // as the guest's), and clearing its accessed bits would spoil the
    // restore's own measurement of its working set.
    idle(&mut q)?;
    // The QEMU behind this VM directory and its guest-RAM file.
    let qemu = crate::qemu_find::find_qemu(None, &vm_dir.join("qmp.sock"))
        .and_then(|pid| Some((pid, crate::accessed::ram_file_of(pid)?)));
    let cleared = qemu
        .as_ref()
        .filter(|(pid, _)| crate::accessed::clear(*pid).is_ok());
    q.execute("calc-dirty-rate", json!({ "calc-time": WINDOW.as_secs() }))
        .map_err(|e| e.to_string())?;
    std::thread::sleep(WINDOW);
    let touched = cleared
        .and_then(|(pid, ram)| crate::accessed::ram_use(*pid, ram).ok())
        .map(|u| u.referenced);
    // A migration that began during the window makes the sample worthless.
    idle(&mut q)?;
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..50 {
        let r = q
            .execute("query-dirty-rate", serde_json::Value::Null)
            .map_err(|e| e.to_string())?;
        if r["status"] == "measured" {
            let mib_per_s = r["dirty-rate"].as_u64().unwrap_or(0);
            let pages = mib_per_s * WINDOW.as_secs() * 256;
            return record(vm_dir, pages, touched);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err("calc-dirty-rate did not finish".into())
}

/// Whether the VM runs with no migration going on (in either direction):
/// the only time the sampler may measure it.
fn idle(q: &mut QmpClient) -> Result<(), String> {
    let status = q
        .execute("query-status", serde_json::Value::Null)
        .map_err(|e| e.to_string())?;
    let migration = q
        .execute("query-migrate", serde_json::Value::Null)
        .map_err(|e| e.to_string())?;
    let (run_state, mig) = (
        status["status"].as_str().unwrap_or(""),
        migration["status"].as_str(),
    );
    if samplable(run_state, mig) {
        Ok(())
    } else {
        Err(format!("busy: {run_state}, migration {mig:?}"))
    }
}

/// The decision behind [`idle`]: QEMU's run state and its `query-migrate`
/// status (absent when no migration ever ran; a restore's destination
/// shows the incoming side's, e.g. `postcopy-active`).
fn samplable(run_state: &str, migration: Option<&str>) -> bool {
    run_state == "running"
        && matches!(
            migration,
            None | Some("none" | "completed" | "failed" | "cancelled")
        )
}

fn record(vm_dir: &Path, pages: u64, touched: Option<u64>) -> Result<(), String> {
    let mut samples = load(vm_dir);
    samples.push(Sample {
        unix_ms: crate::unix_ms(std::time::SystemTime::now()),
        pages,
        touched,
    });
    let drop = samples.len().saturating_sub(KEEP);
    samples.drain(..drop);
    let path: PathBuf = vm_dir.join(SAMPLES_NAME);
    let tmp = vm_dir.join(format!(".{SAMPLES_NAME}.tmp"));
    let text = serde_json::to_vec(&samples).map_err(|e| e.to_string())?;
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, &path))
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 23): the sampler ran QEMU's dirty-page sampling
    /// and cleared the accessed bits of restored VMs during postcopy. About
    /// one restore in four then had hundreds of extra demand faults (the
    /// sampling read missing pages) and a working set measured as unused.
    #[test]
    fn a_migrating_or_paused_vm_is_not_sampled() {
        assert!(samplable("running", None));
        assert!(samplable("running", Some("completed")));
        assert!(samplable("running", Some("failed")));
        assert!(!samplable("running", Some("postcopy-active")));
        assert!(!samplable("running", Some("active")));
        assert!(!samplable("running", Some("setup")));
        assert!(!samplable("inmigrate", None));
        assert!(!samplable("paused", Some("completed")));
        assert!(!samplable("finish-migrate", Some("device")));
    }

    #[test]
    fn samples_round_trip_and_keep_the_newest() {
        let d = tempfile::tempdir().unwrap();
        assert!(load(d.path()).is_empty());
        for i in 0..(KEEP as u64 + 3) {
            record(d.path(), i * 10, (i % 2 == 0).then_some(i * 100)).unwrap();
        }
        let s = load(d.path());
        assert_eq!(s.len(), KEEP);
        assert_eq!(s[0].pages, 30);
        assert_eq!(mean_pages(&s), Some(85), "mean of 30, 40, ..., 140");
        assert_eq!(mean_pages(&[]), None);
        // Touched counts of the even i in 3..15 only: 400, 600, ..., 1400.
        assert_eq!(mean_touched(&s), Some(900));
        assert_eq!(mean_touched(&[]), None);
        let mut m = vmcsnap_control::SnapshotMetrics::default();
        let newest = s.last().unwrap().unix_ms;
        record_in(&s, newest + 1000, &mut m);
        assert_eq!(m.wss_sample_pages, Some(900));
        assert_eq!(m.wss_sample_written_pages, Some(85));
        assert_eq!(m.wss_snapshot_touched_pages, Some(1400));
        let mut m = vmcsnap_control::SnapshotMetrics::default();
        record_in(&s, newest + SNAPSHOT_SAMPLE_MAX_AGE_MS + 1, &mut m);
        assert_eq!(m.wss_snapshot_touched_pages, None, "too old");
    }
}
