//! The cluster snapshot's computations that need no VM.

pub mod metrics;

pub use metrics::{
    backoff, communicating_pairs, Backoff, Moments, PairBackoff, TcpCounters, TcpGrowth,
};
