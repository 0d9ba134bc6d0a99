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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path, `["scheduler", "service", "ingest"]`; the crate root is `[]`.
type ModPath = Vec<String>;

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

/// Which module imports which, and by which names.
type Edges = BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>>;

/// The import graph of a crate's modules (`sources`: each module's text);
/// `show` names a module in the edges' labels.
fn import_graph(sources: &BTreeMap<ModPath, String>, show: &dyn Fn(&ModPath) -> String) -> Edges {
    let modules: BTreeSet<ModPath> = sources.keys().cloned().collect();
    // Per module, the paths it names (from the crate root), and what its
    // `use` lines bring in by name (to follow a re-export).
    let mut named: BTreeMap<ModPath, Vec<ModPath>> = BTreeMap::new();
    let mut imports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
    for (module, text) in sources {
        let code = strip_comments(text);
        let children: BTreeSet<&str> = modules
            .iter()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
            .map(|m| m[module.len()].as_str())
            .collect();
        for (path, by_use) in named_paths(&code, &children) {
            let Some(absolute) = resolve(module, &path) else {
                continue;
            };
            if by_use {
                if let Some(name) = absolute.last() {
                    imports
                        .entry(module.clone())
                        .or_default()
                        .insert(name.clone(), absolute.clone());
                }
            }
            named.entry(module.clone()).or_default().push(absolute);
        }
    }
    let mut edges = Edges::new();
    for (module, paths) in &named {
        for absolute in paths {
            let Some(mut target) = owning_module(&modules, absolute) else {
                continue;
            };
            let mut name = absolute[target.len()..]
                .first()
                .cloned()
                .unwrap_or_else(|| "(the module)".into());
            if module.starts_with(&target) {
                // An ancestor (or itself): counted only when the name is
                // one the ancestor brought in from elsewhere (a re-export).
                let Some(via) = imports.get(&target).and_then(|i| i.get(&name)) else {
                    continue;
                };
                let Some(origin) = owning_module(&modules, via) else {
                    continue;
                };
                if module.starts_with(&origin) {
                    continue;
                }
                name = format!("{name} (through {})", show(&target));
                target = origin;
            }
            edges
                .entry(module.clone())
                .or_default()
                .entry(target)
                .or_default()
                .insert(name);
        }
    }
    edges
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

/// The text with `//` and `/* */` comments and string literals blanked out,
/// so a path in a doc comment or a message is not taken for an import.
fn strip_comments(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i..].starts_with(b"//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if bytes[i..].starts_with(b"/*") {
            i += 2;
            while i < bytes.len() && !bytes[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if let Some((open, hashes)) = raw_string_start(&bytes[i..], i == 0 || !ident(bytes[i - 1])) {
            let close = format!("\"{}", "#".repeat(hashes));
            i += open;
            while i < bytes.len() && !bytes[i..].starts_with(close.as_bytes()) {
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if bytes[i] == b'"' && (i == 0 || bytes[i - 1] != b'\'') {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// At `r"`, `r#"`, `br"` ... (not inside a name): the opening's length and
/// the number of `#`.
fn raw_string_start(bytes: &[u8], at_word_start: bool) -> Option<(usize, usize)> {
    let b = usize::from(bytes.first() == Some(&b'b'));
    if !at_word_start || bytes.get(b) != Some(&b'r') {
        return None;
    }
    let hashes = bytes[b + 1..].iter().take_while(|c| **c == b'#').count();
    (bytes.get(b + 1 + hashes) == Some(&b'"')).then_some((b + 2 + hashes, hashes))
}

fn ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// `use` text with its renames (`as Name`) taken out.
fn drop_renames(tree: &str) -> String {
    let mut out = String::new();
    let mut words = tree
        .split_inclusive(|c: char| !(c.is_alphanumeric() || c == '_'))
        .peekable();
    while let Some(word) = words.next() {
        if word.trim() == "as" || word == "as " {
            // skip the new name: the next word that is an identifier
            for next in words.by_ref() {
                let name = next.trim_end_matches(|c: char| !(c.is_alphanumeric() || c == '_'));
                if !name.is_empty() {
                    out.push_str(&next[name.len()..]);
                    break;
                }
            }
        } else {
            out.push_str(word);
        }
    }
    out
}

/// The module paths the code names: `use` trees expanded, and the paths
/// starting with `crate`, `super`, `self` or a child module's name
/// (`children`, read as `self::child`) anywhere else.
fn named_paths(code: &str, children: &BTreeSet<&str>) -> Vec<(ModPath, bool)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = find_word(rest, "use") {
        let tail = &rest[at + 3..];
        let end = tail.find(';').unwrap_or(tail.len());
        let tree: String = drop_renames(&tail[..end])
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        expand(&tree, &mut Vec::new(), &mut out);
        rest = &tail[end..];
    }
    for path in &mut out {
        if path.first().is_some_and(|p| children.contains(p.as_str())) {
            path.insert(0, "self".to_string());
        }
    }
    let mut out: Vec<(ModPath, bool)> = out.into_iter().map(|p| (p, true)).collect();
    let starts: Vec<String> = ["crate", "super", "self"]
        .iter()
        .copied()
        .chain(children.iter().copied())
        .map(|s| format!("{s}::"))
        .collect();
    for line in code.lines().filter(|l| find_word(l, "use").is_none()) {
        for start in &starts {
            let mut from = 0;
            while let Some(at) = line[from..].find(start) {
                let at = from + at;
                from = at + start.len();
                let before = line[..at].chars().last();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let path: String = line[at..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let mut path: ModPath = path
                    .split("::")
                    .filter(|p| !p.is_empty())
                    .map(String::from)
                    .collect();
                if children.contains(path[0].as_str()) {
                    path.insert(0, "self".to_string());
                }
                out.push((path, false));
            }
        }
    }
    out
}

/// The byte offset of `word` standing alone at the start of a statement.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = text[from..].find(word) {
        let at = from + at;
        from = at + word.len();
        let before = text[..at].trim_end_matches([' ', '\t']).chars().last();
        let after = text[at + word.len()..].chars().next();
        let starts = before.is_none_or(|c| matches!(c, '\n' | ';' | '{' | '}' | ')' | ']'))
            || text[..at].ends_with("pub ")
            || text[..at].ends_with("pub(crate) ")
            || text[..at].ends_with("pub(super) ");
        if starts && after.is_some_and(|c| c == ' ') {
            return Some(at);
        }
    }
    None
}

/// `a::{b::{C, D}, E}` into `a::b::C`, `a::b::D`, `a::E`.
fn expand(tree: &str, prefix: &mut ModPath, out: &mut Vec<ModPath>) {
    let tree = tree.trim_start_matches("::");
    if let Some(open) = tree.find('{') {
        let head: ModPath = tree[..open]
            .split("::")
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        let depth = prefix.len();
        prefix.extend(head);
        for part in split_top(inner) {
            expand(part, prefix, out);
        }
        prefix.truncate(depth);
    } else {
        let mut full = prefix.clone();
        full.extend(
            tree.split("::")
                .filter(|p| !p.is_empty() && *p != "*")
                .map(String::from),
        );
        if full.last().is_some_and(|p| p == "self") {
            full.pop();
        }
        if !full.is_empty() {
            out.push(full);
        }
    }
}

/// The comma-separated parts of a brace group, nested groups kept whole.
fn split_top(inner: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// A path named in `module` as a path from the crate root; `None` for paths
/// into other crates.
fn resolve(module: &ModPath, path: &ModPath) -> Option<ModPath> {
    let mut parts = path.iter();
    let mut base = match parts.next()?.as_str() {
        "crate" => Vec::new(),
        "self" => module.clone(),
        "super" => module[..module.len().checked_sub(1)?].to_vec(),
        _ => return None,
    };
    let mut parts = parts.peekable();
    while parts.peek().is_some_and(|p| *p == "super") {
        parts.next();
        base.pop();
    }
    base.extend(parts.cloned());
    Some(base)
}

/// The deepest module of the library that `path` lies in.
fn owning_module(modules: &BTreeSet<ModPath>, path: &ModPath) -> Option<ModPath> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|m| modules.contains(m))
}

/// The strongly connected groups of more than one module (Tarjan), each
/// sorted, in order.
fn cycles(modules: &BTreeSet<ModPath>, edges: &Edges) -> Vec<Vec<ModPath>> {
    struct Walk<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a ModPath, (usize, usize)>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        found: Vec<Vec<ModPath>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a ModPath) {
            let n = self.index.len();
            self.index.insert(v, (n, n));
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.index[w].1.min(self.index[v].1);
                    self.index.get_mut(v).unwrap().1 = low;
                } else if self.on_stack.contains(w) {
                    let low = self.index[w].0.min(self.index[v].1);
                    self.index.get_mut(v).unwrap().1 = low;
                }
            }
            if self.index[v].0 == self.index[v].1 {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.found.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for m in modules {
        if !walk.index.contains_key(m) {
            walk.visit(m);
        }
    }
    walk.found.sort();
    walk.found
}
