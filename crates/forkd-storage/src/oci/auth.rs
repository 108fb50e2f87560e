//! Registry credentials in a docker-style auth file (`{"auths": {"host:port": {"auth":
//! base64("user:password")}}}`): `~/.docker/config.json`, or the file
//! `REGISTRY_AUTH_FILE` names (the containers tools' convention). `forkd login` writes
//! one entry; credentials never come from a command-line argument.

use super::{io, ArchiveError};
use base64::Engine;
use std::path::{Path, PathBuf};

/// The auth file to use: `explicit`, else `REGISTRY_AUTH_FILE`, else
/// `~/.docker/config.json`. None when none is named and the default does not exist.
pub fn auth_file(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_owned());
    }
    if let Some(p) = std::env::var_os("REGISTRY_AUTH_FILE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty())?;
    let p = PathBuf::from(home).join(".docker/config.json");
    p.exists().then_some(p)
}

/// The registry a key of `auths` names: `https://host:port/v1/` and `host:port` alike.
fn key_registry(key: &str) -> &str {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    k.split('/').next().unwrap_or(k)
}

/// The user and password stored for `registry`, if any.
pub fn lookup(path: &Path, registry: &str) -> Result<Option<(String, String)>, ArchiveError> {
    let bad = |m: String| ArchiveError::Refused(format!("the auth file {}: {m}", path.display()));
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(format!("reading {}", path.display()))(e)),
    };
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(auths) = v["auths"].as_object() else {
        return Ok(None);
    };
    // docker.io's credentials are stored under its v1 index URL.
    let wanted = if registry == "docker.io" {
        "index.docker.io"
    } else {
        registry
    };
    for (key, entry) in auths {
        if key_registry(key) != wanted {
            continue;
        }
        if let (Some(u), Some(p)) = (entry["username"].as_str(), entry["password"].as_str()) {
            return Ok(Some((u.to_owned(), p.to_owned())));
        }
        let Some(b64) = entry["auth"].as_str() else {
            continue;
        };
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(format!("the entry for {key} is not base64: {e}")))?;
        let raw =
            String::from_utf8(raw).map_err(|_| bad(format!("the entry for {key} is not UTF-8")))?;
        let Some((user, password)) = raw.split_once(':') else {
            return Err(bad(format!("the entry for {key} is not user:password")));
        };
        return Ok(Some((user.to_owned(), password.to_owned())));
    }
    Ok(None)
}

/// Stores `user` and `password` for `registry` in the auth file at `path`, keeping its
/// other entries; the file is replaced in one step and readable by its owner only.
pub fn store(path: &Path, registry: &str, user: &str, password: &str) -> Result<(), ArchiveError> {
    use std::os::unix::fs::DirBuilderExt;
    let mut v: serde_json::Value = match std::fs::read(path) {
        Ok(t) => serde_json::from_slice(&t).map_err(|e| {
            ArchiveError::Refused(format!("the auth file {} is not JSON: {e}", path.display()))
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::json!({}),
        Err(e) => return Err(io(format!("reading {}", path.display()))(e)),
    };
    if !v["auths"].is_object() {
        v["auths"] = serde_json::json!({});
    }
    let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    v["auths"][registry] = serde_json::json!({ "auth": b64 });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(format!("creating {}", dir.display())))?;
    }
    let text = serde_json::to_vec_pretty(&v).expect("JSON serializes");
    forkd_host::atomic_file::write(path, &text).map_err(io(format!("replacing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_credentials_are_found_by_registry_and_others_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docker/config.json");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(
            &path,
            r#"{"auths":{"https://index.docker.io/v1/":{"auth":"ZDpwdw=="}},"credsStore":"x"}"#,
        )
        .unwrap();
        store(&path, "127.0.0.1:5000", "forkd", "s3cret:with:colons").unwrap();
        assert_eq!(
            lookup(&path, "127.0.0.1:5000").unwrap(),
            Some(("forkd".into(), "s3cret:with:colons".into()))
        );
        assert_eq!(
            lookup(&path, "docker.io").unwrap(),
            Some(("d".into(), "pw".into()))
        );
        assert_eq!(lookup(&path, "127.0.0.1:5001").unwrap(), None);
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(v["credsStore"], "x", "other settings are kept");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
