//! HotRestore's figures 3 and 4, reconstructed from the text (the figures
//! themselves are images):
//!
//! * Figure 3(b): VM1, VM2, VM3 form a ring; VM4 depends on VM3 (VM2 and
//!   VM4 "can be restored independently after VM3"); VM5 is an orphan. The
//!   ring is VM1 → VM2 → VM3 → VM1: figure 4(a) removes "the dependency
//!   between VM1 and VM3" and its causal orders start with VM3 and end
//!   with VM1 after VM2, which needs VM1 → VM2 → VM3 to remain.
//! * Figure 4(a): the same without VM3 → VM1. The paper's defacto order
//!   is [VM2, VM4, VM3, VM5, VM1]; its causal candidates are
//!   [VM3, VM4, VM2, VM1, VM5] and [VM3, VM2, VM4, VM5, VM1]. The weights
//!   and sizes are not in the text: we use W = 2 and sizes in that
//!   defacto order.

use std::collections::{BTreeMap, BTreeSet};

use vmcsnap_restoreline::{revise_wss, Edge, OrderError, Rdg};

fn vms() -> Vec<String> {
    (1..=5).map(|i| format!("VM{i}")).collect()
}

fn v(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn figure3() -> Rdg {
    let edges = vec![
        Edge::new("VM1", "VM2", 2),
        Edge::new("VM2", "VM3", 2),
        Edge::new("VM3", "VM1", 2),
        Edge::new("VM4", "VM3", 2),
    ];
    Rdg::new(vms(), edges).unwrap()
}

fn figure4() -> Rdg {
    let edges = vec![
        Edge::new("VM1", "VM2", 2),
        Edge::new("VM2", "VM3", 2),
        Edge::new("VM4", "VM3", 2),
    ];
    Rdg::new(vms(), edges).unwrap()
}

#[test]
fn figure3_rings_orphans_order() {
    let g = figure3();
    assert_eq!(g.rings(), vec![v(&["VM1", "VM2", "VM3"])]);
    assert_eq!(g.orphans(), v(&["VM5"]));
    assert_eq!(g.ring_of("VM2"), Some(v(&["VM1", "VM2", "VM3"])));
    assert_eq!(g.ring_of("VM4"), None);
    // The ring first (rules 1, 5), VM4 after it (rule 2), VM5 free (rule 6).
    assert_eq!(
        g.causal_order(),
        vec![v(&["VM1", "VM2", "VM3"]), v(&["VM4"]), v(&["VM5"])]
    );
    assert_eq!(g.must_start_before("VM4"), v(&["VM3"]));
    assert!(g.must_start_before("VM3").is_empty(), "inside the ring");
    // A ring split even by the free orphan is not causal (rule 5) ...
    let split = v(&["VM1", "VM2", "VM5", "VM3", "VM4"]);
    assert!(matches!(
        g.check_causal_order(&split),
        Err(OrderError::RingSplit { .. })
    ));
    // ... nor VM4 before the ring it sends to (rule 2).
    let early = v(&["VM4", "VM1", "VM2", "VM3", "VM5"]);
    assert!(matches!(
        g.check_causal_order(&early),
        Err(OrderError::SenderFirst { .. })
    ));
    // The orphan may go anywhere else (rule 6).
    g.check_causal_order(&v(&["VM5", "VM2", "VM3", "VM1", "VM4"]))
        .unwrap();
}

#[test]
fn figure3_checker() {
    let g = figure3();
    let set = |n: &[&str]| -> BTreeSet<String> { n.iter().map(|s| s.to_string()).collect() };
    let groups = |loaded: &[&str], running: &[&str]| -> Vec<Vec<String>> {
        let s = g.startable(&set(loaded), &set(running));
        s.into_iter().map(|g| g.members).collect()
    };
    let all = ["VM1", "VM2", "VM3", "VM4", "VM5"];
    // Loaded, nothing runs: the ring (rules 1, 5) and the orphan (rule 6).
    assert_eq!(
        groups(&all, &[]),
        vec![v(&["VM1", "VM2", "VM3"]), v(&["VM5"])]
    );
    // The ring starts together: not while one member is still loading.
    assert_eq!(
        groups(&["VM1", "VM2", "VM4"], &[]),
        Vec::<Vec<String>>::new()
    );
    // VM4 waits for VM3, the ring member it sends to (rule 2) ...
    assert!(groups(&["VM4"], &["VM1", "VM2"]).is_empty());
    // ... and starts once it runs.
    assert_eq!(groups(&["VM4"], &["VM3"]), vec![v(&["VM4"])]);
}

#[test]
fn figure4_causal_orders() {
    let g = figure4();
    assert!(g.rings().is_empty());
    assert_eq!(g.orphans(), v(&["VM5"]));
    assert_eq!(
        g.causal_order(),
        vec![
            v(&["VM3"]),
            v(&["VM2"]),
            v(&["VM4"]),
            v(&["VM1"]),
            v(&["VM5"])
        ]
    );
    // Both of the paper's candidates are causal orders ...
    g.check_causal_order(&v(&["VM3", "VM4", "VM2", "VM1", "VM5"]))
        .unwrap();
    g.check_causal_order(&v(&["VM3", "VM2", "VM4", "VM5", "VM1"]))
        .unwrap();
    // ... the defacto order is not: VM2 sends to VM3 but starts first.
    assert_eq!(
        g.check_causal_order(&v(&["VM2", "VM4", "VM3", "VM5", "VM1"])),
        Err(OrderError::SenderFirst {
            sender: "VM2".into(),
            receiver: "VM3".into()
        })
    );
}

#[test]
fn figure4_revision() {
    let g = figure4();
    let sizes: BTreeMap<String, u64> = [
        ("VM2", 20),
        ("VM4", 30),
        ("VM3", 40),
        ("VM5", 50),
        ("VM1", 60),
    ]
    .into_iter()
    .map(|(k, s)| (k.to_string(), s))
    .collect();
    assert_eq!(
        vmcsnap_restoreline::restore_line(&g, &sizes),
        v(&["VM2", "VM4", "VM3", "VM5", "VM1"])
    );
    let rev = revise_wss(&g, &sizes).unwrap();
    // VM3 must drop below VM2 - 2 (or VM2 rise): 22 pages at least; VM4
    // stays at 30 as long as VM3 ≤ 28.
    assert_eq!(rev.objective, 22.0);
    assert_eq!(rev.sizes["VM2"], rev.sizes["VM3"] + 2);
    assert_eq!(
        (rev.sizes["VM4"], rev.sizes["VM5"], rev.sizes["VM1"]),
        (30, 50, 60)
    );
    // The revised line is the paper's second candidate.
    assert_eq!(rev.restore_line, v(&["VM3", "VM2", "VM4", "VM5", "VM1"]));
    g.check_causal_order(&rev.restore_line).unwrap();
}
