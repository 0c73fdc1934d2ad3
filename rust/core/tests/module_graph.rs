//! The modules of `rust/core/src` import each other without a circle: each file's `crate::X`
//! paths (in `use` lines and inline) are its edges, and the graph must be acyclic, so the core
//! reads bottom-up (pools and index, the store, the layout, sequences, the hit rule, the
//! protocol). `lib.rs`, which declares and re-exports every module, is not a node.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every `crate::name` a source file mentions (its own name excluded), comments skipped.
fn imports(source: &str, own: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
            let name: String =
                after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let preceded =
                rest[..at].chars().last().is_some_and(|c| c.is_alphanumeric() || c == '_');
            if !preceded && !name.is_empty() && name != own {
                out.insert(name);
            }
            rest = after;
        }
        // `use crate::{a, b::C}` groups.
        if let Some(at) = code.find("use crate::{") {
            for part in code[at + "use crate::{".len()..].split(',') {
                let name: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != own {
                    out.insert(name);
                }
            }
        }
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("rust/core/src") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let name = path.file_stem().and_then(|s| s.to_str()).expect("name").to_string();
        if name == "lib" {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("source");
        graph.insert(name.clone(), imports(&source, &name));
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for edges in graph.values_mut() {
        edges.retain(|m| modules.contains(m));
    }
    graph
}

/// A circle of the graph, if there is one (depth-first search).
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in &graph[node] {
            if let Some(found) = visit(next, graph, done, path) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|node| visit(node, graph, &mut done, &mut Vec::new()))
}

#[test]
fn the_core_modules_import_each_other_without_a_circle() {
    let graph = graph();
    assert!(graph.len() > 10, "read {} modules: {:?}", graph.len(), graph.keys());
    let described: Vec<String> = graph
        .iter()
        .map(|(m, edges)| {
            format!("{m} -> {}", edges.iter().cloned().collect::<Vec<_>>().join(", "))
        })
        .collect();
    assert_eq!(circle(&graph), None, "import circle; the graph:\n{}", described.join("\n"));
}

#[test]
fn the_circle_detector_finds_a_circle() {
    let source_a = "use crate::b::X;\nuse crate::{c, d::Y};\n// crate::z in a comment\n";
    assert_eq!(
        imports(source_a, "a"),
        ["b", "c", "d"].iter().map(|s| (*s).to_string()).collect::<BTreeSet<_>>()
    );
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.insert("a".into(), ["b".to_string()].into());
    graph.insert("b".into(), ["c".to_string()].into());
    graph.insert("c".into(), BTreeSet::new());
    assert_eq!(circle(&graph), None);
    graph.get_mut("c").expect("c").insert("a".into());
    assert_eq!(circle(&graph), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
}
