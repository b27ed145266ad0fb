//! Running statistics of a stream being read.

use crate::page_origin::PageOrigin;

/// Page records of one origin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCounts {
    /// Records carrying page data (PAGE).
    pub normal: u64,
    /// One-byte-filled page records (ZERO).
    pub zero: u64,
}

impl PageCounts {
    /// Records of either kind.
    pub fn total(&self) -> u64 {
        self.normal + self.zero
    }
}

/// What the reader has seen so far. Updated before each event is returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes of the stream consumed.
    pub bytes: u64,
    /// "ram" sections (START, PART, END or FULL).
    pub ram_sections: u64,
    /// Commands.
    pub commands: u64,
    /// Page records saved by the linear scan.
    pub scan: PageCounts,
    /// Page records saved out of scan order the first time (guest writes).
    pub guest_write: PageCounts,
    /// Page records of pages already sent earlier in the stream.
    pub resent: PageCounts,
    /// Bytes of device state (first device section up to, not including, EOF).
    pub device_state_bytes: u64,
    /// Bytes of VM description JSON (0 if absent).
    pub vmdesc_bytes: u64,
}

impl Stats {
    /// The counts for one origin.
    pub fn pages(&self, origin: PageOrigin) -> PageCounts {
        match origin {
            PageOrigin::Scan => self.scan,
            PageOrigin::GuestWrite => self.guest_write,
            PageOrigin::Resent => self.resent,
        }
    }

    /// All page records, whatever their origin.
    pub fn all_pages(&self) -> PageCounts {
        PageCounts {
            normal: self.scan.normal + self.guest_write.normal + self.resent.normal,
            zero: self.scan.zero + self.guest_write.zero + self.resent.zero,
        }
    }

    pub(crate) fn count_page(&mut self, origin: PageOrigin, zero: bool) {
        let c = match origin {
            PageOrigin::Scan => &mut self.scan,
            PageOrigin::GuestWrite => &mut self.guest_write,
            PageOrigin::Resent => &mut self.resent,
        };
        if zero {
            c.zero += 1;
        } else {
            c.normal += 1;
        }
    }
}
