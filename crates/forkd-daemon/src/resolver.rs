//! The resolver each sandbox with a NIC asks for names: the gateway's port 53 (UDP and
//! TCP) in its namespace, served by the daemon. Queries go upstream over UDP; one the
//! guest sent over TCP is asked again upstream over TCP when the UDP answer comes back
//! truncated (a guest asking over UDP gets the truncated answer and asks again over TCP,
//! as it would any server).
//!
//! It answers only what the sandbox's egress policy lets out (see
//! [`EgressPolicy::resolves`]): other names are refused (REFUSED). Allowed queries go
//! as they are to the upstream server the daemon was given, and in `deny` mode the
//! public IPv4 addresses of the answer are let out of the sandbox's namespace before
//! the answer reaches the guest, for the answer's TTL (at least a minute), so that the
//! guest's first connection already passes. A guest that floods it gets at most
//! [`IN_FLIGHT`] queries answered at once; the rest are dropped, as a busy server does.

use forkd_core::Sandbox;
use forkd_host::network::policy::{EgressPolicy, Resolution};
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
pub const MIN_TTL: u32 = 60;
/// See [`MIN_TTL`].
pub const MAX_TTL: u32 = 86_400;

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
    let (socket, listener) = forkd_host::network::bind_resolver(pid).await?;
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
                    if let Some(reply) = answer(&query, &policy, pid, upstream, false).await {
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
        let Some(reply) = answer(&query, &current, pid, upstream, true).await else {
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

/// The reply to `query`, which came over TCP when `over_tcp` (none for what is not a DNS
/// query).
async fn answer(
    query: &[u8],
    policy: &EgressPolicy,
    pid: u32,
    upstream: SocketAddr,
    over_tcp: bool,
) -> Option<Vec<u8>> {
    let Checked {
        msg,
        name,
        resolution,
    } = match check(query, policy) {
        Ok(checked) => checked,
        Err(reply) => return reply,
    };
    let reply = match forward(query, upstream, over_tcp).await {
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
            if let Err(e) = forkd_host::network::let_out(pid, addrs, ports, ttl).await {
                tracing::warn!("letting out the addresses of {name}: {e}");
                return failure(&msg, ResponseCode::ServFail);
            }
        }
    }
    Some(reply)
}

/// A guest's query that may go upstream: the message, its one name, and what the
/// policy says of it (anything but [`Resolution::Refused`]).
#[derive(Debug)]
pub struct Checked {
    /// The query, parsed.
    pub msg: Message,
    /// The name it asks for.
    pub name: String,
    /// What the policy says of the name.
    pub resolution: Resolution,
}

/// Checks the guest's `query` before anything goes upstream; `Err` holds the reply it
/// gets at once (FORMERR, REFUSED), or none for what is not a DNS query. Public for the
/// fuzz targets (the guest's bytes reach it unfiltered).
pub fn check(query: &[u8], policy: &EgressPolicy) -> Result<Checked, Option<Vec<u8>>> {
    let msg = Message::from_vec(query).map_err(|_| None)?;
    if msg.metadata.message_type != MessageType::Query {
        return Err(None);
    }
    // One question a message (RFC 9619): a second one would go upstream unchecked.
    let [question] = msg.queries.as_slice() else {
        return Err(failure(&msg, ResponseCode::FormErr));
    };
    let name = question.name().to_ascii();
    let resolution = policy.resolves(&name);
    if resolution == Resolution::Refused {
        return Err(failure(&msg, ResponseCode::Refused));
    }
    Ok(Checked {
        msg,
        name,
        resolution,
    })
}

/// The IPv4 addresses an answer holds that are not closed to sandboxes (see
/// [`forkd_host::network::closed`]), and the shortest TTL among them (within
/// [`MIN_TTL`]..[`MAX_TTL`]). Public for the fuzz targets: the upstream server's
/// answer is not the daemon's own bytes.
pub fn public_addresses(reply: &Message) -> (Vec<Ipv4Addr>, u32) {
    let closed = forkd_host::network::closed::current();
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
        .filter(|a| !closed.closes(*a))
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

/// Asks `upstream` (from the daemon's own namespace) and returns its answer: over UDP,
/// and again over TCP when that answer is truncated and `over_tcp` (the guest asked over
/// TCP, so it already had a truncated answer, or wants the whole one). An upstream
/// server that does not answer over TCP leaves the guest the truncated answer, which is
/// what there is.
async fn forward(query: &[u8], upstream: SocketAddr, over_tcp: bool) -> std::io::Result<Vec<u8>> {
    let reply = within_timeout(forward_udp(query, upstream)).await?;
    if over_tcp && truncated(&reply) {
        match within_timeout(forward_tcp(query, upstream)).await {
            Ok(whole) => return Ok(whole),
            Err(e) => tracing::debug!("asking {upstream} again over TCP: {e}"),
        }
    }
    Ok(reply)
}

async fn within_timeout(
    f: impl std::future::Future<Output = std::io::Result<Vec<u8>>>,
) -> std::io::Result<Vec<u8>> {
    tokio::time::timeout(UPSTREAM_TIMEOUT, f)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))?
}

/// Whether a DNS message has its TC (truncated) flag: bit 1 of the header's third byte
/// (RFC 1035 4.1.1).
fn truncated(message: &[u8]) -> bool {
    message.get(2).is_some_and(|b| b & 0x02 != 0)
}

/// Whether `reply` answers `query`: the same id, so a stray message is not the answer.
fn same_id(query: &[u8], reply: &[u8]) -> bool {
    reply.len() >= 2 && query.len() >= 2 && reply[..2] == query[..2]
}

