//! HotRestore's elastic working set, as pure functions over page keys.
//!
//! Nothing here touches QEMU, files or sockets: the agent gives it the
//! snapshot's traces and sizes and gets back which pages to load before the
//! guest starts and in which order the rest follow.
//!
//! * [`size`]: the hybrid working-set size, 0.7 × WSS_sample + 0.3 ×
//!   WSS_snapshot, halved (HotRestore §3.2).
//! * [`queue`]: the first-access-first-load (FAFL) queue: the pages the
//!   guest wrote during the full snapshot in the order it wrote them,
//!   merged with the demand-fault order learned from earlier restores.
//! * [`plan`]: per restore mode (eager, lazy, workingset, sampling-ws), the
//!   pages sent before the guest starts, the background order and the
//!   demand cluster.
//! * [`access`]: pages the host kernel saw the guest access during a
//!   snapshot (reads included), stored next to the image.
//! * [`learn`]: what the next restore loads first, learned from the last
//!   one's faults and accessed bits, with a bound.
//! * [`analyze`]: hit rate and accuracy of a working set against a trace of
//!   first accesses (HotRestore §6.1.1).

#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod access;
pub mod analyze;
pub mod learn;
pub mod plan;
pub mod queue;
pub mod size;

pub use analyze::{analyze, Quality};
pub use plan::{make_plan, Mode, Plan, PlanError, PlanInput, DMA_CLUSTER};
pub use queue::{fafl_queue, fill_by_locality};
pub use size::hybrid_wss;
pub use vmcsnap_image::PageKey;
