//! Helpers shared by the integration tests: a seeded xorshift, random
//! graphs, an independent constraint check, brute force and heuristics.
#![allow(dead_code)]

use std::collections::BTreeMap;

use vmcsnap_restoreline::{Edge, Rdg};

/// xorshift64*: deterministic, no `rand` crate.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// True with probability `pct`%.
    pub fn chance(&mut self, pct: u64) -> bool {
        self.next() % 100 < pct
    }
}

pub fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("vm{i:02}")).collect()
}

/// A random DAG over a random permutation (later sends to earlier), plus a
/// few back edges that close rings, duplicate edges and zero weights.
pub fn random_edges(rng: &mut XorShift, n: usize, max_w: u64) -> Vec<Edge> {
    let nm = names(n);
    let mut perm: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        perm.swap(i, rng.range(0, i as u64) as usize);
    }
    let mut edges = Vec::new();
    for a in 0..n {
        for b in a + 1..n {
            if rng.chance(35) {
                let w = rng.range(1, max_w);
                edges.push(Edge::new(&nm[perm[b]], &nm[perm[a]], w));
                if rng.chance(10) {
                    edges.push(Edge::new(&nm[perm[b]], &nm[perm[a]], rng.range(0, max_w)));
                }
            } else if rng.chance(8) {
                // back edge: closes a ring if a path b -> a exists
                edges.push(Edge::new(&nm[perm[a]], &nm[perm[b]], rng.range(1, max_w)));
            } else if rng.chance(3) {
                edges.push(Edge::new(&nm[perm[a]], &nm[perm[b]], 0));
            }
        }
    }
    edges
}

/// Independent check of the revision's constraints, from the public API.
pub fn feasible(rdg: &Rdg, x: &BTreeMap<String, u64>, scale: u64) -> bool {
    let same_ring = |a: &str, b: &str| rdg.ring_of(a).is_some_and(|r| r.iter().any(|v| v == b));
    rdg.nodes().iter().all(|n| x.contains_key(n))
        && rdg
            .rings()
            .iter()
            .all(|r| r.iter().all(|v| x[v] == x[&r[0]]))
        && rdg.edges().iter().all(|e| {
            same_ring(&e.from, &e.to)
                || x[&e.from] as i128 - x[&e.to] as i128 >= (scale * e.weight) as i128
        })
}

pub fn cost(s: &BTreeMap<String, u64>, x: &BTreeMap<String, u64>) -> u64 {
    s.iter().map(|(k, &v)| v.abs_diff(x[k])).sum()
}

/// Expands one value per causal group to one per VM.
fn expand(groups: &[Vec<String>], vals: &[u64]) -> BTreeMap<String, u64> {
    groups
        .iter()
        .zip(vals)
        .flat_map(|(g, &v)| g.iter().map(move |vm| (vm.clone(), v)))
        .collect()
}

/// Largest scaled W from group `g` to group `d` (0 if no edge).
fn gap(rdg: &Rdg, groups: &[Vec<String>], g: usize, d: usize, scale: u64) -> Option<u64> {
    rdg.edges()
        .iter()
        .filter(|e| groups[g].contains(&e.from) && groups[d].contains(&e.to))
        .map(|e| e.weight * scale)
        .max()
}

/// Exact integer optimum by enumeration over the causal groups (receivers
/// first, each from its lowest feasible value up to max S + scale·ΣW),
/// pruned by the cost so far.
pub fn brute_force(rdg: &Rdg, s: &BTreeMap<String, u64>, scale: u64) -> u64 {
    struct Ctx {
        members: Vec<Vec<u64>>,
        gaps: Vec<Vec<(usize, u64)>>,
        top: u64,
    }
    fn rec(k: usize, c: &Ctx, vals: &mut Vec<u64>, so_far: u64, best: &mut u64) {
        if so_far >= *best {
            return;
        }
        if k == c.members.len() {
            *best = so_far;
            return;
        }
        let lo = c.gaps[k]
            .iter()
            .map(|&(d, w)| vals[d] + w)
            .max()
            .unwrap_or(0);
        for v in lo..=c.top.max(lo) {
            vals[k] = v;
            let add: u64 = c.members[k].iter().map(|&m| m.abs_diff(v)).sum();
            rec(k + 1, c, vals, so_far + add, best);
        }
    }
    let groups = rdg.causal_order();
    let ctx = Ctx {
        members: groups
            .iter()
            .map(|g| g.iter().map(|vm| s[vm]).collect())
            .collect(),
        gaps: (0..groups.len())
            .map(|k| {
                (0..k)
                    .filter_map(|d| gap(rdg, &groups, k, d, scale).map(|w| (d, w)))
                    .collect()
            })
            .collect(),
        top: s.values().max().copied().unwrap_or(0)
            + scale * rdg.edges().iter().map(|e| e.weight).sum::<u64>(),
    };
    let mut best = u64::MAX;
    rec(0, &ctx, &mut vec![0; groups.len()], 0, &mut best);
    best
}

fn median(groups: &[String], s: &BTreeMap<String, u64>) -> u64 {
    let mut v: Vec<u64> = groups.iter().map(|g| s[g]).collect();
    v.sort();
    v[(v.len() - 1) / 2]
}

/// "Longest path": receivers first, each group at max(its median, what its
/// receivers need). Always feasible.
pub fn longest_path(rdg: &Rdg, s: &BTreeMap<String, u64>, scale: u64) -> BTreeMap<String, u64> {
    let groups = rdg.causal_order();
    let mut vals = vec![0; groups.len()];
    for k in 0..groups.len() {
        let need = (0..k).filter_map(|d| gap(rdg, &groups, k, d, scale).map(|w| vals[d] + w));
        vals[k] = need.fold(median(&groups[k], s), u64::max);
    }
    expand(&groups, &vals)
}

/// "Push down": senders first, each group at min(its median, what its
/// senders allow), then raised receivers first where it hit 0. Feasible.
pub fn push_down(rdg: &Rdg, s: &BTreeMap<String, u64>, scale: u64) -> BTreeMap<String, u64> {
    let groups = rdg.causal_order();
    let n = groups.len();
    let mut vals = vec![0i128; n];
    for k in (0..n).rev() {
        let allow =
            (k + 1..n).filter_map(|g| gap(rdg, &groups, g, k, scale).map(|w| vals[g] - w as i128));
        vals[k] = allow.fold(median(&groups[k], s) as i128, i128::min).max(0);
    }
    for k in 0..n {
        let need =
            (0..k).filter_map(|d| gap(rdg, &groups, k, d, scale).map(|w| vals[d] + w as i128));
        vals[k] = need.fold(vals[k], i128::max);
    }
    let vals: Vec<u64> = vals.into_iter().map(|v| v as u64).collect();
    expand(&groups, &vals)
}