/// One query over TCP, with its two-byte length either way (RFC 1035 4.2.2).
async fn forward_tcp(query: &[u8], upstream: SocketAddr) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let len = u16::try_from(query.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "query too long"))?;
    let mut conn = tokio::net::TcpStream::connect(upstream).await?;
    let mut framed = len.to_be_bytes().to_vec();
    framed.extend_from_slice(query);
    conn.write_all(&framed).await?;
    let mut n = [0u8; 2];
    conn.read_exact(&mut n).await?;
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(n))];
    conn.read_exact(&mut reply).await?;
    if !same_id(query, &reply) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the upstream server answered another query over TCP",
        ));
    }
    Ok(reply)
}

/// One query over UDP.
async fn forward_udp(query: &[u8], upstream: SocketAddr) -> std::io::Result<Vec<u8>> {
    let bind: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind).await?;
    socket.connect(upstream).await?;
    socket.send(query).await?;
    // The largest datagram: an EDNS answer may be bigger than 4 KiB, and a smaller
    // buffer would cut it silently.
    let mut buf = vec![0u8; 65_535];
    loop {
        let n = socket.recv(&mut buf).await?;
        if same_id(query, &buf[..n]) {
            buf.truncate(n);
            return Ok(buf);
        }
    }
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

    /// An upstream server on loopback that answers `name` truncated over UDP and with
    /// `records` A records over TCP, on one port; returns its address.
    async fn truncating_upstream(records: u8) -> SocketAddr {
        use hickory_proto::rr::{rdata::A, Record};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (udp, tcp) = loop {
            let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            if let Ok(tcp) = tokio::net::TcpListener::bind(udp.local_addr().unwrap()).await {
                break (udp, tcp);
            }
        };
        let addr = udp.local_addr().unwrap();
        let reply = move |query: &[u8], full: bool| {
            let q = Message::from_vec(query).unwrap();
            let mut r = Message::response(q.metadata.id, q.metadata.op_code);
            r.add_queries(q.queries.iter().cloned());
            r.metadata.truncation = !full;
            if full {
                for i in 0..records {
                    r.add_answer(Record::from_rdata(
                        q.queries[0].name().clone(),
                        300,
                        RData::A(A(Ipv4Addr::new(198, 51, 100, i))),
                    ));
                }
            }
            r.to_vec().unwrap()
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = udp.recv_from(&mut buf).await {
                let _ = udp.send_to(&reply(&buf[..n], false), from).await;
            }
        });
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = tcp.accept().await {
                let mut n = [0u8; 2];
                conn.read_exact(&mut n).await.unwrap();
                let mut query = vec![0u8; usize::from(u16::from_be_bytes(n))];
                conn.read_exact(&mut query).await.unwrap();
                let r = reply(&query, true);
                let mut framed = u16::try_from(r.len()).unwrap().to_be_bytes().to_vec();
                framed.extend_from_slice(&r);
                conn.write_all(&framed).await.unwrap();
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_tcp_query_whose_udp_answer_is_truncated_is_asked_again_over_tcp() {
        let upstream = truncating_upstream(100).await;
        let mut q = Message::query();
        q.metadata.id = 777;
        q.add_query(hickory_proto::op::Query::query(
            "big.test.".parse().unwrap(),
            hickory_proto::rr::RecordType::A,
        ));
        let query = q.to_vec().unwrap();
        // A guest asking over UDP gets the truncated answer, to ask again over TCP.
        let over_udp = forward(&query, upstream, false).await.unwrap();
        assert!(truncated(&over_udp));
        // Over TCP it gets the whole answer, longer than any 512-byte datagram.
        let over_tcp = forward(&query, upstream, true).await.unwrap();
        assert!(!truncated(&over_tcp));
        assert!(over_tcp.len() > 512, "{}", over_tcp.len());
        let whole = Message::from_vec(&over_tcp).unwrap();
        assert_eq!(whole.metadata.id, 777);
        assert_eq!(whole.answers.len(), 100);

        // An upstream server with nothing on TCP leaves the truncated answer, not a
        // failure.
        let udp_only = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let at = udp_only.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = udp_only.recv_from(&mut buf).await {
                let mut r = Message::from_vec(&buf[..n]).unwrap();
                r.metadata.message_type = MessageType::Response;
                r.metadata.truncation = true;
                let _ = udp_only.send_to(&r.to_vec().unwrap(), from).await;
            }
        });
        let partial = forward(&query, at, true).await.unwrap();
        assert!(truncated(&partial));
        assert_eq!(Message::from_vec(&partial).unwrap().metadata.id, 777);
    }

    #[tokio::test]
    async fn a_query_of_more_than_one_question_is_refused_unasked() {
        let question = |name: &str| {
            hickory_proto::op::Query::query(name.parse().unwrap(), hickory_proto::rr::RecordType::A)
        };
        let mut q = Message::query();
        q.metadata.id = 9;
        q.add_query(question("allowed.test."));
        q.add_query(question("other.test."));
        let policy: EgressPolicy = serde_json::from_value(
            serde_json::json!({"egress": "deny", "allow": ["allowed.test"]}),
        )
        .unwrap();
        // Nothing listens upstream: an answer other than FORMERR would be SERVFAIL.
        let nowhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let code = |bytes: Vec<u8>| Message::from_vec(&bytes).unwrap().metadata.response_code;
        let two = answer(&q.to_vec().unwrap(), &policy, 0, nowhere, false).await;
        assert_eq!(code(two.unwrap()), ResponseCode::FormErr);
        q.queries.clear();
        let none = answer(&q.to_vec().unwrap(), &policy, 0, nowhere, false).await;
        assert_eq!(code(none.unwrap()), ResponseCode::FormErr);
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
