//! What a sandbox may reach: its egress policy.
//!
//! A destination is an IPv4 address or prefix, or a DNS name, with an optional port (TCP
//! and UDP): `203.0.113.7`, `203.0.113.0/24`, `203.0.113.7:443`, `pypi.org`,
//! `*.pythonhosted.org:443`. The networks of [`super::closed`] (IANA's special-purpose
//! ranges and the host's own networks) stay closed whatever the mode and the lists say,
//! unless the daemon's operator opened them; a name never opens them.
//!
//! Names are for the resolver forkd serves each sandbox: it answers only the names the
//! policy lets out, and lets out the addresses it answered with (see `rules`).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// Whether, and where, a sandbox's traffic may leave it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EgressMode {
    /// Nothing leaves but what `allow` lists.
    #[default]
    Deny,
    /// Everything public leaves but what `deny` lists.
    Allow,
    /// The link is down: nothing leaves or arrives.
    Off,
}

/// A sandbox's egress policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// The mode (`mode` in a recipe's `[egress]`).
    #[serde(default, alias = "mode")]
    pub egress: EgressMode,
    /// Destinations let through (in `deny` mode, the only ones; in `allow` mode, they
    /// win over `deny`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<Destination>,
    /// Destinations refused in `allow` mode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<Destination>,
}

impl EgressPolicy {
    /// Checks the policy as a whole: `deny` entries mean something only in `allow` mode.
    pub fn check(&self) -> Result<(), String> {
        if self.egress == EgressMode::Deny && !self.deny.is_empty() {
            return Err(
                "a deny-list needs egress \"allow\"; with egress \"deny\" everything not in the allow-list is refused already"
                    .into(),
            );
        }
        if self.egress == EgressMode::Off && !(self.allow.is_empty() && self.deny.is_empty()) {
            return Err("egress \"off\" takes no allow- or deny-list".into());
        }
        Ok(())
    }
}

/// One destination of an allow- or deny-list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// An IPv4 network.
    Net(Network),
    /// A DNS name.
    Name(NamePattern),
}

/// An IPv4 network and, optionally, one port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    /// The network address (host bits clear).
    pub addr: Ipv4Addr,
    /// The prefix length, 0..=32.
    pub prefix: u8,
    /// The TCP/UDP destination port, if only one is meant.
    pub port: Option<u16>,
}

/// A DNS name (`example.com`: that name only) or every name under one (`*.example.com`:
/// its subdomains, not itself), and optionally one port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamePattern {
    /// Lower case, without the trailing dot; `*.` first for a wildcard.
    pub name: String,
    /// The TCP/UDP destination port, if only one is meant.
    pub port: Option<u16>,
}

impl NamePattern {
    /// Whether `qname` (any case, trailing dot or not) is this pattern's.
    pub fn matches(&self, qname: &str) -> bool {
        let q = qname.trim_end_matches('.').to_ascii_lowercase();
        match self.name.strip_prefix("*.") {
            Some(parent) => q
                .strip_suffix(parent)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            None => q == self.name,
        }
    }
}

impl EgressPolicy {
    /// The `allow` entries that are networks.
    pub fn allowed_networks(&self) -> impl Iterator<Item = &Network> {
        self.allow.iter().filter_map(Destination::network)
    }

    /// The `deny` entries that are networks.
    pub fn denied_networks(&self) -> impl Iterator<Item = &Network> {
        self.deny.iter().filter_map(Destination::network)
    }

    /// Whether the sandbox's resolver may answer `qname`, and if so, which ports the
    /// addresses it answers with are let out on (`Some(vec![])`: every port; `None`
    /// in the list form: nothing is added, the mode lets public addresses out anyway).
    pub fn resolves(&self, qname: &str) -> Resolution {
        let matching = |list: &[Destination]| -> Vec<Option<u16>> {
            list.iter()
                .filter_map(Destination::name)
                .filter(|n| n.matches(qname))
                .map(|n| n.port)
                .collect()
        };
        match self.egress {
            EgressMode::Off => Resolution::Refused,
            EgressMode::Allow if matching(&self.deny).is_empty() => Resolution::Answered,
            EgressMode::Allow => Resolution::Refused,
            EgressMode::Deny => {
                let ports = matching(&self.allow);
                if ports.is_empty() {
                    Resolution::Refused
                } else if ports.contains(&None) {
                    Resolution::LetOut(Vec::new())
                } else {
                    Resolution::LetOut(ports.into_iter().flatten().collect())
                }
            }
        }
    }
}

/// What a sandbox's resolver does with a name (see [`EgressPolicy::resolves`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Not answered.
    Refused,
    /// Answered; the addresses need no rule (the mode lets them out).
    Answered,
    /// Answered, and the (public) addresses in the answer are let out: on every port if
    /// the list is empty, else on those ports.
    LetOut(Vec<u16>),
}

impl Destination {
    /// The network, if it is one.
    pub fn network(&self) -> Option<&Network> {
        match self {
            Destination::Net(n) => Some(n),
            Destination::Name(_) => None,
        }
    }

    /// The name, if it is one.
    pub fn name(&self) -> Option<&NamePattern> {
        match self {
            Destination::Name(n) => Some(n),
            Destination::Net(_) => None,
        }
    }
}

/// `addr` with all but its first `len` bits cleared.
pub(crate) fn mask(addr: Ipv4Addr, len: u8) -> Ipv4Addr {
    let bits = u32::from(addr);
    let m = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ipv4Addr::from(bits & m)
}

