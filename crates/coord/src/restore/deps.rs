//! The restore dependencies the Checker follows, their validation, and the
//! start groups derived from them.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::msg::RestoreProtocolError;
use crate::NodeId;

/// When the coordinator lets a loaded VM start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Policy {
    /// HotRestore's restore line: a VM starts once the VMs it depends on
    /// run, a ring starts together once all its members are loaded
    /// (the Checker, see [`Deps`]).
    #[default]
    RestoreLine,
    /// Every VM starts as soon as its working set is loaded: the baseline
    /// without a restore line. The dependencies are validated but not used.
    Independent,
}

/// The restore dependency graph (RDG) of a cluster, rings collapsed.
///
/// `deps[v]` is the set of VMs that must be running before `v` starts:
/// the VMs `v` sends packets to (HotRestore: "v depends on w"). `rings` are
/// the strongly connected components of that graph with two or more VMs;
/// each ring starts together. Dependencies between members of one ring are
/// allowed and ignored. With rings collapsed the graph must be acyclic (a
/// DAG), which guarantees that the Checker always makes progress; the
/// coordinator checks it ([`validate`](Self::validate)).
/// [`from_edges`](Self::from_edges) builds a valid `Deps` from any
/// communication graph.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deps {
    /// VM → the VMs that must have started before it.
    pub deps: BTreeMap<NodeId, BTreeSet<NodeId>>,
    /// Groups of VMs that depend on each other and start together.
    pub rings: Vec<BTreeSet<NodeId>>,
}

/// VMs the coordinator starts together, and what they wait for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartGroup {
    /// A ring, or a single VM.
    pub members: BTreeSet<NodeId>,
    /// VMs outside the group that must have started (`START_FIN` received)
    /// before the group gets `START`.
    pub after: BTreeSet<NodeId>,
}

impl Deps {
    /// No dependencies: every VM is an orphan.
    pub fn new() -> Self {
        Deps::default()
    }

    /// Adds "`vm` starts after `before`" (`vm` sends to `before`).
    pub fn after(mut self, vm: impl Into<NodeId>, before: impl Into<NodeId>) -> Self {
        self.deps
            .entry(vm.into())
            .or_default()
            .insert(before.into());
        self
    }

    /// Adds a ring of VMs that start together.
    pub fn ring<S: Into<NodeId>>(mut self, members: impl IntoIterator<Item = S>) -> Self {
        self.rings
            .push(members.into_iter().map(Into::into).collect());
        self
    }

    /// Builds the dependencies from communication edges `(from, to)`
    /// ("`from` sent a packet to `to`", e.g. the on-the-fly packets logged
    /// during the snapshot): `to` must start before `from`. The rings are
    /// found as the strongly connected components (Tarjan); self-edges are
    /// dropped. The result always passes [`validate`](Self::validate) for
    /// cohorts that include every VM named.
    pub fn from_edges<S: Into<NodeId>>(edges: impl IntoIterator<Item = (S, S)>) -> Self {
        let mut deps = Deps::new();
        for (from, to) in edges {
            let (from, to) = (from.into(), to.into());
            if from != to {
                deps = deps.after(from, to);
            }
        }
        deps.rings = Tarjan::sccs(&deps.deps)
            .into_iter()
            .filter(|c| c.len() > 1)
            .collect();
        deps
    }

    /// Checks the dependencies against the restore's cohorts: every VM
    /// named is a cohort, rings have two or more members and do not
    /// overlap, and with rings collapsed there is no cycle (a VM depending
    /// on itself outside a ring is a cycle).
    pub fn validate(&self, cohorts: &BTreeSet<NodeId>) -> Result<(), RestoreProtocolError> {
        self.groups(cohorts).map(|_| ())
    }

    /// The start groups under `policy`: rings and single VMs with what
    /// they wait for (`RestoreLine`), or every VM alone waiting for nothing
    /// (`Independent`). Validates first.
    pub fn start_groups(
        &self,
        cohorts: &BTreeSet<NodeId>,
        policy: Policy,
    ) -> Result<Vec<StartGroup>, RestoreProtocolError> {
        let groups = self.groups(cohorts)?;
        Ok(match policy {
            Policy::RestoreLine => groups,
            Policy::Independent => cohorts
                .iter()
                .map(|c| StartGroup {
                    members: BTreeSet::from([c.clone()]),
                    after: BTreeSet::new(),
                })
                .collect(),
        })
    }

