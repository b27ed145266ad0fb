//! The restore dependencies: validation (what the Checker could deadlock
//! on is rejected at construction), start groups, ring detection.

use std::collections::BTreeSet;
use std::time::Duration;

use vmcsnap_coord::restore::*;

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn new(cohorts: &[&str], deps: Deps) -> Result<Coordinator, RestoreProtocolError> {
    let cohorts = cohorts.iter().map(|s| s.to_string()).collect();
    let t = Timeouts {
        retry: Duration::from_millis(10),
        ..Timeouts::default()
    };
    Coordinator::new(1, "mgr".into(), cohorts, deps, Policy::RestoreLine, t)
}

fn err(cohorts: &[&str], deps: Deps) -> String {
    let e = new(cohorts, deps.clone()).unwrap_err().to_string();
    // The independent policy validates the same dependencies.
    let cs = cohorts.iter().map(|s| s.to_string()).collect();
    let t = Timeouts::default();
    assert!(Coordinator::new(1, "mgr".into(), cs, deps, Policy::Independent, t).is_err());
    e
}

#[test]
fn valid_dependencies_give_start_groups() {
    let deps = Deps::new()
        .after("a", "b")
        .after("b", "c")
        .ring(["x", "y"])
        .after("x", "y") // inside the ring: ignored
        .after("y", "x")
        .after("y", "c")
        .after("z", "x");
    let cohorts = set(&["a", "b", "c", "x", "y", "z", "o"]);
    deps.validate(&cohorts).unwrap();
    let g = deps.start_groups(&cohorts, Policy::RestoreLine).unwrap();
    let find = |m: &[&str]| {
        g.iter()
            .find(|g| g.members == set(m))
            .unwrap()
            .after
            .clone()
    };
    assert_eq!(g.len(), 6);
    assert_eq!(find(&["a"]), set(&["b"]));
    assert_eq!(find(&["c"]), set(&[]));
    assert_eq!(find(&["x", "y"]), set(&["c"]));
    assert_eq!(find(&["z"]), set(&["x"]));
    assert_eq!(find(&["o"]), set(&[]));
    let ind = deps.start_groups(&cohorts, Policy::Independent).unwrap();
    assert_eq!(ind.len(), 7);
    assert!(ind
        .iter()
        .all(|g| g.members.len() == 1 && g.after.is_empty()));
}

#[test]
fn unknown_vms_are_rejected() {
    let e = err(&["a"], Deps::new().after("a", "ghost"));
    assert!(
        e.contains("\"ghost\"") && e.contains("deps of \"a\""),
        "{e}"
    );
    let e = err(&["a"], Deps::new().after("ghost", "a"));
    assert!(e.contains("\"ghost\"") && e.contains("keys"), "{e}");
    let e = err(&["a"], Deps::new().ring(["a", "ghost"]));
    assert!(e.contains("\"ghost\"") && e.contains("ring 0"), "{e}");
}

#[test]
fn inconsistent_rings_are_rejected() {
    let e = err(
        &["a", "b", "c"],
        Deps::new().ring(["a", "b"]).ring(["b", "c"]),
    );
    assert!(e.contains("\"b\"") && e.contains("merge"), "{e}");
    let e = err(&["a"], Deps::new().ring(["a"]));
    assert!(e.contains("ring 0 has 1 member"), "{e}");
    let e = err(&["a"], Deps::new().ring(Vec::<String>::new()));
    assert!(e.contains("at least two"), "{e}");
}

#[test]
fn cycles_outside_rings_are_rejected() {
    let e = err(
        &["a", "b", "c"],
        Deps::new().after("a", "b").after("b", "c").after("c", "a"),
    );
    assert!(e.contains("a -> b -> c -> a") && e.contains("ring"), "{e}");
    let e = err(&["a"], Deps::new().after("a", "a"));
    assert!(e.contains("a -> a"), "{e}");
    // A cycle through a ring: the ring is collapsed, the cycle remains.
    let deps = Deps::new().ring(["x", "y"]).after("x", "z").after("z", "y");
    let e = err(&["x", "y", "z"], deps);
    assert!(e.contains("ring{x, y}") && e.contains("z"), "{e}");
    assert!(matches!(
        new(&["a", "b"], Deps::new().after("a", "b").after("b", "a")),
        Err(RestoreProtocolError::Cycle { .. })
    ));
    // Declared as a ring, the same graph is fine.
    new(
        &["a", "b"],
        Deps::new().after("a", "b").after("b", "a").ring(["a", "b"]),
    )
    .unwrap();
}

#[test]
fn coordinator_must_not_be_a_cohort() {
    let e = err(&["mgr", "a"], Deps::new());
    assert!(e.contains("\"mgr\""), "{e}");
}

#[test]
fn from_edges_finds_the_rings() {
    // a <-> b form a ring, both send to c; d sends to c and to itself.
    let deps = Deps::from_edges([("a", "b"), ("b", "a"), ("b", "c"), ("d", "c"), ("d", "d")]);
    assert_eq!(deps.rings, vec![set(&["a", "b"])]);
    assert_eq!(deps.deps["d"], set(&["c"]));
    let cohorts = set(&["a", "b", "c", "d"]);
    let g = deps.start_groups(&cohorts, Policy::RestoreLine).unwrap();
    let ring = g.iter().find(|g| g.members.len() == 2).unwrap();
    assert_eq!(ring.after, set(&["c"]));

    // A larger graph: two rings chained, plus a chain into them.
    let deps = Deps::from_edges([
        ("p", "q"),
        ("q", "r"),
        ("r", "p"),
        ("r", "s"),
        ("s", "t"),
        ("t", "s"),
        ("u", "p"),
    ]);
    let mut rings = deps.rings.clone();
    rings.sort();
    assert_eq!(rings, vec![set(&["p", "q", "r"]), set(&["s", "t"])]);
    deps.validate(&set(&["p", "q", "r", "s", "t", "u"]))
        .unwrap();
}