impl FromStr for Destination {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("{s:?} is not a destination ({why}); write ADDRESS[/PREFIX][:PORT] or NAME[:PORT], e.g. 203.0.113.0/24, 203.0.113.7:443, pypi.org or *.pythonhosted.org:443")
        };
        let (target, port) = match s.rsplit_once(':') {
            Some((target, port)) => {
                let port: u16 = port.parse().map_err(|_| bad("bad port"))?;
                if port == 0 {
                    return Err(bad("port 0"));
                }
                (target, Some(port))
            }
            None => (s, None),
        };
        let looks_numeric = target
            .chars()
            .all(|c| c.is_ascii_digit() || c == '.' || c == '/');
        if !looks_numeric {
            return name_pattern(target)
                .map(|name| Destination::Name(NamePattern { name, port }))
                .map_err(|why| bad(&why));
        }
        let (addr, prefix) = match target.split_once('/') {
            Some((addr, len)) => (
                addr,
                len.parse::<u8>()
                    .ok()
                    .filter(|l| *l <= 32)
                    .ok_or_else(|| bad("the prefix length must be 0 to 32"))?,
            ),
            None => (target, 32),
        };
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad("not an IPv4 address"))?;
        if mask(addr, prefix) != addr {
            return Err(bad(&format!(
                "host bits set; the network is {}/{prefix}",
                mask(addr, prefix)
            )));
        }
        Ok(Destination::Net(Network { addr, prefix, port }))
    }
}

/// A DNS name or `*.` and a name, checked and lower-cased.
fn name_pattern(s: &str) -> Result<String, String> {
    let name = s.trim_end_matches('.').to_ascii_lowercase();
    let bare = name.strip_prefix("*.").unwrap_or(&name);
    if bare.len() > 253 || !bare.contains('.') {
        return Err("a name has at least two labels and at most 253 characters".into());
    }
    for label in bare.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok {
            return Err(format!("{label:?} is not a DNS label"));
        }
    }
    Ok(name)
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.addr)?;
        if self.prefix != 32 {
            write!(f, "/{}", self.prefix)?;
        }
        if let Some(port) = self.port {
            write!(f, ":{port}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Destination::Net(n) => n.fmt(f),
            Destination::Name(n) => {
                f.write_str(&n.name)?;
                match n.port {
                    Some(port) => write!(f, ":{port}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl Serialize for Destination {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Destination {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_parse_and_print_back() {
        for s in [
            "203.0.113.7",
            "203.0.113.0/24",
            "203.0.113.7:443",
            "0.0.0.0/0",
            "pypi.org",
            "*.pythonhosted.org:443",
        ] {
            assert_eq!(s.parse::<Destination>().unwrap().to_string(), s);
        }
        assert_eq!(
            "10.1.2.0/24:8080".parse::<Destination>().unwrap(),
            Destination::Net(Network {
                addr: Ipv4Addr::new(10, 1, 2, 0),
                prefix: 24,
                port: Some(8080)
            })
        );
        assert_eq!(
            "PyPI.org.".parse::<Destination>().unwrap().to_string(),
            "pypi.org"
        );
        for bad in [
            "10.1.2.3/24",
            "10.1.2.3/33",
            "10.1.2.3:0",
            "10.1.2.3:x",
            "10.1.2",
            "localhost",
            "a..b",
            "-a.b",
            "*.com.*",
            "::1",
            "",
        ] {
            assert!(bad.parse::<Destination>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_match_exactly_or_below_a_wildcard() {
        let p = |s: &str| s.parse::<Destination>().unwrap().name().unwrap().clone();
        assert!(p("pypi.org").matches("PYPI.org."));
        assert!(!p("pypi.org").matches("x.pypi.org"));
        assert!(p("*.pypi.org").matches("files.pypi.org"));
        assert!(p("*.pypi.org").matches("a.b.pypi.org"));
        assert!(!p("*.pypi.org").matches("pypi.org"));
        assert!(!p("*.pypi.org").matches("evilpypi.org"));
    }

    #[test]
    fn the_resolver_answers_what_the_mode_lets_out() {
        let policy = |json: &str| serde_json::from_str::<EgressPolicy>(json).unwrap();
        let deny = policy(r#"{"allow":["a.test", "b.test:443", "b.test:80", "203.0.113.1"]}"#);
        assert_eq!(deny.resolves("a.test"), Resolution::LetOut(vec![]));
        assert_eq!(deny.resolves("b.test"), Resolution::LetOut(vec![443, 80]));
        assert_eq!(deny.resolves("c.test"), Resolution::Refused);
        let allow = policy(r#"{"egress":"allow","deny":["*.bad.test"]}"#);
        assert_eq!(allow.resolves("x.bad.test"), Resolution::Refused);
        assert_eq!(allow.resolves("good.test"), Resolution::Answered);
        let off = policy(r#"{"egress":"off"}"#);
        assert_eq!(off.resolves("a.test"), Resolution::Refused);
    }

    #[test]
    fn a_policy_is_checked_as_a_whole() {
        let json = r#"{"egress":"allow","deny":["203.0.113.0/24"]}"#;
        let p: EgressPolicy = serde_json::from_str(json).unwrap();
        assert!(p.check().is_ok());
        assert_eq!(serde_json::to_string(&p).unwrap(), json);
        let p: EgressPolicy = serde_json::from_str(r#"{"deny":["203.0.113.0/24"]}"#).unwrap();
        assert!(p.check().is_err());
        assert_eq!(EgressPolicy::default().egress, EgressMode::Deny);
        assert!(serde_json::from_str::<EgressPolicy>(r#"{"allow":["nope"]}"#).is_err());
    }
}
