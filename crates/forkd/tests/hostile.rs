//! Hardening, as an attacker would probe it: requests that try to make the daemon read
//! host files. No guest is booted here.

mod common;

use common::{build_recipe, call, finish_operation, runtime, Daemon};
use hyper::{Method, StatusCode};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use std::path::Path;

/// What a secret file of the host holds (as /etc/shadow does).
const SECRET: &str = "root:*:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n";

/// Whether `text` quotes any of the secret.
fn leaks(text: &str) -> bool {
    text.contains("root:") || text.contains("20228") || text.contains("daemon:*")
}

/// A tar of an OCI layout holding one image (an empty layer), tagged `v1`; returns it
/// and the hex digest of its manifest.
fn layout_tar() -> (Vec<u8>, String) {
    use sha2::{Digest, Sha256};
    let mut tar = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        tar.append_data(&mut h, name, data).unwrap();
    };
    let hex = |b: &[u8]| format!("{:x}", Sha256::digest(b));
    let layer = tar::Builder::new(Vec::new()).into_inner().unwrap();
    let config =
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{}", hex(config)), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{}", hex(&layer)), "size": layer.len()}],
    })
    .to_string();
    let m_hex = hex(manifest.as_bytes());
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": format!("sha256:{m_hex}"), "size": manifest.len(),
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]})
    .to_string();
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    add("index.json", index.as_bytes());
    add(&format!("blobs/sha256/{}", hex(config)), config);
    add(&format!("blobs/sha256/{}", hex(&layer)), &layer);
    add(&format!("blobs/sha256/{m_hex}"), manifest.as_bytes());
    (tar.into_inner().unwrap(), m_hex)
}

/// Posts `body` to `POST /v1/images{query}`.
async fn upload(d: &Daemon, query: &str, body: Vec<u8>) -> (StatusCode, serde_json::Value) {
    let resp = d
        .unix()
        .send_stream(
            Method::POST,
            &format!("/v1/images{query}"),
            "application/x-tar",
            Some(body.len() as u64),
            http_body_util::Full::new(hyper::body::Bytes::from(body)),
        )
        .await
        .unwrap();
    let status = resp.status();
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[test]
fn a_recipe_sent_through_the_api_opens_no_host_file() {
    let host = tempfile::tempdir().unwrap();
    let secret = host.path().join("shadow");
    std::fs::write(&secret, SECRET).unwrap();
    let secret_dir = host.path().join("private");
    std::fs::create_dir(&secret_dir).unwrap();
    let imports = host.path().join("imports");
    std::fs::create_dir(&imports).unwrap();
    // Not an archive, under the directory the daemon may read: opened, never quoted.
    std::fs::write(imports.join("bad.tar"), SECRET.repeat(20)).unwrap();
    std::os::unix::fs::symlink(&secret, imports.join("link.tar")).unwrap();

    let watch = Inotify::init(InitFlags::IN_NONBLOCK).unwrap();
    for p in [&secret, &secret_dir] {
        watch
            .add_watch(p.as_path(), AddWatchFlags::IN_OPEN)
            .unwrap();
    }
    let d = Daemon::start(&["--import-dir", imports.to_str().unwrap()]);
    let c = d.unix();
    let imports = imports.canonicalize().unwrap();
    runtime().block_on(async {
        let show = |p: &Path| p.display().to_string();
        let refused = [
            format!("docker-archive:{}", show(&secret)),
            format!("docker-archive:{}:team/app:1", show(&secret)),
            format!("oci-layout:{}", show(&secret_dir)),
            format!("oci-layout:{}:v1", show(&secret_dir)),
            format!("oci-layout:{}/missing", show(&secret_dir)),
            "docker-archive:../../../../etc/shadow".to_owned(),
            format!("docker-archive:{}/../shadow", show(&imports)),
            format!("docker-archive:{}", show(&imports.join("link.tar"))),
        ];
        let mut messages = Vec::new();
        for from in &refused {
            let (s, v) = build_recipe(&c, "probe", &format!("from = \"{from}\"\n")).await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{from}: {v}");
            let m = v["error"]["message"].as_str().unwrap().to_owned();
            assert!(!leaks(&m) && m.contains("--import-dir"), "{m}");
            messages.push(m);
        }
        // Whether a path exists is not told: a missing one is refused in the same words.
        let shape = |m: &str, from: &str| m.replacen(from, "P", 1);
        assert_eq!(
            shape(&messages[2], &show(&secret_dir)),
            shape(&messages[4], &format!("{}/missing", show(&secret_dir)))
        );

        // Under --import-dir the daemon reads it, and says only why it cannot use it.
        let from = format!("docker-archive:{}", show(&imports.join("bad.tar")));
        let (s, op) = build_recipe(&c, "probe", &format!("from = \"{from}\"\n")).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        let op = finish_operation(&c, op["id"].as_str().unwrap()).await;
        assert_eq!(op["status"], "failed", "{op}");
        let e = op["error"].as_str().unwrap();
        assert!(e.contains("cannot be read") && !leaks(e), "{e}");

        // An uploaded image: garbage is refused without being quoted, a layout's tar is
        // kept and named by its manifest's digest.
        let (s, v) = upload(&d, "", SECRET.repeat(20).into_bytes()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
        assert!(!leaks(&v.to_string()), "{v}");
        let (tar, hex) = layout_tar();
        let (s, v) = upload(&d, "?name=v2", tar.clone()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no image tagged v2"));
        let (s, v) = upload(&d, "?name=v1", tar).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        assert_eq!(v["from"], format!("upload:sha256:{hex}"));
        assert_eq!(v["layers"], 1);
        assert!(d
            .home
            .path()
            .join("images/oci/uploads")
            .join(&hex)
            .join("index.json")
            .is_file());
        // An upload that is not here fails its build with a clear reason.
        let missing = "0".repeat(64);
        let recipe = format!("from = \"upload:sha256:{missing}\"\n");
        let (s, op) = build_recipe(&c, "probe", &recipe).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        let op = finish_operation(&c, op["id"].as_str().unwrap()).await;
        let e = op["error"].as_str().unwrap();
        assert!(e.contains("was uploaded to this daemon"), "{e}");
        // A declared size that cannot fit is refused before a byte is read.
        let resp = d
            .unix()
            .send_stream(
                Method::POST,
                "/v1/images",
                "application/x-tar",
                Some(1 << 60),
                http_body_util::Empty::<hyper::body::Bytes>::new(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::INSUFFICIENT_STORAGE);
        let (s, _) = call(&c, Method::GET, "/v1/health", None).await;
        assert_eq!(s, StatusCode::OK);
    });
    let opened = watch.read_events();
    assert!(
        matches!(opened, Err(nix::errno::Errno::EAGAIN)),
        "a refused path was opened: {opened:?}\n{}",
        d.log()
    );
}
