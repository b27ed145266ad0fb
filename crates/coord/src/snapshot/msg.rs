//! The protocol's messages, their JSON-line form, timeouts and counters.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A message of the cluster-snapshot protocol. Every message carries the
/// epoch of the cluster snapshot it belongs to.
///
/// Serialized as one JSON object tagged by `type` with the paper's message
/// names, e.g. `{"type":"TRANSIENT_SNAP_FIN","epoch":7}`
/// (see [`to_json_line`](Self::to_json_line)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Msg {
    /// Initiator → peer: take your snapshot.
    Snapshot {
        /// The cluster snapshot's epoch.
        epoch: u64,
    },
    /// Peer → initiator: my transient snapshot is taken; I color my packets.
    TransientSnapFin {
        /// The cluster snapshot's epoch.
        epoch: u64,
    },
    /// Initiator → peers: every transient snapshot is taken; stop coloring.
    AllTransientSnapFin {
        /// The cluster snapshot's epoch.
        epoch: u64,
    },
    /// Peer → initiator: my full snapshot is done (it also implies
    /// `TRANSIENT_SNAP_FIN`).
    FullSnapFin {
        /// The cluster snapshot's epoch.
        epoch: u64,
    },
    /// Initiator → peers: every full snapshot is done; commit.
    AllFullSnapFin {
        /// The cluster snapshot's epoch.
        epoch: u64,
    },
    /// Peer → initiator: my snapshot failed; I have abandoned it.
    Failed {
        /// The cluster snapshot's epoch.
        epoch: u64,
        /// What failed.
        error: String,
    },
    /// Initiator → peers: the cluster snapshot is aborted; discard yours.
    Abort {
        /// The cluster snapshot's epoch.
        epoch: u64,
        /// Why.
        reason: String,
    },
}

impl Msg {
    /// The epoch the message belongs to.
    pub fn epoch(&self) -> u64 {
        match self {
            Msg::Snapshot { epoch }
            | Msg::TransientSnapFin { epoch }
            | Msg::AllTransientSnapFin { epoch }
            | Msg::FullSnapFin { epoch }
            | Msg::AllFullSnapFin { epoch }
            | Msg::Failed { epoch, .. }
            | Msg::Abort { epoch, .. } => *epoch,
        }
    }

    /// The message's name as in the paper and on the wire, e.g.
    /// `"ALL_TRANSIENT_SNAP_FIN"`.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Snapshot { .. } => "SNAPSHOT",
            Msg::TransientSnapFin { .. } => "TRANSIENT_SNAP_FIN",
            Msg::AllTransientSnapFin { .. } => "ALL_TRANSIENT_SNAP_FIN",
            Msg::FullSnapFin { .. } => "FULL_SNAP_FIN",
            Msg::AllFullSnapFin { .. } => "ALL_FULL_SNAP_FIN",
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
    pub fn from_json_line(line: &str) -> Result<Msg, MsgError> {
        crate::transport::parse_json_line(line)
            .map_err(|(line, source)| MsgError::Decode { line, source })
    }
}

/// Errors of the snapshot protocol module.
#[derive(Debug, thiserror::Error)]
pub enum MsgError {
    /// A line is not a protocol message.
    #[error("not a cluster-snapshot message: {line:?}: {source}; the sender must write one JSON object per line as Msg::to_json_line does (same vmcsnap version on both hosts?)")]
    Decode {
        /// The offending line (at most 200 characters).
        line: String,
        /// The JSON error.
        source: serde_json::Error,
    },
}

/// Timers of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeouts {
    /// Interval of retransmissions (initiator: `SNAPSHOT` to peers that have
    /// not answered; peer: its unacknowledged FINs). Default 200 ms.
    pub retry: Duration,
    /// The initiator aborts unless every peer's `TRANSIENT_SNAP_FIN` arrived
    /// within this time from [`Initiator::start`](super::Initiator::start).
    /// Default 30 s.
    pub transient_deadline: Duration,
    /// The initiator aborts unless every peer's `FULL_SNAP_FIN` arrived within
    /// this time from `ALL_TRANSIENT_SNAP_FIN`. Default 600 s. (A peer
    /// waiting for an answer to its FIN gives up after
    /// [`peer_give_up`](Self::peer_give_up), which is longer.)
    pub full_deadline: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            retry: Duration::from_millis(200),
            transient_deadline: Duration::from_secs(30),
            full_deadline: Duration::from_secs(600),
        }
    }
}

impl Timeouts {
    /// How long a finished initiator keeps answering retransmitted FINs
    /// (and an aborted one keeps re-broadcasting `ABORT`) after the last
    /// message it received: 10 × [`retry`](Self::retry).
    pub fn linger(&self) -> Duration {
        self.retry * 10
    }

    /// How long a peer with an unanswered FIN waits without hearing from
    /// the initiator before it abandons: `transient_deadline + full_deadline
    /// + linger()`. A peer's silence starts no earlier than the initiator's
    /// start, and the initiator decides (completes or aborts) at most
    /// `transient_deadline + full_deadline` after its start, so a peer never
    /// gives up while the initiator may still decide, and keeps asking for
    /// the decision for at least another `linger()`.
    pub fn peer_give_up(&self) -> Duration {
        self.transient_deadline + self.full_deadline + self.linger()
    }
}

/// Messages a state machine ignored, by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ignored {
    /// Messages of another epoch.
    pub stale_epoch: u64,
    /// Messages from a node that is not part of this snapshot.
    pub unknown_sender: u64,
    /// Messages of this epoch that make no sense in the current state
    /// (e.g. `SNAPSHOT` sent to the initiator, `ALL_FULL_SNAP_FIN` before the
    /// peer's own full snapshot is done).
    pub unexpected: u64,
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
        let e = Msg::from_json_line("{\"type\":\"HELLO\",\"epoch\":1}\n").unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("HELLO") && s.contains("one JSON object per line"),
            "{s}"
        );
        assert!(Msg::from_json_line("{\"type\":\"SNAPSHOT\"}").is_err());
    }

    #[test]
    fn wire_names() {
        let line = Msg::TransientSnapFin { epoch: 7 }.to_json_line();
        assert_eq!(line, "{\"type\":\"TRANSIENT_SNAP_FIN\",\"epoch\":7}\n");
        let m = Msg::Abort {
            epoch: 1,
            reason: "x".into(),
        };
        assert!(m
            .to_json_line()
            .contains(&format!("\"type\":\"{}\"", m.name())));
    }
}
