//! Work on a VM that a new agent must finish if the old one dies midway.
//!
//! Before the agent pauses a VM it did not find paused, or takes its QEMU
//! away, it writes what it is doing to `<vm-dir>/intent.json` (atomically,
//! synced); when the work is done it removes the file. An agent that
//! adopts the VM after a crash ([`crate::cluster_record::adopt`]) reads the file
//! and finishes the work ([`crate::intent_recovery`]), so that no VM stays
//! paused and no VM whose QEMU was being replaced is lost:
//!
//! | intent | written | a new agent finding a live QEMU | ... finding none |
//! |---|---|---|---|
//! | `resume` | before `stop` (snapshot, rejuvenation) | ends a migration still running, resumes the guest | nothing (the VM is exited) |
//! | `restart` | once the device state is saved and synced, before the old QEMU quits | a new QEMU still loading is waited for; either QEMU is resumed | starts a new QEMU on the saved state and resumes it |
//! | `boot` | before a cold restart quits the old QEMU | resumes it if paused | boots the VM again |
//!
//! A VM the operator paused is never marked, so it is never resumed.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::qemu::QemuConfig;
use crate::AgentError;

/// The file in a VM's directory.
pub const INTENT_FILE: &str = "intent.json";

/// What the agent is doing to a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Intent {
    /// The agent pauses (or paused) the VM and will resume it.
    Resume,
    /// Warm or saved restart: the complete device state (and for `saved`,
    /// RAM) is in `state`; the old QEMU may be gone.
    Restart {
        /// The state file.
        state: PathBuf,
        /// Whether guest RAM stays in the shared file (warm).
        warm: bool,
    },
    /// Cold restart: the old QEMU is being replaced by a fresh boot.
    Boot,
}

fn path(config: &QemuConfig) -> PathBuf {
    config.console_log.with_file_name(INTENT_FILE)
}

/// Records `intent` for the VM of `config`, durably, before the work starts.
pub fn set(config: &QemuConfig, intent: &Intent) -> Result<(), AgentError> {
    crate::paths::write_atomic(
        &path(config),
        &serde_json::to_vec(intent).expect("intent serialises"),
    )
}

/// The work is done.
pub fn clear(config: &QemuConfig) {
    let _ = std::fs::remove_file(path(config));
}

/// The recorded intent, if any (an unreadable file counts as `resume`:
/// resuming a VM the agent paused is the safe reading).
pub fn get(config: &QemuConfig) -> Option<Intent> {
    let bytes = std::fs::read(path(config)).ok()?;
    Some(serde_json::from_slice(&bytes).unwrap_or(Intent::Resume))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intents_round_trip_and_clear() {
        let d = tempfile::tempdir().unwrap();
        let mut c: QemuConfig = serde_json::from_value(serde_json::json!({
            "name": "a", "accel": "tcg", "memory_mib": 128, "vcpus": 1, "ram_file": "/dev/shm/x",
            "kernel": "/k", "initrd": "/i", "cmdline": "", "console_log": "/x/console.log",
            "qmp_socket": "/x/q", "disk": "/x/d", "port_socket": "/x/p", "mac": "52:54:00:00:00:01",
            "incoming": false,
        }))
        .unwrap();
        c.console_log = d.path().join("console.log");
        assert_eq!(get(&c), None);
        let i = Intent::Restart {
            state: d.path().join("restart.state"),
            warm: true,
        };
        set(&c, &i).unwrap();
        assert_eq!(get(&c), Some(i));
        clear(&c);
        assert_eq!(get(&c), None);
        std::fs::write(d.path().join(INTENT_FILE), b"garbage").unwrap();
        assert_eq!(
            get(&c),
            Some(Intent::Resume),
            "an unreadable intent is read as resume"
        );
    }
}
