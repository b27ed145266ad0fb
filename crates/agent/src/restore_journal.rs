//! The journal of a restore in progress: before a restore starts a QEMU
//! the agent writes `<run-dir>/restoring.json` (atomically, [`begin`]);
//! when the restore has ended, successfully or not, it removes the file
//! ([`end`]). An agent that starts and finds the file ([`pending`]) finishes
//! or redoes that restore: see `crate::restore_recovery`.

use serde::{Deserialize, Serialize};

use crate::{log, AgentError, RunDir};

/// The journal's file name in the run directory.
pub const JOURNAL_FILE: &str = "restoring.json";

/// A restore in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Restoring {
    /// One VM from a VM snapshot.
    Vm {
        /// The snapshot.
        snapshot: String,
        /// The VM it restores.
        vm: String,
    },
    /// A whole cluster from a cluster snapshot.
    Cluster {
        /// The cluster snapshot.
        snapshot: String,
        /// Its VMs.
        vms: Vec<String>,
    },
}

/// Records `r` before the restore starts any QEMU.
pub fn begin(run: &RunDir, r: &Restoring) -> Result<(), AgentError> {
    crate::paths::write_atomic(
        &run.root().join(JOURNAL_FILE),
        &serde_json::to_vec(r).expect("journal serialises"),
    )
}

/// The restore has ended (whatever its outcome).
pub fn end(run: &RunDir) {
    let _ = std::fs::remove_file(run.root().join(JOURNAL_FILE));
}

fn read(run: &RunDir) -> Option<Restoring> {
    let bytes = std::fs::read(run.root().join(JOURNAL_FILE)).ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(r) => Some(r),
        Err(e) => {
            log(format!("{JOURNAL_FILE}: unreadable ({e}); nothing to redo"));
            end(run);
            None
        }
    }
}

/// The restore the previous agent did not finish, if any.
pub fn pending(run: &RunDir) -> Option<Restoring> {
    read(run)
}

impl std::fmt::Display for Restoring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Restoring::Vm { snapshot, vm } => {
                write!(f, "the restore of VM {vm} from snapshot {snapshot}")
            }
            Restoring::Cluster { snapshot, vms } => write!(
                f,
                "the cluster restore of snapshot {snapshot} (VMs {})",
                vms.join(", ")
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_journal_round_trips_and_ends() {
        let d = tempfile::tempdir().unwrap();
        let run = RunDir::new(d.path());
        let r = Restoring::Cluster {
            snapshot: "s".into(),
            vms: vec!["a".into(), "b".into()],
        };
        begin(&run, &r).unwrap();
        assert_eq!(read(&run), Some(r));
        end(&run);
        assert_eq!(read(&run), None);
        std::fs::write(d.path().join(JOURNAL_FILE), b"{").unwrap();
        assert_eq!(read(&run), None, "an unreadable journal is dropped");
        assert!(!d.path().join(JOURNAL_FILE).exists());
    }
}
