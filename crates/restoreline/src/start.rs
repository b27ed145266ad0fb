//! The Checker of the restore protocol (HotRestore §4.3): which VMs start
//! together and what each waits for. This is the one place that decides
//! the order in which a cluster restore starts its VMs; the protocol's
//! coordinator (`vmcsnap_coord::restore::Coordinator`) only asks it.
//!
//! * A **start group** is a ring (rule 5: its members start at once) or a
//!   single VM. Its `after` set is the VMs outside the group that any
//!   member sends to directly (rules 2 and 3: "after all the depended
//!   VMs").
//! * A group may start once every member's working set is loaded and every
//!   VM of its `after` set **runs** (reported its start, not merely told
//!   to start). A group with an empty `after` set (rules 1, 4, 6: a VM
//!   that depends on nobody, an orphan) starts as soon as it is loaded.
//!
//! Because the rings are the strongly connected components, the groups
//! form a DAG: once every VM is loaded some group always waits for nobody,
//! and each group's turn comes once its receivers run, so the Checker
//! never deadlocks. [`Rdg::start_groups`] lists the groups in causal order
//! ([`Rdg::causal_order`]), so every group's `after` set lies in earlier
//! groups.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::graph::Rdg;

/// VMs that start together, and the VMs that must run before they start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartGroup {
    /// A ring, or a single VM; sorted.
    pub members: Vec<String>,
    /// The VMs outside the group that a member sends to; sorted. They must
    /// run before the group starts.
    pub after: Vec<String>,
}

impl StartGroup {
    /// Whether the group may start now: every member is in `loaded` and
    /// every VM of its `after` set in `running`.
    pub fn may_start(&self, loaded: &BTreeSet<String>, running: &BTreeSet<String>) -> bool {
        self.members.iter().all(|m| loaded.contains(m))
            && self.after.iter().all(|d| running.contains(d))
    }
}

impl Rdg {
    /// The start groups in causal order: each ring one group, every other
    /// VM a group of its own (orphans last), each with its `after` set.
    pub fn start_groups(&self) -> Vec<StartGroup> {
        self.causal_order()
            .into_iter()
            .map(|members| {
                let after: BTreeSet<String> = members
                    .iter()
                    .flat_map(|m| self.must_start_before(m))
                    .collect();
                StartGroup {
                    members,
                    after: after.into_iter().collect(),
                }
            })
            .collect()
    }

    /// The start groups when the order is ignored (HotRestore "w/o RL",
    /// the baseline): every VM alone, waiting for nobody.
    pub fn unordered_groups(&self) -> Vec<StartGroup> {
        self.nodes
            .iter()
            .map(|vm| StartGroup {
                members: vec![vm.clone()],
                after: Vec::new(),
            })
            .collect()
    }

    /// The Checker: the groups that may start now, in causal order, given
    /// the VMs that are `loaded` and have not been told to start yet, and
    /// the VMs that are `running`. A group none of whose members is in
    /// `loaded` (already started, or still loading) is never returned.
    pub fn startable(
        &self,
        loaded: &BTreeSet<String>,
        running: &BTreeSet<String>,
    ) -> Vec<StartGroup> {
        self.start_groups()
            .into_iter()
            .filter(|g| g.may_start(loaded, running))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Edge;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn v(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// x <-> y is a ring that sends to c; z sends to x; a -> b -> c; o alone.
    fn mixed() -> Rdg {
        let e = |a: &str, b: &str| Edge::new(a, b, 1);
        let edges = vec![
            e("a", "b"),
            e("b", "c"),
            e("x", "y"),
            e("y", "x"),
            e("y", "c"),
            e("z", "x"),
        ];
        Rdg::new(v(&["a", "b", "c", "o", "x", "y", "z"]), edges).unwrap()
    }

    #[test]
    fn groups_are_rings_and_single_vms_with_direct_receivers() {
        let g = mixed().start_groups();
        let after = |m: &[&str]| g.iter().find(|g| g.members == v(m)).unwrap().after.clone();
        assert_eq!(g.len(), 6);
        assert_eq!(after(&["a"]), v(&["b"]));
        assert_eq!(after(&["c"]), v(&[]));
        assert_eq!(after(&["x", "y"]), v(&["c"]), "inside the ring: ignored");
        assert_eq!(after(&["z"]), v(&["x"]), "x only, not the whole ring");
        assert_eq!(after(&["o"]), v(&[]));
        assert_eq!(g.last().unwrap().members, v(&["o"]), "orphans last");
        // Causal order: every group's after set lies in earlier groups.
        for (i, grp) in g.iter().enumerate() {
            for d in &grp.after {
                assert!(g[..i].iter().any(|h| h.members.contains(d)), "{d}");
            }
        }
    }

    #[test]
    fn unordered_groups_wait_for_nobody() {
        let g = mixed().unordered_groups();
        assert_eq!(g.len(), 7);
        assert!(g.iter().all(|g| g.members.len() == 1 && g.after.is_empty()));
    }

    #[test]
    fn checker_needs_every_member_loaded_and_receivers_running() {
        let r = mixed();
        let names = |gs: Vec<StartGroup>| -> Vec<Vec<String>> {
            gs.into_iter().map(|g| g.members).collect()
        };
        // Nothing loaded: nothing starts.
        assert!(r.startable(&set(&[]), &set(&[])).is_empty());
        // Loaded but waiting for receivers: only c and o may go.
        let all = set(&["a", "b", "c", "o", "x", "z"]);
        assert_eq!(names(r.startable(&all, &set(&[]))), [v(&["c"]), v(&["o"])]);
        // y still loading: the ring waits even once c runs.
        let loaded = set(&["a", "b", "x", "z"]);
        assert_eq!(names(r.startable(&loaded, &set(&["c"]))), [v(&["b"])]);
        let loaded = set(&["a", "b", "x", "y", "z"]);
        assert_eq!(
            names(r.startable(&loaded, &set(&["c"]))),
            [v(&["b"]), v(&["x", "y"])]
        );
        // z waits for x only, whatever y does (rule 3: its direct receivers).
        assert_eq!(names(r.startable(&set(&["z"]), &set(&["x"]))), [v(&["z"])]);
    }
}
