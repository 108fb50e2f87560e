//! Templates from container images: an OCI image the test builds itself (Debian's
//! static busybox, a lower layer with a file an upper layer whites out, Env and
//! WorkingDir in its config) goes into a registry with skopeo, `forkd image pull` makes
//! its root filesystem, and a template whose recipe says `from` boots, freezes and
//! forks; the children see the image as its layers make it, and run commands with its
//! defaults.

mod common;

use common::{b64, call, create, exec, runtime, Daemon, Registry};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::Path;

/// A tar layer of `entries`: (path, data, mode) files, or (path, target) symlinks when
/// the data starts with `->`.
fn layer(entries: &[(String, Vec<u8>, u32)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data, mode) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mode(*mode);
        if let Some(target) = data.strip_prefix(b"->") {
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, path, std::str::from_utf8(target).unwrap())
                .unwrap();
        } else if path.ends_with('/') {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            b.append_data(&mut h, path, &[][..]).unwrap();
        } else {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, path, &data[..]).unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// Writes `bytes` as a blob of the layout at `dir`; returns its descriptor.
fn blob(dir: &Path, media_type: &str, bytes: &[u8]) -> Value {
    let hex = format!("{:x}", Sha256::digest(bytes));
    std::fs::write(dir.join("blobs/sha256").join(&hex), bytes).unwrap();
    json!({ "mediaType": media_type, "digest": format!("sha256:{hex}"), "size": bytes.len() })
}

/// An OCI image layout at `dir` with the image tagged `v1`.
fn busybox_image(dir: &Path) {
    std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static is installed");
    let file = |p: &str, data: &[u8], mode: u32| (p.to_owned(), data.to_vec(), mode);
    let mut lower = vec![
        file("bin/", b"", 0o755),
        file("bin/busybox", &busybox, 0o755),
        file("etc/", b"", 0o755),
        file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644),
        file("etc/group", b"root:x:0:\n", 0o644),
        file("root/", b"", 0o700),
        file("data/", b"", 0o755),
        file("data/gone.txt", b"the upper layer removes me\n", 0o644),
    ];
    for applet in ["sh", "cat", "ls", "pwd", "env", "id", "test", "echo"] {
        lower.push(file(&format!("bin/{applet}"), b"->busybox", 0o777));
    }
    let upper = vec![
        file("data/.wh.gone.txt", b"", 0o644),
        file("data/kept.txt", b"from the upper layer\n", 0o644),
    ];
    let layers: Vec<Value> = [layer(&lower), layer(&upper)]
        .iter()
        .map(|l| blob(dir, "application/vnd.oci.image.layer.v1.tar", l))
        .collect();
    let diff_ids: Vec<&Value> = layers.iter().map(|l| &l["digest"]).collect();
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin", "FOO=from-the-image"],
            "WorkingDir": "/data",
            "Cmd": ["/bin/sh"],
        },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    });
    let config = blob(
        dir,
        "application/vnd.oci.image.config.v1+json",
        config.to_string().as_bytes(),
    );
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config,
        "layers": layers,
    });
    let mut m = blob(
        dir,
        "application/vnd.oci.image.manifest.v1+json",
        manifest.to_string().as_bytes(),
    );
    m["annotations"] = json!({ "org.opencontainers.image.ref.name": "v1" });
    let index = json!({ "schemaVersion": 2, "manifests": [m] });
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

async fn sh(c: &forkd_daemon::client::Client, id: &str, script: &str) -> String {
    let v = exec(c, id, script).await;
    assert_eq!(v["exit_code"], 0, "{script}: {v}");
    String::from_utf8(b64(&v["stdout_b64"]))
        .unwrap()
        .trim()
        .to_owned()
}

