//! File routes: streamed read and atomic write, list, stat, mkdir, remove, rename.

use crate::error::ApiError;
use crate::server::{parse_json, parse_query};
use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, Request};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_proto::files::{
    FileKind, FileStat, MkdirRequest, PathQuery, RemoveRequest, RenameRequest, WriteQuery,
};
use forkd_proto::ErrorCode;
use http_body_util::BodyExt;
use std::fs::Metadata;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncWriteExt;

/// Reads and writes go through buffers of this size.
const CHUNK: usize = 64 * 1024;

/// Mode of a written file when the request names none.
const DEFAULT_MODE: u32 = 0o644;

/// Makes temp file names unique within this agent (the pid separates agents).
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Refuses relative paths: the agent's cwd is meaningless to the host.
fn absolute(path: &str) -> Result<&Path, ApiError> {
    if path.starts_with('/') {
        Ok(Path::new(path))
    } else {
        Err(ApiError::invalid(format!(
            "path must be absolute, got {path:?}"
        )))
    }
}

/// The wire form of `meta` (from `lstat`) for `path`.
pub fn file_stat(path: &Path, meta: &Metadata) -> FileStat {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileStat {
        path: path.to_string_lossy().into_owned(),
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime_ms: meta.mtime() * 1000 + meta.mtime_nsec() / 1_000_000,
    }
}

async fn lstat(path: &Path) -> Result<FileStat, ApiError> {
    let meta = tokio::fs::symlink_metadata(path)
        .await
        .map_err(|e| ApiError::io(&e, &path.to_string_lossy()))?;
    Ok(file_stat(path, &meta))
}

/// `PUT /v1/files?path=&mode=&parents=`: the body is written to a temp file next to the
/// target, synced, then renamed over it, so readers see the old file or the whole new one.
pub async fn write(RawQuery(query): RawQuery, req: Request) -> Result<Json<FileStat>, ApiError> {
    let q: WriteQuery = parse_query(query.as_deref())?;
    let target = absolute(&q.path)?;
    let (Some(dir), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(ApiError::new(
            ErrorCode::IsADirectory,
            format!("is a directory: {}", q.path),
        ));
    };
    let owner = owner_ids(q.owner.as_deref())?;
    if let Some(ids) = owner {
        // The agent writes as root: what the user could not write is refused here.
        may_write(target, ids, &q.path)?;
    }
    if q.parents {
        create_dirs(dir, owner).await?;
    }
    let tmp = dir.join(format!(
        ".{}.forkd-{}-{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let mode = q.mode.unwrap_or(DEFAULT_MODE) & 0o7777;
    let mut result = write_temp(&tmp, mode, req.into_body(), &q.path).await;
    if let (Ok(()), Some((uid, gid))) = (&result, owner) {
        result = std::os::unix::fs::chown(&tmp, Some(uid), Some(gid))
            .map_err(|e| ApiError::io(&e, &q.path));
    }
    let result = match result {
        Ok(()) => tokio::fs::rename(&tmp, target)
            .await
            .map_err(|e| ApiError::io(&e, &q.path)),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        let _ = tokio::fs::remove_file(&tmp).await;
        return Err(e);
    }
    Ok(Json(lstat(target).await?))
}

async fn write_temp(tmp: &Path, mode: u32, mut body: Body, target: &str) -> Result<(), ApiError> {
    let io_err = |e: std::io::Error| ApiError::io(&e, target);
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(tmp)
        .await
        .map_err(io_err)?;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::new(
                ErrorCode::Io,
                format!("receiving the contents of {target} failed: {e}"),
            )
        })?;
        if let Ok(data) = frame.into_data() {
            file.write_all(&data).await.map_err(io_err)?;
        }
    }
    file.flush().await.map_err(io_err)?;
    // The umask may have masked bits off at open.
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .await
        .map_err(io_err)?;
    file.sync_all().await.map_err(io_err)?;
    Ok(())
}

