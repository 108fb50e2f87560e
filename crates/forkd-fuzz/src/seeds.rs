//! The seed corpus, as code: what `corpus/<target>/` was written from (by the test
//! `the_committed_seeds_are_what_the_generator_makes` with `FORKD_WRITE_SEEDS=1`, and
//! checked against it in every run). Each seed is a small, valid input of its decoder,
//! so that the mutations start from inputs that reach deep into it rather than from
//! noise.

use forkd_proto::exec::{Command, ExecEvent, ExecRequest, ExitStatus};
use forkd_proto::frame::{encode, encode_json, Tag};
use sha2::{Digest, Sha256};
use std::io::Write;

/// One seed: its target, its file name and its bytes.
pub type Seed = (&'static str, &'static str, Vec<u8>);

fn with(first: u8, rest: &[u8]) -> Vec<u8> {
    let mut v = vec![first];
    v.extend_from_slice(rest);
    v
}

fn frames(parts: &[(Tag, &[u8])]) -> Vec<u8> {
    let mut wire = Vec::new();
    for (tag, payload) in parts {
        wire.extend_from_slice(&encode(*tag, payload).expect("a seed frame fits"));
    }
    wire
}

fn exec_body() -> Vec<u8> {
    let mut req = ExecRequest::new(Command::Argv(vec!["cat".into()]));
    req.stdin = true;
    req.env.insert("LANG".into(), "C.UTF-8".into());
    req.cwd = Some("/root".into());
    let mut wire = encode_json(&req).expect("a seed request fits").to_vec();
    wire.extend_from_slice(&frames(&[(Tag::Stdin, b"hello\n"), (Tag::Stdin, b"")]));
    wire
}

fn exec_response() -> Vec<u8> {
    let started = serde_json::to_vec(&ExecEvent::Started { pid: 42 }).expect("json");
    let exited = serde_json::to_vec(&ExecEvent::Exited(ExitStatus {
        code: Some(0),
        signal: None,
        timed_out: false,
        duration_ms: 3,
    }))
    .expect("json");
    frames(&[
        (Tag::Json, &started),
        (Tag::Stdout, b"hello\n"),
        (Tag::Stderr, b"warning\n"),
        (Tag::Json, &exited),
    ])
}

/// A tar of `(name, data)` regular files.
fn tar_files(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        b.append_data(&mut h, name, *data).expect("a seed tar");
    }
    b.into_inner().expect("a seed tar")
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A layer: directories, files, a symbolic link, a hard link, a whiteout and an opaque
/// directory.
fn layer_tar() -> Vec<u8> {
    use tar::EntryType as E;
    let mut b = tar::Builder::new(Vec::new());
    let entries: [(&str, E, &str); 9] = [
        ("etc/", E::Directory, ""),
        ("etc/os-release", E::Regular, "ID=fuzz\n"),
        ("etc/gone", E::Regular, "x"),
        ("bin/", E::Directory, ""),
        ("bin/tool", E::Regular, "#!/bin/sh\n"),
        ("bin/alias", E::Symlink, "tool"),
        ("bin/same", E::Link, "bin/tool"),
        ("etc/.wh.gone", E::Regular, ""),
        ("bin/.wh..wh..opq", E::Regular, ""),
    ];
    for (name, kind, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(if kind == E::Directory { 0o755 } else { 0o644 });
        h.set_mtime(1_700_000_000);
        let body: &[u8] = if kind.is_symlink() || kind.is_hard_link() {
            h.set_link_name(data).expect("a seed link");
            b""
        } else {
            data.as_bytes()
        };
        h.set_size(body.len() as u64);
        b.append_data(&mut h, name, body).expect("a seed tar");
    }
    b.into_inner().expect("a seed tar")
}

