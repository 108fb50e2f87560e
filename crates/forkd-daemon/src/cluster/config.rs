//! How a daemon joins a cluster: the etcd members it talks to, the name and address
//! other hosts know it by, how long its registration outlives its silence, and the
//! credentials etcd asks for. Checked before anything starts.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// The shortest lease accepted: etcd refuses shorter ones, and a host refreshes its
/// lease three times per period.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);

/// The default lease: a host whose daemon stops answering is shown unreachable after
/// this long.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15);

/// A daemon's place in a cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// etcd's client endpoints, `HOST:PORT` each.
    pub endpoints: Vec<String>,
    /// This host's name in the cluster (unique in it).
    pub host_name: String,
    /// Where the other hosts reach this one's API (`HOST:PORT` of its TCP listener).
    pub advertise: String,
    /// How long this host's registration lasts without a refresh.
    pub lease_ttl: Duration,
    /// TLS to etcd, if its members serve it.
    pub tls: Option<EtcdTls>,
    /// etcd's user and password, if it has authentication on.
    pub credentials: Option<(String, String)>,
    /// Labels other hosts place forks by (`zone=eu-1`).
    pub labels: BTreeMap<String, String>,
    /// The CA that signed the other hosts' API certificates: they are reached over TLS.
    /// Without it, over plain HTTP (hosts on one machine or a private network).
    pub peer_ca: Option<PathBuf>,
    /// The cluster's OCI registry, `HOST[:PORT]/REPO`: a host pushes a snapshot there
    /// when a fork places children on hosts that lack it, and they pull it by digest.
    pub registry: Option<String>,
}

/// PEM files for TLS to etcd.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The CA that signed the members' certificates.
    pub ca: PathBuf,
    /// A client certificate and its key, for members that ask for one.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A cluster configuration that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ClusterConfigError {
    /// Not `etcd://HOST:PORT[,HOST:PORT...]`.
    #[error("--cluster {0:?}: write etcd://HOST:PORT[,HOST:PORT...] (the etcd members' client addresses)")]
    Url(String),
    /// A host name others could not tell apart or put in a key.
    #[error("--host-name {0:?}: a host's name is 1 to 63 letters, digits, `.`, `_` or `-`")]
    HostName(String),
    /// Not `HOST:PORT`.
    #[error(
        "--advertise {0:?}: write the HOST:PORT other hosts reach this daemon's TCP listener at"
    )]
    Advertise(String),
    /// Too short a lease.
    #[error("--lease-ttl {0} s: at least {min} s", min = MIN_LEASE_TTL.as_secs())]
    LeaseTtl(u64),
    /// Not a registry repository.
    #[error("--registry {0:?}: write HOST[:PORT]/REPO, the repository snapshots are pushed to and pulled from")]
    Registry(String),
    /// A label that is not `KEY=VALUE`.
    #[error("--label {0:?}: write KEY=VALUE (letters, digits, `.`, `_`, `-`, `/` in the key)")]
    Label(String),
}

/// The etcd endpoints of an `etcd://HOST:PORT[,HOST:PORT...]` URL.
pub fn parse_url(url: &str) -> Result<Vec<String>, ClusterConfigError> {
    let bad = || ClusterConfigError::Url(url.to_owned());
    let rest = url.strip_prefix("etcd://").ok_or_else(bad)?;
    let endpoints: Vec<String> = rest
        .trim_end_matches('/')
        .split(',')
        .map(str::to_owned)
        .collect();
    if endpoints.iter().any(|e| !is_host_port(e)) {
        return Err(bad());
    }
    Ok(endpoints)
}

/// Whether `s` is `HOST:PORT` (a name, an IPv4 address or a bracketed IPv6 one).
fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-_".contains(c))
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// A `KEY=VALUE` label.
pub fn parse_label(s: &str) -> Result<(String, String), ClusterConfigError> {
    let bad = || ClusterConfigError::Label(s.to_owned());
    let (k, v) = s.split_once('=').ok_or_else(bad)?;
    let key_ok = !k.is_empty()
        && k.len() <= 63
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c));
    if !key_ok || v.len() > 253 || v.chars().any(char::is_control) {
        return Err(bad());
    }
    Ok((k.to_owned(), v.to_owned()))
}

impl ClusterConfig {
    /// Checks what was given.
    pub fn validate(&self) -> Result<(), ClusterConfigError> {
        let name_ok = !self.host_name.is_empty()
            && self.host_name.len() <= 63
            && self
                .host_name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
        if !name_ok {
            return Err(ClusterConfigError::HostName(self.host_name.clone()));
        }
        if !is_host_port(&self.advertise) {
            return Err(ClusterConfigError::Advertise(self.advertise.clone()));
        }
        if self.lease_ttl < MIN_LEASE_TTL {
            return Err(ClusterConfigError::LeaseTtl(self.lease_ttl.as_secs()));
        }
        if let Some(r) = &self.registry {
            // HOST[:PORT]/REPO, to which a push adds the tag.
            let repo = r.split_once('/').map(|(_, repo)| repo);
            let tagged = forkd_storage::oci::registry::parse_reference(&format!("{r}:x"));
            if repo.is_none_or(|repo| repo.contains([':', '@'])) || tagged.is_err() {
                return Err(ClusterConfigError::Registry(r.clone()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ClusterConfig {
        ClusterConfig {
            endpoints: vec!["127.0.0.1:2379".into()],
            host_name: "a".into(),
            advertise: "10.0.0.1:7070".into(),
            lease_ttl: DEFAULT_LEASE_TTL,
            tls: None,
            credentials: None,
            labels: BTreeMap::new(),
            peer_ca: None,
            registry: None,
        }
    }

    #[test]
    fn urls_name_every_member() {
        assert_eq!(
            parse_url("etcd://10.0.0.1:2379,etcd-2:2379,[::1]:2379").unwrap(),
            ["10.0.0.1:2379", "etcd-2:2379", "[::1]:2379"]
        );
        for bad in [
            "http://a:2379",
            "etcd://",
            "etcd://a",
            "etcd://a:0",
            "etcd://a:2379,",
            "etcd://a b:1",
            "etcd://[zz]:1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_addresses_and_leases_are_checked() {
        assert_eq!(config().validate(), Ok(()));
        let mut c = config();
        c.host_name = "a/b".into();
        assert!(matches!(c.validate(), Err(ClusterConfigError::HostName(_))));
        let mut c = config();
        c.advertise = "10.0.0.1".into();
        assert!(matches!(
            c.validate(),
            Err(ClusterConfigError::Advertise(_))
        ));
        let mut c = config();
        c.lease_ttl = Duration::from_secs(1);
        assert_eq!(c.validate(), Err(ClusterConfigError::LeaseTtl(1)));
        let mut c = config();
        c.registry = Some("10.0.0.30:5000/forkd/snapshots".into());
        assert_eq!(c.validate(), Ok(()));
        for bad in [
            "",
            "no-repository",
            "host:5000/repo:tag",
            "host/repo@sha256",
            "a b/c",
        ] {
            c.registry = Some(bad.into());
            assert!(
                matches!(c.validate(), Err(ClusterConfigError::Registry(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn labels_are_key_value() {
        assert_eq!(
            parse_label("zone=eu-1").unwrap(),
            ("zone".into(), "eu-1".into())
        );
        assert!(parse_label("zone").is_err());
        assert!(parse_label("=x").is_err());
        assert!(parse_label("a b=x").is_err());
    }
}
