//! What a sandbox may reach: its egress policy.
//!
//! A destination is an IPv4 address or prefix with an optional port (TCP and UDP):
//! `203.0.113.7`, `203.0.113.0/24`, `203.0.113.7:443`. Private, loopback, link-local
//! and multicast ranges (and with them the host's side of every sandbox's link) are
//! refused whatever the mode, unless a destination inside them is listed in `allow`.

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
    /// The mode.
    #[serde(default)]
    pub egress: EgressMode,
    /// Destinations let through (in `deny` mode, the only ones; in `allow` mode, the
    /// private ones let through).
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

/// One IPv4 destination: a prefix and, optionally, one port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destination {
    /// The network address (host bits clear).
    pub addr: Ipv4Addr,
    /// The prefix length, 0..=32.
    pub prefix: u8,
    /// The TCP/UDP destination port, if only one is meant.
    pub port: Option<u16>,
}

/// The ranges no sandbox reaches unless a destination inside them is listed: private
/// networks, loopback, link-local, shared address space, "this network", multicast and
/// reserved (RFC 1918, 1122, 3927, 6598, 5771, 1112).
pub const PRIVATE_RANGES: [(Ipv4Addr, u8); 9] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

impl Destination {
    /// True when every address of this destination lies in one of [`PRIVATE_RANGES`].
    pub fn is_private(&self) -> bool {
        PRIVATE_RANGES
            .iter()
            .any(|&(net, len)| self.prefix >= len && mask(self.addr, len) == net)
    }
}

fn mask(addr: Ipv4Addr, len: u8) -> Ipv4Addr {
    let bits = u32::from(addr);
    let m = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ipv4Addr::from(bits & m)
}

impl FromStr for Destination {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("{s:?} is not a destination ({why}); write ADDRESS[/PREFIX][:PORT], e.g. 203.0.113.0/24 or 203.0.113.7:443")
        };
        let (net, port) = match s.rsplit_once(':') {
            Some((net, port)) => {
                let port: u16 = port.parse().map_err(|_| bad("bad port"))?;
                if port == 0 {
                    return Err(bad("port 0"));
                }
                (net, Some(port))
            }
            None => (s, None),
        };
        let (addr, prefix) = match net.split_once('/') {
            Some((addr, len)) => (
                addr,
                len.parse::<u8>()
                    .ok()
                    .filter(|l| *l <= 32)
                    .ok_or_else(|| bad("the prefix length must be 0 to 32"))?,
            ),
            None => (net, 32),
        };
        let addr: Ipv4Addr = addr
            .parse()
            .map_err(|_| bad("not an IPv4 address; DNS names are not supported"))?;
        if mask(addr, prefix) != addr {
            return Err(bad(&format!(
                "host bits set; the network is {}/{prefix}",
                mask(addr, prefix)
            )));
        }
        Ok(Destination { addr, prefix, port })
    }
}

impl fmt::Display for Destination {
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
        ] {
            assert_eq!(s.parse::<Destination>().unwrap().to_string(), s);
        }
        let d: Destination = "10.1.2.0/24:8080".parse().unwrap();
        assert_eq!(
            d,
            Destination {
                addr: Ipv4Addr::new(10, 1, 2, 0),
                prefix: 24,
                port: Some(8080)
            }
        );
        for bad in [
            "10.1.2.3/24",
            "10.1.2.3/33",
            "10.1.2.3:0",
            "10.1.2.3:x",
            "example.com",
            "::1",
            "",
        ] {
            assert!(bad.parse::<Destination>().is_err(), "{bad}");
        }
    }

    #[test]
    fn private_means_wholly_inside_a_private_range() {
        let private = |s: &str| s.parse::<Destination>().unwrap().is_private();
        assert!(private("10.1.2.3"));
        assert!(private("192.168.0.0/16:53"));
        assert!(private("127.0.0.1"));
        assert!(!private("0.0.0.0/0"));
        assert!(!private("8.0.0.0/7"));
        assert!(!private("203.0.113.7"));
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
