//! The working-set size revision (HotRestore §4.2.3) and the restore line.
//!
//! Given the working-set sizes S_i (pages) and the RDG, find S*_i ≥ 0 that
//!
//! ```text
//! minimise   Σ_i |S*_i − S_i|
//! subject to S*_i − S*_j ≥ k·W(i,j)   for every edge i → j between different rings
//!            S*_i = S*_j              for i, j in the same ring
//!            S*_i ≥ 0
//! ```
//!
//! with k = 1 in [`revise_wss`] (the paper: W is a frame count used as-is,
//! a gap of a few pages) and k = `pages_per_frame` in
//! [`revise_wss_scaled`] (a gap large enough to order real restore times;
//! the caller picks it). k = 0 asks only S*_i ≥ S*_j.
//!
//! Formulation: one variable x_c ≥ 0 per component (a ring shares one,
//! which is its equality constraint), one auxiliary t_i ≥ 0 per VM with
//! t_i ≥ x_c − S_i and t_i ≥ S_i − x_c (the usual linearisation of |·|),
//! objective Σ t_i; parallel edges between two components keep only the
//! largest W. It is solved by good_lp's pure-Rust `microlp` backend.
//!
//! Ties: the optimum is often not unique. A ring of two VMs of sizes a < b
//! may take any common size in [a, b] at the same cost b − a, and the paper
//! does not say which. The largest makes the smaller member load the
//! larger one's pages and the whole ring start as late as without the
//! revision; so a second LP, over the first one's optimal face
//! (Σ t_i ≤ the optimum), minimises Σ_i S*_i: of the revisions that change
//! the sizes least, the one with the smallest working sets, whose VMs start
//! soonest (HotRestore's elastic working set loads the rest after the
//! start). Its vertices are vertices of the first LP's polytope, hence
//! integral; should it ever cost objective after rounding (numerics), the
//! first LP's solution is kept.
//!
//! Negative sizes: a receiver may be pushed down only to 0. Where the
//! constraints would need a receiver below 0 the bound S* ≥ 0 makes the LP
//! raise its senders instead; shifting everything up is always feasible,
//! but the objective pays for it, so the LP picks the cheapest mix. The LP
//! is always feasible (the condensation is a DAG: S* = k · the longest
//! weighted path to a sink works) and bounded (the objective is ≥ 0).
//!
//! Integers: the constraint matrix is that of a network (dual of a
//! min-cost flow), so an optimal vertex is integral for integral data; the
//! solver's values are rounded, then, receivers first, each component is
//! raised if a constraint still fails; the result is checked and the
//! objective recomputed from the integers.

use std::collections::BTreeMap;

use good_lp::{
    constraint, microlp, variable, Expression, ProblemVariables, Solution, SolverModel, Variable,
};
use thiserror::Error;

use crate::graph::Rdg;

/// Largest value allowed for a size or bound: f64 represents every integer
/// up to 2^53 exactly; 2^50 leaves room for the solver's arithmetic.
const MAX_VALUE: u64 = 1 << 50;

/// Why [`revise_wss`] or [`check_sizes`] failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum LpError {
    /// A VM of the graph has no working-set size.
    #[error("VM `{0}` has no working-set size: give a size (pages) for every VM of the graph")]
    MissingSize(String),
    /// A size was given for a VM that is not in the graph.
    #[error(
        "a size is given for `{0}`, which is not in the graph: drop it or add the VM to the graph"
    )]
    UnknownVm(String),
    /// The numbers are too large to be solved exactly.
    #[error("sizes or pages_per_frame × W reach {0}, past 2^50: use a smaller pages_per_frame or smaller sizes")]
    TooLarge(u128),
    /// The LP solver failed (it should not: the LP is feasible and bounded).
    #[error("the LP solver failed: {0}; report it with the graph and sizes")]
    Solver(String),
    /// Sizes break a constraint.
    #[error("sizes break the restore order: {0}")]
    Violated(String),
}

/// The revised working-set sizes and the restore line.
#[derive(Debug, Clone, PartialEq)]
pub struct Revision {
    /// S*_i in pages for every VM of the graph (integers).
    pub sizes: BTreeMap<String, u64>,
    /// Σ |S*_i − S_i| of the integer sizes, in pages.
    pub objective: f64,
    /// The objective value the LP solver reported (before rounding).
    pub lp_objective: f64,
    /// The VMs in ascending S*; ties by position in
    /// [`Rdg::causal_order`], then by name.
    pub restore_line: Vec<String>,
}

