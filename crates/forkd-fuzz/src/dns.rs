//! The resolver each sandbox with a NIC asks: a guest's DNS query, checked against its
//! egress policy before anything goes upstream, and the upstream server's answer, whose
//! addresses may be let out of the sandbox's namespace.

use forkd_daemon::resolver::{self, Checked, MAX_TTL, MIN_TTL};
use forkd_host::network::policy::{EgressPolicy, Resolution};
use hickory_proto::op::{Message, ResponseCode};
use std::sync::OnceLock;

/// A policy that lets some names out and refuses the rest: `deny` mode with an
/// allow-list, the mode in which answers open the namespace.
fn policy() -> &'static EgressPolicy {
    static POLICY: OnceLock<EgressPolicy> = OnceLock::new();
    POLICY.get_or_init(|| {
        serde_json::from_value(serde_json::json!({
            "egress": "deny",
            "allow": ["allowed.test", "*.wild.test:443", "203.0.113.0/24"]
        }))
        .expect("the fuzz policy is valid")
    })
}

/// A query from the guest, then the same bytes as an upstream answer.
pub fn dns_query(data: &[u8]) {
    let policy = policy();
    match resolver::check(data, policy) {
        Ok(Checked {
            msg,
            name,
            resolution,
        }) => {
            // Only a query of one question the policy answers goes upstream.
            assert_eq!(
                msg.queries.len(),
                1,
                "a query of several questions went upstream"
            );
            assert_ne!(resolution, Resolution::Refused);
            assert_eq!(policy.resolves(&name), resolution);
        }
        Err(Some(reply)) => {
            // An immediate reply answers the query: same id, the question kept, an
            // error code.
            let reply = Message::from_vec(&reply).expect("the resolver's reply parses");
            let query = Message::from_vec(data).expect("only a parsed query is answered");
            assert_eq!(reply.metadata.id, query.metadata.id);
            assert!(matches!(
                reply.metadata.response_code,
                ResponseCode::FormErr | ResponseCode::Refused
            ));
            assert!(reply.answers.is_empty(), "a refusal carries records");
        }
        Err(None) => {}
    }
    if let Ok(answer) = Message::from_vec(data) {
        let (addrs, ttl) = resolver::public_addresses(&answer);
        assert!((MIN_TTL..=MAX_TTL).contains(&ttl), "ttl {ttl}");
        let closed = forkd_host::network::closed::current();
        for a in addrs {
            assert!(!closed.closes(a), "{a} is let out of the namespace");
        }
    }
}
