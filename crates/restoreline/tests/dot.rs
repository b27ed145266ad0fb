//! Graphviz output: a golden file for a small graph, and every node and
//! edge present for random graphs.

mod common;

use std::collections::BTreeMap;

use common::{names, random_edges, XorShift};
use vmcsnap_restoreline::{Edge, Rdg};

#[test]
fn golden_small_graph() {
    let edges = vec![
        Edge::new("a", "b", 2),
        Edge::new("b", "a", 1),
        Edge::new("c", "a", 3),
    ];
    let g = Rdg::new(["a", "b", "c", "d"].map(String::from).to_vec(), edges).unwrap();
    let sizes = BTreeMap::from([("a".to_string(), 10), ("c".to_string(), 7)]);
    let want = r#"digraph rdg {
  node [shape=box];
  subgraph cluster_ring1 {
    label="ring 1";
    style=dashed;
    "a" [label="a\nS=10"];
    "b" [label="b"];
  }
  "c" [label="c\nS=7"];
  "d" [label="d"];
  "a" -> "b" [label="2"];
  "b" -> "a" [label="1"];
  "c" -> "a" [label="3"];
}
"#;
    assert_eq!(g.to_dot(Some(&sizes)), want);
    assert_eq!(
        g.to_dot(None),
        want.replace("a\\nS=10", "a").replace("c\\nS=7", "c")
    );
}

#[test]
fn names_are_escaped() {
    let g = Rdg::new(
        vec!["x\"y".into(), "p\\q".into()],
        vec![Edge::new("x\"y", "p\\q", 1)],
    )
    .unwrap();
    let dot = g.to_dot(None);
    assert!(dot.contains(r#""x\"y" -> "p\\q" [label="1"];"#), "{dot}");
}

#[test]
fn random_graphs_have_every_node_and_edge() {
    let mut rng = XorShift(42);
    for n in 1..=12 {
        let rdg = Rdg::new(names(n), random_edges(&mut rng, n, 5)).unwrap();
        let dot = rdg.to_dot(None);
        for vm in rdg.nodes() {
            assert_eq!(
                dot.matches(&format!("  \"{vm}\" [label=\"{vm}\"];"))
                    .count(),
                1,
                "{dot}"
            );
        }
        for e in rdg.edges() {
            let line = format!(
                "  \"{}\" -> \"{}\" [label=\"{}\"];\n",
                e.from, e.to, e.weight
            );
            assert!(dot.contains(&line), "{line} missing from {dot}");
        }
        assert_eq!(dot.matches(" -> ").count(), rdg.edges().len());
        assert_eq!(
            dot.matches("subgraph cluster_ring").count(),
            rdg.rings().len()
        );
    }
}