/// Revises the sizes with the paper's constraint S*_i − S*_j ≥ W(i,j)
/// (W a frame count, used as pages). Same as
/// [`revise_wss_scaled`]`(rdg, sizes, 1)`.
pub fn revise_wss(rdg: &Rdg, sizes: &BTreeMap<String, u64>) -> Result<Revision, LpError> {
    revise_wss_scaled(rdg, sizes, 1)
}

/// Revises the sizes with S*_i − S*_j ≥ `pages_per_frame`·W(i,j): every
/// in-flight frame asks the sender to load `pages_per_frame` more pages
/// than its receiver. The paper's W is a count and a difference of a few
/// pages does not order real restore times, hence the scale.
/// `sizes` must hold exactly the VMs of the graph.
pub fn revise_wss_scaled(
    rdg: &Rdg,
    sizes: &BTreeMap<String, u64>,
    pages_per_frame: u64,
) -> Result<Revision, LpError> {
    let s = size_vector(rdg, sizes)?;
    let edges = scaled_comp_edges(rdg, pages_per_frame)?;
    let bound: u128 = s.iter().map(|&v| v as u128).max().unwrap_or(0)
        + edges.values().map(|&w| w as u128).sum::<u128>();
    if bound > MAX_VALUE as u128 {
        return Err(LpError::TooLarge(bound));
    }

    let per_vm = |xs: Vec<u64>| -> BTreeMap<String, u64> {
        rdg.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), xs[rdg.comp[i]]))
            .collect()
    };
    let (lp_objective, first) = solve(rdg, &s, &edges, None)?;
    let revised = per_vm(repair(rdg, &edges, &first));
    // The tie-break (module doc); the first LP's sizes stand if it fails or
    // costs objective.
    let revised = match solve(rdg, &s, &edges, Some(lp_objective)) {
        Ok((_, smallest)) => {
            let small = per_vm(repair(rdg, &edges, &smallest));
            if l1_distance(sizes, &small) <= l1_distance(sizes, &revised) {
                small
            } else {
                revised
            }
        }
        Err(_) => revised,
    };
    check_sizes(rdg, &revised, pages_per_frame)?;
    let objective = l1_distance(sizes, &revised) as f64;
    let restore_line = restore_line(rdg, &revised);
    Ok(Revision {
        sizes: revised,
        objective,
        lp_objective,
        restore_line,
    })
}

/// Solves the LP (module doc): minimise Σ t_i, or with `cap` = the optimum
/// of Σ t_i, minimise Σ_i S*_i among solutions with Σ t_i ≤ `cap`. Returns
/// Σ t_i and x_c per component.
fn solve(
    rdg: &Rdg,
    s: &[u64],
    edges: &BTreeMap<(usize, usize), u64>,
    cap: Option<f64>,
) -> Result<(f64, Vec<f64>), LpError> {
    let mut vars = ProblemVariables::new();
    let x: Vec<Variable> = rdg
        .comps
        .iter()
        .map(|_| vars.add(variable().min(0.0)))
        .collect();
    let t: Vec<Variable> = s.iter().map(|_| vars.add(variable().min(0.0))).collect();
    let deviation: Expression = t.iter().sum();
    let objective: Expression = match cap {
        None => deviation.clone(),
        // Σ_i S*_i: each component's size once per member.
        Some(_) => rdg
            .comps
            .iter()
            .zip(&x)
            .map(|(members, &xc)| members.len() as f64 * xc)
            .sum(),
    };
    let mut model = vars.minimise(objective).using(microlp);
    for (i, &si) in s.iter().enumerate() {
        let (xc, si) = (x[rdg.comp[i]], si as f64);
        model = model.with(constraint!(t[i] >= xc - si));
        model = model.with(constraint!(t[i] >= si - xc));
    }
    for (&(c, d), &w) in edges {
        model = model.with(constraint!(x[c] - x[d] >= w as f64));
    }
    if let Some(opt) = cap {
        // The optimal face, with room for the solver's rounding errors.
        model = model.with(constraint!(deviation <= opt + 1e-7 * (1.0 + opt)));
    }
    let solution = model.solve().map_err(|e| LpError::Solver(e.to_string()))?;
    let sum_t = t.iter().map(|&v| solution.value(v)).sum();
    Ok((sum_t, x.iter().map(|&v| solution.value(v)).collect()))
}

