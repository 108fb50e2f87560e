//! Every fuzz target over its seed corpus and 10,000 generated inputs: what CI runs of
//! the fuzzing (`cargo test`), a few seconds a target in a debug build. A failure names
//! the input and saves it to keep as a regression (docs/fuzzing.md).

use forkd_fuzz::generate::run_target;
use std::path::Path;

/// Generated inputs per target.
const GENERATED: usize = 10_000;

fn run(name: &str) {
    let target = forkd_fuzz::target(name).expect("a target of that name");
    let crashes = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-crashes");
    let started = std::time::Instant::now();
    let n = run_target(target, GENERATED, &crashes);
    eprintln!("{name}: {n} inputs in {:.2?}", started.elapsed());
}

#[test]
fn every_target_is_tested() {
    let tested = include_str!("corpus.rs");
    for t in forkd_fuzz::TARGETS {
        assert!(
            tested.contains(&format!("fn {}()", t.name)),
            "target {} has no test here",
            t.name
        );
    }
}

#[test]
fn frame() {
    run("frame");
}

#[test]
fn agent_request() {
    run("agent_request");
}

#[test]
fn agent_response() {
    run("agent_response");
}

#[test]
fn handshake() {
    run("handshake");
}

#[test]
fn api_body() {
    run("api_body");
}

#[test]
fn e2b_connect() {
    run("e2b_connect");
}

#[test]
fn docker_archive() {
    run("docker_archive");
}

#[test]
fn oci_layout() {
    run("oci_layout");
}

#[test]
fn oci_layer() {
    run("oci_layer");
}

#[test]
fn oci_layer_tree() {
    run("oci_layer_tree");
}

#[test]
fn zstd_blob() {
    run("zstd_blob");
}

#[test]
fn recipe() {
    run("recipe");
}

#[test]
fn dns_query() {
    run("dns_query");
}

/// The committed seed corpus is what `forkd_fuzz::seeds` makes, so a seed changed in
/// code is not left unused. After changing a seed, run this test with
/// `FORKD_WRITE_SEEDS=1` to write the files, and commit them.
#[test]
fn the_committed_seeds_are_what_the_generator_makes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let write = std::env::var_os("FORKD_WRITE_SEEDS").is_some();
    for (target, name, bytes) in forkd_fuzz::seeds::all() {
        assert!(forkd_fuzz::target(target).is_some(), "no target {target}");
        let path = root.join(target).join(name);
        if write {
            std::fs::create_dir_all(root.join(target)).expect("the corpus directory");
            std::fs::write(&path, &bytes).expect("writing a seed");
        }
        let committed = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (FORKD_WRITE_SEEDS=1 writes it)", path.display()));
        assert!(
            committed == bytes,
            "{} differs from its generator (FORKD_WRITE_SEEDS=1 writes it)",
            path.display()
        );
    }
}
