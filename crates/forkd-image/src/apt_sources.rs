//! Which Debian suite and mirror a rootfs is bootstrapped from: options, then the
//! environment, then the host's own configuration (/etc/os-release, apt sources),
//! so forkd never needs a mirror address written into it.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{ImageError, Result};

/// One `deb` source: a URI and its suites.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AptSource {
    pub(crate) uri: String,
    pub(crate) suites: Vec<String>,
}

/// Suite names that mark a source as a Debian archive when no suite matches
/// exactly (e.g. building a trixie rootfs on a bookworm host).
const DEBIAN_SUITES: &[&str] = &[
    "buster",
    "bullseye",
    "bookworm",
    "trixie",
    "forky",
    "duke",
    "sid",
    "oldstable",
    "stable",
    "testing",
    "unstable",
];

/// The suite to bootstrap: the option, `$FORKD_DEBIAN_SUITE`, the host's
/// VERSION_CODENAME, or bookworm.
pub fn debian_suite(option: Option<&str>) -> String {
    if let Some(s) = option.filter(|s| !s.is_empty()) {
        return s.to_string();
    }
    if let Ok(s) = std::env::var("FORKD_DEBIAN_SUITE") {
        if !s.is_empty() {
            return s;
        }
    }
    fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| os_release_codename(&t))
        .unwrap_or_else(|| "bookworm".to_string())
}

/// The mirror to bootstrap from: the option, `$FORKD_DEBIAN_MIRROR`, or the host's
/// apt sources.
pub fn debian_mirror(option: Option<&str>, suite: &str) -> Result<String> {
    if let Some(m) = option.filter(|m| !m.is_empty()) {
        return Ok(normalise_uri(m));
    }
    if let Ok(m) = std::env::var("FORKD_DEBIAN_MIRROR") {
        if !m.is_empty() {
            return Ok(normalise_uri(&m));
        }
    }
    pick_mirror(&host_sources(Path::new("/etc/apt")), suite).ok_or_else(|| ImageError::NoMirror {
        suite: suite.to_string(),
    })
}

fn normalise_uri(uri: &str) -> String {
    // "http://x/debian/" and "http://x/debian" are the same mirror; one inputs digest.
    uri.trim().trim_end_matches('/').to_string()
}

fn os_release_codename(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim().trim_matches('"').trim_matches('\'').to_string())
        .find(|v| !v.is_empty())
}

/// All `deb` sources configured under an apt directory (normally /etc/apt), in
/// the order apt reads them: sources.list, then sources.list.d/ sorted by name.
pub(crate) fn host_sources(apt_dir: &Path) -> Vec<AptSource> {
    let mut sources = Vec::new();
    if let Ok(t) = fs::read_to_string(apt_dir.join("sources.list")) {
        sources.extend(parse_one_line(&t));
    }
    let mut files: Vec<PathBuf> = fs::read_dir(apt_dir.join("sources.list.d"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let Ok(text) = fs::read_to_string(&f) else {
            continue;
        };
        match f.extension().and_then(|e| e.to_str()) {
            Some("list") => sources.extend(parse_one_line(&text)),
            Some("sources") => sources.extend(parse_deb822(&text)),
            // apt ignores other names (.disabled, .save, .dpkg-old...), so do we.
            _ => {}
        }
    }
    sources
}

/// Parses one-line sources: `deb [options] URI suite [components...]`.
pub(crate) fn parse_one_line(text: &str) -> Vec<AptSource> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line.strip_prefix("deb") else {
            continue;
        };
        // "deb-src" and other words starting with "deb" are not binary sources.
        if !rest.starts_with(char::is_whitespace) {
            continue;
        }
        let mut rest = rest.trim_start();
        if rest.starts_with('[') {
            match rest.find(']') {
                Some(end) => rest = rest[end + 1..].trim_start(),
                None => continue,
            }
        }
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            out.push(AptSource {
                uri: normalise_uri(uri),
                suites: vec![suite.to_string()],
            });
        }
    }
    out
}

/// Parses deb822 sources: stanzas separated by blank lines, with `Types:`,
/// `URIs:`, `Suites:` and optionally `Enabled: no`.
pub(crate) fn parse_deb822(text: &str) -> Vec<AptSource> {
    let mut out = Vec::new();
    for stanza in stanzas(text) {
        let get = |key: &str| -> Vec<String> {
            stanza
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case(key))
                .flat_map(|(_, v)| v.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .collect()
        };
        if !get("Types").iter().any(|t| t == "deb") {
            continue;
        }
        if get("Enabled")
            .first()
            .is_some_and(|v| v.eq_ignore_ascii_case("no"))
        {
            continue;
        }
        let suites = get("Suites");
        for uri in get("URIs") {
            out.push(AptSource {
                uri: normalise_uri(&uri),
                suites: suites.clone(),
            });
        }
    }
    out
}