/// The solver's component sizes rounded, then repaired receivers first
/// (waves are a topological order) where rounding broke a constraint.
fn repair(rdg: &Rdg, edges: &BTreeMap<(usize, usize), u64>, x: &[f64]) -> Vec<u64> {
    let mut xs: Vec<u64> = x.iter().map(|&v| v.round().max(0.0) as u64).collect();
    for c in rdg.waves().into_iter().flatten() {
        for (&(_, d), &w) in edges.range((c, 0)..=(c, usize::MAX)) {
            xs[c] = xs[c].max(xs[d] + w);
        }
    }
    xs
}

/// Checks that `sizes` (one per VM of the graph) satisfy the revision's
/// constraints with scale `pages_per_frame`: ring members equal, and
/// S_i − S_j ≥ `pages_per_frame`·W(i,j) for every edge between rings.
pub fn check_sizes(
    rdg: &Rdg,
    sizes: &BTreeMap<String, u64>,
    pages_per_frame: u64,
) -> Result<(), LpError> {
    let s = size_vector(rdg, sizes)?;
    for ring in &rdg.comps {
        if let Some(&i) = ring.iter().find(|&&i| s[i] != s[ring[0]]) {
            return Err(LpError::Violated(format!(
                "`{}` ({}) and `{}` ({}) are in one ring but differ: give the ring one size",
                rdg.nodes[ring[0]], s[ring[0]], rdg.nodes[i], s[i]
            )));
        }
    }
    for e in rdg.edges() {
        let (i, j) = (
            rdg.index(&e.from).unwrap_or(0),
            rdg.index(&e.to).unwrap_or(0),
        );
        let need = pages_per_frame as u128 * e.weight as u128;
        if rdg.comp[i] != rdg.comp[j] && (s[i] as i128 - s[j] as i128) < need as i128 {
            return Err(LpError::Violated(format!(
                "`{}` ({}) − `{}` ({}) < {need}: the sender needs {need} pages more than its receiver",
                e.from, s[i], e.to, s[j]
            )));
        }
    }
    Ok(())
}

/// Σ |a_i − b_i| over the keys of `a` (missing keys of `b` count as 0).
pub fn l1_distance(a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>) -> u64 {
    a.iter()
        .map(|(k, &v)| v.abs_diff(b.get(k).copied().unwrap_or(0)))
        .sum()
}

/// The restore line of sizes (one per VM of the graph): the VMs in
/// ascending size, ties by position in [`Rdg::causal_order`], then name.
/// VMs without a size count as 0.
pub fn restore_line(rdg: &Rdg, sizes: &BTreeMap<String, u64>) -> Vec<String> {
    let mut rank = vec![0; rdg.nodes.len()];
    for (g, group) in rdg.causal_order().iter().enumerate() {
        for vm in group {
            rank[rdg.index(vm).expect("causal order names nodes")] = g;
        }
    }
    let size = |i: usize| sizes.get(&rdg.nodes[i]).copied().unwrap_or(0);
    // Node indices follow name order, so `i` breaks the last ties by name.
    let mut line: Vec<usize> = (0..rdg.nodes.len()).collect();
    line.sort_by_key(|&i| (size(i), rank[i], i));
    line.into_iter().map(|i| rdg.nodes[i].clone()).collect()
}

/// The sizes in node order; errors on missing or unknown VMs.
fn size_vector(rdg: &Rdg, sizes: &BTreeMap<String, u64>) -> Result<Vec<u64>, LpError> {
    if let Some(k) = sizes.keys().find(|k| rdg.index(k).is_none()) {
        return Err(LpError::UnknownVm(k.clone()));
    }
    rdg.nodes
        .iter()
        .map(|n| {
            sizes
                .get(n)
                .copied()
                .ok_or_else(|| LpError::MissingSize(n.clone()))
        })
        .collect()
}

/// The condensation's edges with weight `pages_per_frame`·max W.
fn scaled_comp_edges(
    rdg: &Rdg,
    pages_per_frame: u64,
) -> Result<BTreeMap<(usize, usize), u64>, LpError> {
    rdg.comp_edges()
        .into_iter()
        .map(|(k, w)| {
            let v = pages_per_frame as u128 * w as u128;
            if v > MAX_VALUE as u128 {
                Err(LpError::TooLarge(v))
            } else {
                Ok((k, v as u64))
            }
        })
        .collect()
}
