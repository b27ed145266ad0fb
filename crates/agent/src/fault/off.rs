//! A build without `fault-injection`: the fault types are empty (an
//! `Option` of one is always `None`), nothing is ever armed, and every hook
//! is a no-op, so no fault code is compiled in.

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::{AgentError, RunDir};

/// A snapshot fault: none in this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {}

/// A rejuvenation fault: none in this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejuvenateFault {}

/// A cluster restore fault: none in this build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreFault {}

/// What a VM does once its peers loaded: nothing in this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenPeersLoaded {}

/// The capture's reader, unchanged.
pub struct FaultyReader<R>(R);

impl<R: Read> FaultyReader<R> {
    /// Wraps `inner`.
    pub fn new(inner: R, _fault: Option<Fault>, _abort: Arc<AtomicBool>) -> Self {
        FaultyReader(inner)
    }
}

impl<R: Read> Read for FaultyReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

/// No fault is ever armed.
pub fn take_snapshot(_run: &RunDir, _vm: &str) -> Result<Option<Fault>, AgentError> {
    Ok(None)
}

/// No fault is ever armed.
pub fn take_rejuvenate(
    _run: &RunDir,
    _vm: Option<&str>,
) -> Result<Option<RejuvenateFault>, AgentError> {
    Ok(None)
}

/// No fault is ever armed.
pub fn take_cluster_restore(_run: &RunDir) -> Result<Option<RestoreFault>, AgentError> {
    Ok(None)
}

/// No delay.
pub fn ram_read_delay(_fault: Option<Fault>) -> Duration {
    Duration::ZERO
}

/// The capture's usual waits.
pub fn short_capture_waits(_fault: Option<Fault>) -> Option<Duration> {
    None
}

/// No stall.
pub fn commit_stall(_fault: Option<Fault>) -> Option<Duration> {
    None
}

/// No write.
pub fn precopy_untracked_write(_fault: Option<Fault>) -> Option<u64> {
    None
}

/// No hooks.
pub fn paused_hooks(_fault: Option<Fault>) -> Option<Box<dyn crate::snapshot::Hooks>> {
    None
}

/// The new QEMU lives.
pub fn new_qemu_dies(_fault: Option<RejuvenateFault>) -> bool {
    false
}

/// The fallback is not failed on purpose.
pub fn fallback_failure(_fault: Option<RejuvenateFault>) -> Option<AgentError> {
    None
}

/// No VM is named.
pub fn restore_fault_vm(_fault: &Option<RestoreFault>) -> Option<&str> {
    None
}

/// Nothing happens once peers loaded.
pub fn when_peers_loaded(_fault: &Option<RestoreFault>, _vm: &str) -> Option<WhenPeersLoaded> {
    None
}

/// The background push is not held.
pub fn background_held_until(_fault: &Option<RestoreFault>) -> Option<PathBuf> {
    None
}

/// START is not held.
pub fn start_held_until(_fault: &Option<RestoreFault>) -> Option<PathBuf> {
    None
}
