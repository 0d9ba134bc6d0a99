//! The library's module graph has no cycles: no two source files under
//! `src/` import each other, directly or through others.
//!
//! Pure logic over the source text, no broker: every file of the library is
//! a module (`src/a/b.rs` and `src/a/b/mod.rs` are `crate::a::b`); a file
//! imports a module when a `use` line or a path in its code names
//! `crate::...`, `super::...` or `self::...` and that path leads into the
//! module's file. A module naming one of its ancestors (a child using its
//! parent's types, as `mod` nesting intends) is not counted: a cycle is
//! between files that are not nested in one another. Run it alone with
//! `cargo test --test modules`.

mod graph;
mod source;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use graph::{cycles, import_graph, owning_module, resolve, ModPath};
use source::named_paths;

#[test]
fn no_two_library_modules_import_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = library_files(&src);
    assert!(files.len() > 50, "found only {} library files", files.len());
    let modules: BTreeSet<ModPath> = files.keys().cloned().collect();
    let sources: BTreeMap<ModPath, String> = files
        .iter()
        .map(|(m, f)| (m.clone(), std::fs::read_to_string(f).unwrap()))
        .collect();
    let edges = import_graph(&sources, &|m| file_of(&files, m));
    let cycles = cycles(&modules, &edges);
    let shown: Vec<String> = cycles
        .iter()
        .map(|cycle| {
            let mut lines = vec![format!("cycle of {} files:", cycle.len())];
            for from in cycle {
                for (to, names) in &edges[from] {
                    if cycle.contains(to) {
                        let names: Vec<&str> = names.iter().map(String::as_str).collect();
                        lines.push(format!(
                            "  {} -> {}: {}",
                            file_of(&files, from),
                            file_of(&files, to),
                            names.join(", ")
                        ));
                    }
                }
            }
            lines.join("\n")
        })
        .collect();
    assert!(
        shown.is_empty(),
        "modules that import each other:\n{}",
        shown.join("\n")
    );
}

/// ARCHITECTURE.md names every source file under `src/` (in backticks, by
/// its path or the end of it; `a/{b,c}.rs` names `a/b.rs` and `a/c.rs`).
#[test]
fn architecture_names_every_source_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let named = named_in_prose(&text);
    let src = root.join("src");
    let files: Vec<String> = files_under(&src)
        .iter()
        .map(|p| p.strip_prefix(&src).unwrap().to_string_lossy().into_owned())
        .collect();
    // A name counts for the file at that path under `src/`, or for the one
    // file it ends (at a `/`): a bare `refill.rs` that three files end
    // names none of them.
    let ends = |file: &str, n: &str| file.ends_with(&format!("/{n}"));
    let mut missing: Vec<String> = files
        .iter()
        .filter(|file| {
            !named
                .iter()
                .any(|n| *file == n || (ends(file, n) && files.iter().filter(|f| ends(f, n)).count() == 1))
        })
        .cloned()
        .collect();
    missing.sort();
    assert!(
        missing.is_empty(),
        "source files ARCHITECTURE.md does not name: {missing:?}"
    );
}

/// The file names in backticks outside fenced blocks, braces expanded.
fn named_in_prose(text: &str) -> Vec<String> {
    let mut prose = String::new();
    for (i, part) in text.split("```").enumerate() {
        if i % 2 == 0 {
            prose.push_str(part);
        }
    }
    let mut out = Vec::new();
    for (i, span) in prose.split('`').enumerate() {
        if i % 2 == 1 {
            for whole in expand_braces(span) {
                out.extend(
                    whole
                        .split([' ', ',', '(', ')', '+'])
                        .filter(|w| w.contains('.'))
                        .map(str::to_string),
                );
            }
        }
    }
    out
}

/// `a/{b,c}.rs` into `a/b.rs`, `a/c.rs` (innermost group first).
fn expand_braces(text: &str) -> Vec<String> {
    let Some(close) = text.find('}') else {
        return vec![text.to_string()];
    };
    let Some(open) = text[..close].rfind('{') else {
        return vec![text.to_string()];
    };
    text[open + 1..close]
        .split(',')
        .flat_map(|alt| expand_braces(&format!("{}{}{}", &text[..open], alt.trim(), &text[close + 1..])))
        .collect()
}

