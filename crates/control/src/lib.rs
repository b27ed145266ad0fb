//! The control protocol between the `vmcsnap` CLI and the per-host agent.
//!
//! Transport: a unix stream socket (`<run-dir>/agent.sock`, mode 0600, in a
//! 0700 directory), one request per connection.
//!
//! ```text
//!  CLI                                   agent
//!   | -- {"op":"up", ...}\n  ----------->  |
//!   | <- {"kind":"progress","message":..}  |   zero or more, for long operations
//!   | <- {"kind":"progress","message":..}  |
//!   | <- {"kind":"done","result":{...}}    |   exactly one of done / failed,
//!   |    or {"kind":"failed","error":".."} |   then the agent closes
//! ```
//!
//! Every message is one line of JSON. Lines longer than [`MAX_LINE`] are a
//! protocol error (the reader never buffers without bound).

mod messages;
pub mod testing;
mod wire;

pub use messages::{
    Busy, ConsoleResult, GcResult, Recover, RemovedSnapshot, Reply, Request, SnapshotKind,
    SnapshotsDeleteResult, StatusResult, UpResult, VmLoad, VmStatus, VmUp,
};
pub use wire::{call, read_request, write_reply, ControlError, MAX_LINE};

#[cfg(test)]
mod tests_fuzz;
