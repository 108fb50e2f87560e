//! Push and pull against a real registry (Debian's `docker-registry`, the CNCF
//! distribution registry) that each test starts on a loopback port of its own, with
//! snapshots made of real parts (see `archive_tests`).

use super::archive_tests::chain_of_two;
use super::registry::{self, RegistryOptions};
use crate::snapshot::{chain, Store, Tag};
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
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut config = format!(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
        dir.path().join("data").display()
    );
    if let Some((user, password)) = basic {
        let out = Command::new("htpasswd")
            .args(["-Bbn", user, password])
            .output()
            .expect("htpasswd (apache2-utils) is installed");
        assert!(out.status.success());
        let file = dir.path().join("htpasswd");
        std::fs::write(&file, out.stdout).unwrap();
        config.push_str(&format!(
            "auth:\n  htpasswd:\n    realm: forkd-test\n    path: {}\n",
            file.display()
        ));
    }
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
    let got = registry::pull(&b, &reference, None, &opts, &quiet)
        .await
        .unwrap();
    assert_eq!(
        (got.tag.as_str(), got.installed.clone()),
        ("link", vec!["base".into(), "link".into()])
    );
    chain::verify(&b, &link).unwrap();
    // Under another tag, on the base that is here now.
    let other = Tag::parse("other").unwrap();
    let got = registry::pull(&b, &reference, Some(&other), &opts, &quiet)
        .await
        .unwrap();
    assert_eq!(
        (got.installed, got.present),
        (vec!["other".into()], vec!["base".into()])
    );
    assert_eq!(tags(&dir.path().join("b")), ["base", "link", "other"]);

    // What is not there, or not a snapshot, is refused and installs nothing.
    let c = dir.path().join("c");
    let missing = format!("{}/forkd/none:v1", reg.addr);
    assert!(
        registry::pull(&Store::at(&c), &missing, None, &opts, &quiet)
            .await
            .is_err()
    );
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
    let e = registry::pull(&Store::at(&c), &image, None, &opts, &quiet)
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
    registry::pull(&b, &reference, None, &opts, &quiet)
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
