//! Push and pull against a real registry (Debian's `docker-registry`, the CNCF
//! distribution registry) that each test starts on a loopback port of its own, with
//! snapshots made of real parts (see `archive_tests`).

use super::archive_tests::chain_of_two;
use super::pack;
use super::registry::{self, RegistryOptions};
use crate::snapshot::{chain, Store, Tag};
use base64::Engine;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A registry process, stopped when dropped.
struct TestRegistry {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts a registry; with `basic`, it asks for that user and password (htpasswd).
fn start_registry(basic: Option<(&str, &str)>) -> TestRegistry {
    start_registry_with(|dir| match basic {
        None => String::new(),
        Some((user, password)) => {
            let out = Command::new("htpasswd")
                .args(["-Bbn", user, password])
                .output()
                .expect("htpasswd (apache2-utils) is installed");
            assert!(out.status.success());
            let file = dir.join("htpasswd");
            std::fs::write(&file, out.stdout).unwrap();
            format!(
                "auth:\n  htpasswd:\n    realm: forkd-test\n    path: {}\n",
                file.display()
            )
        }
    })
}

/// Starts a registry whose configuration ends with what `auth` writes (given the
/// registry's directory).
fn start_registry_with(auth: impl FnOnce(&Path) -> String) -> TestRegistry {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut config = format!(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
        dir.path().join("data").display()
    );
    config.push_str(&auth(dir.path()));
    let cfg = dir.path().join("config.yml");
    std::fs::write(&cfg, config).unwrap();
    let child = Command::new("docker-registry")
        .arg("serve")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("docker-registry is installed");
    let started = std::time::Instant::now();
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            started.elapsed().as_secs() < 30,
            "the registry did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    TestRegistry {
        child,
        addr,
        _dir: dir,
    }
}

fn quiet(_: u64, _: u64, _: &str) {}

