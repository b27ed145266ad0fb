//! Random DAGs with rings (seeded xorshift): the revision is feasible,
//! integral, consistent with the causal order, and optimal: equal to a
//! brute force for up to 4 VMs, never worse than two feasible heuristics
//! or any feasible ±1 move of one group for more.

mod common;

use std::collections::BTreeMap;

use common::{brute_force, cost, feasible, longest_path, names, push_down, random_edges, XorShift};
use vmcsnap_restoreline::{check_sizes, revise_wss_scaled, Rdg};

fn case(rng: &mut XorShift, n: usize) -> (Rdg, BTreeMap<String, u64>, u64) {
    let small = n <= 4;
    let edges = random_edges(rng, n, if small { 3 } else { 9 });
    let rdg = Rdg::new(names(n), edges).unwrap();
    let scale = if small {
        rng.range(0, 2)
    } else {
        [0, 1, 4, 64][rng.range(0, 3) as usize]
    };
    let top = if small {
        12
    } else if rng.chance(30) {
        20
    } else {
        100_000
    };
    let sizes = rdg
        .nodes()
        .iter()
        .map(|vm| (vm.clone(), rng.range(0, top)))
        .collect();
    (rdg, sizes, scale)
}

#[test]
fn random_revisions_are_feasible_and_optimal() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let (mut brute_cases, mut rings_seen, mut moved) = (0, 0, 0);
    for k in 0..200 {
        let n = 2 + k % 11; // 2..=12
        let (rdg, s, scale) = case(&mut rng, n);
        let ctx = format!(
            "case {k}: edges {:?} sizes {s:?} scale {scale}",
            rdg.edges()
        );
        let rev = revise_wss_scaled(&rdg, &s, scale).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        rings_seen += rdg.rings().len();
        moved += (rev.objective > 0.0) as usize;

        // Feasible (checked independently), integral, objective consistent.
        assert!(
            feasible(&rdg, &rev.sizes, scale),
            "{ctx}: infeasible {:?}",
            rev.sizes
        );
        check_sizes(&rdg, &rev.sizes, scale).unwrap();
        let obj = cost(&s, &rev.sizes);
        assert_eq!(rev.objective, obj as f64, "{ctx}");
        assert!(
            (rev.lp_objective - rev.objective).abs() < 1e-6 * (1.0 + rev.objective),
            "{ctx}: lp {} vs {}",
            rev.lp_objective,
            rev.objective
        );

        // The line: ascending S*, and a causal order.
        let line_sizes: Vec<u64> = rev.restore_line.iter().map(|vm| rev.sizes[vm]).collect();
        assert!(line_sizes.windows(2).all(|w| w[0] <= w[1]), "{ctx}");
        rdg.check_causal_order(&rev.restore_line)
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));

        // Optimal.
        if n <= 4 {
            brute_cases += 1;
            assert_eq!(
                obj,
                brute_force(&rdg, &s, scale),
                "{ctx}: not the brute-force optimum"
            );
        }
        for h in [longest_path(&rdg, &s, scale), push_down(&rdg, &s, scale)] {
            assert!(feasible(&rdg, &h, scale), "{ctx}: heuristic infeasible");
            assert!(obj <= cost(&s, &h), "{ctx}: heuristic {h:?} beats the LP");
        }
        for group in rdg.causal_order() {
            for delta in [-1i64, 1] {
                let mut x = rev.sizes.clone();
                for vm in &group {
                    let v = x[vm] as i64 + delta;
                    x.insert(vm.clone(), v.max(0) as u64);
                }
                if feasible(&rdg, &x, scale) {
                    assert!(
                        obj <= cost(&s, &x),
                        "{ctx}: moving {group:?} by {delta} improves"
                    );
                }
            }
        }
    }
    // The generator exercised what it should.
    assert!(brute_cases >= 50, "{brute_cases}");
    assert!(rings_seen >= 20, "{rings_seen}");
    assert!(moved >= 100, "{moved}");
}

#[test]
fn brute_force_and_heuristics_are_not_trivial() {
    // The checks above could pass vacuously if the helpers were wrong: on
    // a chain with conflicting sizes, the heuristic is strictly worse and
    // the brute force finds the known optimum.
    let edges = vec![
        vmcsnap_restoreline::Edge::new("vm00", "vm01", 1),
        vmcsnap_restoreline::Edge::new("vm01", "vm02", 1),
    ];
    let rdg = Rdg::new(names(3), edges).unwrap();
    let s: BTreeMap<String, u64> = [("vm00", 0), ("vm01", 5), ("vm02", 10)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    // pool all three at p (offsets 2, 1, 0): |p+2| + |p+1-5| + |p-10| → p = 4: 6 + 0 + 6 = 12
    assert_eq!(brute_force(&rdg, &s, 1), 12);
    assert_eq!(cost(&s, &longest_path(&rdg, &s, 1)), 18); // 10, 11, 12
    assert_eq!(revise_wss_scaled(&rdg, &s, 1).unwrap().objective, 12.0);
}

/// The Checker on random graphs, with VMs finishing their loads and
/// starts in a random order: it never deadlocks, starts every VM once,
/// releases a group only once its members are loaded and the VMs it sends
/// to run (checked from the edges, not from the groups), and the order of
/// its decisions is a causal restore order.
#[test]
fn random_checker_runs_are_causal_and_never_deadlock() {
    use std::collections::BTreeSet;
    let mut rng = XorShift(0xD1B5_4A32_D192_ED03);
    let mut rings_seen = 0;
    for _ in 0..300 {
        let n = rng.range(1, 12) as usize;
        let rdg = Rdg::new(names(n), random_edges(&mut rng, n, 5)).unwrap();
        rings_seen += usize::from(!rdg.rings().is_empty());
        let (mut loading, mut loaded): (Vec<String>, BTreeSet<String>) =
            (rdg.nodes().to_vec(), BTreeSet::new());
        let (mut starting, mut running) = (Vec::<String>::new(), BTreeSet::new());
        let mut decided: Vec<String> = Vec::new();
        while running.len() < n {
            for g in rdg.startable(&loaded, &running) {
                for m in &g.members {
                    assert!(loaded.remove(m), "{m} started twice or unloaded");
                    let same_ring = |to: &String| g.members.contains(to);
                    for e in rdg.edges().iter().filter(|e| &e.from == m) {
                        assert!(same_ring(&e.to) || running.contains(&e.to), "{e:?}");
                    }
                }
                decided.extend(g.members.iter().cloned());
                starting.extend(g.members);
            }
            // One random event: a load finishes or a started VM runs.
            let pending = loading.len() + starting.len();
            assert!(
                pending > 0,
                "deadlock: {:?} loaded, {:?} run",
                loaded,
                running
            );
            let k = rng.range(0, pending as u64 - 1) as usize;
            if k < loading.len() {
                loaded.insert(loading.swap_remove(k));
            } else {
                running.insert(starting.swap_remove(k - loading.len()));
            }
        }
        rdg.check_causal_order(&decided).unwrap();
    }
    assert!(rings_seen > 30, "rings were exercised: {rings_seen}");
}
