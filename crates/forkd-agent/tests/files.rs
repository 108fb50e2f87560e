//! File routes against the real agent.

mod common;

use common::{full, q, Agent};
use forkd_proto::files::{FileKind, FileStat};
use forkd_proto::{ErrorBody, ErrorCode};
use hyper::{Method, StatusCode};
use serde_json::json;
use std::io::Read;

#[tokio::test]
async fn write_and_read_five_mib() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut data = vec![0u8; 5 << 20];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut data))
        .expect("random data");
    let path = agent.dir.path().join("sub/dir/blob.bin");

    // Without parents=true a missing directory is a 404 that names the path.
    let (status, body) = c
        .call(
            Method::PUT,
            &format!("/v1/files?{}", q(&path)),
            full(data.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let err: ErrorBody = serde_json::from_slice(&body).expect("error body");
    assert_eq!(err.error.code, ErrorCode::NotFound);
    assert!(
        err.error.message.contains("no such file or directory"),
        "{}",
        err.error.message
    );
    assert!(
        err.error.message.contains(&*path.to_string_lossy()),
        "{}",
        err.error.message
    );

    let (status, body) = c
        .call(
            Method::PUT,
            &format!("/v1/files?{}&mode={}&parents=true", q(&path), 0o600),
            full(data.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let stat: FileStat = serde_json::from_slice(&body).expect("stat");
    assert_eq!(stat.size, data.len() as u64);
    assert_eq!(stat.mode, 0o600);
    assert_eq!(stat.kind, FileKind::File);
    assert_eq!(stat.name, "blob.bin");

    let (status, got) = c
        .call(Method::GET, &format!("/v1/files?{}", q(&path)), full(""))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(got == data, "read back differs");
    assert!(std::fs::read(&path).expect("on disk") == data);
    // No temp file is left next to it.
    let names: Vec<_> = std::fs::read_dir(path.parent().expect("parent"))
        .expect("dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");

    // Overwrite atomically with something shorter.
    let (status, _) = c
        .call(
            Method::PUT,
            &format!("/v1/files?{}", q(&path)),
            full("short"),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, got) = c
        .call(Method::GET, &format!("/v1/files?{}", q(&path)), full(""))
        .await;
    assert_eq!(&got[..], b"short");
    assert_eq!(std::fs::metadata(&path).map(|m| m.len()).ok(), Some(5));
}

#[tokio::test]
async fn list_stat_mkdir_remove_rename() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let root = agent.dir.path().join("tree");

    let (status, made): (_, FileStat) = c
        .json(
            Method::POST,
            "/v1/files/mkdir",
            Some(json!({"path": root.join("a/b")})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(made.kind, FileKind::Dir);
    // mkdir -p of an existing directory is fine.
    let (status, _): (_, FileStat) = c
        .json(
            Method::POST,
            "/v1/files/mkdir",
            Some(json!({"path": root.join("a")})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    std::fs::write(root.join("z.txt"), "zz").expect("write");
    std::fs::write(root.join("a/b/deep.txt"), "d").expect("write");
    std::os::unix::fs::symlink("/nonexistent", root.join("link")).expect("symlink");

    let (status, entries): (_, Vec<FileStat>) = c
        .json(Method::GET, &format!("/v1/files/list?{}", q(&root)), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["a", "link", "z.txt"]);
    assert_eq!(entries[1].kind, FileKind::Symlink);
    assert_eq!(entries[2].size, 2);
    assert_eq!(entries[2].path, root.join("z.txt").to_string_lossy());

    let (status, st): (_, FileStat) = c
        .json(
            Method::GET,
            &format!("/v1/files/stat?{}", q(&root.join("link"))),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(st.kind, FileKind::Symlink);

    // Errors.
    let missing = root.join("missing");
    for (method, path) in [
        (Method::GET, format!("/v1/files?{}", q(&missing))),
        (Method::GET, format!("/v1/files/stat?{}", q(&missing))),
        (Method::GET, format!("/v1/files/list?{}", q(&missing))),
    ] {
        let (status, err): (_, ErrorBody) = c.json(method, &path, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(err.error.code, ErrorCode::NotFound);
        assert!(err.error.message.contains(&*missing.to_string_lossy()));
    }
    let (status, err): (_, ErrorBody) = c
        .json(Method::GET, &format!("/v1/files?{}", q(&root)), None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(err.error.code, ErrorCode::IsADirectory);
    let (status, err): (_, ErrorBody) = c
        .json(Method::GET, "/v1/files/stat?path=relative/x", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(err.error.code, ErrorCode::InvalidArgument);
    let (status, _): (_, ErrorBody) = c.json(Method::GET, "/v1/files/stat", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // Rename.
    let (status, st): (_, FileStat) = c
        .json(
            Method::POST,
            "/v1/files/rename",
            Some(json!({"from": root.join("z.txt"), "to": root.join("a/y.txt")})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(st.name, "y.txt");
    assert_eq!(st.size, 2);
    let (status, _): (_, ErrorBody) = c
        .json(
            Method::POST,
            "/v1/files/rename",
            Some(json!({"from": root.join("z.txt"), "to": root.join("q")})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Remove.
    let remove = |path: &std::path::Path, recursive: bool| {
        full(serde_json::to_vec(&json!({"path": path, "recursive": recursive})).expect("json"))
    };
    let (status, body) = c
        .call(
            Method::POST,
            "/v1/files/remove",
            remove(&root.join("a"), false),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    let err: ErrorBody = serde_json::from_slice(&body).expect("error body");
    assert_eq!(err.error.code, ErrorCode::DirectoryNotEmpty);
    let (status, _) = c
        .call(
            Method::POST,
            "/v1/files/remove",
            remove(&root.join("link"), false),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = c
        .call(
            Method::POST,
            "/v1/files/remove",
            remove(&root.join("a"), true),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(!root.join("a").exists());
    let (status, _) = c
        .call(
            Method::POST,
            "/v1/files/remove",
            remove(&root.join("a"), true),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _): (_, Vec<FileStat>) = c
        .json(Method::GET, &format!("/v1/files/list?{}", q(&root)), None)
        .await;
    assert_eq!(status, StatusCode::OK);
}