fn skopeo_inspect(reference: &str, creds: Option<&str>) -> serde_json::Value {
    let mut cmd = Command::new("skopeo");
    cmd.args(["inspect", "--raw", "--tls-verify=false"]);
    if let Some(c) = creds {
        cmd.args(["--creds", c]);
    }
    let out = cmd
        .arg(format!("docker://{reference}"))
        .output()
        .expect("skopeo");
    assert!(
        out.status.success(),
        "skopeo: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn tags(dir: &Path) -> Vec<String> {
    Store::at(dir).list().into_iter().map(|(t, _)| t).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_is_pushed_once_and_pulled_into_another_store() {
    let reg = start_registry(None);
    let dir = tempfile::tempdir().unwrap();
    let a = Store::at(dir.path().join("a"));
    chain_of_two(&a);
    let link = Tag::parse("link").unwrap();
    let opts = RegistryOptions::default();
    let reference = format!("{}/forkd/test:v1", reg.addr);
    let first = registry::push(&a, &link, &reference, &opts, &quiet)
        .await
        .unwrap();
    assert_eq!(first.snapshots, ["base", "link"]);
    assert!(first.uploaded > 0);
    // The guest assets both snapshots carry went up once.
    assert_eq!(first.skipped, 0, "{first:?}");
    let again = registry::push(&a, &link, &reference, &opts, &quiet)
        .await
        .unwrap();
    assert_eq!(
        (again.uploaded, again.skipped),
        (0, first.uploaded),
        "{again:?}"
    );
    assert_eq!(again.digest, first.digest);

    let raw = skopeo_inspect(&reference, None);
    assert_eq!(raw["artifactType"], super::ARTIFACT_TYPE);
    assert_eq!(raw["config"]["mediaType"], super::CONFIG_MEDIA_TYPE);
    assert!(raw["annotations"][super::PARENT_ANNOTATION].is_string());

    let b = Store::at(dir.path().join("b"));
    let downloads = std::sync::Mutex::new(Vec::new());
    let counted = |_: u64, total: u64, what: &str| {
        if what == "installing" {
            downloads.lock().unwrap().push(total);
        }
    };
    let got = registry::pull(
        &b,
        forkd_qemu::hypervisor(),
        &reference,
        None,
        &opts,
        &counted,
    )
    .await
    .unwrap();
    assert_eq!(
        (got.tag.as_str(), got.installed.clone()),
        ("link", vec!["base".into(), "link".into()])
    );
    chain::verify(&b, &link).unwrap();
    // Under another tag, on the base that is here now: only the link's own parts
    // (its state, memory diff and disk layer) are downloaded.
    let other = Tag::parse("other").unwrap();
    let got = registry::pull(
        &b,
        forkd_qemu::hypervisor(),
        &reference,
        Some(&other),
        &opts,
        &counted,
    )
    .await
    .unwrap();
    assert_eq!(
        (got.installed, got.present),
        (vec!["other".into()], vec!["base".into()])
    );
    let own: u64 = {
        let layout = pack::pack(&a, &link, &|_| {}).unwrap().layout;
        let chain = layout.index_chain().unwrap();
        chain[1]
            .parts
            .iter()
            .filter(|(name, _)| ["state.bin", "memory.diff", "disk.qcow2"].contains(&name.as_str()))
            .map(|(_, b)| b.size)
            .sum()
    };
    let downloads = downloads.into_inner().unwrap();
    assert_eq!(downloads.len(), 2);
    assert!(downloads[0] > own, "{downloads:?}");
    assert_eq!(downloads[1], own, "{downloads:?}");
    assert_eq!(tags(&dir.path().join("b")), ["base", "link", "other"]);

    // What is not there, or not a snapshot, is refused and installs nothing.
    let c = dir.path().join("c");
    let missing = format!("{}/forkd/none:v1", reg.addr);
    assert!(registry::pull(
        &Store::at(&c),
        forkd_qemu::hypervisor(),
        &missing,
        None,
        &opts,
        &quiet
    )
    .await
    .is_err());
    let image = format!("{}/library/plain:latest", reg.addr);
    let client = oci_client::Client::new(oci_client::client::ClientConfig {
        protocol: oci_client::client::ClientProtocol::Http,
        ..Default::default()
    });
    let layer = oci_client::client::ImageLayer::oci_v1(b"not a real tar".to_vec(), None);
    let config = oci_client::client::Config::oci_v1(
        br#"{"architecture":"amd64","os":"linux"}"#.to_vec(),
        None,
    );
    client
        .push(
            &image.parse().unwrap(),
            &[layer],
            config,
            &oci_client::secrets::RegistryAuth::Anonymous,
            None,
        )
        .await
        .unwrap();
    let e = registry::pull(
        &Store::at(&c),
        forkd_qemu::hypervisor(),
        &image,
        None,
        &opts,
        &quiet,
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("is not a forkd snapshot"), "{e}");
    assert!(tags(&c).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_with_basic_auth_takes_the_auth_file_s_credentials() {
    let reg = start_registry(Some(("forkd", "pass-word")));
    let dir = tempfile::tempdir().unwrap();
    let a = Store::at(dir.path().join("a"));
    chain_of_two(&a);
    let base = Tag::parse("base").unwrap();
    let reference = format!("{}/forkd/base:v1", reg.addr);
    let auth_file = dir.path().join("auth.json");
    let opts = RegistryOptions {
        insecure: Vec::new(),
        auth_file: Some(auth_file.clone()),
    };
    let e = registry::push(&a, &base, &reference, &opts, &quiet)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("401") || e.to_lowercase().contains("unauthorized"),
        "{e}"
    );
    super::auth::store(&auth_file, &reg.addr, "forkd", "wrong").unwrap();
    assert!(registry::push(&a, &base, &reference, &opts, &quiet)
        .await
        .is_err());
    super::auth::store(&auth_file, &reg.addr, "forkd", "pass-word").unwrap();
    registry::push(&a, &base, &reference, &opts, &quiet)
        .await
        .unwrap();
    let raw = skopeo_inspect(&reference, Some("forkd:pass-word"));
    assert_eq!(raw["artifactType"], super::ARTIFACT_TYPE);
    let b = Store::at(dir.path().join("b"));
    registry::pull(
        &b,
        forkd_qemu::hypervisor(),
        &reference,
        None,
        &opts,
        &quiet,
    )
    .await
    .unwrap();
    chain::verify(&b, &base).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_cut_short_resumes_without_sending_finished_blobs_again() {
    let reg = start_registry(None);
    let dir = tempfile::tempdir().unwrap();
    let a = Store::at(dir.path().join("a"));
    chain_of_two(&a);
    let link = Tag::parse("link").unwrap();
    let opts = RegistryOptions::default();
    // How many blobs a whole push sends.
    let whole = format!("{}/forkd/whole:v1", reg.addr);
    let all = registry::push(&a, &link, &whole, &opts, &quiet)
        .await
        .unwrap()
        .uploaded;

    let reference = format!("{}/forkd/cut:v1", reg.addr);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let tx = std::sync::Mutex::new(Some(tx));
    let (a2, link2, reference2, opts2) = (a.clone(), link.clone(), reference.clone(), opts.clone());
    let push = tokio::spawn(async move {
        // Cut after the first blob is in the registry: the push stops at its next step.
        let cut = move |_: u64, _: u64, step: &str| {
            if step.contains("is in the registry") {
                if let Some(tx) = tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
            }
        };
        registry::push(&a2, &link2, &reference2, &opts2, &cut).await
    });
    rx.await.unwrap();
    push.abort();
    assert!(push.await.unwrap_err().is_cancelled());
    let resumed = registry::push(&a, &link, &reference, &opts, &quiet)
        .await
        .unwrap();
    assert_eq!(
        (resumed.skipped, resumed.uploaded),
        (1, all - 1),
        "{resumed:?}"
    );
}

/// A token service as a registry's `auth.token` expects one: it answers
/// `GET /token?service=&scope=` for the one user it knows (HTTP basic) with a JWT,
/// signed ES256 by the key of a self-signed certificate the registry trusts (sent in
/// the token's `x5c` header), granting every scope asked for.
struct TokenService {
    addr: String,
    cert_pem: String,
}

impl TokenService {
    fn start(user: &'static str, password: &'static str) -> TokenService {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["forkd-test-tokens".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let signer = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &key.serialize_der(),
            &ring::rand::SystemRandom::new(),
        )
        .unwrap();
        let x5c = base64::engine::general_purpose::STANDARD.encode(cert.der());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = answer_token_request(conn, user, password, &signer, &x5c);
            }
        });
        TokenService {
            addr,
            cert_pem: cert.pem(),
        }
    }
}

fn answer_token_request(
    mut conn: std::net::TcpStream,
    user: &str,
    password: &str,
    signer: &ring::signature::EcdsaKeyPair,
    x5c: &str,
) -> std::io::Result<()> {
    use std::io::{BufRead, Write};
    let mut reader = std::io::BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut authorization = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("authorization") {
                authorization = Some(v.trim().to_owned());
            }
        }
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let url = b64url();
    let expected = format!("Basic {}", b64.encode(format!("{user}:{password}")));
    if authorization.as_deref() != Some(expected.as_str()) {
        let body = r#"{"details":"wrong credentials"}"#;
        return write!(
            conn,
            "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }
    // `GET /token?service=S&scope=repository:NAME:ACTIONS[&scope=...]`
    let target = request_line.split_whitespace().nth(1).unwrap_or_default();
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let mut access = Vec::new();
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        if k == "scope" {
            let v = v
                .replace("%3A", ":")
                .replace("%2F", "/")
                .replace("%2C", ",");
            let mut parts = v.splitn(3, ':');
            let (kind, name, actions) = (parts.next(), parts.next(), parts.next());
            if let (Some(kind), Some(name), Some(actions)) = (kind, name, actions) {
                access.push(serde_json::json!({
                    "type": kind, "name": name,
                    "actions": actions.split(',').collect::<Vec<_>>(),
                }));
            }
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = serde_json::json!({"typ": "JWT", "alg": "ES256", "x5c": [x5c]});
    let claims = serde_json::json!({
        "iss": "forkd-test-issuer", "sub": user, "aud": "forkd-test-registry",
        "exp": now + 300, "nbf": now - 10, "iat": now,
        "jti": format!("{now}-{}", access.len()), "access": access,
    });
    let signing_input = format!(
        "{}.{}",
        url.encode(header.to_string()),
        url.encode(claims.to_string())
    );
    let sig = signer
        .sign(&ring::rand::SystemRandom::new(), signing_input.as_bytes())
        .unwrap();
    let token = format!("{signing_input}.{}", url.encode(sig.as_ref()));
    let body =
        serde_json::json!({"token": token, "access_token": token, "expires_in": 300}).to_string();
    write!(
        conn,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

fn b64url() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_behind_a_token_service_is_reached_with_a_bearer_token() {
    let tokens = TokenService::start("forkd", "token-pass");
    let reg = start_registry_with(|dir| {
        let bundle = dir.join("token-ca.pem");
        std::fs::write(&bundle, &tokens.cert_pem).unwrap();
        format!(
            "auth:\n  token:\n    realm: http://{}/token\n    service: forkd-test-registry\n    issuer: forkd-test-issuer\n    rootcertbundle: {}\n",
            tokens.addr,
            bundle.display()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let a = Store::at(dir.path().join("a"));
    chain_of_two(&a);
    let link = Tag::parse("link").unwrap();
    let reference = format!("{}/forkd/tokens:v1", reg.addr);
    let auth_file = dir.path().join("auth.json");
    let opts = RegistryOptions {
        insecure: Vec::new(),
        auth_file: Some(auth_file.clone()),
    };
    super::auth::store(&auth_file, &reg.addr, "forkd", "not-the-password").unwrap();
    let e = registry::push(&a, &link, &reference, &opts, &quiet)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("authenticating") || e.contains("401"), "{e}");
    super::auth::store(&auth_file, &reg.addr, "forkd", "token-pass").unwrap();
    let pushed = registry::push(&a, &link, &reference, &opts, &quiet)
        .await
        .unwrap();
    assert!(pushed.uploaded > 0);
    let b = Store::at(dir.path().join("b"));
    registry::pull(
        &b,
        forkd_qemu::hypervisor(),
        &reference,
        None,
        &opts,
        &quiet,
    )
    .await
    .unwrap();
    chain::verify(&b, &link).unwrap();
}
