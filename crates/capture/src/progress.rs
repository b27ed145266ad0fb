//! What a capture reports while it runs ([`CaptureProgress`]) and when it
//! is done ([`CaptureStats`]).

use std::time::Duration;

use crate::options::CaptureMode;

/// Where a capture is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Reading QEMU's stream (and, except in precopy mode, writing pages
    /// into the image as they arrive).
    Receiving,
    /// Precopy only: the stream has ended; the staged pages are being
    /// written into the image.
    WritingImage,
    /// Every page and the device state are in the (uncommitted) image.
    Done,
}

/// One progress report, for the CLI's progress lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureProgress {
    /// Where the capture is.
    pub phase: Phase,
    /// Bytes of QEMU's stream read so far.
    pub stream_bytes: u64,
    /// Page records read so far (data and zero pages, first copies and
    /// re-sent ones).
    pub page_records: u64,
    /// Pages given to the image so far (stored or zero).
    pub pages_written: u64,
    /// Bytes appended to the memory image so far.
    pub image_bytes: u64,
    /// Since the capture started.
    pub elapsed: Duration,
}

/// Counts and timings of a finished capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureStats {
    /// The capture's mode.
    pub mode: CaptureMode,
    /// Bytes of QEMU's stream.
    pub stream_bytes: u64,
    /// Page records in the stream (data and zero, first and re-sent).
    pub page_records: u64,
    /// Page records of pages sent before (precopy rounds after the first).
    pub pages_resent: u64,
    /// Pages the guest wrote during a background snapshot, as far as the
    /// stream shows (the FAFL trace's length; 0 in the other modes).
    pub pages_guest_written: u64,
    /// Pages stored in the memory image.
    pub pages_stored: u64,
    /// Zero pages (in the bitmap).
    pub pages_zero: u64,
    /// Bytes of the device-state blob.
    pub device_state_bytes: u64,
    /// From the start of the capture to the stream's first byte (how long
    /// QEMU took to connect and start sending).
    pub wait_first_byte: Duration,
    /// From the stream's first byte to its end.
    pub stream_time: Duration,
    /// From the end of the stream to the image being complete (precopy:
    /// writing the staged pages; otherwise only the last block).
    pub finish_time: Duration,
    /// From the start of the capture to the image being complete
    /// (uncommitted).
    pub total_time: Duration,
}

impl CaptureStats {
    /// Stream throughput in MB/s (10⁶ bytes) from first byte to end of
    /// stream; 0 if no time was measured.
    pub fn stream_mb_per_s(&self) -> f64 {
        let s = self.stream_time.as_secs_f64();
        if s > 0.0 {
            self.stream_bytes as f64 / s / 1e6
        } else {
            0.0
        }
    }
}
