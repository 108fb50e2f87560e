//! Hardening, as an attacker would probe it: requests that try to make the daemon read
//! host files; a writer of the audit log covering its tracks. No guest is booted here.

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
        ];
        let mut messages = Vec::new();
        for from in &refused {
            let (s, v) = build_recipe(&c, "probe", &format!("from = \"{from}\"\n")).await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{from}: {v}");
            let m = v["error"]["message"].as_str().unwrap().to_owned();
            assert!(!leaks(&m) && m.contains("--import-dir"), "{m}");
            messages.push(m);
        }
        // Under the directory, a symbolic link out of it is not followed.
        let from = format!("docker-archive:{}", show(&imports.join("link.tar")));
        let (s, v) = build_recipe(&c, "probe", &format!("from = \"{from}\"\n")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("symbolic link") && !leaks(m), "{m}");
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
        // A declared size over the limit is refused before a byte is read.
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
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
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

/// `forkd audit verify` on the data directory `home`: whether it passed, and what it
/// said.
fn audit_verify(home: &Path) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["audit", "verify"])
        .env("FORKD_HOME", home)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_cut_or_emptied_audit_log_is_found_and_refuses_the_start_until_reset() {
    let mut d = Daemon::start(&[]);
    let home = d.home.path().to_owned();
    runtime().block_on(async {
        for _ in 0..3 {
            let (s, _) = call(&d.unix(), Method::DELETE, "/v1/sandboxes/sb-none", None).await;
            assert_eq!(s, StatusCode::NOT_FOUND);
        }
    });
    d.stop();
    let log = home.join("audit.jsonl");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.lines().count() >= 3, "{text}");
    let (ok, said) = audit_verify(&home);
    assert!(
        ok && said.contains("marked with its key") && said.contains("ends where"),
        "{said}"
    );
    use std::os::unix::fs::PermissionsExt;
    let key_mode = std::fs::metadata(home.join("audit.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(key_mode & 0o777, 0o600);

    for (what, cut) in [
        ("the last record removed", {
            let mut lines: Vec<&str> = text.lines().collect();
            lines.pop();
            lines.iter().map(|l| format!("{l}\n")).collect::<String>()
        }),
        ("emptied", String::new()),
    ] {
        std::fs::write(&log, &cut).unwrap();
        let (ok, said) = audit_verify(&home);
        assert!(!ok && said.contains("were removed"), "{what}: {said}");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_forkd"))
            .arg("daemon")
            .env("FORKD_HOME", &home)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--audit-reset"),
            "{what}: {err}"
        );
    }
    // Told to, it moves the log aside and starts a new chain that says what it found.
    d.start_again(&["--audit-reset"]);
    let first = std::fs::read_to_string(&log).unwrap();
    let first: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    assert_eq!(first["method"], "AUDIT-RESET", "{first}");
    assert!(
        first["ids"][0].as_str().unwrap().contains("were removed"),
        "{first}"
    );
    d.stop();
    assert!(audit_verify(&home).0);
}

/// One request without a valid token from `from`, over a connection of its own; the
/// status line's code.
async fn refused_request(from: std::net::Ipv4Addr, port: u16) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((from, 0).into()).unwrap();
    let mut conn = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    conn.write_all(
        b"POST /v1/sandboxes HTTP/1.1\r\nHost: forkd\r\nAuthorization: Bearer not-the-token-not-the-token-xx\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[test]
fn ten_thousand_refused_requests_from_five_hundred_addresses_add_little_to_the_audit_log() {
    let secrets = tempfile::tempdir().unwrap();
    let token = secrets.path().join("token");
    common::write_secret(&token, "flood-test-token-flood-test-token-flood");
    let listen = common::free_port();
    let port: u16 = listen.rsplit(':').next().unwrap().parse().unwrap();
    let mut d = Daemon::start(&["--listen", &listen, "--token-file", token.to_str().unwrap()]);
    let log = d.home.path().join("audit.jsonl");
    let before = std::fs::metadata(&log).unwrap().len();
    let started = std::time::Instant::now();
    let codes = runtime().block_on(async {
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for worker in 0..25u32 {
            let sent = sent.clone();
            tasks.push(tokio::spawn(async move {
                let mut codes = Vec::new();
                for i in 0..400u32 {
                    // 500 addresses of 127/8, in two /24s.
                    let n = (worker * 400 + i) % 500;
                    let from =
                        std::net::Ipv4Addr::new(127, 0, 1 + (n / 250) as u8, 1 + (n % 250) as u8);
                    codes.push(refused_request(from, port).await);
                    sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                codes
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all
    });
    let took = started.elapsed();
    assert_eq!(codes.len(), 10_000);
    assert!(
        codes.iter().all(|c| *c == 401 || *c == 429),
        "{:?}",
        &codes[..20]
    );
    // The aggregates of the last window are written when the daemon stops.
    d.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    let grew = text.len() as u64 - before;
    let windows = took.as_secs() / 60 + 2;
    assert!(
        grew <= windows * (64 << 10),
        "{grew} bytes in {took:?} ({windows} windows)"
    );
    let records: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        !records.iter().any(|r| r["path"] == "/v1/sandboxes"),
        "a refused request was recorded one by one"
    );
    let counted: u64 = records
        .iter()
        .filter(|r| r["method"] == "AUTH-FAILED")
        .map(|r| {
            let ids = r["ids"][0].as_str().unwrap();
            ids.split(' ').next().unwrap().parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(counted, 10_000, "every refusal is counted");
    let networks: Vec<&str> = records
        .iter()
        .filter(|r| r["method"] == "AUTH-FAILED")
        .map(|r| r["principal"].as_str().unwrap())
        .collect();
    assert!(
        networks.contains(&"tcp:127.0.1.0/24") && networks.contains(&"tcp:127.0.2.0/24"),
        "{networks:?}"
    );
    eprintln!("10,000 refused requests in {took:?} grew the audit log by {grew} bytes");
}