#[test]
fn a_template_from_a_container_image_forks_with_the_image_s_files_and_defaults() {
    let work = tempfile::tempdir().unwrap();
    let imports = work.path().canonicalize().unwrap();
    let d = Daemon::start(&["--import-dir", imports.to_str().unwrap()]);
    let reg = Registry::start();
    let layout = imports.join("layout");
    busybox_image(&layout);
    let reference = format!("{}/forkd-test/busybox:v1", reg.addr);
    let out = std::process::Command::new("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:v1", layout.display()))
        .arg(format!("docker://{reference}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "skopeo: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Pulled by the CLI, on the host: the root filesystem is made once, by digest.
    let out = d
        .forkd()
        .args(["image", "pull", &reference])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("sha256:"), "{stdout}");
    let out = d.forkd().args(["image", "ls"]).output().unwrap();
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        listed.contains("oci-") && listed.contains(&format!("from {reference}")),
        "{listed}"
    );
    // A snapshot is not a container image, and the other way round.
    let out = d.forkd().args(["pull", &reference]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not a forkd snapshot"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let recipe = format!("from = \"{reference}\"\nmemory_mib = 256\n");
    let c = d.unix();
    runtime().block_on(async {
        let (s, op) = call(
            &c,
            Method::POST,
            "/v1/snapshots",
            Some(json!({ "template": "bb", "recipe": recipe })),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        let path = format!("/v1/operations/{}", op["id"].as_str().unwrap());
        let done = loop {
            let (_, v) = call(&c, Method::GET, &path, None).await;
            if v["status"] != "running" {
                break v;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        };
        assert_eq!(done["status"], "succeeded", "{done}\n{}", d.log());
        let id = create(&c, "bb", 1).await.remove(0);
        assert_eq!(sh(&c, &id, "cat kept.txt").await, "from the upper layer");
        assert_eq!(
            sh(&c, &id, "test -e /data/gone.txt || echo absent").await,
            "absent"
        );
        assert_eq!(sh(&c, &id, "pwd").await, "/data");
        assert_eq!(sh(&c, &id, "echo $FOO").await, "from-the-image");
        // The request still wins over the image.
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "shell": "pwd; echo $FOO", "cwd": "/", "env": {"FOO": "mine"} })),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            String::from_utf8(b64(&v["stdout_b64"])).unwrap(),
            "/\nmine\n"
        );
        let (s, _) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    });
    // The same image as `docker save` would write it.
    let saved = work.path().join("bb.tar");
    let out = std::process::Command::new("skopeo")
        .args(["copy", "--quiet"])
        .arg(format!("oci:{}:v1", layout.display()))
        .arg(format!(
            "docker-archive:{}:forkd-test/busybox:v1",
            saved.display()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "skopeo: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let source = format!("docker-archive:{}", saved.display());
    let out = d.forkd().args(["image", "pull", &source]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let recipe = format!("from = \"{source}:forkd-test/busybox:v1\"\nmemory_mib = 256\n");
    let dir = recipe_dir(&recipe, &[]);
    let (ok, out, err) = template_build(&d, &dir, "bb-saved");
    assert!(ok, "{out}{err}");
    runtime().block_on(async {
        let id = create(&c, "bb-saved", 1).await.remove(0);
        assert_eq!(sh(&c, &id, "cat kept.txt").await, "from the upper layer");
        assert_eq!(
            sh(&c, &id, "test -e /data/gone.txt || echo absent").await,
            "absent"
        );
        let (s, _) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    });

    // A layout under the daemon's --import-dir, named by a recipe sent through the API:
    // opened there (no link followed), read as an upload is.
    runtime().block_on(async {
        let recipe = format!(
            "from = \"oci-layout:{}:v1\"\nmemory_mib = 256\n",
            layout.display()
        );
        let (s, op) = common::build_recipe(&c, "bb-imported", &recipe).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        common::wait_operation(&c, op["id"].as_str().unwrap()).await;
        let id = create(&c, "bb-imported", 1).await.remove(0);
        assert_eq!(sh(&c, &id, "cat kept.txt").await, "from the upper layer");
        let (s, _) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    });

    // Packages come from Debian's archive: a busybox image has none to take.
    let (ok, _, err) = template_build(
        &d,
        &recipe_dir(
            &format!("from = \"{reference}\"\npackages = [\"jq\"]\n"),
            &[],
        ),
        "bb-jq",
    );
    assert!(!ok && err.contains("is not Debian"), "{err}");
    recipes_customise_their_base_and_rebuild_only_on_change(&d);
}

/// A recipe directory holding `recipe.toml` with `text` and the `files` given.
fn recipe_dir(text: &str, files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("recipe.toml"), text).unwrap();
    for (name, contents) in files {
        std::fs::write(dir.path().join(name), contents).unwrap();
    }
    dir
}

/// `forkd template build DIR/recipe.toml --tag TAG`: whether it succeeded, and its
/// stdout and stderr.
fn template_build(d: &Daemon, dir: &tempfile::TempDir, tag: &str) -> (bool, String, String) {
    let out = d
        .forkd()
        .args(["template", "build", "--tag", tag])
        .arg(dir.path().join("recipe.toml"))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The recipe's own root filesystems in the image cache.
fn custom_images(d: &Daemon) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d.home.path().join("images/rootfs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".ext4").map(str::to_owned))
        .filter(|n| n.starts_with("custom-"))
        .collect();
    v.sort();
    v
}

/// `packages`, `files` and `[[build]]` on the minimal Debian image: the child has them;
/// the same inputs reuse the root filesystem, a changed file makes a new one.
fn recipes_customise_their_base_and_rebuild_only_on_change(d: &Daemon) {
    // A file unique to this run, so that a root filesystem of an earlier run (the image
    // cache outlives the test) is never what is found.
    let nonce = format!(
        "{:x}",
        Sha256::digest(d.home.path().to_string_lossy().as_bytes())
    );
    let text = "image = \"minimal\"\nmemory_mib = 256\npackages = [\"jq\"]\nfiles = [{ src = \"conf/hello.txt\", dest = \"/opt/app/hello.txt\", mode = \"0640\" }]\n[[build]]\nrun = \"jq -n '1 + 1' > /opt/app/built && cat /opt/app/hello.txt >> /opt/app/built\"\n";
    let dir = recipe_dir(text, &[]);
    std::fs::create_dir(dir.path().join("conf")).unwrap();
    std::fs::write(
        dir.path().join("conf/hello.txt"),
        format!("hello {nonce}\n"),
    )
    .unwrap();
    let before = custom_images(d);

    let (ok, out, err) = template_build(d, &dir, "custom");
    assert!(ok, "{out}{err}\n{}", d.log());
    // The CLI shows the build's steps as the daemon reports them.
    assert!(
        err.contains("packages: dpkg -i (") && err.contains("build step 1: jq"),
        "{err}"
    );
    let made = custom_images(d);
    let new: Vec<_> = made
        .iter()
        .filter(|n| !before.contains(n))
        .cloned()
        .collect();
    assert_eq!(new.len(), 1, "{before:?} -> {made:?}");
    let c = d.unix();
    let check = |tag: &str, hello: &str| {
        runtime().block_on(async {
            let id = create(&c, tag, 1).await.remove(0);
            assert_eq!(sh(&c, &id, "jq -n '[1,2] | length'").await, "2");
            assert_eq!(sh(&c, &id, "cat /opt/app/hello.txt").await, hello);
            assert_eq!(sh(&c, &id, "stat -c %a /opt/app/hello.txt").await, "640");
            assert_eq!(
                sh(&c, &id, "cat /opt/app/built").await,
                format!("2\n{hello}")
            );
            assert_eq!(
                sh(&c, &id, "test -e /var/cache/forkd-packages || echo gone").await,
                "gone"
            );
            let (s, _) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
            assert_eq!(s, StatusCode::NO_CONTENT);
        })
    };
    check("custom", &format!("hello {nonce}"));

    // Nothing changed (another tag, another warm-up): the same root filesystem.
    let image = d.home.path().join(format!("images/rootfs/{}.ext4", new[0]));
    let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let first = inode(&image);
    std::fs::write(
        dir.path().join("recipe.toml"),
        format!("{text}[[warmup]]\nrun = \"true\"\n"),
    )
    .unwrap();
    let (ok, out, err) = template_build(d, &dir, "custom-again");
    assert!(ok, "{out}{err}");
    assert!(err.contains("reusing root filesystem custom-"), "{err}");
    assert_eq!(custom_images(d), made, "nothing was made again");
    assert_eq!(inode(&image), first);

    // A file changed: a new root filesystem, with it.
    std::fs::write(
        dir.path().join("conf/hello.txt"),
        format!("changed {nonce}\n"),
    )
    .unwrap();
    let (ok, out, err) = template_build(d, &dir, "custom-changed");
    assert!(ok, "{out}{err}");
    let after = custom_images(d);
    assert_eq!(after.len(), made.len() + 1, "{after:?}");
    check("custom-changed", &format!("changed {nonce}"));

    // A file outside the recipe's directory is refused before anything is built.
    let (ok, _, err) = template_build(
        d,
        &recipe_dir(
            "image = \"minimal\"\nfiles = [{ src = \"../x\", dest = \"/x\" }]\n",
            &[],
        ),
        "escape",
    );
    assert!(
        !ok && err.contains("inside the recipe's directory"),
        "{err}"
    );

    for tag in ["custom", "custom-again", "custom-changed"] {
        let out = d.forkd().args(["rmi", tag]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for name in after.iter().filter(|n| !before.contains(n)) {
        let out = d.forkd().args(["image", "rm", name]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(custom_images(d), before);
}
