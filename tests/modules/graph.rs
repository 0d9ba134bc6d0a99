//! The import graph of a crate's modules and its cycles.

use std::collections::{BTreeMap, BTreeSet};

use crate::source::{named_paths, strip_comments};

/// A module path, `["scheduler", "service", "ingest"]`; the crate root is `[]`.
pub(crate) type ModPath = Vec<String>;

/// Which module imports which, and by which names.
pub(crate) type Edges = BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>>;

/// The import graph of a crate's modules (`sources`: each module's text);
/// `show` names a module in the edges' labels.
pub(crate) fn import_graph(sources: &BTreeMap<ModPath, String>, show: &dyn Fn(&ModPath) -> String) -> Edges {
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

/// A path named in `module` as a path from the crate root; `None` for paths
/// into other crates.
pub(crate) fn resolve(module: &ModPath, path: &ModPath) -> Option<ModPath> {
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
pub(crate) fn owning_module(modules: &BTreeSet<ModPath>, path: &ModPath) -> Option<ModPath> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|m| modules.contains(m))
}

/// The strongly connected groups of more than one module (Tarjan), each
/// sorted, in order.
pub(crate) fn cycles(modules: &BTreeSet<ModPath>, edges: &Edges) -> Vec<Vec<ModPath>> {
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