/// `docker save` of one image `app:1` with one layer.
fn docker_save() -> Vec<u8> {
    let config = br#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"]},"rootfs":{"type":"layers","diff_ids":[]}}"#;
    let layer = layer_tar();
    let manifest = serde_json::json!([{
        "Config": "config.json",
        "RepoTags": ["app:1"],
        "Layers": ["abc/layer.tar", "link.tar"],
    }])
    .to_string();
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in [
        ("config.json", &config[..]),
        ("abc/layer.tar", &layer[..]),
        ("manifest.json", manifest.as_bytes()),
    ] {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        b.append_data(&mut h, name, data).expect("a seed tar");
    }
    // Older Docker links a repeated layer.
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    h.set_mode(0o777);
    b.append_link(&mut h, "link.tar", "abc/layer.tar")
        .expect("a seed tar");
    b.into_inner().expect("a seed tar")
}

/// A layout's tar (`oci-archive:`) of one image tagged `app:1`.
fn image_layout_tar() -> Vec<u8> {
    let config =
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    let layer = zstd::encode_all(&layer_tar()[..], 1).expect("zstd");
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{}", hex(config)), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
                    "digest": format!("sha256:{}", hex(&layer)), "size": layer.len()}],
    })
    .to_string();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": format!("sha256:{}", hex(manifest.as_bytes())),
                       "size": manifest.len(),
                       "annotations": {"org.opencontainers.image.ref.name": "app:1"}}],
    })
    .to_string();
    let blobs: Vec<(String, Vec<u8>)> = [&config[..], &layer[..], manifest.as_bytes()]
        .iter()
        .map(|b| (format!("blobs/sha256/{}", hex(b)), b.to_vec()))
        .collect();
    let mut files: Vec<(&str, &[u8])> = vec![
        ("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#),
        ("index.json", index.as_bytes()),
    ];
    files.extend(blobs.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    tar_files(&files)
}

/// A snapshot archive (`forkd pack`) of one snapshot whose six parts are a few bytes.
fn snapshot_archive() -> Vec<u8> {
    use forkd_storage::snapshot::manifest::{parts, BuildTimes, Machine, Manifest, Part, Versions};
    let contents: Vec<(&str, Vec<u8>)> = parts::ALL
        .iter()
        .map(|p| (*p, format!("the {p} part").into_bytes()))
        .collect();
    let manifest = Manifest {
        format: forkd_storage::snapshot::manifest::FORMAT,
        tag: "seed".into(),
        template: "minimal".into(),
        created_at: "2026-01-01T00:00:00Z".into(),
        parent: None,
        parent_digest: None,
        branch: None,
        machine: Machine {
            vcpus: 1,
            memory_mib: 128,
            accel: forkd_hypervisor::Accel::Tcg,
            cpu: "Westmere-v1".into(),
            cmdline: "console=ttyS0".into(),
            clock: Default::default(),
            pit: true,
            nic: false,
        },
        versions: Versions {
            kernel: "k".into(),
            rootfs: "r".into(),
            initramfs_sha256: "i".into(),
            forkd: "0".into(),
            agent_protocol: forkd_proto::PROTOCOL_VERSION,
            hypervisor: "qemu".into(),
            hypervisor_version: "q".into(),
        },
        parts: contents
            .iter()
            .map(|(p, c)| {
                let part = Part {
                    size: c.len() as u64,
                    sha256: hex(c),
                };
                ((*p).to_owned(), part)
            })
            .collect(),
        contexts: Vec::new(),
        build: BuildTimes::default(),
        pool: 0,
        egress: None,
        lifecycle: Default::default(),
    };
    let config = serde_json::to_vec(&manifest).expect("a manifest serializes");
    let mut blobs = vec![config.clone()];
    let mut layers = Vec::new();
    for (p, c) in &contents {
        let blob = zstd::encode_all(&c[..], 1).expect("zstd");
        layers.push(serde_json::json!({
            "mediaType": forkd_storage::oci::PART_MEDIA_TYPE,
            "digest": format!("sha256:{}", hex(&blob)), "size": blob.len(),
            "annotations": {forkd_storage::oci::TITLE: p, forkd_storage::oci::STORED_ANNOTATION: c.len().to_string()},
        }));
        blobs.push(blob);
    }
    let oci = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": forkd_storage::oci::MANIFEST_MEDIA_TYPE,
        "artifactType": forkd_storage::oci::ARTIFACT_TYPE,
        "config": {"mediaType": forkd_storage::oci::CONFIG_MEDIA_TYPE,
                   "digest": format!("sha256:{}", hex(&config)), "size": config.len()},
        "layers": layers,
        "annotations": {forkd_storage::oci::TAG_ANNOTATION: "seed"},
    })
    .to_string()
    .into_bytes();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": forkd_storage::oci::MANIFEST_MEDIA_TYPE,
                       "digest": format!("sha256:{}", hex(&oci)), "size": oci.len()}],
    })
    .to_string();
    blobs.push(oci);
    let names: Vec<(String, Vec<u8>)> = blobs
        .into_iter()
        .map(|b| (format!("blobs/sha256/{}", hex(&b)), b))
        .collect();
    let mut files: Vec<(&str, &[u8])> = vec![
        ("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#),
        ("index.json", index.as_bytes()),
    ];
    files.extend(names.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    tar_files(&files)
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(data).expect("gzip into memory");
    gz.finish().expect("gzip into memory")
}

fn dns(build: impl FnOnce(&mut hickory_proto::op::Message)) -> Vec<u8> {
    let mut m = hickory_proto::op::Message::query();
    m.metadata.id = 0x1234;
    m.metadata.recursion_desired = true;
    build(&mut m);
    m.to_vec().expect("a seed message")
}

fn question(name: &str) -> hickory_proto::op::Query {
    hickory_proto::op::Query::query(
        name.parse().expect("a seed name"),
        hickory_proto::rr::RecordType::A,
    )
}

/// Bytes that look random, the same every time (the structured target reads any).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..len).map(|_| rng.u8(..)).collect()
}

