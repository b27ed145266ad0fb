//! The causal restore order (HotRestore §4.2.1, rules 1-6); the Checker
//! built on it is in [`start`](crate::start).
//!
//! How each rule maps to the code of [`Rdg::causal_order`]:
//!
//! * **Rule 5** (a ring restores at the same time): the order is built over
//!   components; a ring is one group, its members sorted by name.
//! * **Rule 1** (a VM that depends on no VM but is depended on comes
//!   first): wave 0 holds the non-orphan components with no edge to another
//!   component. A ring that sends only inside itself is there too (rule 5).
//! * **Rules 2 and 3** (a sender after its receivers; after *all* of them):
//!   a component joins wave `k` = 1 + the highest wave among the components
//!   it sends to, i.e. only once every receiver has been placed.
//! * **Rule 4** (no dependency, independent restore): components of the
//!   same wave have no path between them; any order among them is causal,
//!   and we pick ascending name of their first member, for determinism.
//! * **Rule 6** (an orphan is free): orphans go after every wave, sorted by
//!   name. Any position would do; at the end they constrain nothing, like
//!   VM5 in the paper's first candidate `[VM3, VM4, VM2, VM1, VM5]`.

use std::collections::BTreeSet;

use thiserror::Error;

use crate::graph::Rdg;

/// Why an order is not a causal restore order of the graph
/// ([`Rdg::check_causal_order`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OrderError {
    /// A VM of the graph is missing from the order.
    #[error("VM `{0}` is missing from the order: list every VM of the graph once")]
    Missing(String),
    /// A VM appears twice, or is not in the graph.
    #[error(
        "VM `{0}` is listed twice or is not in the graph: list every VM of the graph exactly once"
    )]
    Unexpected(String),
    /// A sender comes before one of its receivers.
    #[error(
        "`{sender}` comes before `{receiver}`, which it sends to: put the receiver first (rule 2)"
    )]
    SenderFirst {
        /// The VM that sends.
        sender: String,
        /// The VM it sends to.
        receiver: String,
    },
    /// The members of a ring are not next to each other.
    #[error(
        "ring {ring:?} is split by `{intruder}`: place the members of a ring together (rule 5)"
    )]
    RingSplit {
        /// The ring.
        ring: Vec<String>,
        /// A VM placed between two of its members.
        intruder: String,
    },
}

impl Rdg {
    /// One causal restore order: groups in start order, a ring being one
    /// group and every other VM a group of its own (see the module docs of
    /// `order` for the rules). Receivers come before senders; orphans last.
    pub fn causal_order(&self) -> Vec<Vec<String>> {
        let mut order: Vec<Vec<String>> = self
            .waves()
            .iter()
            .flatten()
            .map(|&c| self.names(&self.comps[c]))
            .collect();
        order.extend(self.orphans().into_iter().map(|o| vec![o]));
        order
    }

    /// The non-orphan components by wave (rules 1-5): wave 0 sends to no
    /// other component; a component is in wave 1 + the highest wave of the
    /// components it sends to. Each wave is sorted by component index (the
    /// smallest member's name). Read in order, it is a topological order
    /// of the condensation with receivers first.
    pub(crate) fn waves(&self) -> Vec<Vec<usize>> {
        let n = self.comps.len();
        let deps = self.comp_deps();
        let mut level: Vec<Option<usize>> = vec![None; n];
        let orphan: Vec<bool> = self
            .comps
            .iter()
            .map(|c| c.len() == 1 && self.is_orphan(c[0]))
            .collect();
        let mut waves: Vec<Vec<usize>> = Vec::new();
        let mut placed = orphan.iter().filter(|&&o| o).count();
        while placed < n {
            let k = waves.len();
            // Ready: all receivers placed in an earlier wave (rules 1-3).
            let wave: Vec<usize> = (0..n)
                .filter(|&c| !orphan[c] && level[c].is_none())
                .filter(|&c| deps[c].iter().all(|&d| level[d].is_some_and(|l| l < k)))
                .collect();
            // The condensation is a DAG, so some component is always ready.
            assert!(!wave.is_empty(), "condensation has a cycle");
            for &c in &wave {
                level[c] = Some(k);
            }
            placed += wave.len();
            waves.push(wave);
        }
        waves
    }

    /// For each component, the components it sends to (excluding itself).
    pub(crate) fn comp_deps(&self) -> Vec<BTreeSet<usize>> {
        let mut deps = vec![BTreeSet::new(); self.comps.len()];
        for &(c, d) in self.comp_edges().keys() {
            deps[c].insert(d);
        }
        deps
    }

    /// Checks that `order` (every VM once) is a causal restore order: each
    /// receiver before each of its senders from another component (rules
    /// 2 and 3, and so transitively) and each ring contiguous (rule 5).
    /// Orphans and independent VMs may be anywhere (rules 4 and 6).
    pub fn check_causal_order(&self, order: &[String]) -> Result<(), OrderError> {
        let mut pos = vec![usize::MAX; self.nodes.len()];
        for (p, vm) in order.iter().enumerate() {
            match self.index(vm) {
                Some(i) if pos[i] == usize::MAX => pos[i] = p,
                _ => return Err(OrderError::Unexpected(vm.clone())),
            }
        }
        if let Some(i) = pos.iter().position(|&p| p == usize::MAX) {
            return Err(OrderError::Missing(self.nodes[i].clone()));
        }
        for e in &self.edges {
            let (i, j) = (self.index(&e.from), self.index(&e.to));
            let (i, j) = (i.expect("edge node"), j.expect("edge node"));
            if self.comp[i] != self.comp[j] && pos[i] < pos[j] {
                return Err(OrderError::SenderFirst {
                    sender: e.from.clone(),
                    receiver: e.to.clone(),
                });
            }
        }
        for c in self.comps.iter().filter(|c| c.len() > 1) {
            let lo = c.iter().map(|&i| pos[i]).min().unwrap_or(0);
            let hi = c.iter().map(|&i| pos[i]).max().unwrap_or(0);
            if let Some(vm) = order[lo..=hi].iter().find(|vm| {
                let k = self.index(vm).expect("checked above");
                self.comp[k] != self.comp[c[0]]
            }) {
                return Err(OrderError::RingSplit {
                    ring: self.names(c),
                    intruder: vm.clone(),
                });
            }
        }
        Ok(())
    }
}