/// `GET /v1/files?path=`: streams the file's bytes.
pub async fn read(RawQuery(query): RawQuery) -> Result<Response, ApiError> {
    let q: PathQuery = parse_query(query.as_deref())?;
    let path = absolute(&q.path)?;
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| ApiError::io(&e, &q.path))?;
    let meta = file
        .metadata()
        .await
        .map_err(|e| ApiError::io(&e, &q.path))?;
    if meta.is_dir() {
        return Err(ApiError::new(
            ErrorCode::IsADirectory,
            format!("is a directory: {}", q.path),
        ));
    }
    // No content-length: files in /proc and /sys report sizes that are not their
    // contents', and a wrong length would break the stream.
    let stream = tokio_util::io::ReaderStream::with_capacity(file, CHUNK);
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// `GET /v1/files/list?path=`: the directory's entries, sorted by name, not following
/// symlinks.
pub async fn list(RawQuery(query): RawQuery) -> Result<Json<Vec<FileStat>>, ApiError> {
    let q: PathQuery = parse_query(query.as_deref())?;
    let dir = absolute(&q.path)?;
    let mut rd = tokio::fs::read_dir(dir)
        .await
        .map_err(|e| ApiError::io(&e, &q.path))?;
    let mut out = Vec::new();
    loop {
        let entry = match rd.next_entry().await {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(e) => return Err(ApiError::io(&e, &q.path)),
        };
        let path = dir.join(entry.file_name());
        // An entry removed while listing is simply not listed.
        match tokio::fs::symlink_metadata(&path).await {
            Ok(meta) => out.push(file_stat(&path, &meta)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ApiError::io(&e, &path.to_string_lossy())),
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Json(out))
}

/// `GET /v1/files/stat?path=` (lstat).
pub async fn stat(RawQuery(query): RawQuery) -> Result<Json<FileStat>, ApiError> {
    let q: PathQuery = parse_query(query.as_deref())?;
    Ok(Json(lstat(absolute(&q.path)?).await?))
}

/// The uid and gid of the guest's user `owner`.
fn owner_ids(owner: Option<&str>) -> Result<Option<(u32, u32)>, ApiError> {
    owner
        .map(|name| crate::exec::account(name).map(|a| (a.uid, a.gid)))
        .transpose()
}

/// Whether the user `(uid, gid)` may write `target`: an existing file must be writable
/// by it, a new one's nearest existing directory too (by the owner, group or other
/// bits that apply to it; root may write anything).
fn may_write(target: &Path, (uid, gid): (u32, u32), shown: &str) -> Result<(), ApiError> {
    use std::os::unix::fs::MetadataExt;
    if uid == 0 {
        return Ok(());
    }
    let writable = |m: &Metadata| {
        let bits = if m.uid() == uid {
            0o200
        } else if m.gid() == gid {
            0o020
        } else {
            0o002
        };
        m.mode() & bits != 0
    };
    let mut at = Some(target);
    while let Some(p) = at {
        if let Ok(m) = std::fs::metadata(p) {
            return if writable(&m) {
                Ok(())
            } else {
                Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    format!("permission denied: the user cannot write {shown}"),
                ))
            };
        }
        at = p.parent();
    }
    Ok(())
}

/// `mkdir -p`, giving what it creates to `owner`.
async fn create_dirs(path: &Path, owner: Option<(u32, u32)>) -> Result<(), ApiError> {
    let io = |e: std::io::Error, p: &Path| ApiError::io(&e, &p.to_string_lossy());
    let Some((uid, gid)) = owner else {
        return tokio::fs::create_dir_all(path)
            .await
            .map_err(|e| io(e, path));
    };
    // The missing ancestors, outermost first.
    let mut missing = Vec::new();
    let mut p = Some(path);
    while let Some(dir) = p {
        if tokio::fs::symlink_metadata(dir).await.is_ok() {
            break;
        }
        missing.push(dir);
        p = dir.parent();
    }
    for dir in missing.into_iter().rev() {
        match tokio::fs::create_dir(dir).await {
            Ok(()) => {
                std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(|e| io(e, dir))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(e, dir)),
        }
    }
    // What exists must be a directory, as create_dir_all would insist.
    match tokio::fs::metadata(path).await {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(ApiError::new(
            ErrorCode::AlreadyExists,
            format!("{} exists and is not a directory", path.display()),
        )),
        Err(e) => Err(io(e, path)),
    }
}

/// `POST /v1/files/mkdir`: `mkdir -p`.
pub async fn mkdir(body: Bytes) -> Result<Json<FileStat>, ApiError> {
    let req: MkdirRequest = parse_json(&body)?;
    let path = absolute(&req.path)?;
    let owner = owner_ids(req.owner.as_deref())?;
    if let Some(ids) = owner {
        may_write(path, ids, &req.path)?;
    }
    create_dirs(path, owner).await?;
    Ok(Json(lstat(path).await?))
}

/// `POST /v1/files/remove`.
pub async fn remove(body: Bytes) -> Result<StatusCode, ApiError> {
    let req: RemoveRequest = parse_json(&body)?;
    let path = absolute(&req.path)?;
    if path.parent().is_none() {
        return Err(ApiError::invalid("refusing to remove /"));
    }
    let meta = tokio::fs::symlink_metadata(path)
        .await
        .map_err(|e| ApiError::io(&e, &req.path))?;
    let result = if !meta.is_dir() {
        tokio::fs::remove_file(path).await
    } else if req.recursive {
        tokio::fs::remove_dir_all(path).await
    } else {
        tokio::fs::remove_dir(path).await
    };
    result.map_err(|e| ApiError::io(&e, &req.path))?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/files/rename`.
pub async fn rename(body: Bytes) -> Result<Json<FileStat>, ApiError> {
    let req: RenameRequest = parse_json(&body)?;
    let from = absolute(&req.from)?;
    let to = absolute(&req.to)?;
    tokio::fs::rename(from, to).await.map_err(|e| {
        let err = ApiError::io(&e, &req.from);
        ApiError::new(err.code, format!("{} -> {}", err.message, req.to))
    })?;
    Ok(Json(lstat(to).await?))
}

#[cfg(test)]
mod write_permission_tests {
    use super::may_write;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    /// A user who owns nothing here: only the "other" bits apply to it.
    const STRANGER: (u32, u32) = (12345, 12345);

    #[test]
    fn a_user_writes_only_what_its_bits_allow() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        fs::write(&file, b"x").unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(may_write(&file, STRANGER, "f").is_err());
        assert!(may_write(&file, (0, 0), "f").is_ok());
        fs::set_permissions(&file, fs::Permissions::from_mode(0o646)).unwrap();
        assert!(may_write(&file, STRANGER, "f").is_ok());
        // A new file, two directories down: the nearest existing directory decides.
        let new = dir.path().join("a/b/new");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        assert!(may_write(&new, STRANGER, "new").is_err());
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
        assert!(may_write(&new, STRANGER, "new").is_ok());
    }
}
