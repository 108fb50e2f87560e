//! Fuzz targets for every decoder of untrusted input in forkd: what a guest, an API
//! client, an E2B SDK, an image archive, a recipe or a DNS query can put in front of
//! forkd's code. Each target is an `fn(&[u8])` that calls the real decoding code as
//! production calls it with the bytes, and asserts what must hold whatever they are:
//! no panic, and where it is cheap to check, that what was accepted is sound (a frame
//! never carries more than the limit, a layer writes nothing outside its tree, an
//! accepted recipe's files stay inside its directory...). A panic is a finding.
//!
//! The same targets run three ways (see `docs/fuzzing.md`): `cargo test` runs each over
//! its seed corpus (`corpus/<target>/`) and 10,000 inputs made from it by
//! [`generate`]; `./dev fuzz` runs them under libFuzzer (the `libfuzzer` feature's
//! binary); and every crash found stays in the corpus as a regression.

pub mod api;
pub mod dns;
pub mod generate;
pub mod oci;
pub mod proto;
pub mod recipe;
pub mod seeds;

/// A fuzz target.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// Its name: the corpus directory and what `./dev fuzz` is given.
    pub name: &'static str,
    /// Runs one input.
    pub run: fn(&[u8]),
    /// The longest input worth trying: longer ones only cost time (the generated inputs
    /// and libFuzzer's `-max_len` stay under it).
    pub max_len: usize,
    /// Where a tar archive starts in the input, for targets that read one: the
    /// generated inputs get their tar headers' checksums fixed there, so that mutations
    /// reach past the header check.
    pub tar_at: Option<usize>,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "frame",
        run: proto::frame,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "agent_request",
        run: proto::agent_request,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "agent_response",
        run: proto::agent_response,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "handshake",
        run: proto::handshake,
        max_len: 1024,
        tar_at: None,
    },
    Target {
        name: "api_body",
        run: api::api_body,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "e2b_connect",
        run: api::e2b_connect,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "docker_archive",
        run: oci::docker_archive,
        max_len: 16 << 10,
        tar_at: Some(1),
    },
    Target {
        name: "oci_layout",
        run: oci::oci_layout,
        max_len: 16 << 10,
        tar_at: Some(0),
    },
    Target {
        name: "oci_layer",
        run: oci::oci_layer,
        max_len: 16 << 10,
        tar_at: Some(1),
    },
    Target {
        name: "oci_layer_tree",
        run: oci::oci_layer_tree,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "zstd_blob",
        run: oci::zstd_blob,
        max_len: 8192,
        tar_at: None,
    },
    Target {
        name: "recipe",
        run: recipe::recipe,
        max_len: 4096,
        tar_at: None,
    },
    Target {
        name: "dns_query",
        run: dns::dns_query,
        max_len: 1024,
        tar_at: None,
    },
];

/// The target named `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
