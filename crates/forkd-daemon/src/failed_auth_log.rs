//! Failed authentications in the audit log, as aggregates: a record per client network
//! (an IPv4 /24, an IPv6 /64) and minute, with how many requests failed, instead of one
//! per request. A local user owns all of 127/8, and a remote one may own whole networks
//! of addresses or rotate through them: counted per request, any set of addresses could
//! grow the log without bound. Here, whatever arrives, a minute adds at most
//! [`MAX_NETWORKS`] records and one for the rest (a few hundred bytes each, well under
//! 64 KiB), and memory holds at most that many counters.

use crate::audit::Record;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

/// How long one aggregate covers.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Networks with a record of their own per window; the rest share one.
pub const MAX_NETWORKS: usize = 64;

/// The window being counted.
#[derive(Debug, Default)]
struct Window {
    /// When its first failure came (RFC 3339).
    since: Option<String>,
    counts: BTreeMap<String, u64>,
    others: u64,
}

/// Failures counted since the last [`FailedAuthLog::drain`].
#[derive(Debug, Default)]
pub struct FailedAuthLog {
    window: Mutex<Window>,
}

impl FailedAuthLog {
    /// Counts a failed authentication from `ip`.
    pub fn note(&self, ip: IpAddr) {
        let mut w = self.window.lock().unwrap_or_else(|e| e.into_inner());
        if w.since.is_none() {
            w.since = Some(crate::now_rfc3339());
        }
        let net = network(ip);
        if let Some(n) = w.counts.get_mut(&net) {
            *n += 1;
        } else if w.counts.len() < MAX_NETWORKS {
            w.counts.insert(net, 1);
        } else {
            w.others += 1;
        }
    }

    /// The records of the window that ends now (none if nothing failed), which starts
    /// the next one.
    pub fn drain(&self) -> Vec<Record> {
        let w = std::mem::take(&mut *self.window.lock().unwrap_or_else(|e| e.into_inner()));
        let Some(since) = w.since else {
            return Vec::new();
        };
        let until = crate::now_rfc3339();
        let record = |who: String, n: u64| {
            let mut r = Record::event(
                &who,
                "AUTH-FAILED",
                "",
                vec![
                    format!("{n} requests without a valid token"),
                    format!("from {since} to {until}"),
                ],
            );
            r.status = 401;
            r
        };
        let mut out: Vec<Record> = w
            .counts
            .into_iter()
            .map(|(net, n)| record(format!("tcp:{net}"), n))
            .collect();
        if w.others > 0 {
            out.push(record("tcp:other networks".into(), w.others));
        }
        out
    }
}

/// The network a client address is counted under (an address a dual-stack listener
/// maps into IPv6 as the IPv4 address it is).
fn network(ip: IpAddr) -> String {
    match crate::auth_failures::key(ip) {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            format!("{}.{}.{}.0/24", o[0], o[1], o[2])
        }
        IpAddr::V6(net) => format!("{net}/64"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_number_of_addresses_makes_a_bounded_number_of_records() {
        let log = FailedAuthLog::default();
        assert!(log.drain().is_empty());
        for i in 0..100_000u32 {
            log.note(IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i * 7)));
        }
        log.note("2001:db8::1".parse().unwrap());
        let records = log.drain();
        assert_eq!(records.len(), MAX_NETWORKS + 1);
        let mapped = FailedAuthLog::default();
        mapped.note("::ffff:192.0.2.7".parse().unwrap());
        assert_eq!(mapped.drain()[0].principal, "tcp:192.0.2.0/24");
        let total: u64 = records
            .iter()
            .map(|r| r.ids[0].split(' ').next().unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(total, 100_001);
        assert_eq!(records[0].principal, "tcp:10.0.0.0/24");
        assert!(records.last().unwrap().principal.contains("other"));
        let bytes: usize = records
            .iter()
            .map(|r| serde_json::to_vec(r).unwrap().len() + 64 * 3)
            .sum();
        assert!(bytes < 64 << 10, "{bytes}");
        assert!(log.drain().is_empty(), "a drained window starts empty");
    }
}
