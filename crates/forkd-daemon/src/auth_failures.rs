//! A budget of failed authentications per client address (an IPv6 client by its /64).
//! Each 401 spends from its address's bucket, which refills with time; while it is
//! empty, a request from that address without a valid token is answered 429, so a
//! client guessing tokens costs the daemon a map lookup. A request with the valid token
//! always passes. Neither answer is audited one by one: failures are counted into the
//! audit log's aggregate records (see [`crate::failed_auth_log`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Instant;

/// Failures an address may have in a burst.
pub const BURST_FAILURES: u32 = 20;
/// [`BURST_FAILURES`] as the bucket counts it.
pub const BURST: f64 = BURST_FAILURES as f64;
/// Failures per second it gets back.
pub const REFILL_PER_S: f64 = 2.0;
/// Addresses remembered at most (the fullest buckets are forgotten first).
const MAX_TRACKED: usize = 4096;

/// The buckets, by address.
#[derive(Debug, Default)]
pub struct AuthFailures {
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
    /// Every failure, counted for the audit log's aggregate records.
    pub audit: crate::failed_auth_log::FailedAuthLog,
}

impl AuthFailures {
    /// Whether `ip` has spent its budget.
    pub fn is_blocked(&self, ip: IpAddr, now: Instant) -> bool {
        let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        buckets
            .get(&key(ip))
            .is_some_and(|&(left, at)| refilled(left, at, now) < 1.0)
    }

    /// Spends one failure of `ip`'s budget.
    pub fn failed(&self, ip: IpAddr, now: Instant) {
        let ip = key(ip);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_TRACKED && !buckets.contains_key(&ip) {
            // Full buckets need no memory; past that, the longest quiet one goes.
            buckets.retain(|_, &mut (left, at)| refilled(left, at, now) < BURST);
            if buckets.len() >= MAX_TRACKED {
                if let Some(oldest) = buckets
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| *k)
                {
                    buckets.remove(&oldest);
                }
            }
        }
        let (left, at) = buckets.get(&ip).copied().unwrap_or((BURST, now));
        buckets.insert(ip, ((refilled(left, at, now) - 1.0).max(0.0), now));
    }

    /// Addresses tracked.
    pub fn tracked(&self) -> usize {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The bucket an address spends from: an IPv4 address (also as a dual-stack listener
/// sees it, mapped into IPv6), an IPv6 address by its /64 (one host can have all of it).
pub(crate) fn key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

fn refilled(left: f64, at: Instant, now: Instant) -> f64 {
    (left + now.saturating_duration_since(at).as_secs_f64() * REFILL_PER_S).min(BURST)
}

/// The address of a TCP principal (`tcp:ADDR:PORT`); `None` for the unix socket.
pub fn peer_ip(principal: &str) -> Option<IpAddr> {
    let addr: std::net::SocketAddr = principal.strip_prefix("tcp:")?.parse().ok()?;
    Some(addr.ip())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_empties_the_bucket_and_time_refills_it() {
        let f = AuthFailures::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        for _ in 0..BURST_FAILURES {
            assert!(!f.is_blocked(a, t0));
            f.failed(a, t0);
        }
        assert!(f.is_blocked(a, t0));
        assert!(!f.is_blocked(b, t0), "another address keeps its own budget");
        // One /64 is one budget.
        let (v6a, v6b): (IpAddr, IpAddr) = (
            "2001:db8::1".parse().unwrap(),
            "2001:db8::ffff:2".parse().unwrap(),
        );
        for _ in 0..BURST_FAILURES {
            f.failed(v6a, t0);
        }
        assert!(f.is_blocked(v6b, t0));
        // The map stays bounded whatever the number of addresses.
        for i in 0..(u32::try_from(MAX_TRACKED).unwrap() + 100) {
            f.failed(IpAddr::V4(std::net::Ipv4Addr::from(0x0b00_0000 + i)), t0);
        }
        assert!(f.tracked() <= MAX_TRACKED);
        let later = t0 + Duration::from_secs_f64(1.0 / REFILL_PER_S);
        assert!(!f.is_blocked(a, later));
        assert_eq!(
            peer_ip("tcp:127.0.0.1:4242"),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(peer_ip("tcp:[::1]:80"), Some("::1".parse().unwrap()));
        assert_eq!(peer_ip("unix:uid=0"), None);
    }
}