    fn groups(&self, cohorts: &BTreeSet<NodeId>) -> Result<Vec<StartGroup>, RestoreProtocolError> {
        let unknown = |vm: &NodeId, place: String| RestoreProtocolError::UnknownVm {
            vm: vm.clone(),
            place,
        };
        // Component of each VM: its ring's index, or a singleton after them.
        let mut comp: BTreeMap<&NodeId, usize> = BTreeMap::new();
        for (i, ring) in self.rings.iter().enumerate() {
            if ring.len() < 2 {
                return Err(RestoreProtocolError::RingTooSmall {
                    index: i,
                    len: ring.len(),
                });
            }
            for vm in ring {
                if !cohorts.contains(vm) {
                    return Err(unknown(vm, format!("ring {i}")));
                }
                if let Some(&first) = comp.get(vm) {
                    return Err(RestoreProtocolError::RingOverlap {
                        vm: vm.clone(),
                        first,
                        second: i,
                    });
                }
                comp.insert(vm, i);
            }
        }
        let mut members: Vec<BTreeSet<NodeId>> = self.rings.clone();
        for c in cohorts {
            comp.entry(c).or_insert_with(|| {
                members.push(BTreeSet::from([c.clone()]));
                members.len() - 1
            });
        }
        let mut after = vec![BTreeSet::new(); members.len()];
        let mut edges = vec![BTreeSet::new(); members.len()];
        for (vm, ds) in &self.deps {
            let Some(&cv) = comp.get(vm) else {
                return Err(unknown(vm, "the keys of Deps::deps".into()));
            };
            for d in ds {
                let Some(&cd) = comp.get(d) else {
                    return Err(unknown(d, format!("the deps of {vm:?}")));
                };
                if cv != cd {
                    after[cv].insert(d.clone());
                    edges[cv].insert(cd);
                } else if members[cv].len() == 1 {
                    let cycle = vec![vm.clone(), vm.clone()];
                    return Err(RestoreProtocolError::Cycle { cycle });
                }
            }
        }
        if let Some(cycle) = find_cycle(&edges) {
            let label = |c: usize| match &members[c] {
                m if m.len() == 1 => m.iter().next().cloned().unwrap_or_default(),
                m => format!(
                    "ring{{{}}}",
                    m.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
            };
            let cycle = cycle.into_iter().map(label).collect();
            return Err(RestoreProtocolError::Cycle { cycle });
        }
        Ok(members
            .into_iter()
            .zip(after)
            .map(|(members, after)| StartGroup { members, after })
            .collect())
    }
}

/// A cycle of the graph `edges` (node → successors), first node repeated
/// at the end, if there is one.
fn find_cycle(edges: &[BTreeSet<usize>]) -> Option<Vec<usize>> {
    // 0 = unvisited, 1 = on the DFS path, 2 = done.
    fn visit(
        n: usize,
        edges: &[BTreeSet<usize>],
        color: &mut [u8],
        path: &mut Vec<usize>,
    ) -> Option<Vec<usize>> {
        color[n] = 1;
        path.push(n);
        for &m in &edges[n] {
            if color[m] == 1 {
                let from = path.iter().position(|&x| x == m).unwrap_or(0);
                let mut cycle = path[from..].to_vec();
                cycle.push(m);
                return Some(cycle);
            }
            if color[m] == 0 {
                if let Some(c) = visit(m, edges, color, path) {
                    return Some(c);
                }
            }
        }
        path.pop();
        color[n] = 2;
        None
    }
    let mut color = vec![0u8; edges.len()];
    (0..edges.len()).find_map(|n| {
        (color[n] == 0)
            .then(|| visit(n, edges, &mut color, &mut Vec::new()))
            .flatten()
    })
}

/// Tarjan's strongly connected components.
struct Tarjan<'a> {
    graph: &'a BTreeMap<NodeId, BTreeSet<NodeId>>,
    index: BTreeMap<&'a NodeId, usize>,
    stack: Vec<&'a NodeId>,
    on_stack: BTreeSet<&'a NodeId>,
    out: Vec<BTreeSet<NodeId>>,
}

impl<'a> Tarjan<'a> {
    fn sccs(graph: &'a BTreeMap<NodeId, BTreeSet<NodeId>>) -> Vec<BTreeSet<NodeId>> {
        let mut t = Tarjan {
            graph,
            index: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            out: Vec::new(),
        };
        for v in graph.keys() {
            if !t.index.contains_key(v) {
                t.connect(v);
            }
        }
        t.out
    }

    /// Returns the low-link of `v`.
    fn connect(&mut self, v: &'a NodeId) -> usize {
        let i = self.index.len();
        self.index.insert(v, i);
        self.stack.push(v);
        self.on_stack.insert(v);
        let mut low = i;
        for w in self.graph.get(v).into_iter().flatten() {
            match self.index.get(w) {
                None => low = low.min(self.connect(w)),
                Some(&wi) if self.on_stack.contains(w) => low = low.min(wi),
                Some(_) => {}
            }
        }
        if low == i {
            let mut scc = BTreeSet::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack.remove(w);
                scc.insert(w.clone());
                if w == v {
                    break;
                }
            }
            self.out.push(scc);
        }
        low
    }
}
