//! Reading Rust source as text: comments and strings blanked out, and
//! the module paths a file names (its `use` trees, and `crate::`,
//! `super::`, `self::` or child-module paths in its code).

use std::collections::BTreeSet;

use crate::graph::ModPath;

/// The text with `//` and `/* */` comments and string literals blanked out,
/// so a path in a doc comment or a message is not taken for an import.
pub(crate) fn strip_comments(text: &str) -> String {
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
pub(crate) fn named_paths(code: &str, children: &BTreeSet<&str>) -> Vec<(ModPath, bool)> {
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
