//! The writes that create, refresh and stop vmcsnap's own kdamond, and
//! [`apply`] to perform them.
//!
//! A plan is a list of `(path relative to the admin root, value)`. Writing
//! a `nr_*` file makes the kernel create the numbered directories below it,
//! so the order matters and [`apply`] keeps it. Directories are never
//! created here: on sysfs only the kernel can.

use std::fs;
use std::path::{Path, PathBuf};

use crate::DamonError;

/// The kdamond vmcsnap creates: it writes `nr_kdamonds = 1`, which the
/// kernel only accepts when no kdamond runs ([`crate::probe`] checks), so
/// its kdamond is always number 0, with context 0, target 0 and scheme 0.
pub const KDAMOND: u32 = 0;
/// The context index in vmcsnap's kdamond.
pub const CONTEXT: u32 = 0;
/// The scheme index whose `tried_regions` hold the accessed regions.
pub const SCHEME: u32 = 0;

/// One write: path relative to the admin root, and the value.
pub type Write = (PathBuf, String);

/// DAMON monitoring attributes (`monitoring_attrs/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MonitorAttrs {
    /// Sampling interval: how often one page per region is checked.
    pub sample_us: u64,
    /// Aggregation interval: `nr_accesses` counts the samples of one such
    /// interval that saw an access, so it is at most `aggr_us / sample_us`.
    pub aggr_us: u64,
    /// How often the target's mappings are re-read.
    pub update_us: u64,
    /// Minimum number of regions the address space is split into.
    pub min_regions: u32,
    /// Maximum number of regions.
    pub max_regions: u32,
}

impl Default for MonitorAttrs {
    /// 100 ms sampling, 2 s aggregation, 1 s update, 200 to 1000 regions.
    fn default() -> Self {
        MonitorAttrs {
            sample_us: 100_000,
            aggr_us: 2_000_000,
            update_us: 1_000_000,
            min_regions: 200,
            max_regions: 1000,
        }
    }
}

impl MonitorAttrs {
    /// Checks what the kernel checks when the kdamond starts
    /// (`damon_set_attrs`): at least 3 regions, min ≤ max, sampling no
    /// longer than aggregation; and non-zero intervals.
    pub fn validate(&self) -> Result<(), DamonError> {
        let bad = |s: String| Err(DamonError::InvalidAttrs(s));
        if self.sample_us == 0 || self.aggr_us == 0 || self.update_us == 0 {
            return bad(format!("intervals must be non-zero: {self:?}"));
        }
        if self.sample_us > self.aggr_us {
            return bad(format!(
                "sample_us {} is longer than aggr_us {}",
                self.sample_us, self.aggr_us
            ));
        }
        if self.min_regions < 3 || self.min_regions > self.max_regions {
            return bad(format!(
                "regions must satisfy 3 <= min ({}) <= max ({})",
                self.min_regions, self.max_regions
            ));
        }
        Ok(())
    }
}

fn w(path: String, value: impl ToString) -> Write {
    (PathBuf::from(path), value.to_string())
}

/// What one kdamond watches: a process, all of it or one address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The process.
    pub pid: u32,
    /// `Some((start, end))`: only these virtual addresses (end exclusive),
    /// with the `fvaddr` operations, whose regions stay within the range
    /// the user set (for QEMU: exactly its guest-RAM mapping). `None`: the
    /// whole address space with `vaddr`, which spends most of its regions
    /// on QEMU's own heap, stacks and libraries.
    pub range: Option<(u64, u64)>,
}

