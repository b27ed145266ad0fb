//! The errors of the postcopy source. Each says what happened and what to
//! look at; a destination-side failure always comes with a hint to read
//! the destination QEMU's stderr, where QEMU prints its reason.

use std::fmt;
use std::io;
use std::time::Duration;

use thiserror::Error;

use super::return_path::RpError;
use super::PageId;

/// How far the migration had come when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Before the PACKAGED blob (with POSTCOPY_RUN) was written: the
    /// destination's guest never ran, a retry from scratch is safe.
    BeforeRun,
    /// After RUN, with this many pages not yet sent: the destination's guest
    /// may have run and is lost (QEMU pauses or exits), restart it.
    AfterRun {
        /// Pages not yet written.
        outstanding: u64,
    },
    /// After EOF, every page sent, while waiting for SHUT.
    AfterEof,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::BeforeRun => write!(f, "before RUN (the guest never started)"),
            Phase::AfterRun { outstanding } => write!(
                f,
                "after RUN with {outstanding} page(s) outstanding (the destination guest is lost)"
            ),
            Phase::AfterEof => write!(f, "after EOF, every page sent, before SHUT"),
        }
    }
}

/// Why [`run_source`](super::run_source) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PostcopyError {
    /// The [`SourceConfig`](super::SourceConfig) cannot describe a valid
    /// stream; nothing was written.
    #[error("invalid postcopy source configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },

    /// The destination closed (or reset) the connection.
    #[error("the destination closed the migration connection {phase}{}; see the destination QEMU's stderr for its reason (machine type, device set or RAM block list mismatch, postcopy-ram not enabled, killed)", io_suffix(.source))]
    DestinationClosed {
        /// When it happened.
        phase: Phase,
        /// The socket error, if the close was seen as one (EPIPE, ECONNRESET).
        #[source]
        source: Option<io::Error>,
    },

    /// The return path carried bytes that are not a valid message.
    #[error("return path garbage at return-path byte {offset} (message bytes {bytes}): {error}; is the peer a QEMU 7.2 postcopy destination?")]
    ReturnPath {
        /// Offset of the message in the return-path byte stream.
        offset: u64,
        /// The first bytes of the offending message, in hex.
        bytes: String,
        /// What is wrong.
        #[source]
        error: RpError,
    },

    /// The destination asked for pages outside the RAM it was told about.
    #[error("the destination requested {len:#x} bytes at {start:#x} of block {block:?}: {reason}; the block list given to the source does not match the destination's RAM")]
    RequestOutOfRange {
        /// The block named by the request.
        block: String,
        /// Requested byte offset in the block.
        start: u64,
        /// Requested length in bytes.
        len: u64,
        /// What is wrong.
        reason: String,
    },

    /// The destination reported failure with SHUT(value ≠ 0).
    #[error("the destination reported failure (SHUT {value}) {phase}; see the destination QEMU's stderr")]
    ShutFailed {
        /// The SHUT value.
        value: u32,
        /// When it came.
        phase: Phase,
    },

    /// Every page and EOF were sent, but no SHUT came in time.
    #[error("no SHUT from the destination within {timeout:?} after EOF; it may still be loading (raise shut_timeout) or hang (check query-migrate on the destination)")]
    NoShut {
        /// The configured timeout.
        timeout: Duration,
    },

    /// The [`PageSource`](super::PageSource) failed.
    #[error("reading page {} of block {} from the page source failed {phase}: {source}", .id.page, .id.block)]
    PageSource {
        /// The page.
        id: PageId,
        /// When it happened.
        phase: Phase,
        /// The page source's error.
        #[source]
        source: io::Error,
    },

    /// A local socket operation failed (other than the peer closing).
    #[error("socket error {phase} while {what}: {source}")]
    Socket {
        /// When it happened.
        phase: Phase,
        /// What the source was doing.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn io_suffix(e: &Option<io::Error>) -> String {
    match e {
        Some(e) => format!(" ({e})"),
        None => String::new(),
    }
}

impl PostcopyError {
    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        PostcopyError::InvalidConfig {
            reason: reason.into(),
        }
    }

    /// The phase in which the error happened, if it concerns the connection.
    pub fn phase(&self) -> Option<Phase> {
        match self {
            PostcopyError::DestinationClosed { phase, .. }
            | PostcopyError::ShutFailed { phase, .. }
            | PostcopyError::PageSource { phase, .. }
            | PostcopyError::Socket { phase, .. } => Some(*phase),
            PostcopyError::NoShut { .. } => Some(Phase::AfterEof),
            _ => None,
        }
    }
}
