//! The resolver each sandbox with a NIC asks for names: the gateway's port 53 (UDP and
//! TCP) in its namespace, served by the daemon. Queries go upstream over UDP.
//!
//! It answers only what the sandbox's egress policy lets out (see
//! [`EgressPolicy::resolves`]): other names are refused (REFUSED). Allowed queries go
//! as they are to the upstream server the daemon was given, and in `deny` mode the
//! public IPv4 addresses of the answer are let out of the sandbox's namespace before
//! the answer reaches the guest, for the answer's TTL (at least a minute), so that the
//! guest's first connection already passes. A guest that floods it gets at most
//! [`IN_FLIGHT`] queries answered at once; the rest are dropped, as a busy server does.

use forkd_core::Sandbox;
use forkd_hypervisor::network::policy::{EgressPolicy, Resolution};
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::RData;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UdpSocket;
use tokio::sync::{watch, Semaphore};

/// Queries of one sandbox answered at once.
const IN_FLIGHT: usize = 16;

/// How long the upstream server may take to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// How long, at least and at most, an address the resolver answered with stays let out.
const MIN_TTL: u32 = 60;
const MAX_TTL: u32 = 86_400;

/// The upstream server when none is given: the host's first `nameserver`.
pub fn default_upstream() -> Option<SocketAddr> {
    let conf = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    conf.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
}

/// Parses `ADDRESS[:PORT]` (port 53 by default).
pub fn parse_upstream(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .or_else(|_| {
            s.parse::<std::net::IpAddr>()
                .map(|ip| SocketAddr::new(ip, 53))
        })
        .map_err(|_| format!("{s:?} is not ADDRESS[:PORT] of a DNS server"))
}

/// Serves sandbox `sandbox`'s resolver until its VM exits or `policy`'s sender is
/// dropped (the sandbox left the registry).
pub fn spawn(sandbox: Arc<Sandbox>, upstream: SocketAddr, policy: watch::Receiver<EgressPolicy>) {
    tokio::spawn(async move {
        let id = sandbox.id().to_owned();
        if let Err(e) = serve(sandbox, upstream, policy).await {
            tracing::warn!(%id, "the sandbox's resolver stopped: {e}");
        }
    });
}

async fn serve(
    sandbox: Arc<Sandbox>,
    upstream: SocketAddr,
    mut policy: watch::Receiver<EgressPolicy>,
) -> std::io::Result<()> {
    let Some(pid) = sandbox.pid() else {
        return Ok(());
    };
    let (socket, listener) = forkd_hypervisor::network::bind_resolver(pid).await?;
    let socket = Arc::new(socket);
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut buf = vec![0u8; 4096];
    loop {
        tokio::select! {
            changed = policy.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            _ = sandbox.vm().wait_exit() => return Ok(()),
            accepted = listener.accept() => {
                let (conn, _) = accepted?;
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    continue;
                };
                let policy = policy.clone();
                tokio::spawn(async move {
                    let _ = serve_tcp(conn, policy, pid, upstream).await;
                    drop(permit);
                });
            }
            received = socket.recv_from(&mut buf) => {
                let (n, from) = received?;
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    continue;
                };
                let query = buf[..n].to_vec();
                let policy = policy.borrow().clone();
                let socket = socket.clone();
                tokio::spawn(async move {
                    if let Some(reply) = answer(&query, &policy, pid, upstream).await {
                        let _ = socket.send_to(&reply, from).await;
                    }
                    drop(permit);
                });
            }
        }
    }
}

/// Queries over one TCP connection (each with its two-byte length, RFC 1035 4.2.2),
/// until the guest closes it or is idle for [`TCP_IDLE`].
async fn serve_tcp(
    mut conn: tokio::net::TcpStream,
    policy: watch::Receiver<EgressPolicy>,
    pid: u32,
    upstream: SocketAddr,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let mut len = [0u8; 2];
        match tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            _ => return Ok(()),
        }
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut query))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "idle"))??;
        let current = policy.borrow().clone();
        let Some(reply) = answer(&query, &current, pid, upstream).await else {
            return Ok(());
        };
        let Ok(n) = u16::try_from(reply.len()) else {
            return Ok(());
        };
        conn.write_all(&n.to_be_bytes()).await?;
        conn.write_all(&reply).await?;
    }
}

