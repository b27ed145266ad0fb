//! The cluster restore's part that needs no VM: its plan.

pub mod plan;

pub use plan::{
    dependency_report, graph_edges, plan, Plan, PlanError, PlannedVm, RdgReport, PAGES_PER_FRAME,
};
