//! The end of a restore: its report, the quality of the pages loaded first,
//! and the record of what it learned ([`super::traces`]), made from what
//! the page source did ([`Outcome`]) and what the agent saw ([`Observed`]).
//!
//! Everything comes from values that [`super::page_source`] keeps in files,
//! so the agent that started a restore and the one that adopts it after a
//! crash ([`crate::restore_journal`]) finish it alike. An adopting agent
//! lacks what only its dead predecessor saw after its last write of
//! `observed.json`: without the start's accessed-bit counters the report has
//! no quality figures, and the learning then works from the faults alone.

use std::path::PathBuf;
use std::time::SystemTime;

use vmcsnap_image::PageKey;
use vmcsnap_workingset::{self as ws, Mode};

use super::job::{fail, unix_us, Quality, Report, LEARN_WINDOW};
use super::page_source::{FinishJob, Observed, Outcome};
use super::traces::{self, Learned, Record};
use crate::accessed::RamUse;
use crate::AgentError;

/// Everything a restore's end is made from.
pub struct Finishing<'a> {
    /// The VM.
    pub vm: &'a str,
    /// The job as the restore began it.
    pub job: &'a FinishJob,
    /// What the agent saw.
    pub obs: &'a Observed,
    /// What the page source did.
    pub out: &'a Outcome,
    /// The RAM counters when every page was loaded (unix µs).
    pub at_full_load: Option<(u64, RamUse)>,
}

fn keys(v: &[(u32, u32)]) -> Vec<PageKey> {
    v.iter().map(|&(b, p)| PageKey::new(b, p)).collect()
}

/// The report, with the record of the restore saved in the snapshot.
pub fn report(f: &Finishing) -> Result<Report, AgentError> {
    let Finishing {
        vm, job, obs, out, ..
    } = f;
    let full_load_ms =
        out.started_unix_us.saturating_sub(job.t0_unix_us) as f64 / 1000.0 + out.all_sent_after_ms;
    let restore_latency_ms = obs
        .latency_ms
        .ok_or_else(|| fail(vm, "the guest did not start (no RESUME event)"))?;
    let run_sent_ms = obs.run_sent_ms.unwrap_or(restore_latency_ms);
    let start_after_run_ms = (restore_latency_ms - run_sent_ms).max(0.0);
    let faults_before_start = out
        .demand
        .iter()
        .filter(|(ms, _, _)| *ms < start_after_run_ms)
        .count() as u64;
    let mut per_100ms = vec![0u64; 100];
    for (ms, _, _) in &out.demand {
        let i = (ms / 100.0) as usize;
        if i < per_100ms.len() {
            per_100ms[i] += 1;
        }
    }
    let ws_loaded = if job.prepared {
        obs.pages_before
    } else {
        out.pages_before_run
    };
    let faults: Vec<(PageKey, f64)> = out
        .demand
        .iter()
        .map(|&(ms, b, p)| (PageKey::new(b, p), ms))
        .collect();
    let quality = match (obs.at_start, f.at_full_load) {
        (Some((t_start, start)), Some((t_full, full))) if job.mode != Mode::Eager => {
            let missed = faults
                .iter()
                .map(|(k, _)| *k)
                .collect::<std::collections::HashSet<_>>()
                .len() as u64;
            Some(Quality::new(
                t_full.saturating_sub(t_start) as f64 / 1000.0,
                ws_loaded,
                full.working_set_used(&start),
                missed,
            ))
        }
        _ => None,
    };
    // Eager and paused restores see no first accesses: nothing to learn.
    let learned = (job.mode != Mode::Eager && !job.paused).then(|| {
        let queue = keys(&job.queue);
        let l = ws::learn::learn(&ws::learn::Observation {
            queue: &queue,
            size: job.wss,
            ws_size: ws_loaded,
            ws_used: quality.map(|q| q.used),
            faults: &faults,
            window_ms: LEARN_WINDOW.as_secs_f64() * 1000.0,
            floor: job.hybrid,
            cap: job.hybrid.saturating_mul(2).max(job.wss),
        });
        Learned {
            size: l.size,
            touched: l.touched,
            queue: l.queue.iter().map(|k| (k.ram_block, k.page)).collect(),
        }
    });
    let record = Record {
        unix_ms: crate::unix_ms(SystemTime::now()),
        mode: job.mode.name().to_string(),
        trace: job.trace,
        preloaded: job.before_run.clone(),
        faults: out.demand.iter().map(|&(ms, b, p)| (b, p, ms)).collect(),
        size: job.wss,
        ws_used: quality.map(|q| q.used),
        learned: learned.clone(),
    };
    let record_path = traces::save(&job.snap_dir, &record).map_err(AgentError::io(
        "writing the restore record in",
        &job.snap_dir,
    ))?;
    Ok(Report {
        vm: vm.to_string(),
        snapshot: job.snapshot.clone(),
        mode: job.mode,
        paused: job.paused,
        restore_latency_ms,
        run_sent_ms,
        start_received_ms: obs.start_received_ms,
        loaded_ms: obs.loaded_ms,
        qemu_ready_ms: obs.qemu_ready_ms,
        background_before_start: obs.background_before_start,
        pages_before_run: out.pages_before_run,
        request_unix_us: job.t0_unix_us,
        // Exact from the source up to RUN; in a cluster restore, what had
        // been read by the start (pages pushed while it waited count).
        ws_pages: ws_loaded,
        wss: job.wss,
        wss_sample: job.wss_sample,
        wss_snapshot: job.wss_snapshot,
        learned: job.learned,
        access_data: job.access_data.clone(),
        quality,
        next_wss: learned.map(|l| l.size),
        bytes_read_before_start: if job.prepared {
            obs.bytes_before
        } else {
            out.bytes_before_run
        },
        demand_faults: out.demand.len() as u64,
        demand_faults_before_start: faults_before_start,
        demand_faults_per_100ms: per_100ms,
        full_load_ms,
        pages_total: out.pages_total,
        pages_on_demand: out.pages_on_demand,
        pages_background: out.pages_background,
        pages_on_preempt: out.pages_on_preempt,
        demand_served_ms: super::job::Spread::of(&out.demand_served_ms),
        vcpu_blocktime_ms: None,
        qemu_threads_raised: obs.qemu_threads_raised,
        overlay: PathBuf::new(),
        record: record_path,
        clock: None,
    })
}

/// The RAM counters of QEMU `pid` now, as `at_full_load`.
pub fn ram_use_now(pid: u32, ram_file: &std::path::Path) -> Option<(u64, RamUse)> {
    let u = crate::accessed::ram_use(pid, ram_file).ok()?;
    Some((unix_us(SystemTime::now()), u))
}
