//! The backing chains of a VM's block devices, as QEMU has them open.
//!
//! Read from QEMU's block graph (`x-debug-query-block-graph`: nodes and
//! their `root`, `file` and `backing` edges) and the file names of its
//! protocol nodes (`query-named-block-nodes`, flat), not from the file
//! names `query-block` gives each image. A format node whose backing QEMU
//! did not open from its header (every overlay a snapshot puts on top) is
//! named `json:{"backing": {…}, "file": {…}}`, the whole chain below it in
//! one string, and QEMU cuts every name at 4095 bytes
//! (`BlockDriverState::filename`): past about 30 overlays the top file's
//! name was gone, and the 33rd snapshot of a lab VM failed with "disk … is
//! not among QEMU's block devices". `query-block`'s names stay the
//! fallback for a QEMU without the debug command (7.2 and 10.0 have it).

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use crate::error::AgentError;
use crate::vm::Vm;

/// One block device's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceChain {
    /// The node the device writes to (the top of the chain).
    pub top_node: String,
    /// Its files, top first, then each backing file.
    pub files: Vec<PathBuf>,
}

/// The longest chain followed (a loop in a malformed answer stops there).
const MAX_DEPTH: usize = 4096;

#[derive(Debug, Deserialize)]
struct Graph {
    nodes: Vec<GraphNode>,
    edges: Vec<GraphEdge>,
}

#[derive(Debug, Deserialize)]
struct GraphNode {
    id: u64,
    #[serde(rename = "type")]
    kind: String,
    name: String,
}

#[derive(Debug, Deserialize)]
struct GraphEdge {
    parent: u64,
    child: u64,
    name: String,
}

#[derive(Debug, Deserialize)]
struct NamedNode {
    #[serde(rename = "node-name")]
    node_name: String,
    file: String,
}

/// The chain of every block device of `vm` that has a medium.
pub fn device_chains(vm: &mut Vm) -> Result<Vec<DeviceChain>, AgentError> {
    match from_graph(vm) {
        Some(chains) => Ok(chains),
        None => Ok(from_query_block(&vm.execute("query-block", Value::Null)?)),
    }
}

fn from_graph(vm: &mut Vm) -> Option<Vec<DeviceChain>> {
    let graph = vm.execute("x-debug-query-block-graph", Value::Null).ok()?;
    let graph: Graph = serde_json::from_value(graph).ok()?;
    let nodes = vm
        .execute(
            "query-named-block-nodes",
            serde_json::json!({ "flat": true }),
        )
        .ok()?;
    let nodes: Vec<NamedNode> = serde_json::from_value(nodes).ok()?;
    Some(chains_from_graph(&graph, &nodes))
}

/// Walks each block backend's `root` edge, then `backing` edges; each
/// format node's file is the name of its `file` child (a protocol node,
/// whose name is a plain path), or its own name if it has none.
fn chains_from_graph(graph: &Graph, nodes: &[NamedNode]) -> Vec<DeviceChain> {
    let names: HashMap<u64, &str> = graph
        .nodes
        .iter()
        .map(|n| (n.id, n.name.as_str()))
        .collect();
    let files: HashMap<&str, &str> = nodes
        .iter()
        .map(|n| (n.node_name.as_str(), n.file.as_str()))
        .collect();
    let child = |parent: u64, edge: &str| {
        graph
            .edges
            .iter()
            .find(|e| e.parent == parent && e.name == edge)
            .map(|e| e.child)
    };
    let file_of = |id: u64| -> Option<PathBuf> {
        let own = child(id, "file").unwrap_or(id);
        let name = files.get(names.get(&own)?)?;
        Some(plain_filename(name))
    };
    let mut out = vec![];
    for backend in graph.nodes.iter().filter(|n| n.kind == "block-backend") {
        let Some(top) = child(backend.id, "root") else {
            continue;
        };
        let mut chain = vec![];
        let mut at = Some(top);
        while let Some(id) = at {
            if chain.len() == MAX_DEPTH {
                break;
            }
            if let Some(f) = file_of(id) {
                chain.push(f);
            }
            at = child(id, "backing");
        }
        if let (Some(name), false) = (names.get(&top), chain.is_empty()) {
            out.push(DeviceChain {
                top_node: name.to_string(),
                files: chain,
            });
        }
    }
    out
}

/// The chains from `query-block`'s answer: its image names, which QEMU
/// cuts at 4095 bytes (see the module's documentation).
fn from_query_block(blocks: &Value) -> Vec<DeviceChain> {
    blocks
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|b| {
            let top_node = b["inserted"]["node-name"].as_str()?.to_string();
            let mut files = vec![];
            let mut img = &b["inserted"]["image"];
            while let Some(f) = img["filename"].as_str() {
                files.push(plain_filename(f));
                img = &img["backing-image"];
            }
            (!files.is_empty()).then_some(DeviceChain { top_node, files })
        })
        .collect()
}

