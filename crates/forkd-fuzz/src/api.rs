//! What API clients send: the REST API's JSON bodies, read as its `JsonBody` extractor
//! reads them (with the checks made on them before anything runs), and the E2B
//! listener's Connect envelopes.

use forkd_daemon::api::types::{
    BuildSnapshotBody, CompactBody, CreateContextBody, CreateSandboxes, ExecBody, NetworkBody,
    PathBody, ProcessStartBody, RenameBody, RunCodeBody, SetPoolBody, SetTimeout, SignalBody,
    StdinBody,
};
use forkd_daemon::api::MAX_JSON_BODY;
use forkd_daemon::e2b::connect;
use serde::de::DeserializeOwned;

/// A body as `JsonBody` reads it.
fn body<T: DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    if bytes.len() > MAX_JSON_BODY {
        return None; // answered 413 before it is parsed
    }
    serde_json::from_slice(bytes).ok()
}

/// A network policy is checked as a whole, then serialized into the database and read
/// back at the next start: what passes the check must come back the same.
fn network(n: NetworkBody) {
    if let Ok(p) = n.policy() {
        let text = serde_json::to_string(&p).expect("a policy serializes");
        let back: forkd_host::network::policy::EgressPolicy =
            serde_json::from_str(&text).expect("a checked policy reads back");
        assert_eq!(
            serde_json::to_string(&back).expect("a policy serializes"),
            text,
            "a policy changed on its way to the database and back"
        );
        back.check().expect("a checked policy is still valid");
        let _ = back.resolves("example.com");
    }
}

/// A REST body: the first byte picks the route, the rest is the body.
pub fn api_body(data: &[u8]) {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    match which % 14 {
        0 => {
            if let Some(b) = body::<CreateSandboxes>(bytes) {
                if let Some(n) = b.network {
                    network(n);
                }
                let _ = forkd_proto::exec::env_problem(&b.env);
            }
        }
        1 => {
            if let Some(n) = body::<NetworkBody>(bytes) {
                network(n);
            }
        }
        2 => {
            let _ = body::<SetTimeout>(bytes);
        }
        3 => {
            if let Some(b) = body::<ExecBody>(bytes) {
                if let Some(cwd) = &b.cwd {
                    let _ = forkd_daemon::api::guest_path(cwd);
                }
                let _ = forkd_proto::exec::env_problem(&b.env);
            }
        }
        4 => {
            let _ = body::<RunCodeBody>(bytes);
        }
        5 => {
            let _ = body::<CreateContextBody>(bytes);
        }
        6 => {
            if let Some(b) = body::<PathBody>(bytes) {
                let _ = forkd_daemon::api::guest_path(&b.path);
            }
        }
        7 => {
            if let Some(b) = body::<RenameBody>(bytes) {
                let _ = forkd_daemon::api::guest_path(&b.from);
                let _ = forkd_daemon::api::guest_path(&b.to);
            }
        }
        8 => {
            let _ = body::<CompactBody>(bytes);
        }
        9 => {
            let _ = body::<SetPoolBody>(bytes);
        }
        10 => {
            // A build's recipe travels in the body: it is parsed as a recipe file is.
            if let Some(b) = body::<BuildSnapshotBody>(bytes) {
                if let Some(text) = &b.recipe {
                    if let Ok(r) = forkd_core::template::Recipe::parse(&b.template, text) {
                        crate::recipe::check(&r);
                    }
                }
            }
        }
        11 => {
            let _ = body::<ProcessStartBody>(bytes);
        }
        12 => {
            let _ = body::<StdinBody>(bytes);
        }
        _ => {
            let _ = body::<SignalBody>(bytes);
        }
    }
}

/// A Connect request: the enveloped message of a streaming call, and the same bytes as
/// a unary call's message.
pub fn e2b_connect(data: &[u8]) {
    if let Ok(v) = connect::stream_request::<serde_json::Value>(data) {
        // Only an uncompressed envelope whose length is exactly its body gets through.
        assert!(
            data.len() >= 5 && data[0] & 1 == 0,
            "a bad envelope was read"
        );
        let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
        assert_eq!(
            len + 5,
            data.len(),
            "an envelope of the wrong length was read"
        );
        // What the server would send back of it decodes to the same message.
        let again = connect::envelope(&v);
        let back: serde_json::Value =
            connect::stream_request(&again).expect("an envelope the server wrote reads back");
        assert_eq!(back, v, "a message changed in its envelope");
    }
    if data.len() <= connect::MAX_MESSAGE {
        let _ = connect::unary_request::<serde_json::Value>(data);
    }
}
