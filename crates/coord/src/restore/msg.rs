//! The restore protocol's messages, their JSON-line form, timeouts and
//! errors.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// A message of the cluster-restore protocol. Every message carries the
/// epoch of the restore it belongs to.
///
/// Serialized as one JSON object tagged by `type` with the paper's message
/// names, e.g. `{"type":"START_FIN","epoch":7,"started_unix_us":1700000000000000}`
/// (see [`to_json_line`](Self::to_json_line)). `START_ACK` and
/// `ALL_RESTORE_FIN` are not in the paper: they acknowledge `START_FIN` and
/// `RESTORE_FIN` (see `docs/cluster-protocol.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Msg {
    /// Coordinator → cohort: load your VM's working set (the VM does not
    /// run yet).
    Load {
        /// The restore's epoch.
        epoch: u64,
    },
    /// Cohort → coordinator: my working set is loaded; the VM may start
    /// (the other pages keep loading in the background).
    LoadFin {
        /// The restore's epoch.
        epoch: u64,
    },
    /// Coordinator → cohort: start your VM (the Checker allowed it).
    Start {
        /// The restore's epoch.
        epoch: u64,
    },
    /// Cohort → coordinator: my VM runs since `started_unix_us`.
    StartFin {
        /// The restore's epoch.
        epoch: u64,
        /// When the guest started, in microseconds since the Unix epoch
        /// (the cohort host's clock; for reports, never for timers).
        started_unix_us: u64,
    },
    /// Coordinator → cohort: your `START_FIN` arrived (answer to every
    /// `START_FIN`).
    StartAck {
        /// The restore's epoch.
        epoch: u64,
    },
    /// Cohort → coordinator: every page of my VM is loaded; its restore is
    /// complete (sent only after `START_FIN`).
    RestoreFin {
        /// The restore's epoch.
        epoch: u64,
    },
    /// Coordinator → cohorts: every VM is restored; the cluster restore is
    /// complete (sent to all once, then in answer to every `RESTORE_FIN`).
    AllRestoreFin {
        /// The restore's epoch.
        epoch: u64,
    },
    /// Cohort → coordinator: my restore failed; I have abandoned it.
    Failed {
        /// The restore's epoch.
        epoch: u64,
        /// What failed.
        error: String,
    },
    /// Coordinator → cohorts: the cluster restore is aborted; stop your VM.
    Abort {
        /// The restore's epoch.
        epoch: u64,
        /// Why.
        reason: String,
    },
}

impl Msg {
    /// The epoch the message belongs to.
    pub fn epoch(&self) -> u64 {
        match self {
            Msg::Load { epoch }
            | Msg::LoadFin { epoch }
            | Msg::Start { epoch }
            | Msg::StartFin { epoch, .. }
            | Msg::StartAck { epoch }
            | Msg::RestoreFin { epoch }
            | Msg::AllRestoreFin { epoch }
            | Msg::Failed { epoch, .. }
            | Msg::Abort { epoch, .. } => *epoch,
        }
    }

    /// The message's name as on the wire, e.g. `"LOAD_FIN"`.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Load { .. } => "LOAD",
            Msg::LoadFin { .. } => "LOAD_FIN",
            Msg::Start { .. } => "START",
            Msg::StartFin { .. } => "START_FIN",
            Msg::StartAck { .. } => "START_ACK",
            Msg::RestoreFin { .. } => "RESTORE_FIN",
            Msg::AllRestoreFin { .. } => "ALL_RESTORE_FIN",
            Msg::Failed { .. } => "FAILED",
            Msg::Abort { .. } => "ABORT",
        }
    }

    /// The message as one line of JSON, ending in `\n`.
    pub fn to_json_line(&self) -> String {
        crate::transport::json_line(self)
    }

    /// Parses one line written by [`to_json_line`](Self::to_json_line)
    /// (surrounding whitespace, including the newline, is ignored).
    pub fn from_json_line(line: &str) -> Result<Msg, RestoreProtocolError> {
        crate::transport::parse_json_line(line)
            .map_err(|(line, source)| RestoreProtocolError::Decode { line, source })
    }
}

/// Errors of the restore protocol module.
#[derive(Debug, thiserror::Error)]
pub enum RestoreProtocolError {
    /// A line is not a restore-protocol message.
    #[error("not a cluster-restore message: {line:?}: {source}; the sender must write one JSON object per line as restore::Msg::to_json_line does (same vmcsnap version on both hosts?)")]
    Decode {
        /// The offending line (at most 200 characters).
        line: String,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// The coordinator's own name is among the cohorts.
    #[error(
        "the coordinator's name {0:?} is also a cohort's; give the coordinator a name of its own"
    )]
    CoordinatorIsCohort(NodeId),
}

/// Timers of the restore protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeouts {
    /// Interval of retransmissions (coordinator: `LOAD` to cohorts without
    /// `LOAD_FIN`, `START` to cohorts without `START_FIN`; cohort: its
    /// unacknowledged FINs). Default 200 ms.
    pub retry: Duration,
    /// The coordinator aborts unless every `LOAD_FIN` arrived within this
    /// time from [`Coordinator::start`](super::Coordinator::start).
    /// Default 600 s.
    pub load_deadline: Duration,
    /// The coordinator aborts unless every `START_FIN` arrived within this
    /// time from the last `LOAD_FIN`. Default 600 s.
    pub start_deadline: Duration,
    /// The coordinator aborts unless every `RESTORE_FIN` arrived within this
    /// time from the last `START_FIN`. Default 1800 s.
    pub restore_deadline: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            retry: Duration::from_millis(200),
            load_deadline: Duration::from_secs(600),
            start_deadline: Duration::from_secs(600),
            restore_deadline: Duration::from_secs(1800),
        }
    }
}

impl Timeouts {
    /// How long a finished coordinator keeps answering retransmitted FINs
    /// (and an aborted one keeps re-broadcasting `ABORT`) after the last
    /// message it received; also how long a failed cohort re-sends `FAILED`
    /// while no `ABORT` comes: 10 × [`retry`](Self::retry).
    pub fn linger(&self) -> Duration {
        self.retry * 10
    }

    /// How long a cohort with an unacknowledged FIN waits without hearing
    /// from the coordinator before it abandons: `load_deadline +
    /// start_deadline + restore_deadline + linger()`. The coordinator
    /// decides (Done or Aborted) at most `load_deadline + start_deadline +
    /// restore_deadline` after its start, and a cohort's silence starts no
    /// earlier, so a cohort never gives up while the coordinator may still
    /// decide (a cohort held back by the Checker hears nothing for a while).
    pub fn cohort_give_up(&self) -> Duration {
        self.load_deadline + self.start_deadline + self.restore_deadline + self.linger()
    }
}

impl crate::transport::Named for Msg {
    fn name(&self) -> &'static str {
        Msg::name(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_line_is_a_decode_error() {
        let e = Msg::from_json_line("{\"type\":\"SNAPSHOT\",\"epoch\":1}\n").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("SNAPSHOT") && s.contains("one JSON object per line"),
            "{s}"
        );
        assert!(Msg::from_json_line("{\"type\":\"START_FIN\",\"epoch\":1}").is_err());
    }

    #[test]
    fn defaults_and_derived_timers() {
        let t = Timeouts::default();
        assert_eq!(t.retry, Duration::from_millis(200));
        assert_eq!(t.restore_deadline, Duration::from_secs(1800));
        assert_eq!(t.linger(), Duration::from_secs(2));
        assert_eq!(t.cohort_give_up(), Duration::from_secs(3002));
    }
}
