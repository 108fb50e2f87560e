//! The networks no sandbox reaches, whatever its egress mode and policy: every range of
//! IANA's IPv4 special-purpose address registry (private use, loopback, link local,
//! shared address space, documentation, benchmarking, AS112, AMT, 6to4 relays,
//! reserved) and multicast, and every network the host has a direct route in (the
//! subnet of each of its addresses among them: its neighbours), less what the daemon's
//! operator opened on purpose (`forkd daemon --egress-open CIDR`, a proxy on a private
//! address).
//!
//! IPv6 needs no list: a sandbox's namespace forwards IPv4 only, so the whole IPv6
//! space, its special-purpose registry included, is closed.
//!
//! The set is enforced twice: in each sandbox's namespace (the `closed` chain, fixed
//! when the namespace is made) and in the host's `forward` chain for every sandbox link,
//! which is applied again when the host's routes change, so a network the host joins
//! later is closed to sandboxes already running. The daemon reads the host's routes at
//! start and then every few seconds ([`refresh_host`]).
//!
//! Several daemons on one host share the host's chain, and each may open other networks.
//! A sandbox's namespace holds it to its own daemon's openings; the host's chain lets
//! through what any live daemon opened ([`on_host`]), so that no daemon's rules close
//! what another opened. Each daemon records its openings in [`OPENINGS_DIR`], in a file
//! named by its pid that also holds its start time: the file of a daemon that is gone
//! counts for nothing, whether or not it was removed.

use super::policy::Network;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::RwLock;

/// IANA's IPv4 special-purpose registry (RFC 6890 and its updates), and multicast
/// (RFC 5771), by their top-level blocks (smaller entries, such as 192.0.0.170/32 or
/// 255.255.255.255/32, lie inside them).
pub const SPECIAL_PURPOSE: [(Ipv4Addr, u8, &str); 19] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8, "this network (RFC 791)"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private use (RFC 1918)"),
    (
        Ipv4Addr::new(100, 64, 0, 0),
        10,
        "shared address space (RFC 6598)",
    ),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback (RFC 1122)"),
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link local (RFC 3927)"),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private use (RFC 1918)"),
    (
        Ipv4Addr::new(192, 0, 0, 0),
        24,
        "IETF protocol assignments (RFC 6890)",
    ),
    (
        Ipv4Addr::new(192, 0, 2, 0),
        24,
        "documentation, TEST-NET-1 (RFC 5737)",
    ),
    (Ipv4Addr::new(192, 31, 196, 0), 24, "AS112-v4 (RFC 7535)"),
    (Ipv4Addr::new(192, 52, 193, 0), 24, "AMT (RFC 7450)"),
    (
        Ipv4Addr::new(192, 88, 99, 0),
        24,
        "6to4 relay anycast (RFC 7526)",
    ),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private use (RFC 1918)"),
    (
        Ipv4Addr::new(192, 175, 48, 0),
        24,
        "direct delegation AS112 (RFC 7534)",
    ),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking (RFC 2544)"),
    (
        Ipv4Addr::new(198, 51, 100, 0),
        24,
        "documentation, TEST-NET-2 (RFC 5737)",
    ),
    (
        Ipv4Addr::new(203, 0, 113, 0),
        24,
        "documentation, TEST-NET-3 (RFC 5737)",
    ),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast (RFC 5771)"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved (RFC 1112)"),
    (
        Ipv4Addr::new(255, 255, 255, 255),
        32,
        "limited broadcast (RFC 919)",
    ),
];

/// The widest direct route taken for a network of the host's.
const MIN_PREFIX: u8 = 8;

/// The closed networks as this process knows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClosedNetworks {
    /// The networks of the host's direct routes that no special-purpose block holds.
    host: Vec<Network>,
    /// What the operator opened.
    opened: Vec<Network>,
}

static CURRENT: RwLock<ClosedNetworks> = RwLock::new(ClosedNetworks {
    host: Vec::new(),
    opened: Vec::new(),
});

