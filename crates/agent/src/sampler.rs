//! The working-set sampler: HotRestore's WSS_sample, measured while VMs run
//! normally.
//!
//! Every [`INTERVAL`] the agent asks each running VM's QEMU for a
//! `calc-dirty-rate` page sampling over [`WINDOW`] (QEMU hashes 512 sampled
//! pages per GiB at the start and end of the window and counts those that
//! changed), through a second QMP monitor (`cluster/<vm>/sample.sock`) so
//! that it never interleaves with requests on the main one. The pages
//! dirtied per window (`dirty-rate` MiB/s × window × 256) go to
//! `cluster/<vm>/wss-samples.json`, the newest [`KEEP`] of them. A snapshot
//! stores their mean as `wss_sample_pages` in its metrics.
//!
//! QEMU's sampling sees writes only, not reads: WSS_sample is the written
//! working set. A VM that has not been sampled yet gets no WSS_sample, and
//! the restore falls back to the snapshot's own count.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use vmcsnap_qmp::QmpClient;

use crate::{log, RunDir};

/// File name of the sampler's QMP socket in a VM's directory.
pub const SOCKET_NAME: &str = "sample.sock";
/// File name of the samples in a VM's directory.
pub const SAMPLES_NAME: &str = "wss-samples.json";
/// Time between two samplings of a VM.
pub const INTERVAL: Duration = Duration::from_secs(10);
/// The sampling window (`calc-time`).
pub const WINDOW: Duration = Duration::from_secs(1);
/// Samples kept per VM.
pub const KEEP: usize = 12;

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// When it ended (Unix ms).
    pub unix_ms: u64,
    /// Pages dirtied during the window.
    pub pages: u64,
}

/// The samples of the VM whose directory is `vm_dir` (empty if none).
pub fn load(vm_dir: &Path) -> Vec<Sample> {
    std::fs::read(vm_dir.join(SAMPLES_NAME))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The mean of `samples`, if there are any.
pub fn mean_pages(samples: &[Sample]) -> Option<u64> {
    if samples.is_empty() {
        return None;
    }
    Some(
        (samples.iter().map(|s| s.pages as f64).sum::<f64>() / samples.len() as f64).round() as u64,
    )
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
    q.execute("calc-dirty-rate", json!({ "calc-time": WINDOW.as_secs() }))
        .map_err(|e| e.to_string())?;
    std::thread::sleep(WINDOW + Duration::from_millis(200));
    for _ in 0..50 {
        let r = q
            .execute("query-dirty-rate", serde_json::Value::Null)
            .map_err(|e| e.to_string())?;
        if r["status"] == "measured" {
            let mib_per_s = r["dirty-rate"].as_u64().unwrap_or(0);
            let pages = mib_per_s * WINDOW.as_secs() * 256;
            return record(vm_dir, pages);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err("calc-dirty-rate did not finish".into())
}

fn record(vm_dir: &Path, pages: u64) -> Result<(), String> {
    let mut samples = load(vm_dir);
    samples.push(Sample {
        unix_ms: crate::handover::unix_ms(std::time::SystemTime::now()),
        pages,
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

    #[test]
    fn samples_round_trip_and_keep_the_newest() {
        let d = tempfile::tempdir().unwrap();
        assert!(load(d.path()).is_empty());
        for i in 0..(KEEP as u64 + 3) {
            record(d.path(), i * 10).unwrap();
        }
        let s = load(d.path());
        assert_eq!(s.len(), KEEP);
        assert_eq!(s[0].pages, 30);
        assert_eq!(mean_pages(&s), Some(85), "mean of 30, 40, ..., 140");
        assert_eq!(mean_pages(&[]), None);
    }
}