/// The file of a block node's `filename`: QEMU names an image opened with
/// options (an overlay whose backing file was given at run time) by a
/// `json:{...}` pseudo-filename; its `file.filename` is the file.
pub(crate) fn plain_filename(name: &str) -> PathBuf {
    if let Some(json) = name.strip_prefix("json:") {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(json) {
            if let Some(f) = v["file"]["filename"].as_str() {
                return PathBuf::from(f);
            }
        }
    }
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What QEMU 7.2 and 10.0 answered (the same) for a disk `disk0` on
    /// base.qcow2 with two overlays put on top by `blockdev-snapshot`,
    /// as a snapshot does (node names `ov1-0`, `ov2-0`).
    const GRAPH: &str = r##"{"nodes": [
        {"name": "ov2-0", "type": "block-driver", "id": 2},
        {"name": "#block217", "type": "block-driver", "id": 7},
        {"name": "ov1-0", "type": "block-driver", "id": 6},
        {"name": "#block127", "type": "block-driver", "id": 5},
        {"name": "disk0", "type": "block-driver", "id": 4},
        {"name": "#block061", "type": "block-driver", "id": 3},
        {"name": "/machine/peripheral-anon/device[0]", "type": "block-backend", "id": 1}],
      "edges": [
        {"parent": 2, "child": 7, "name": "file", "perm": [], "shared-perm": []},
        {"parent": 2, "child": 6, "name": "backing", "perm": [], "shared-perm": []},
        {"parent": 6, "child": 5, "name": "file", "perm": [], "shared-perm": []},
        {"parent": 6, "child": 4, "name": "backing", "perm": [], "shared-perm": []},
        {"parent": 4, "child": 3, "name": "file", "perm": [], "shared-perm": []},
        {"parent": 1, "child": 2, "name": "root", "perm": [], "shared-perm": []}]}"##;

    fn nodes(top_name: &str) -> Vec<NamedNode> {
        [
            ("ov2-0", top_name),
            ("#block217", "/b/ov2.qcow2"),
            ("ov1-0", "json:{\"backing\": {\"driver\": \"qcow2\"}}"),
            ("#block127", "/b/ov1.qcow2"),
            ("disk0", "/b/base.qcow2"),
            ("#block061", "/b/base.qcow2"),
        ]
        .into_iter()
        .map(|(n, f)| NamedNode {
            node_name: n.into(),
            file: f.into(),
        })
        .collect()
    }

    #[test]
    fn a_chain_is_read_from_the_graph_whatever_the_format_nodes_are_named() {
        let graph: Graph = serde_json::from_str(GRAPH).unwrap();
        // The top's own name cut off after 4095 bytes, as QEMU does past
        // about 30 overlays: the protocol node still names the file.
        let cut = format!("json:{{\"backing\": {}", "{\"backing\": ".repeat(400));
        let chains = chains_from_graph(&graph, &nodes(&cut[..4095]));
        assert_eq!(
            chains,
            vec![DeviceChain {
                top_node: "ov2-0".into(),
                files: ["/b/ov2.qcow2", "/b/ov1.qcow2", "/b/base.qcow2"]
                    .map(PathBuf::from)
                    .to_vec(),
            }]
        );
    }

    #[test]
    fn json_pseudo_filenames_name_their_file() {
        let j = r#"json:{"backing": {"driver": "qcow2", "file": {"driver": "file", "filename": "/r/d.qcow2"}}, "driver": "qcow2", "file": {"driver": "file", "filename": "/r/d-1.qcow2"}}"#;
        assert_eq!(plain_filename(j), PathBuf::from("/r/d-1.qcow2"));
        assert_eq!(plain_filename("/r/d.qcow2"), PathBuf::from("/r/d.qcow2"));
        assert_eq!(plain_filename("json:{bad"), PathBuf::from("json:{bad"));
    }

    #[test]
    fn a_backend_without_a_medium_has_no_chain() {
        let graph: Graph = serde_json::from_str(
            r#"{"nodes": [{"name": "cd", "type": "block-backend", "id": 1}], "edges": []}"#,
        )
        .unwrap();
        assert!(chains_from_graph(&graph, &[]).is_empty());
    }

    #[test]
    fn query_block_names_are_the_fallback() {
        let blocks = serde_json::json!([{"inserted": {"node-name": "ov1-0", "image": {
            "filename": "json:{\"backing\": {}, \"driver\": \"qcow2\", \"file\": {\"driver\": \"file\", \"filename\": \"/b/ov1.qcow2\"}}",
            "backing-image": {"filename": "/b/base.qcow2"}}}}, {"device": "cd"}]);
        assert_eq!(
            from_query_block(&blocks),
            vec![DeviceChain {
                top_node: "ov1-0".into(),
                files: ["/b/ov1.qcow2", "/b/base.qcow2"]
                    .map(PathBuf::from)
                    .to_vec(),
            }]
        );
    }
}
