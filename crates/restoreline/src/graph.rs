//! The restore dependency graph (RDG, HotRestore §4.1): nodes are VMs, an
//! edge `i → j` with weight W(i,j) says VM `i` sent W(i,j) frames to VM `j`
//! that were in flight at the cut. `j` (the receiver) must be running
//! before `i` (the sender) starts, or `i`'s TCP backs off.
//!
//! Rings are the strongly connected components with more than one VM; the
//! graph of components (the condensation) is a DAG.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One weighted edge of the RDG: `from` sent `weight` in-flight frames to
/// `to`.
///
/// The field `weight` also accepts the name `frames`, so the `edges` of a
/// cluster snapshot's `cluster.json` (`{from, to, frames, bytes}`)
/// deserialize directly (`bytes` is ignored).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Edge {
    /// The sending VM.
    pub from: String,
    /// The receiving VM (it must start before `from`).
    pub to: String,
    /// W(from, to): frames sent by `from` to `to` and logged at the cut.
    #[serde(alias = "frames")]
    pub weight: u64,
}

impl Edge {
    /// An edge `from → to` with weight `weight`.
    pub fn new(from: impl Into<String>, to: impl Into<String>, weight: u64) -> Edge {
        Edge {
            from: from.into(),
            to: to.into(),
            weight,
        }
    }
}

/// Why [`Rdg::new`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RdgError {
    /// A node name was empty.
    #[error("a VM name is empty: give every VM of the graph a non-empty name")]
    EmptyName,
    /// The same node was listed twice.
    #[error("VM `{0}` is listed twice in the nodes: list each VM once")]
    DuplicateNode(String),
    /// An edge named a VM that is not a node.
    #[error("edge {from} -> {to} names VM `{unknown}`, which is not a node: add it to the nodes or drop the edge")]
    UnknownNode {
        /// The edge's sender.
        from: String,
        /// The edge's receiver.
        to: String,
        /// The name that is not a node.
        unknown: String,
    },
    /// An edge from a VM to itself.
    #[error("edge {0} -> {0} is a self-loop: a VM never depends on itself, drop the edge")]
    SelfLoop(String),
    /// Summing the weights of duplicate edges overflowed.
    #[error("the weights of the duplicate edges {from} -> {to} add up past u64::MAX: check the frame counts")]
    WeightOverflow {
        /// The edge's sender.
        from: String,
        /// The edge's receiver.
        to: String,
    },
}

/// The restore dependency graph, with its rings (strongly connected
/// components) computed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rdg {
    /// Node names, sorted.
    pub(crate) nodes: Vec<String>,
    /// Merged, non-zero edges, sorted by (from, to).
    pub(crate) edges: Vec<Edge>,
    /// `out[i]`: indices of the VMs node `i` sends to, with the weight.
    pub(crate) out: Vec<Vec<(usize, u64)>>,
    /// `comp[i]`: index of node `i`'s component in `comps`.
    pub(crate) comp: Vec<usize>,
    /// The components (node indices, ascending), sorted by their first
    /// (smallest) member.
    pub(crate) comps: Vec<Vec<usize>>,
}

impl Rdg {
    /// Builds the graph. Nodes are kept sorted by name; every edge must join
    /// two distinct known nodes; the weights of duplicate `(from, to)` pairs
    /// are summed; edges of weight 0 are dropped (no frame, no dependency).
    pub fn new(nodes: Vec<String>, edges: Vec<Edge>) -> Result<Rdg, RdgError> {
        let mut nodes = nodes;
        nodes.sort();
        if nodes.first().is_some_and(|n| n.is_empty()) {
            return Err(RdgError::EmptyName);
        }
        if let Some(w) = nodes.windows(2).find(|w| w[0] == w[1]) {
            return Err(RdgError::DuplicateNode(w[0].clone()));
        }
        let index = |name: &str| nodes.binary_search_by(|n| n.as_str().cmp(name)).ok();
        let mut merged: BTreeMap<(usize, usize), u64> = BTreeMap::new();
        for e in &edges {
            if e.from == e.to {
                return Err(RdgError::SelfLoop(e.from.clone()));
            }
            let unknown = |name: &String| RdgError::UnknownNode {
                from: e.from.clone(),
                to: e.to.clone(),
                unknown: name.clone(),
            };
            let i = index(&e.from).ok_or_else(|| unknown(&e.from))?;
            let j = index(&e.to).ok_or_else(|| unknown(&e.to))?;
            if e.weight == 0 {
                continue;
            }
            let w = merged.entry((i, j)).or_insert(0);
            *w = w
                .checked_add(e.weight)
                .ok_or_else(|| RdgError::WeightOverflow {
                    from: e.from.clone(),
                    to: e.to.clone(),
                })?;
        }
        let mut out = vec![Vec::new(); nodes.len()];
        let mut list = Vec::with_capacity(merged.len());
        for (&(i, j), &w) in &merged {
            out[i].push((j, w));
            list.push(Edge::new(nodes[i].clone(), nodes[j].clone(), w));
        }
        let (comp, comps) = components(&out);
        Ok(Rdg {
            nodes,
            edges: list,
            out,
            comp,
            comps,
        })
    }

