//! E2B's network settings as forkd's egress policy.
//!
//! E2B lets a sandbox reach the internet unless told otherwise: `allow_internet_access:
//! false`, or `0.0.0.0/0` in `network.denyOut`, shuts everything but `network.allowOut`
//! (forkd's `deny` mode); otherwise every public destination but `denyOut` is reachable
//! (forkd's `allow` mode), `allowOut` winning over `denyOut`. As in forkd's own API,
//! private ranges, the host and other sandboxes stay shut unless listed. What E2B
//! offers and forkd does not (an egress proxy, request rewriting rules, a host mask)
//! is refused, not ignored.

use forkd_host::network::policy::{Destination, EgressMode, EgressPolicy};
use serde::Deserialize;

/// `network` of E2B's create call, and the body of its network update. Fields forkd has
/// nothing to do with are ignored: `allowPublicTraffic` asks whether sandbox URLs answer
/// without the access token, and forkd's always need it.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    #[serde(default)]
    allow_out: Vec<String>,
    #[serde(default)]
    deny_out: Vec<String>,
    #[serde(default)]
    egress_proxy: Option<serde_json::Value>,
    #[serde(default)]
    rules: Option<serde_json::Value>,
    #[serde(default)]
    mask_request_host: Option<serde_json::Value>,
    /// In the update body, at the top level.
    #[serde(default, rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

impl NetworkConfig {
    /// Whether anything was asked beyond E2B's defaults.
    pub fn is_default(&self) -> bool {
        self.allow_out.is_empty()
            && self.deny_out.is_empty()
            && self.allow_internet_access.is_none()
    }
}

/// The policy E2B's settings describe: `allow_internet_access` from the create call's
/// top level (or the update body), `network` its network settings.
pub fn policy(
    allow_internet_access: Option<bool>,
    network: &NetworkConfig,
) -> Result<EgressPolicy, String> {
    for (given, what) in [
        (network.egress_proxy.is_some(), "egressProxy"),
        (network.rules.is_some(), "rules"),
        (network.mask_request_host.is_some(), "maskRequestHost"),
    ] {
        if given {
            return Err(format!(
                "network.{what} is not supported: forkd filters egress by address, port and name only"
            ));
        }
    }
    let parse = |list: &[String], field: &str| -> Result<Vec<Destination>, String> {
        list.iter()
            .filter(|s| s.as_str() != "0.0.0.0/0" || field == "allowOut")
            .map(|s| s.parse().map_err(|e| format!("network.{field}: {e}")))
            .collect()
    };
    let allow = parse(&network.allow_out, "allowOut")?;
    let deny = parse(&network.deny_out, "denyOut")?;
    if deny.iter().any(|d| d.name().is_some()) {
        return Err("network.denyOut: domain names are not supported for deny rules".into());
    }
    let shut = allow_internet_access.or(network.allow_internet_access) == Some(false)
        || network.deny_out.iter().any(|d| d == "0.0.0.0/0");
    let policy = if shut {
        EgressPolicy {
            egress: EgressMode::Deny,
            allow,
            deny: Vec::new(),
        }
    } else {
        EgressPolicy {
            egress: EgressMode::Allow,
            allow,
            deny,
        }
    };
    policy.check()?;
    Ok(policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> NetworkConfig {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn e2b_settings_map_to_a_policy() {
        let open = policy(None, &NetworkConfig::default()).unwrap();
        assert_eq!(open.egress, EgressMode::Allow);
        let shut = policy(Some(false), &NetworkConfig::default()).unwrap();
        assert_eq!(shut.egress, EgressMode::Deny);
        let only = policy(
            None,
            &config(r#"{"denyOut":["0.0.0.0/0"],"allowOut":["example.com","8.8.8.8"]}"#),
        )
        .unwrap();
        assert_eq!(only.egress, EgressMode::Deny);
        assert_eq!(only.allow.len(), 2);
        assert!(only.deny.is_empty());
        let some = policy(None, &config(r#"{"denyOut":["203.0.113.0/24"]}"#)).unwrap();
        assert_eq!(some.egress, EgressMode::Allow);
        assert_eq!(some.deny.len(), 1);
        assert!(policy(None, &config(r#"{"denyOut":["example.com"]}"#)).is_err());
        assert!(policy(None, &config(r#"{"rules":{}}"#)).is_err());
        assert!(policy(None, &config(r#"{"allowOut":["not a name"]}"#)).is_err());
        let update = config(r#"{"allow_internet_access":false}"#);
        assert_eq!(policy(None, &update).unwrap().egress, EgressMode::Deny);
    }
}
