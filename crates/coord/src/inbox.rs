//! What the blocking drivers of both protocols share: waiting on an inbox
//! channel until the next item or the state machine's next wakeup.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

/// What the inbox gave: an item, a timeout (time to tick) or its end.
pub(crate) enum Next<T> {
    Item(T),
    Tick,
    Closed,
}

/// Waits for the next item of `inbox`, at most until `wake` (forever
/// without one).
pub(crate) fn next<T>(inbox: &Receiver<T>, wake: Option<Instant>) -> Next<T> {
    let r = match wake {
        None => inbox.recv().map_err(|_| RecvTimeoutError::Disconnected),
        Some(at) => match at.checked_duration_since(Instant::now()) {
            None => return Next::Tick,
            Some(d) => inbox.recv_timeout(d),
        },
    };
    match r {
        Ok(x) => Next::Item(x),
        Err(RecvTimeoutError::Timeout) => Next::Tick,
        Err(RecvTimeoutError::Disconnected) => Next::Closed,
    }
}