/// Splits deb822 text into stanzas of (field, value), folding continuation lines.
fn stanzas(text: &str) -> Vec<Vec<(String, String)>> {
    let mut all = Vec::new();
    let mut cur: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        if line.trim().is_empty() {
            if !cur.is_empty() {
                all.push(std::mem::take(&mut cur));
            }
            continue;
        }
        if line.starts_with(char::is_whitespace) {
            if let Some((_, v)) = cur.last_mut() {
                v.push(' ');
                v.push_str(line.trim());
            }
            continue;
        }
        if let Some((k, v)) = line.split_once(':') {
            cur.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    if !cur.is_empty() {
        all.push(cur);
    }
    all
}

/// True for suites that only carry updates on top of a base suite: debootstrap
/// needs the base suite's full archive.
fn is_overlay_suite(suite: &str) -> bool {
    ["-security", "-updates", "-backports", "-proposed-updates"]
        .iter()
        .any(|s| suite.ends_with(s))
        || suite.contains("/updates")
}

fn usable_uri(uri: &str) -> bool {
    // debootstrap speaks http(s) and file; "mirror+", "tor+", "cdrom:" it does not.
    let scheme_ok = ["http://", "https://", "file:/"]
        .iter()
        .any(|p| uri.starts_with(p));
    scheme_ok && !uri.contains("debian-security")
}

/// The first source that carries `suite` itself; failing that, the first one that
/// carries some Debian base suite (its archive serves the other suites too).
pub(crate) fn pick_mirror(sources: &[AptSource], suite: &str) -> Option<String> {
    let usable = || sources.iter().filter(|s| usable_uri(&s.uri));
    usable()
        .find(|s| s.suites.iter().any(|x| x == suite))
        .or_else(|| {
            usable().find(|s| {
                s.suites
                    .iter()
                    .any(|x| !is_overlay_suite(x) && DEBIAN_SUITES.contains(&x.as_str()))
            })
        })
        .map(|s| s.uri.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEB822: &str = "\
Types: deb
# a comment line
URIs: http://security.example.org/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example.org/debian
Suites: bookworm

Types: deb
URIs: http://off.example.org/debian
Suites: bookworm
Enabled: no

Types: deb deb-src
URIs: http://mirror.example.org/debian/
  http://second.example.org/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
";

    const ONE_LINE: &str = "\
# deb http://commented.example.org/debian bookworm main
deb-src http://src.example.org/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://thirdparty.example.org/apt cloud-sdk-bookworm main
deb http://updates.example.org/debian bookworm-updates main
deb [ trusted=yes ] https://mirror.example.net/debian bookworm main # trailing comment
";

    #[test]
    fn deb822_stanzas() {
        let s = parse_deb822(DEB822);
        assert_eq!(
            s,
            vec![
                AptSource {
                    uri: "http://security.example.org/debian-security".into(),
                    suites: vec!["bookworm-security".into()],
                },
                AptSource {
                    uri: "http://mirror.example.org/debian".into(),
                    suites: vec!["bookworm".into(), "bookworm-updates".into()],
                },
                AptSource {
                    uri: "http://second.example.org/debian".into(),
                    suites: vec!["bookworm".into(), "bookworm-updates".into()],
                },
            ]
        );
        assert_eq!(
            pick_mirror(&s, "bookworm").as_deref(),
            Some("http://mirror.example.org/debian")
        );
    }

    #[test]
    fn one_line_sources() {
        let s = parse_one_line(ONE_LINE);
        let uris: Vec<&str> = s.iter().map(|s| s.uri.as_str()).collect();
        assert_eq!(
            uris,
            [
                "http://thirdparty.example.org/apt",
                "http://updates.example.org/debian",
                "https://mirror.example.net/debian"
            ]
        );
        // Third-party and updates-only entries are skipped; exact suite wins.
        assert_eq!(
            pick_mirror(&s, "bookworm").as_deref(),
            Some("https://mirror.example.net/debian")
        );
        // Another suite: fall back to the Debian base archive.
        assert_eq!(
            pick_mirror(&s, "trixie").as_deref(),
            Some("https://mirror.example.net/debian")
        );
    }

    #[test]
    fn nothing_usable() {
        let s = parse_one_line(
            "deb http://security.example.org/debian-security bookworm-security main\n\
             deb http://ppa.example.org/ubuntu jammy main\n\
             deb mirror+file:/etc/apt/mirrors.txt bookworm main\n",
        );
        assert_eq!(pick_mirror(&s, "bookworm"), None);
    }

    #[test]
    fn reads_an_apt_directory() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("sources.list.d")).unwrap();
        fs::write(d.join("sources.list.d/z.sources"), DEB822).unwrap();
        fs::write(
            d.join("sources.list.d/a.list"),
            "deb http://a.example.org/debian bookworm main\n",
        )
        .unwrap();
        fs::write(
            d.join("sources.list.d/b.list.disabled"),
            "deb http://b.example.org/debian bookworm main\n",
        )
        .unwrap();
        let s = host_sources(d);
        assert_eq!(s.len(), 4);
        assert_eq!(
            pick_mirror(&s, "bookworm").as_deref(),
            Some("http://a.example.org/debian")
        );
    }

    #[test]
    fn codename() {
        assert_eq!(
            os_release_codename("NAME=\"Debian\"\nVERSION_CODENAME=bookworm\n").as_deref(),
            Some("bookworm")
        );
        assert_eq!(os_release_codename("VERSION_CODENAME=\n"), None);
        assert_eq!(debian_suite(Some("trixie")), "trixie");
        assert_eq!(
            debian_mirror(Some("http://m.example.org/debian/"), "x").unwrap(),
            "http://m.example.org/debian"
        );
    }
}