/// How long a TCP connection to the resolver may stay silent.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// The reply to `query` (none for what is not a DNS query).
async fn answer(
    query: &[u8],
    policy: &EgressPolicy,
    pid: u32,
    upstream: SocketAddr,
) -> Option<Vec<u8>> {
    let msg = Message::from_vec(query).ok()?;
    if msg.metadata.message_type != MessageType::Query {
        return None;
    }
    let name = msg.queries.first()?.name().to_ascii();
    let resolution = policy.resolves(&name);
    if resolution == Resolution::Refused {
        return failure(&msg, ResponseCode::Refused);
    }
    let reply = match forward(query, upstream).await {
        Ok(reply) => reply,
        Err(e) => {
            tracing::debug!("resolving {name} upstream: {e}");
            return failure(&msg, ResponseCode::ServFail);
        }
    };
    if let Resolution::LetOut(ports) = resolution {
        let parsed = Message::from_vec(&reply).ok()?;
        let (addrs, ttl) = public_addresses(&parsed);
        if !addrs.is_empty() {
            // Before the guest hears the answer: its first connection must pass.
            if let Err(e) = forkd_hypervisor::network::let_out(pid, addrs, ports, ttl).await {
                tracing::warn!("letting out the addresses of {name}: {e}");
                return failure(&msg, ResponseCode::ServFail);
            }
        }
    }
    Some(reply)
}

/// The public IPv4 addresses an answer holds, and the shortest TTL among them (within
/// [`MIN_TTL`]..[`MAX_TTL`]).
fn public_addresses(reply: &Message) -> (Vec<Ipv4Addr>, u32) {
    use forkd_hypervisor::network::policy::Network;
    let mut ttl = MAX_TTL;
    let addrs = reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => {
                ttl = ttl.min(r.ttl);
                Some(a.0)
            }
            _ => None,
        })
        .filter(|a| {
            !Network {
                addr: *a,
                prefix: 32,
                port: None,
            }
            .is_private()
        })
        .collect();
    (addrs, ttl.clamp(MIN_TTL, MAX_TTL))
}

/// An answer with no records and `code`.
fn failure(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut reply = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.iter().cloned());
    reply.to_vec().ok()
}

/// Asks `upstream` (from the daemon's own namespace) and returns its answer.
async fn forward(query: &[u8], upstream: SocketAddr) -> std::io::Result<Vec<u8>> {
    let bind: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind).await?;
    socket.connect(upstream).await?;
    socket.send(query).await?;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(UPSTREAM_TIMEOUT, async {
        loop {
            let n = socket.recv(&mut buf).await?;
            // The same id as the query's: a stray datagram is not the answer.
            if n >= 2 && query.len() >= 2 && buf[..2] == query[..2] {
                return Ok::<usize, std::io::Error>(n);
            }
        }
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    buf.truncate(n);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_parse_with_or_without_a_port() {
        assert_eq!(
            parse_upstream("10.0.0.1").unwrap(),
            "10.0.0.1:53".parse().unwrap()
        );
        assert_eq!(
            parse_upstream("10.0.0.1:5353").unwrap(),
            "10.0.0.1:5353".parse().unwrap()
        );
        assert!(parse_upstream("resolver").is_err());
    }

    #[test]
    fn a_refusal_keeps_the_question_and_the_id() {
        let mut q = Message::query();
        q.metadata.id = 4242;
        q.add_query(hickory_proto::op::Query::query(
            "other.test.".parse().unwrap(),
            hickory_proto::rr::RecordType::A,
        ));
        let reply = Message::from_vec(&failure(&q, ResponseCode::Refused).unwrap()).unwrap();
        assert_eq!(reply.metadata.id, 4242);
        assert_eq!(reply.metadata.response_code, ResponseCode::Refused);
        assert_eq!(reply.queries, q.queries);
    }
}