/// The resolver and the cycle finder on a made-up crate, so the check above
/// is known to see a cycle when there is one.
#[test]
fn the_check_finds_a_cycle_and_ignores_ancestors() {
    let m = |s: &str| -> ModPath {
        s.split("::")
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect()
    };
    let modules: BTreeSet<ModPath> = ["", "a", "a::b", "a::c", "d"].iter().map(|s| m(s)).collect();
    assert_eq!(resolve(&m("a::b"), &m("super::c::X")), Some(m("a::c::X")));
    assert_eq!(resolve(&m("a::b"), &m("crate::d::f")), Some(m("d::f")));
    assert_eq!(resolve(&m("a"), &m("self::b::Y")), Some(m("a::b::Y")));
    assert_eq!(resolve(&m("a"), &m("std::sync::Arc")), None);
    assert_eq!(owning_module(&modules, &m("a::c::X")), Some(m("a::c")));
    assert_eq!(
        named_paths(
            "use super::{c::{X as Z, Y}, Shared};\nuse e::W;\nfn f() { crate::d::go(); e::run(); }",
            &BTreeSet::from(["e"])
        ),
        vec![
            (m("super::c::X"), true),
            (m("super::c::Y"), true),
            (m("super::Shared"), true),
            (m("self::e::W"), true),
            (m("crate::d::go"), false),
            (m("self::e::run"), false)
        ]
    );
    let mut edges: BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>> = BTreeMap::new();
    let edge = |edges: &mut BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>>, from: &str, to: &str| {
        edges
            .entry(m(from))
            .or_default()
            .entry(m(to))
            .or_default()
            .insert("x".into());
    };
    edge(&mut edges, "a::b", "a::c");
    edge(&mut edges, "a::c", "d");
    assert!(cycles(&modules, &edges).is_empty());
    edge(&mut edges, "d", "a::b");
    assert_eq!(cycles(&modules, &edges), vec![vec![m("a::b"), m("a::c"), m("d")]]);
    // A child naming its parent's re-export imports the module it came from.
    let sources: BTreeMap<ModPath, String> = [
        ("", "mod a;\nmod d;\n"),
        ("a", "mod b;\nmod c;\npub use c::Thing;\n"),
        ("a::b", "use super::Thing;\n"),
        ("a::c", "use crate::d::go;\n"),
        ("d", "use crate::a::b::Other;\n"),
    ]
    .iter()
    .map(|(k, v)| (m(k), v.to_string()))
    .collect();
    let graph = import_graph(&sources, &|p| p.join("::"));
    assert!(graph[&m("a::b")].contains_key(&m("a::c")), "{graph:?}");
    assert_eq!(
        cycles(&sources.keys().cloned().collect(), &graph),
        vec![vec![m("a::b"), m("a::c"), m("d")]]
    );
    assert_eq!(
        named_in_prose("`x/{a,b}.rs`, `c.rs` (+ `d.rs`)\n```\n`e.rs`\n```"),
        vec!["x/a.rs", "x/b.rs", "c.rs", "d.rs"]
    );
}

/// Every `.rs` file under `src/` by its module path, the binary's
/// (`main.rs` and the modules it declares) left out.
fn library_files(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut out = BTreeMap::new();
    for path in files_under(src) {
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let relative = path.strip_prefix(src).unwrap().with_extension("");
        let mut module: ModPath = relative
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        match module.last().map(String::as_str) {
            Some("main") if module.len() == 1 => continue,
            Some("lib") if module.len() == 1 => module.clear(),
            Some("mod") => {
                module.pop();
            }
            _ => {}
        }
        if module.len() == 1 && binary_modules(src).contains(&module[0]) {
            continue;
        }
        out.insert(module, path);
    }
    out
}

/// Every file below `dir`.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

/// The modules `src/main.rs` declares: the binary's, not the library's.
fn binary_modules(src: &Path) -> Vec<String> {
    let main = std::fs::read_to_string(src.join("main.rs")).unwrap_or_default();
    main.lines()
        .filter_map(|l| l.trim().strip_prefix("mod ")?.strip_suffix(';'))
        .map(str::to_string)
        .collect()
}

fn file_of(files: &BTreeMap<ModPath, PathBuf>, module: &ModPath) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"));
    files[module].strip_prefix(src).unwrap().display().to_string()
}