/// The ordered writes that configure and start one kdamond with one
/// context monitoring `target` (`fvaddr` over its range, or `vaddr`), and one scheme with action
/// `stat` (counts only, changes no memory) whose access pattern matches
/// every region accessed at least once in an aggregation interval, of any
/// size and age, so that its `tried_regions` list the accessed regions.
///
/// The last write turns the kdamond `on`. Every access-pattern bound is
/// written: a new scheme directory starts with all ranges at 0..0, which
/// would match nothing. Quotas and watermarks keep their defaults (no
/// quota, no watermark). Sizes are written for a 64-bit kernel.
pub fn plan_setup(target: Target, attrs: &MonitorAttrs) -> Result<Vec<Write>, DamonError> {
    attrs.validate()?;
    if let Some((start, end)) = target.range {
        if start >= end {
            return Err(DamonError::InvalidAttrs(format!(
                "empty target range {start:#x}..{end:#x}"
            )));
        }
    }
    let kd = format!("kdamonds/{KDAMOND}");
    let ctx = format!("{kd}/contexts/{CONTEXT}");
    let mon = format!("{ctx}/monitoring_attrs");
    let sch = format!("{ctx}/schemes/{SCHEME}");
    let pat = format!("{sch}/access_pattern");
    let tgt = format!("{ctx}/targets/0");
    let ops = if target.range.is_some() {
        "fvaddr"
    } else {
        "vaddr"
    };
    let mut plan = vec![
        w("kdamonds/nr_kdamonds".into(), 1),
        w(format!("{kd}/contexts/nr_contexts"), 1),
        w(format!("{ctx}/operations"), ops),
        w(format!("{mon}/intervals/sample_us"), attrs.sample_us),
        w(format!("{mon}/intervals/aggr_us"), attrs.aggr_us),
        w(format!("{mon}/intervals/update_us"), attrs.update_us),
        w(format!("{mon}/nr_regions/min"), attrs.min_regions),
        w(format!("{mon}/nr_regions/max"), attrs.max_regions),
        w(format!("{ctx}/targets/nr_targets"), 1),
        w(format!("{tgt}/pid_target"), target.pid),
    ];
    if let Some((start, end)) = target.range {
        plan.extend([
            w(format!("{tgt}/regions/nr_regions"), 1),
            w(format!("{tgt}/regions/0/start"), start),
            w(format!("{tgt}/regions/0/end"), end),
        ]);
    }
    plan.extend([
        w(format!("{ctx}/schemes/nr_schemes"), 1),
        w(format!("{sch}/action"), "stat"),
        w(format!("{pat}/sz/min"), 0),
        w(format!("{pat}/sz/max"), u64::MAX),
        w(format!("{pat}/nr_accesses/min"), 1),
        w(format!("{pat}/nr_accesses/max"), u32::MAX),
        w(format!("{pat}/age/min"), 0),
        w(format!("{pat}/age/max"), u32::MAX),
        w(format!("{kd}/state"), "on"),
    ]);
    Ok(plan)
}

/// The write that asks the running kdamond to refill every scheme's
/// `tried_regions` directory (done by the kernel at the scheme's next
/// apply interval, i.e. the next aggregation; wait that long before
/// [`crate::read_tried_regions`]).
pub fn plan_refresh() -> Vec<Write> {
    vec![w(
        format!("kdamonds/{KDAMOND}/state"),
        "update_schemes_tried_regions",
    )]
}

/// The writes that stop vmcsnap's kdamond and remove its directories.
/// The kdamond also stops by itself when the target process exits, and
/// writing `off` then fails: apply these one at a time and go on past an
/// error of the first.
pub fn plan_stop() -> Vec<Write> {
    vec![
        w(format!("kdamonds/{KDAMOND}/state"), "off"),
        w("kdamonds/nr_kdamonds".into(), 0),
    ]
}

/// Performs `writes` in order under `root`, each value in one `write(2)`
/// to an existing file (no file or directory is created: sysfs files exist
/// once their parent `nr_*` count is written). Stops at the first error,
/// which names the file and value.
pub fn apply(root: &Path, writes: &[Write]) -> Result<(), DamonError> {
    for (rel, value) in writes {
        let path = root.join(rel);
        let result = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, value.as_bytes()));
        result.map_err(|source| DamonError::Write {
            path,
            value: value.clone(),
            source,
        })?;
    }
    Ok(())
}