    /// The VMs, sorted by name.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The edges after merging duplicates and dropping zero weights,
    /// sorted by `(from, to)`.
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    /// The rings: strongly connected components of more than one VM, each
    /// sorted by name, the list sorted too. VMs of a ring restore together
    /// (rule 5) and get equal working-set sizes.
    pub fn rings(&self) -> Vec<Vec<String>> {
        self.comps
            .iter()
            .filter(|c| c.len() > 1)
            .map(|c| self.names(c))
            .collect()
    }

    /// The orphans: VMs with no edge at all, sorted (rule 6).
    pub fn orphans(&self) -> Vec<String> {
        (0..self.nodes.len())
            .filter(|&i| self.is_orphan(i))
            .map(|i| self.nodes[i].clone())
            .collect()
    }

    /// The VMs `vm` sends to directly, outside `vm`'s own ring, sorted:
    /// they must be running before `vm` starts (rules 2 and 3). Empty for an
    /// unknown VM. A ring starts as one, so before a ring member starts the
    /// union of this list over [`Rdg::ring_of`] must be running (a start
    /// group's `after` set, [`Rdg::start_groups`]).
    pub fn must_start_before(&self, vm: &str) -> Vec<String> {
        let Some(i) = self.index(vm) else {
            return Vec::new();
        };
        self.out[i]
            .iter()
            .filter(|&&(j, _)| self.comp[j] != self.comp[i])
            .map(|&(j, _)| self.nodes[j].clone())
            .collect()
    }

    /// The ring `vm` belongs to (sorted, `vm` included), or `None` if `vm`
    /// is in no ring or unknown.
    pub fn ring_of(&self, vm: &str) -> Option<Vec<String>> {
        let c = &self.comps[self.comp[self.index(vm)?]];
        (c.len() > 1).then(|| self.names(c))
    }

    /// Index of `vm` in [`Rdg::nodes`].
    pub(crate) fn index(&self, vm: &str) -> Option<usize> {
        self.nodes.binary_search_by(|n| n.as_str().cmp(vm)).ok()
    }

    /// Whether node `i` has no edge in or out.
    pub(crate) fn is_orphan(&self, i: usize) -> bool {
        self.out[i].is_empty() && self.out.iter().all(|o| o.iter().all(|&(j, _)| j != i))
    }

    /// Names of the node indices `idx`.
    pub(crate) fn names(&self, idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| self.nodes[i].clone()).collect()
    }

    /// Edges of the condensation: for each pair of distinct components
    /// `(c, d)` with some edge from a VM of `c` to a VM of `d`, the largest
    /// such weight. Sorted by `(c, d)`.
    pub(crate) fn comp_edges(&self) -> BTreeMap<(usize, usize), u64> {
        let mut m: BTreeMap<(usize, usize), u64> = BTreeMap::new();
        for (i, o) in self.out.iter().enumerate() {
            for &(j, w) in o {
                let (c, d) = (self.comp[i], self.comp[j]);
                if c != d {
                    let e = m.entry((c, d)).or_insert(0);
                    *e = (*e).max(w);
                }
            }
        }
        m
    }
}

/// Strongly connected components by mutual reachability: one BFS per node,
/// O(n·(n+m)), plenty for the VMs of a cluster. Returns each node's
/// component index and the components (ascending node indices), ordered by
/// their smallest node.
fn components(out: &[Vec<(usize, u64)>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let n = out.len();
    let reach: Vec<BTreeSet<usize>> = (0..n)
        .map(|s| {
            let mut seen = BTreeSet::from([s]);
            let mut queue = VecDeque::from([s]);
            while let Some(u) = queue.pop_front() {
                for &(v, _) in &out[u] {
                    if seen.insert(v) {
                        queue.push_back(v);
                    }
                }
            }
            seen
        })
        .collect();
    let mut comp = vec![usize::MAX; n];
    let mut comps = Vec::new();
    for i in 0..n {
        if comp[i] != usize::MAX {
            continue;
        }
        let members: Vec<usize> = (i..n)
            .filter(|&j| reach[i].contains(&j) && reach[j].contains(&i))
            .collect();
        for &j in &members {
            comp[j] = comps.len();
        }
        comps.push(members);
    }
    (comp, comps)
}
