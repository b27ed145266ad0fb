//! Where a snapshot's pause goes: consecutive parts from QEMU's `STOP`
//! event to its `RESUME` event.
//!
//! Boundaries come from two clocks that are both the host's wall clock:
//! QMP event timestamps (QEMU's) and the agent's own readings around its
//! commands. A boundary read on one clock can come out a few µs before the
//! previous one read on the other (a reply read after the event that
//! followed it); such a boundary is moved up to the previous one, so every
//! part is ≥ 0 and the parts add up exactly to the measured pause.
//!
//! Part names (docs/snapshot.md, "Where the pause goes"):
//! - `stop`: QEMU stopping the vCPUs after its STOP event (draining and
//!   flushing block I/O) until the agent has the reply to `stop`;
//! - `agent`: the agent's own work while paused (a cluster snapshot's
//!   network cut, a debug RAM copy);
//! - `disk_snapshot`: the QMP transaction that freezes the disk;
//! - `migrate_command`: sending `migrate` until QEMU's migration is set up;
//! - `qemu_setup`: QEMU's migration setup (opening the stream, reading all
//!   RAM once before write protection, dirty bitmaps);
//! - `device_state`: device state saved, write protection on, vCPUs
//!   started again (background snapshot);
//! - `copy`: the whole RAM copied (stop-copy) or its last dirty pages and
//!   device state (pre-copy);
//! - `switchover`: pre-copy only, QEMU stopped for the switch-over until
//!   the agent saw it;
//! - `ram_check`: pre-copy only, after `copy`, the rest of the check of the
//!   captured pages against the paused guest's RAM (`final_ram`);
//! - `resume`: from the end of the copy to QEMU's `RESUME` event (`cont`).

use vmcsnap_image::{PauseBreakdown, PausePart};

/// Boundaries of a pause, in the order they happened.
#[derive(Debug, Clone, Default)]
pub struct PauseClock {
    start_us: Option<u64>,
    marks: Vec<(&'static str, u64)>,
}

impl PauseClock {
    /// The pause began (QEMU's STOP event), Unix µs.
    pub fn start(&mut self, unix_us: u64) {
        self.start_us = Some(unix_us);
        self.marks.clear();
    }

    /// The part `name` ended at `unix_us`.
    pub fn mark(&mut self, name: &'static str, unix_us: u64) {
        self.marks.push((name, unix_us));
    }

    /// The parts up to the pause's end (QEMU's RESUME event) at `end_us`,
    /// the last of which is `last`. None if the pause never started.
    pub fn finish(&self, last: &'static str, end_us: u64) -> Option<PauseBreakdown> {
        let start = self.start_us?;
        let end = end_us.max(start);
        let mut prev = start;
        let mut parts = Vec::with_capacity(self.marks.len() + 1);
        for &(name, t) in self.marks.iter().chain([(last, end)].iter()) {
            let t = t.clamp(prev, end);
            parts.push(PausePart {
                name: name.to_string(),
                us: t - prev,
            });
            prev = t;
        }
        Some(PauseBreakdown {
            total_us: end - start,
            parts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_add_up_even_when_clocks_disagree() {
        let mut c = PauseClock::default();
        c.start(1_000);
        c.mark("stop", 1_400);
        c.mark("disk_snapshot", 3_000);
        // Read by the agent after QEMU's next event: earlier than it.
        c.mark("migrate_command", 2_990);
        c.mark("qemu_setup", 5_000);
        let b = c.finish("device_state", 6_500).unwrap();
        assert_eq!(b.total_us, 5_500);
        assert_eq!(b.parts_us(), b.total_us);
        assert_eq!(b.part_us("stop"), 400);
        assert_eq!(b.part_us("disk_snapshot"), 1_600);
        assert_eq!(b.part_us("migrate_command"), 0);
        assert_eq!(b.part_us("qemu_setup"), 2_000);
        assert_eq!(b.part_us("device_state"), 1_500);
        let names: Vec<_> = b.parts.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "stop",
                "disk_snapshot",
                "migrate_command",
                "qemu_setup",
                "device_state"
            ]
        );
    }

    #[test]
    fn a_mark_past_the_end_is_cut_to_it() {
        let mut c = PauseClock::default();
        c.start(10);
        c.mark("copy", 50);
        let b = c.finish("resume", 40).unwrap();
        assert_eq!((b.total_us, b.parts_us()), (30, 30));
        assert_eq!(b.part_us("resume"), 0);
        assert!(PauseClock::default().finish("resume", 5).is_none());
    }
}