/// The closed networks now.
pub fn current() -> ClosedNetworks {
    CURRENT.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Where each daemon of this host records the networks it opened (a tmpfs: the
/// records go with the processes at a reboot).
pub const OPENINGS_DIR: &str = "/run/forkd/egress-open";

/// Opens `networks` (the daemon's `--egress-open`), for this process's life, and
/// records them for the other daemons of this host when it has any.
pub fn open(networks: Vec<Network>) -> std::io::Result<()> {
    let record = Path::new(OPENINGS_DIR).join(std::process::id().to_string());
    if super::unavailable().is_some() {
        // No sandbox of this process has a network: nothing to record.
    } else if networks.is_empty() {
        match std::fs::remove_file(&record) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    } else {
        let started = crate::process::start_time(std::process::id())
            .ok_or_else(|| std::io::Error::other("reading this process's start time"))?;
        let mut text = format!("{started}\n");
        for n in &networks {
            text.push_str(&format!("{n}\n"));
        }
        std::fs::create_dir_all(OPENINGS_DIR)?;
        let aside = record.with_extension("partial");
        std::fs::write(&aside, text)?;
        std::fs::rename(&aside, &record)?;
    }
    CURRENT.write().unwrap_or_else(|e| e.into_inner()).opened = networks;
    Ok(())
}

/// The closed networks as the host's chain holds them: this process's, less what any
/// live daemon of this host opened. Records of daemons that are gone are removed.
pub fn on_host() -> ClosedNetworks {
    less_recorded_openings(current(), Path::new(OPENINGS_DIR))
}

/// `closed` less what the live processes recorded in `dir` opened.
fn less_recorded_openings(mut closed: ClosedNetworks, dir: &Path) -> ClosedNetworks {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return closed;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let mut lines = text.lines();
        let started = lines.next().and_then(|l| l.parse::<u64>().ok());
        if started.is_none() || crate::process::start_time(pid) != started {
            let _ = std::fs::remove_file(e.path());
            continue;
        }
        for line in lines {
            let net = line
                .parse::<super::policy::Destination>()
                .ok()
                .and_then(|d| d.network().copied());
            if let Some(net) = net.filter(|n| !closed.opened.contains(n)) {
                closed.opened.push(net);
            }
        }
    }
    closed
}

/// Reads the host's direct routes again; true when the closed set changed (the host's
/// rules must then be applied again).
pub fn refresh_host() -> std::io::Result<bool> {
    let table = std::fs::read_to_string("/proc/net/route")?;
    let host = ClosedNetworks::host_routes(&table);
    let mut current = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    if current.host == host {
        return Ok(false);
    }
    current.host = host;
    Ok(true)
}

fn net(addr: Ipv4Addr, prefix: u8) -> Network {
    Network {
        addr,
        prefix,
        port: None,
    }
}

impl ClosedNetworks {
    /// A set for tests and tools: `host` networks besides the special-purpose blocks,
    /// less `opened`.
    pub fn new(host: Vec<Network>, opened: Vec<Network>) -> ClosedNetworks {
        ClosedNetworks { host, opened }
    }

    /// The networks of the direct routes (no gateway) of `/proc/net/route`'s `table`,
    /// but the default route, sandboxes' own links and what a special-purpose block
    /// holds already.
    fn host_routes(table: &str) -> Vec<Network> {
        let mut out: Vec<Network> = table
            .lines()
            .skip(1)
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let hex = |i: usize| f.get(i).and_then(|s| u32::from_str_radix(s, 16).ok());
                let (iface, dest, gateway, mask) = (f.first()?, hex(1)?, hex(2)?, hex(7)?);
                // The kernel prints each field as the u32 it holds in network order.
                let addr = Ipv4Addr::from(dest.to_ne_bytes());
                let prefix = u8::try_from(mask.count_ones()).ok()?;
                let link_of_sandbox = iface.starts_with(super::HOST_LINK_PREFIX);
                // Routes wider than a /8 (a VPN's 0.0.0.0/1 and 128.0.0.0/1) stand for
                // the Internet, not for neighbours.
                (gateway == 0 && prefix >= MIN_PREFIX && !link_of_sandbox)
                    .then(|| net(addr, prefix))
            })
            .filter(|n| !special(n))
            .collect();
        out.sort_by_key(|n| (u32::from(n.addr), n.prefix));
        out.dedup();
        out
    }

    /// Every closed network: the special-purpose blocks, then the host's.
    pub fn networks(&self) -> Vec<Network> {
        SPECIAL_PURPOSE
            .iter()
            .map(|&(addr, prefix, _)| net(addr, prefix))
            .chain(self.host.iter().cloned())
            .collect()
    }

    /// The host's networks that are closed besides the special-purpose blocks.
    pub fn host(&self) -> &[Network] {
        &self.host
    }

    /// What the operator opened.
    pub fn opened(&self) -> &[Network] {
        &self.opened
    }

    /// Whether `addr` is closed to sandboxes.
    pub fn closes(&self, addr: Ipv4Addr) -> bool {
        let one = net(addr, 32);
        self.networks().iter().any(|c| within(&one, c))
            && !self.opened.iter().any(|o| within(&one, o))
    }
}

