//! The cluster snapshot's computations that need no VM.

pub mod metrics;

pub use metrics::{
    backoff, communicating_pairs, console_offset, console_since, console_text, parse_console,
    tcp_now, Backoff, GuestView, Moments, PairBackoff, TcpCounters, TcpGrowth,
};
