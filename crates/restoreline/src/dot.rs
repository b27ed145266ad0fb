//! Graphviz DOT output of the RDG: `dot -Tpng rdg.dot -o rdg.png`.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::graph::Rdg;

impl Rdg {
    /// The graph in Graphviz DOT: each ring is a `cluster_ring<k>` subgraph
    /// (k counting from 1 in [`Rdg::rings`] order), every other VM a plain
    /// node, in name order; node labels are the VM names, followed by
    /// `\nS=<pages>` when `sizes` has the VM; edges `sender -> receiver`
    /// labelled with W, in [`Rdg::edges`] order.
    pub fn to_dot(&self, sizes: Option<&BTreeMap<String, u64>>) -> String {
        let node = |vm: &str| {
            let label = match sizes.and_then(|s| s.get(vm)) {
                Some(s) => format!("{}\\nS={s}", escape(vm)),
                None => escape(vm),
            };
            format!("\"{}\" [label=\"{label}\"];", escape(vm))
        };
        let mut out = String::from("digraph rdg {\n  node [shape=box];\n");
        for (k, ring) in self.rings().iter().enumerate() {
            let _ = writeln!(out, "  subgraph cluster_ring{} {{", k + 1);
            let _ = writeln!(out, "    label=\"ring {}\";\n    style=dashed;", k + 1);
            for vm in ring {
                let _ = writeln!(out, "    {}", node(vm));
            }
            out.push_str("  }\n");
        }
        for vm in self.nodes.iter().filter(|vm| self.ring_of(vm).is_none()) {
            let _ = writeln!(out, "  {}", node(vm));
        }
        for e in &self.edges {
            let _ = writeln!(
                out,
                "  \"{}\" -> \"{}\" [label=\"{}\"];",
                escape(&e.from),
                escape(&e.to),
                e.weight
            );
        }
        out.push_str("}\n");
        out
    }
}

/// Escapes `"` and `\` for a DOT quoted string.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}