/// Whether every address of `n` lies in one of the special-purpose blocks.
pub fn special(n: &Network) -> bool {
    SPECIAL_PURPOSE
        .iter()
        .any(|&(addr, prefix, _)| within(n, &net(addr, prefix)))
}

/// Whether `inner` lies wholly inside `outer`.
fn within(inner: &Network, outer: &Network) -> bool {
    use super::policy::mask;
    inner.prefix >= outer.prefix && mask(inner.addr, outer.prefix) == mask(outer.addr, outer.prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Network {
        *s.parse::<super::super::policy::Destination>()
            .unwrap()
            .network()
            .unwrap()
    }

    #[test]
    fn what_live_daemons_recorded_is_open_and_records_of_gone_ones_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut live = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let started = crate::process::start_time(live.id()).unwrap();
        let record = |name: String, text: String| std::fs::write(dir.path().join(name), text);
        record(
            live.id().to_string(),
            format!("{started}\n198.51.100.0/24\n192.168.7.0/24\n"),
        )
        .unwrap();
        // The same pid started at another time: a daemon that is gone.
        let gone = format!("{}", started + 1);
        record("1".into(), format!("{gone}\n203.0.113.0/24\n")).unwrap();
        record("junk".into(), "not a record".into()).unwrap();
        let own = ClosedNetworks::new(Vec::new(), vec![n("192.168.7.0/24")]);
        let closed = less_recorded_openings(own, dir.path());
        assert_eq!(closed.opened(), [n("192.168.7.0/24"), n("198.51.100.0/24")]);
        assert!(!closed.closes("198.51.100.9".parse().unwrap()));
        assert!(closed.closes("203.0.113.9".parse().unwrap()));
        assert!(
            !dir.path().join("1").exists(),
            "the gone daemon's record stays"
        );
        live.kill().unwrap();
        live.wait().unwrap();
        let closed = less_recorded_openings(ClosedNetworks::default(), dir.path());
        assert!(closed.opened().is_empty(), "{closed:?}");
        assert!(!dir.path().join(live.id().to_string()).exists());
    }

    #[test]
    fn the_registry_is_closed_and_public_space_is_not() {
        let c = ClosedNetworks::default();
        for a in [
            "0.1.2.3",
            "10.0.0.1",
            "100.64.0.1",
            "127.0.0.1",
            "169.254.169.254",
            "172.16.0.1",
            "192.0.0.170",
            "192.0.2.1",
            "192.31.196.1",
            "192.52.193.1",
            "192.88.99.1",
            "192.168.1.1",
            "192.175.48.1",
            "198.18.0.1",
            "198.19.255.254",
            "198.51.100.1",
            "203.0.113.1",
            "224.0.0.1",
            "240.0.0.1",
            "255.255.255.255",
        ] {
            assert!(c.closes(a.parse().unwrap()), "{a}");
        }
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "198.20.0.1",
            "203.0.114.1",
            "192.0.3.1",
        ] {
            assert!(!c.closes(a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn what_the_operator_opens_is_open_and_host_routes_close_their_networks() {
        let table =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            eth0\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
            eth1\t00050305\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
            eth1\t00000909\t04030201\t0003\t0\t0\t0\t0000FFFF\t0\t0\t0\n\
            fkd7\t0800FD0A\t00000000\t0001\t0\t0\t0\tFCFFFFFF\t0\t0\t0\n\
            tun0\t00000000\t00000000\t0001\t0\t0\t0\t00000080\t0\t0\t0\n";
        let host = ClosedNetworks::host_routes(table);
        // The default route, a gateway's route, a sandbox's link, a private subnet
        // (closed already) and a VPN's half of the Internet add nothing; 5.3.5.0/24 is
        // the host's neighbours.
        assert_eq!(host, vec![n("5.3.5.0/24")]);
        let c = ClosedNetworks::new(host, vec![n("10.252.77.0/24"), n("203.0.113.0/24")]);
        assert!(c.closes("5.3.5.9".parse().unwrap()));
        assert!(!c.closes("5.3.6.9".parse().unwrap()));
        assert!(!c.closes("10.252.77.2".parse().unwrap()));
        assert!(c.closes("10.252.78.2".parse().unwrap()));
    }
}
