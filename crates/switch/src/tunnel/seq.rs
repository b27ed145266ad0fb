//! The receiving end's check of a tunnel's sequence numbers: which
//! datagrams to deliver (each at most once) and what was lost.

/// How far behind the newest datagram a late one is still told apart from
/// a duplicate.
pub const WINDOW: u64 = 64;

/// What to do with a received datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// Newer than any before: deliver. `skipped` datagrams between it and
    /// the newest before it have not arrived (yet).
    New {
        /// The gap it leaves.
        skipped: u64,
    },
    /// Older than the newest, not seen before: deliver (it was counted as
    /// lost until now).
    Late,
    /// Seen before: drop.
    Duplicate,
    /// Too old to tell ([`WINDOW`] behind the newest), from an older
    /// incarnation of the sender, or numbered 0: drop.
    Stale,
}

/// Counts of one tunnel's received datagrams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqCounts {
    /// Delivered (new or late).
    pub delivered: u64,
    /// Dropped as repeated.
    pub duplicates: u64,
    /// Dropped as stale.
    pub stale: u64,
    /// Not arrived: gaps left by newer datagrams, less late arrivals.
    pub lost: u64,
    /// The sender started again (a larger incarnation).
    pub restarts: u64,
}

/// The receiving end's state for one sending end.
#[derive(Debug, Clone, Default)]
pub struct SeqWindow {
    incarnation: u64,
    /// The newest sequence number delivered (0: none yet).
    top: u64,
    /// Bit `i` set: `top - 1 - i` was delivered.
    below: u64,
    /// The first sequence number delivered in this incarnation (0: none).
    first: u64,
    counts: SeqCounts,
}

impl SeqWindow {
    /// A window that has seen nothing.
    pub fn new() -> SeqWindow {
        SeqWindow::default()
    }

    /// The verdict on datagram `seq` of the sender's `incarnation`, and the
    /// window moved on.
    pub fn observe(&mut self, incarnation: u64, seq: u64) -> SeqVerdict {
        if incarnation > self.incarnation {
            if self.incarnation != 0 || self.top != 0 {
                self.counts.restarts += 1;
            }
            self.incarnation = incarnation;
            self.top = 0;
            self.below = 0;
            self.first = 0;
        }
        let v = self.verdict(incarnation, seq);
        self.count(v);
        v
    }

    /// How many datagrams of `incarnation` numbered below `seq` have not
    /// arrived, counting from the first this window delivered (what the
    /// sender sent before the receiver heard from it is not waited for)
    /// and at most [`WINDOW`] behind the newest (older ones are delivered
    /// or lost for good). `None` if `incarnation` is not the sender's
    /// current one. 0 means every datagram sent before `seq` is in.
    pub fn missing_below(&self, incarnation: u64, seq: u64) -> Option<u64> {
        if incarnation != self.incarnation || self.first == 0 {
            return None;
        }
        // At most WINDOW + 1 numbers, whatever `seq` is.
        let from = self.first.max(self.top.saturating_sub(WINDOW));
        let to = seq.min(self.top.saturating_add(1));
        let missing = (from..to).filter(|&s| !self.delivered(s)).count() as u64;
        // Numbers beyond the newest delivered one are missing too.
        let beyond = seq.saturating_sub(self.top.saturating_add(1));
        Some(missing + beyond)
    }

    /// Whether `s` (at most the newest, at most WINDOW behind it) was
    /// delivered.
    fn delivered(&self, s: u64) -> bool {
        s == self.top || self.below & (1 << (self.top - s - 1)) != 0
    }

    /// What was received so far.
    pub fn counts(&self) -> SeqCounts {
        self.counts
    }

    fn verdict(&mut self, incarnation: u64, seq: u64) -> SeqVerdict {
        if incarnation < self.incarnation || seq == 0 {
            return SeqVerdict::Stale;
        }
        if seq > self.top {
            let skipped = seq - self.top - 1;
            // Shift the delivered marks down by the distance; the old top
            // becomes a delivered mark (unless nothing was delivered yet).
            let shift = seq - self.top;
            let moved = if shift >= WINDOW {
                0
            } else {
                self.below << shift
            };
            let top_mark = if self.top != 0 && shift <= WINDOW {
                1 << (shift - 1)
            } else {
                0
            };
            self.below = moved | top_mark;
            self.top = seq;
            if self.first == 0 {
                self.first = seq;
            }
            return SeqVerdict::New { skipped };
        }
        if seq == self.top {
            return SeqVerdict::Duplicate;
        }
        let back = self.top - seq; // 1..
        if back > WINDOW {
            return SeqVerdict::Stale;
        }
        let bit = 1u64 << (back - 1);
        if self.below & bit != 0 {
            return SeqVerdict::Duplicate;
        }
        self.below |= bit;
        SeqVerdict::Late
    }

    fn count(&mut self, v: SeqVerdict) {
        let c = &mut self.counts;
        match v {
            SeqVerdict::New { skipped } => {
                c.delivered += 1;
                // A sender may jump by any amount: saturate, never wrap.
                c.lost = c.lost.saturating_add(skipped);
            }
            SeqVerdict::Late => {
                c.delivered += 1;
                c.lost = c.lost.saturating_sub(1);
            }
            SeqVerdict::Duplicate => c.duplicates += 1,
            SeqVerdict::Stale => c.stale += 1,
        }
    }
}