/// Every seed.
pub fn all() -> Vec<Seed> {
    let exec_req =
        serde_json::to_vec(&ExecRequest::new(Command::Shell("echo hi".into()))).expect("json");
    let ndjson = b"{\"type\":\"stdout\",\"text\":\"hi\\n\"}\n{\"type\":\"result\",\"text\":\"3\",\"html\":\"<b>3</b>\"}\n{\"type\":\"error\",\"name\":\"E\",\"value\":\"v\",\"traceback\":\"t\"}\n{\"type\":\"done\",\"execution_count\":1}\n";
    let nonce = "0123456789abcdef0123456789abcdef";
    let mut greeting = b"\x00stale bytes FORKD-HEL".to_vec();
    greeting.extend_from_slice(&forkd_proto::handshake::hello(nonce));
    greeting.extend_from_slice(b"PRI * HTTP/2.0\r\n");
    let layer = layer_tar();
    let envelope = forkd_daemon::e2b::connect::envelope(&serde_json::json!({
        "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}, "cwd": "/home/user"},
        "stdin": false
    }));
    let recipe = br#"description = "a recipe with everything"
from = "docker.io/library/python:3.12-slim"
vcpus = 2
memory_mib = 1024
packages = ["curl", "libpq5"]
files = [{ src = "conf/app.toml", dest = "/etc/app.toml", mode = "0600" }]
cpu = "Westmere-v1"
pool = 2
network = "nat"

[[build]]
run = "pip install requests"
timeout_s = 300

[[warmup]]
run = "true"

[[contexts]]
language = "python"
preload = "import json"

[egress]
egress = "deny"
allow = ["pypi.org:443", "203.0.113.0/24"]
"#;
    let mut reply = hickory_proto::op::Message::response(0x1234, hickory_proto::op::OpCode::Query);
    reply.add_query(question("allowed.test."));
    for (i, ip) in [[203, 0, 113, 7], [10, 0, 0, 1], [8, 8, 8, 8]]
        .iter()
        .enumerate()
    {
        reply.add_answer(hickory_proto::rr::Record::from_rdata(
            "allowed.test.".parse().expect("a seed name"),
            30 + 1000 * u32::try_from(i).expect("a few seeds"),
            hickory_proto::rr::RData::A(hickory_proto::rr::rdata::A((*ip).into())),
        ));
    }
    let mut blob_data = vec![0u8; 12288];
    blob_data[5000..5010].copy_from_slice(b"not zeroes");
    let blob = zstd::encode_all(&blob_data[..], 3).expect("zstd");
    let mut zstd_seed = 12288u16.to_be_bytes().to_vec();
    zstd_seed.push(3); // two pages of data stated
    zstd_seed.extend_from_slice(&blob);
    let mut zstd_unstated = 12288u16.to_be_bytes().to_vec();
    zstd_unstated.push(0);
    zstd_unstated.extend_from_slice(&blob);

    vec![
        ("frame", "exec-request", with(0, &exec_body())),
        ("frame", "exec-response-bytewise", with(0, &exec_response())),
        ("frame", "cut-every-7", with(6, &exec_response())),
        ("frame", "truncated", with(255, &exec_body()[..20])),
        ("frame", "too-large", with(0, &[1, 0, 0x10, 0, 1, 0])),
        ("agent_request", "exec-body", with(0, &exec_body())),
        ("agent_request", "exec-request", with(1, &exec_req)),
        ("agent_request", "signal", with(2, br#"{"signal":15}"#)),
        ("agent_request", "create-context", with(3, br#"{"language":"python","cwd":"/root","env":{"A":"1"}}"#)),
        ("agent_request", "run-code", with(4, br#"{"code":"1+1","timeout_ms":1000}"#)),
        ("agent_request", "resume", with(5, br#"{"wall_clock_ns":1700000000000000000,"entropy_hex":"00ff","hostname":"sbx-1","env":{"K":"V"},"settle":true}"#)),
        ("agent_request", "mkdir", with(6, br#"{"path":"/home/user/d","owner":"user"}"#)),
        ("agent_request", "remove", with(7, br#"{"path":"/tmp/x","recursive":true}"#)),
        ("agent_request", "rename", with(8, br#"{"from":"/a","to":"/b"}"#)),
        ("agent_request", "shutdown", with(9, br#"{"poweroff":true}"#)),
        ("agent_request", "path-query", with(10, b"path=%2Fetc%2Fhostname")),
        ("agent_request", "write-query", with(11, b"path=/x&mode=420&parents=true&owner=user")),
        ("agent_request", "stdin-query", with(12, b"close=true")),
        ("agent_request", "wait-query", with(13, b"timeout_ms=100")),
        ("agent_response", "exec-stream", with(0, &exec_response())),
        ("agent_response", "run-events", with(1, ndjson)),
        ("agent_response", "ping", with(2, br#"{"agent_version":"0.1.0","protocol":4,"uptime_ms":5,"hostname":"h"}"#)),
        ("agent_response", "error", with(3, br#"{"error":{"code":"not_found","message":"no such file: /x"}}"#)),
        ("agent_response", "process", with(4, br#"{"id":1,"pid":7,"argv":["sleep","1"],"started_at_ms":1,"exit":{"code":null,"signal":9,"timed_out":true,"duration_ms":1000},"stdin_open":false,"stdout_b64":"aGk=","stderr_b64":""}"#)),
        ("agent_response", "file-list", with(5, br#"[{"name":"a","path":"/a","kind":"file","size":1,"mode":420,"modified_ms":0}]"#)),
        ("handshake", "greeting-after-garbage", greeting),
        ("handshake", "ready", forkd_proto::handshake::ready(nonce)),
        (
            "handshake",
            "greeting-with-resume",
            forkd_proto::handshake::hello_with(
                nonce,
                br#"{"wall_clock_ns":1,"entropy_hex":"00","hostname":"sb-1"}"#,
            ),
        ),
        (
            "handshake",
            "ready-with-outcome",
            forkd_proto::handshake::ready_with(
                nonce,
                br#"{"resumed":{"clock_step_ms":0,"contexts_reseeded":0}}"#,
            ),
        ),
        ("api_body", "create-sandboxes", with(0, br#"{"snapshot":"python","n":3,"labels":{"team":"a"},"env":{"K":"V"},"timeout_s":600,"partial":true,"wait":false,"limits":{"memory_mib":1024,"cpu_cores":0.5,"cpu_weight":100,"pids":256},"network":{"egress":"deny","allow":["203.0.113.0/24","198.51.100.7:443","pypi.org"]}}"#)),
        ("api_body", "network", with(1, br#"{"egress":"allow","deny":["203.0.113.0/24:22","*.bad.test"]}"#)),
        ("api_body", "timeout", with(2, br#"{"timeout_s":null}"#)),
        ("api_body", "exec", with(3, br#"{"cmd":["ls","-l"],"env":{"A":"1"},"cwd":"/root","timeout_s":1.5,"stdin_b64":"aGk=","stream":true}"#)),
        ("api_body", "run-code", with(4, br#"{"code":"1+1","context":"default","timeout_s":10}"#)),
        ("api_body", "rename", with(7, br#"{"from":"/a","to":"/b"}"#)),
        ("api_body", "build", with(10, &serde_json::to_vec(&serde_json::json!({"template":"app","recipe":std::str::from_utf8(recipe).unwrap_or_default(),"files":{"conf/app.toml":"a2V5ID0gMQo="}})).expect("json"))),
        ("api_body", "process", with(11, br#"{"shell":"sleep 10","stdin":true}"#)),
        ("api_body", "stdin", with(12, br#"{"data":"hello","close":true}"#)),
        ("api_body", "signal", with(13, br#"{"signal":15}"#)),
        ("e2b_connect", "process-start", envelope.to_vec()),
        ("e2b_connect", "unary", br#"{"path":"/home/user","depth":1}"#.to_vec()),
        ("docker_archive", "docker-save", with(0, &docker_save())),
        ("docker_archive", "docker-save-tagged", with(2, &docker_save())),
        ("docker_archive", "oci-archive", with(1, &image_layout_tar())),
        ("oci_layout", "snapshot", snapshot_archive()),
        ("oci_layer", "tar", with(0, &layer)),
        ("oci_layer", "gzip", with(1, &gzip(&layer))),
        ("oci_layer", "zstd", with(2, &zstd::encode_all(&layer[..], 3).expect("zstd"))),
        ("oci_layer_tree", "noise-1", noise(1, 512)),
        ("oci_layer_tree", "noise-2", noise(2, 2048)),
        ("zstd_blob", "sparse-part", zstd_seed),
        ("zstd_blob", "unstated", zstd_unstated),
        ("recipe", "minimal", forkd_core::template::BUILTIN[0].1.as_bytes().to_vec()),
        ("recipe", "python", forkd_core::template::BUILTIN[1].1.as_bytes().to_vec()),
        ("recipe", "everything", recipe.to_vec()),
        ("dns_query", "allowed", dns(|m| { m.add_query(question("allowed.test.")); })),
        ("dns_query", "wildcard", dns(|m| { m.add_query(question("a.wild.test.")); })),
        ("dns_query", "refused", dns(|m| { m.add_query(question("other.test.")); })),
        ("dns_query", "two-questions", dns(|m| { m.add_query(question("allowed.test.")); m.add_query(question("other.test.")); })),
        ("dns_query", "answer", reply.to_vec().expect("a seed message")),
    ]
}
