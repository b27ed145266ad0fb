//! What restores learn, stored with the snapshot.
//!
//! Each restore writes `<snapshot>/restores/<unix ms>-<mode>.json`: the
//! pages it loaded before the guest started and the pages the guest then
//! faulted on, in fault order (the guest's real first accesses after the
//! restore point, reads included). The next restore's FAFL queue merges
//! the newest record with the snapshot-time write order
//! (`vmcsnap_workingset::queue`); `analyze-ws` reads the newest record made
//! with `--trace`. The image itself is never modified: these files sit in
//! a subdirectory the image format ignores, each written under a temporary
//! name and renamed.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vmcsnap_image::PageKey;

/// Subdirectory of the snapshot holding the records.
pub const DIR: &str = "restores";

/// One restore's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// When (Unix ms).
    pub unix_ms: u64,
    /// Restore mode.
    pub mode: String,
    /// A tracing restore: nothing preloaded, no background push while tracing.
    pub trace: bool,
    /// Pages loaded before the guest started, as `[ram_block, page]`.
    pub preloaded: Vec<(u32, u32)>,
    /// Pages the guest faulted on, in order, with ms since the start.
    pub faults: Vec<(u32, u32, f64)>,
}

impl Record {
    /// The preloaded pages as keys.
    pub fn preloaded_keys(&self) -> Vec<PageKey> {
        self.preloaded
            .iter()
            .map(|&(b, p)| PageKey::new(b, p))
            .collect()
    }

    /// Distinct pages the guest touched early in that restore: the pages
    /// loaded before its start plus those it faulted on. HotRestore's
    /// WSS_snapshot counts every page touched, reads included; stock QEMU
    /// only shows vmcsnap the writes at snapshot time, so a restore's own
    /// faults are how the reads are learned.
    pub fn touched_pages(&self) -> u64 {
        let mut all: Vec<(u32, u32)> = self.preloaded.clone();
        all.extend(self.faults.iter().map(|&(b, p, _)| (b, p)));
        all.sort_unstable();
        all.dedup();
        all.len() as u64
    }

    /// The faults as keys, in order.
    pub fn fault_keys(&self) -> Vec<PageKey> {
        self.faults
            .iter()
            .map(|&(b, p, _)| PageKey::new(b, p))
            .collect()
    }
}

/// Writes `rec` into `snapshot`'s record directory; returns its path.
pub fn save(snapshot: &Path, rec: &Record) -> std::io::Result<PathBuf> {
    let dir = snapshot.join(DIR);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}-{}.json", rec.unix_ms, rec.mode));
    let tmp = dir.join(format!(".{}-{}.json.tmp", rec.unix_ms, rec.mode));
    std::fs::write(
        &tmp,
        serde_json::to_vec(rec).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, &path)?;
    prune(&dir);
    Ok(path)
}

/// Records kept per snapshot (the newest; a record of a large VM is a few MB).
pub const KEEP: usize = 8;

fn records(dir: &Path) -> Vec<PathBuf> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "json")
                && !p.file_name().unwrap().to_string_lossy().starts_with('.')
        })
        .collect();
    // Oldest first, by the Unix-ms prefix of the name.
    names.sort_by_key(|p| {
        let n = p.file_name().unwrap().to_string_lossy().into_owned();
        (
            n.split('-')
                .next()
                .and_then(|t| t.parse::<u64>().ok())
                .unwrap_or(0),
            n,
        )
    });
    names
}

fn prune(dir: &Path) {
    let names = records(dir);
    for old in &names[..names.len().saturating_sub(KEEP)] {
        let _ = std::fs::remove_file(old);
    }
}

/// The newest record of `snapshot` satisfying `keep` (records that do not
/// parse are skipped).
pub fn newest(snapshot: &Path, keep: impl Fn(&Record) -> bool) -> Option<Record> {
    records(&snapshot.join(DIR))
        .iter()
        .rev()
        .filter_map(|p| serde_json::from_slice::<Record>(&std::fs::read(p).ok()?).ok())
        .find(|r| keep(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_matching_record_wins() {
        let d = tempfile::tempdir().unwrap();
        assert!(newest(d.path(), |_| true).is_none());
        let r = |t: u64, trace: bool| Record {
            unix_ms: t,
            mode: "lazy".into(),
            trace,
            preloaded: vec![(0, 1)],
            faults: vec![(0, 2, 1.5)],
        };
        save(d.path(), &r(10, true)).unwrap();
        save(d.path(), &r(20, false)).unwrap();
        std::fs::write(d.path().join(DIR).join("30-lazy.json"), b"garbage").unwrap();
        assert_eq!(newest(d.path(), |_| true).unwrap().unix_ms, 20);
        assert_eq!(newest(d.path(), |r| r.trace).unwrap().unix_ms, 10);
        assert_eq!(r(1, false).fault_keys(), vec![PageKey::new(0, 2)]);
        for t in 100..100 + KEEP as u64 + 2 {
            save(d.path(), &r(t, false)).unwrap();
        }
        assert_eq!(
            records(&d.path().join(DIR)).len(),
            KEEP,
            "older records are pruned"
        );
        assert_eq!(
            newest(d.path(), |_| true).unwrap().unix_ms,
            100 + KEEP as u64 + 1
        );
    }
}

#[cfg(test)]
mod touched_tests {
    use super::*;

    #[test]
    fn touched_pages_count_loaded_and_faulted_pages_once() {
        let r = Record {
            unix_ms: 0,
            mode: "workingset".into(),
            trace: false,
            preloaded: vec![(0, 1), (0, 2), (1, 1)],
            faults: vec![(0, 2, 1.0), (0, 9, 2.0), (0, 9, 3.0)],
        };
        assert_eq!(r.touched_pages(), 4);
    }
}
