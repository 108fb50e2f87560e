//! The crates depend on each other only as docs/architecture.md's table says: no crate
//! names one above it, and only the binary names the QEMU backend. Read from
//! `cargo metadata`, so a new dependency edge fails here until the table allows it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The table between the `layering` markers of docs/architecture.md: crate → the forkd
/// crates it may depend on.
fn allowed(doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let start = doc
        .find("<!-- layering")
        .expect("the layering table's start marker");
    let end = doc
        .find("<!-- /layering -->")
        .expect("the layering table's end marker");
    doc[start..end]
        .lines()
        .filter(|l| l.starts_with("| forkd"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let deps = cells[1]
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(str::to_owned)
                .collect();
            (cells[0].to_owned(), deps)
        })
        .collect()
}

/// Each workspace crate and the workspace crates it depends on for its library and
/// binaries (dev-dependencies left out: tests may use any backend).
fn actual(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = meta["packages"].as_array().unwrap();
    let names: BTreeSet<&str> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null() || d["kind"] == "build")
                .map(|d| d["name"].as_str().unwrap())
                .filter(|n| names.contains(n))
                .map(str::to_owned)
                .collect();
            (p["name"].as_str().unwrap().to_owned(), deps)
        })
        .collect()
}

#[test]
fn crates_depend_only_on_what_the_architecture_allows() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let allowed = allowed(&doc);
    let actual = actual(&root);
    assert_eq!(
        allowed.keys().collect::<Vec<_>>(),
        actual.keys().collect::<Vec<_>>(),
        "the table names every workspace crate, and only those"
    );
    for (krate, deps) in &actual {
        let extra: Vec<_> = deps.difference(&allowed[krate]).collect();
        assert!(
            extra.is_empty(),
            "{krate} depends on {extra:?}, which the table does not allow"
        );
    }
    // The seal itself: whatever the table says, only the binary names the backend.
    for (krate, deps) in &actual {
        if krate != "forkd" {
            assert!(
                !deps.contains("forkd-qemu"),
                "{krate} depends on the QEMU backend"
            );
        }
    }
}

/// Each error message is written once, in its `#[error]` attribute: a doc comment right
/// above it that repeats it (a format string with `{...}`) is a second copy that drifts.
#[test]
fn error_messages_are_written_once() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut copies = Vec::new();
    let mut stack = vec![root.join("crates")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let above = i.checked_sub(1).map(|j| lines[j].trim());
                if line.trim().starts_with("#[error(")
                    && above.is_some_and(|a| a.starts_with("///") && a.contains('{'))
                {
                    copies.push(format!("{}:{}", path.display(), i + 1));
                }
            }
        }
    }
    assert!(
        copies.is_empty(),
        "doc comments repeating an #[error] message: {copies:?}"
    );
}

#[test]
fn the_table_is_read_as_written() {
    let doc = "<!-- layering -->\n| crate | may depend on |\n|---|---|\n| forkd-a | |\n| forkd-b | forkd-a, forkd-c |\n<!-- /layering -->";
    let t = allowed(doc);
    assert!(t["forkd-a"].is_empty());
    assert_eq!(
        t["forkd-b"].iter().collect::<Vec<_>>(),
        ["forkd-a", "forkd-c"]
    );
}
