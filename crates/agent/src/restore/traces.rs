//! What restores learn, stored with the snapshot.
//!
//! Each restore writes `<snapshot>/restores/<unix ms>-<mode>.json`: the
//! pages it loaded before the guest started, the pages the guest then
//! faulted on, in fault order (the guest's real first accesses after the
//! restore point, reads included), how many loaded pages the guest used
//! (accessed bits), and what the next restore should load first
//! ([`Learned`], bounded: `vmcsnap_workingset::learn`). The next
//! `workingset` restore starts from the newest record's [`Learned`];
//! `analyze-ws` reads the newest record made with `--trace`. The image itself is never modified: these files sit in
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
    /// The working-set size the restore asked for.
    #[serde(default)]
    pub size: u64,
    /// Loaded pages the guest touched before the full load (accessed
    /// bits), if measured.
    #[serde(default)]
    pub ws_used: Option<u64>,
    /// What the next restore starts from (absent in records of older
    /// vmcsnap versions, which are then not learned from).
    #[serde(default)]
    pub learned: Option<Learned>,
}

/// What a restore learned for the next one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Learned {
    /// Working-set size in pages.
    pub size: u64,
    /// Pages seen touched in the learning window.
    pub touched: u64,
    /// The learned queue head, as `[ram_block, page]`.
    pub queue: Vec<(u32, u32)>,
}

impl Record {
    /// The preloaded pages as keys.
    pub fn preloaded_keys(&self) -> Vec<PageKey> {
        self.preloaded
            .iter()
            .map(|&(b, p)| PageKey::new(b, p))
            .collect()
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

/// What the newest record that learned something learned.
pub fn newest_learned(snapshot: &Path) -> Option<Learned> {
    newest(snapshot, |r| r.learned.is_some()).and_then(|r| r.learned)
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
            size: 1,
            ws_used: None,
            learned: (t == 10).then(|| Learned {
                size: 7,
                touched: 2,
                queue: vec![(0, 2)],
            }),
        };
        save(d.path(), &r(10, true)).unwrap();
        save(d.path(), &r(20, false)).unwrap();
        std::fs::write(d.path().join(DIR).join("30-lazy.json"), b"garbage").unwrap();
        assert_eq!(newest(d.path(), |_| true).unwrap().unix_ms, 20);
        assert_eq!(newest(d.path(), |r| r.trace).unwrap().unix_ms, 10);
        assert_eq!(newest_learned(d.path()).unwrap().size, 7);
        // A record of an older vmcsnap (no size, no learned state) still reads.
        std::fs::write(
            d.path().join(DIR).join("40-lazy.json"),
            br#"{"unix_ms":40,"mode":"lazy","trace":false,"preloaded":[],"faults":[[0,3,1.0]]}"#,
        )
        .unwrap();
        assert_eq!(newest(d.path(), |_| true).unwrap().unix_ms, 40);
        assert_eq!(newest_learned(d.path()).unwrap().size, 7);
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
