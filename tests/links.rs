//! The documentation's links resolve: every relative link in the markdown
//! files at the top of the repository and under `docs/` names a file that
//! exists and, with a `#fragment`, a heading of that file (as GitHub makes
//! its anchors); and the README links every page under `docs/`. The alert
//! rules and the Grafana dashboard in `config/` name only metrics Kairos
//! exports. No broker.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let pages = pages();
    assert!(pages.len() >= 5, "found the docs: {pages:?}");
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, fragment) = match target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (target.as_str(), None),
            };
            let file = match path {
                "" => page.clone(),
                p => page.parent().unwrap().join(p),
            };
            if !file.exists() {
                broken.push(format!("{}: {target} (no such file)", name(page)));
                continue;
            }
            let Some(fragment) = fragment else { continue };
            let anchors = std::fs::read_to_string(&file)
                .map(|t| anchors(&t))
                .unwrap_or_default();
            if !anchors.contains(fragment) {
                broken.push(format!("{}: {target} (no heading with that anchor)", name(page)));
            }
        }
    }
    assert!(checked > 20, "the pages' links were read ({checked})");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_links_every_page_under_docs() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let linked: BTreeSet<String> = links(&readme).into_iter().collect();
    let missing: Vec<String> = pages()
        .iter()
        .filter(|p| p.parent().is_some_and(|d| d.ends_with("docs")))
        .map(|p| name(p))
        .filter(|n| !linked.contains(n))
        .collect();
    assert!(missing.is_empty(), "README does not link {missing:?}");
}

#[test]
fn the_alerts_and_the_dashboard_name_only_metrics_kairos_exports() {
    let mut exported = String::new();
    read_sources(&Path::new(ROOT).join("src"), &mut exported);
    for file in ["config/alerts.yml", "config/grafana/kairos.json"] {
        let text = std::fs::read_to_string(Path::new(ROOT).join(file)).unwrap();
        let names = metric_names(&text);
        assert!(names.len() >= 5, "{file} names metrics: {names:?}");
        let unknown: Vec<&String> = names
            .iter()
            .filter(|n| !registered(&exported, family(n)))
            .collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics no source registers: {unknown:?}"
        );
    }
    assert_eq!(family("kairos_worker_parked_total"), "kairos_worker_parked");
    assert_eq!(
        family("kairos_scheduler_fire_lateness_seconds_bucket"),
        "kairos_scheduler_fire_lateness_seconds"
    );
}

#[test]
fn anchors_and_links_are_read_as_github_does() {
    let text = "# Wire contract (version 1)\n## `kairos keys`: held keys\n```sh\n# not a heading\n```\n\
                See [a](docs/a.md#x) and [b](#y \"title\") but not `[c](d)`.\n";
    let a = anchors(text);
    assert!(a.contains("wire-contract-version-1"), "{a:?}");
    assert!(a.contains("kairos-keys-held-keys"), "{a:?}");
    assert!(!a.contains("not-a-heading"), "{a:?}");
    assert_eq!(links(text), vec!["docs/a.md#x".to_string(), "#y".to_string()]);
}

/// Every `kairos_...` name in a text.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("kairos_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        out.insert(name);
    }
    out
}

/// Whether the sources register metric family `name`: as a literal, or
/// through the shared helpers that name a family after its service
/// (`"kairos_{service}_rebalances"`).
fn registered(sources: &str, name: &str) -> bool {
    if sources.contains(&format!("\"{name}\"")) {
        return true;
    }
    ["scheduler", "worker"].iter().any(|service| {
        name.strip_prefix(&format!("kairos_{service}_"))
            .is_some_and(|rest| sources.contains(&format!("\"kairos_{{service}}_{rest}\"")))
    })
}

/// The metric family a sample name belongs to (OpenMetrics adds `_total`
/// to counters and `_bucket`, `_sum`, `_count` to histograms).
fn family(sample: &str) -> &str {
    ["_total", "_bucket", "_sum", "_count", "_created"]
        .iter()
        .find_map(|s| sample.strip_suffix(s))
        .unwrap_or(sample)
}

/// The text of every `.rs` file under `dir`.
fn read_sources(dir: &Path, out: &mut String) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            read_sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&p).unwrap());
        }
    }
}

/// The markdown files at the top of the repository and under `docs/`.
fn pages() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [Path::new(ROOT).to_path_buf(), Path::new(ROOT).join("docs")] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A page's path from the repository's root.
fn name(page: &Path) -> String {
    page.strip_prefix(ROOT)
        .unwrap_or(page)
        .to_string_lossy()
        .into_owned()
}

/// The targets of a page's inline links `[text](target)`, outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        // Inline code spans are not links.
        let line: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                out.push(target.to_string());
            }
            rest = &after[end..];
        }
    }
    out
}

/// The anchors GitHub gives a page's headings: lower case, spaces to
/// hyphens, punctuation but `-` and `_` dropped (duplicates numbered).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in prose(text) {
        let Some(title) = line.strip_prefix('#') else {
            continue;
        };
        let title = title.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut n = 0;
        let mut candidate = slug.clone();
        while out.contains(&candidate) {
            n += 1;
            candidate = format!("{slug}-{n}");
        }
        out.insert(candidate);
    }
    out
}

/// A page's lines outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}
