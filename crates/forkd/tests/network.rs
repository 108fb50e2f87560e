//! Each sandbox's network, shown on a real daemon with real VMs and test hosts this file
//! makes itself in network namespaces on this machine (never an outside address):
//! egress follows the policy a fork gives and changes while the child runs; a `python`
//! child downloads a file with urllib from an allowed host; children reach neither each
//! other, nor the host, nor the daemon; a child's web server answers through the daemon;
//! names resolve (through a DNS server the test runs) only when allowed, and open only
//! the open addresses they resolved to; an address of every special-purpose range the
//! host can route, put on a test host the guest reaches otherwise, stays closed over TCP
//! and UDP, and IPv6 frames a guest writes itself go nowhere; a template built with
//! `network = "none"` has no NIC.
//!
//! One daemon, one `python` template (with a NIC) and one `minimal` template without
//! are built once for the whole file.

mod common;

use common::{call, create, exec, runtime, Daemon};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};

/// The test hosts' network: the host's side is .1, the hosts are .2 and .3.
const NET: &str = "10.252.77";
/// The port the test hosts serve HTTP on.
const PORT: u16 = 8000;
/// The daemon's TCP port (on every address of the host).
const DAEMON_PORT: u16 = 47_131;

/// Two HTTP servers (one per address) in a network namespace of their own, linked to the
/// host by a veth pair; removed when dropped.
struct TestHosts {
    ns: String,
    server: Child,
    /// A UDP echo server on port 8001 of every address, which logs what it receives.
    udp: Child,
    /// What the servers serve: `file.bin`.
    dir: tempfile::TempDir,
    /// The contents of `file.bin`.
    file: Vec<u8>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestHosts {
    fn start() -> TestHosts {
        let ns = format!("forkd-test-{}", std::process::id());
        let (host_end, ns_end) = (
            format!("nt{}h", std::process::id() % 100_000),
            format!("nt{}n", std::process::id() % 100_000),
        );
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", &ns_end, "netns", &ns,
        ]);
        ip(&["addr", "add", &format!("{NET}.1/24"), "dev", &host_end]);
        ip(&["link", "set", &host_end, "up"]);
        for args in [
            vec!["addr", "add", &format!("{NET}.2/24"), "dev", &ns_end],
            vec!["addr", "add", &format!("{NET}.3/24"), "dev", &ns_end],
            // Not opened by the daemon: closed like the rest of the host's networks.
            vec!["addr", "add", &format!("{NET}.4/24"), "dev", &ns_end],
            vec!["link", "set", &ns_end, "up"],
            vec!["link", "set", "lo", "up"],
            vec!["route", "add", "default", "via", &format!("{NET}.1")],
        ] {
            let mut full = vec!["-n", ns.as_str()];
            full.extend(args.iter().copied());
            ip(&full);
        }
        let dir = tempfile::tempdir().unwrap();
        let file: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(dir.path().join("file.bin"), &file).unwrap();
        let server = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-m", "http.server"])
            .arg(PORT.to_string())
            .arg("--directory")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let udp = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", UDP_ECHO])
            .arg(dir.path().join("udp.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let hosts = TestHosts {
            ns,
            server,
            udp,
            dir,
            file,
        };
        // Serving once it answers from the host.
        for _ in 0..100 {
            if std::net::TcpStream::connect((format!("{NET}.2"), PORT)).is_ok() {
                return hosts;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the test hosts' HTTP server did not start");
    }
}

/// The names the test's DNS server knows.
const RECORDS: [(&str, &str); 3] = [
    ("allowed.test", "203.0.113.10"),
    ("other.test", "203.0.113.11"),
    // An allowed name that points into a closed network: it must not open it.
    ("private.test", "10.252.77.4"),
];

impl TestHosts {
    /// Gives the hosts the public addresses of [`RECORDS`] too (routed to them from the
    /// host), and serves those names on `{NET}.2:53` from a thread in their namespace.
    fn serve_dns(&self) {
        for (_, addr) in RECORDS {
            if addr.starts_with("203.") {
                let ns_end = self.ns_end();
                ip(&[
                    "-n",
                    &self.ns,
                    "addr",
                    "add",
                    &format!("{addr}/32"),
                    "dev",
                    &ns_end,
                ]);
                ip(&[
                    "route",
                    "add",
                    &format!("{addr}/32"),
                    "via",
                    &format!("{NET}.2"),
                ]);
            }
        }
        for over_tcp in [false, true] {
            let netns = std::fs::File::open(format!("/var/run/netns/{}", self.ns)).unwrap();
            let (ready_tx, ready) = std::sync::mpsc::channel();
            // Each ends with the process (the namespace, and the socket with it, outlive
            // nothing of the test).
            std::thread::spawn(move || {
                nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
                let at = (format!("{NET}.2"), 53);
                if over_tcp {
                    let listener = std::net::TcpListener::bind(at).unwrap();
                    ready_tx.send(()).unwrap();
                    for mut conn in listener.incoming().flatten() {
                        use std::io::{Read, Write};
                        let mut n = [0u8; 2];
                        let mut query = Vec::new();
                        if conn.read_exact(&mut n).is_ok() {
                            query.resize(usize::from(u16::from_be_bytes(n)), 0);
                            let _ = conn.read_exact(&mut query);
                        }
                        if let Some(reply) = dns_reply(&query, true) {
                            let mut framed =
                                u16::try_from(reply.len()).unwrap().to_be_bytes().to_vec();
                            framed.extend_from_slice(&reply);
                            let _ = conn.write_all(&framed);
                        }
                    }
                } else {
                    let socket = std::net::UdpSocket::bind(at).unwrap();
                    ready_tx.send(()).unwrap();
                    let mut buf = [0u8; 4096];
                    while let Ok((n, from)) = socket.recv_from(&mut buf) {
                        if let Some(reply) = dns_reply(&buf[..n], false) {
                            let _ = socket.send_to(&reply, from);
                        }
                    }
                }
            });
            ready.recv().unwrap();
        }
    }

    fn ns_end(&self) -> String {
        format!("nt{}n", std::process::id() % 100_000)
    }

    fn host_end(&self) -> String {
        format!("nt{}h", std::process::id() % 100_000)
    }

    /// What the UDP echo server received: a line per datagram, its payload first.
    fn udp_log(&self) -> std::path::PathBuf {
        self.dir.path().join("udp.log")
    }

    /// Gives the hosts the addresses `v4` and `v6` too, each routed to them from the host.
    fn add_addresses(&self, v4: &[&str], v6: &[&str]) {
        let (ns_end, host_end) = (self.ns_end(), self.host_end());
        for a in v4.iter().filter(|a| !a.starts_with(NET)) {
            let a32 = format!("{a}/32");
            ip(&["-n", &self.ns, "addr", "add", &a32, "dev", &ns_end]);
            ip(&["route", "add", &a32, "via", &format!("{NET}.2")]);
        }
        for a in v6 {
            let a128 = format!("{a}/128");
            ip(&[
                "-n", &self.ns, "addr", "add", &a128, "dev", &ns_end, "nodad",
            ]);
            ip(&["-6", "route", "add", &a128, "dev", &host_end]);
        }
    }
}

/// A UDP echo server on port 8001 of every address (IPv4 and IPv6), appending each
/// datagram's payload and sender to the file `argv[1]`.
const UDP_ECHO: &str = r#"import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", 8001))
log = open(sys.argv[1], "a", buffering=1)
while True:
    data, peer = s.recvfrom(2048)
    log.write(data[:64].decode(errors="replace") + " from " + peer[0] + "\n")
    s.sendto(data, peer)"#;

/// The test's DNS server's answer to `query`, asked over TCP when `over_tcp`: the
/// address of a name of [`RECORDS`], and for [`BIG_NAME`] [`BIG_COUNT`] addresses, too
/// many for a 512-byte datagram, so that over UDP it answers truncated and empty.
fn dns_reply(query: &[u8], over_tcp: bool) -> Option<Vec<u8>> {
    use hickory_proto::op::{Message, MessageType, ResponseCode};
    use hickory_proto::rr::{rdata::A, RData, Record};
    let query = Message::from_vec(query).ok()?;
    let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
    reply.metadata.message_type = MessageType::Response;
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.iter().cloned());
    let q = query.queries.first()?;
    let name = q.name().to_ascii();
    let name = name.trim_end_matches('.');
    let is_a = q.query_type() == hickory_proto::rr::RecordType::A;
    let a = |addr: std::net::Ipv4Addr| Record::from_rdata(q.name().clone(), 300, RData::A(A(addr)));
    if name == BIG_NAME {
        if !over_tcp {
            reply.metadata.truncation = true;
        } else if is_a {
            for i in 0..BIG_COUNT {
                reply.add_answer(a(std::net::Ipv4Addr::new(198, 51, 100, i)));
            }
        }
        return reply.to_vec().ok();
    }
    match RECORDS.iter().find(|(n, _)| name == *n) {
        Some((_, addr)) if is_a => {
            reply.add_answer(a(addr.parse().unwrap()));
        }
        Some(_) => {}
        None => reply.metadata.response_code = ResponseCode::NXDomain,
    }
    reply.to_vec().ok()
}

/// A name the test's DNS server answers with [`BIG_COUNT`] addresses.
const BIG_NAME: &str = "big.test";
const BIG_COUNT: u8 = 40;

impl Drop for TestHosts {
    fn drop(&mut self) {
        for child in [&mut self.server, &mut self.udp] {
            let _ = child.kill();
            let _ = child.wait();
        }
        // The veth pair goes with the namespace.
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// The daemon (also on TCP, on every address: the sandboxes must not reach it), its two
/// snapshots (`python` with a NIC, `nonet` without) and the test hosts, made once; then
/// each promise in turn.
#[test]
fn sandbox_networks() {
    let listen = format!("0.0.0.0:{DAEMON_PORT}");
    let secrets = tempfile::tempdir().unwrap();
    let token = secrets.path().join("token");
    common::write_secret(&token, "network-test-token-network-test-token");
    // The shared snapshot first (built by a daemon of its own where no other test
    // process built it yet): other daemons run beside this test's, applying the host's
    // rules with no `--egress-open` of theirs, and must leave this one's networks open.
    common::fixture::snapshot("python", "python");
    let hosts = TestHosts::start();
    hosts.serve_dns();
    let daemon = Daemon::start(&[
        "--listen",
        &listen,
        "--insecure-plaintext",
        "--token-file",
        token.to_str().unwrap(),
        "--dns-upstream",
        &format!("{NET}.2"),
        // The test hosts: on one of the host's own networks (closed by default), and on
        // a documentation range (closed too); opened on purpose, as an operator opens a
        // proxy. {NET}.4 stays closed.
        "--egress-open",
        &format!("{NET}.2/32"),
        "--egress-open",
        &format!("{NET}.3/32"),
        "--egress-open",
        "203.0.113.0/24",
    ]);
    runtime().block_on(async {
        let c = daemon.unix();
        daemon.link_snapshot("python", "python");
        let (s, op) = common::build_recipe(
            &c,
            "nonet",
            "image = \"minimal\"\nmemory_mib = 256\nnetwork = \"none\"\n",
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        common::wait_operation(&c, op["id"].as_str().unwrap()).await;

        egress_follows_the_policy_and_changes_while_the_child_runs(&c, &hosts).await;
        children_reach_neither_each_other_nor_the_host_nor_the_daemon(&c, &daemon).await;
        names_resolve_only_when_allowed_and_open_only_what_they_resolved_to(&c).await;
        every_closed_network_stays_closed_from_inside(&c, &hosts).await;
        a_fork_bomb_and_a_memory_hog_leave_a_neighbour_answering(&c).await;
        a_template_built_without_network_has_no_nic(&c).await;
    });
}

/// Forks one `python` child with the egress policy `network`.
async fn fork_with(c: &forkd_daemon::client::Client, network: Value) -> String {
    let (s, v) = call(
        c,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"snapshot": "python", "network": network})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["sandboxes"][0]["id"].as_str().unwrap().to_owned()
}

/// Whether the child connects to `addr:port` within 3 s ("ok", else the error).
async fn connect(c: &forkd_daemon::client::Client, id: &str, addr: &str, port: u16) -> String {
    socket_call(
        c,
        id,
        &format!("socket.create_connection(('{addr}', {port}), timeout=3).close(); print('ok')"),
    )
    .await
}

/// Runs `statement` (Python, with `socket` imported) in the child; returns what it
/// printed, or the name of the `OSError` it raised.
async fn socket_call(c: &forkd_daemon::client::Client, id: &str, statement: &str) -> String {
    let code = format!(
        "import socket\ntry:\n    {statement}\nexcept OSError as e:\n    print(type(e).__name__)\n"
    );
    let r = exec(c, id, &format!("python3 -c \"{code}\"")).await;
    String::from_utf8(common::b64(&r["stdout_b64"]))
        .unwrap()
        .trim()
        .to_owned()
}

async fn set_network(c: &forkd_daemon::client::Client, id: &str, network: Value) -> Value {
    let (s, v) = call(
        c,
        Method::PUT,
        &format!("/v1/sandboxes/{id}/network"),
        Some(network),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

async fn egress_follows_the_policy_and_changes_while_the_child_runs(
    c: &forkd_daemon::client::Client,
    hosts: &TestHosts,
) {
    {
        let allowed = format!("{NET}.2:{PORT}");
        let id = fork_with(c, json!({"allow": [allowed]})).await;
        let (_, info) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(
            info["network"],
            json!({"egress": "deny", "allow": [allowed], "deny": []})
        );

        // The shape of a package install through an allow-list.
        let got = exec(
            c,
            &id,
            &format!(
                "python3 -c \"import urllib.request,hashlib; d=urllib.request.urlopen('http://{NET}.2:{PORT}/file.bin', timeout=10).read(); print(len(d), hashlib.sha256(d).hexdigest())\""
            ),
        )
        .await;
        let want = {
            use sha2::Digest;
            format!(
                "{} {:x}",
                hosts.file.len(),
                sha2::Sha256::digest(&hosts.file)
            )
        };
        assert_eq!(
            String::from_utf8(common::b64(&got["stdout_b64"]))
                .unwrap()
                .trim(),
            want,
            "{got}"
        );
        // The other host is not in the list.
        assert_ne!(connect(c, &id, &format!("{NET}.3"), PORT).await, "ok");

        // Allow everything but one range: what the operator opened is reachable, the
        // denied range and the closed networks (the host's own, {NET}.4) are not.
        set_network(
            c,
            &id,
            json!({"egress": "allow", "deny": ["203.0.113.0/24"]}),
        )
        .await;
        // Another daemon of this host, started now with nothing opened, applies the
        // host's rules again: they keep open what this test's daemon opened.
        let other = Daemon::start(&[]);
        assert_eq!(connect(c, &id, &format!("{NET}.2"), PORT).await, "ok");
        drop(other);
        assert_ne!(connect(c, &id, "203.0.113.10", PORT).await, "ok");
        assert_ne!(connect(c, &id, &format!("{NET}.4"), PORT).await, "ok");
        set_network(
            c,
            &id,
            json!({"egress": "deny", "allow": [format!("{NET}.3/32")]}),
        )
        .await;
        assert_eq!(connect(c, &id, &format!("{NET}.3"), PORT).await, "ok");
        assert_ne!(connect(c, &id, &format!("{NET}.2"), PORT).await, "ok");
        // A closed network stays closed even listed: no policy opens it.
        set_network(
            c,
            &id,
            json!({"egress": "deny", "allow": [format!("{NET}.4"), format!("{NET}.3")]}),
        )
        .await;
        assert_ne!(connect(c, &id, &format!("{NET}.4"), PORT).await, "ok");
        assert_eq!(connect(c, &id, &format!("{NET}.3"), PORT).await, "ok");

        // Off: the guest sees its link down.
        let v = set_network(c, &id, json!({"egress": "off"})).await;
        assert_eq!(v["network"]["egress"], "off");
        let carrier = exec(c, &id, "cat /sys/class/net/eth0/carrier").await;
        assert_eq!(common::b64(&carrier["stdout_b64"]), b"0\n");
        assert_ne!(connect(c, &id, &format!("{NET}.3"), PORT).await, "ok");
        set_network(
            c,
            &id,
            json!({"egress": "deny", "allow": [format!("{NET}.3")]}),
        )
        .await;
        let carrier = exec(c, &id, "cat /sys/class/net/eth0/carrier").await;
        assert_eq!(common::b64(&carrier["stdout_b64"]), b"1\n");
        assert_eq!(connect(c, &id, &format!("{NET}.3"), PORT).await, "ok");

        // Bad policies are refused whole, and the running one stays.
        for bad in [
            json!({"egress": "deny", "deny": ["203.0.113.0/24"]}),
            json!({"allow": ["not a name"]}),
            json!({"allow": ["10.1.2.3/8"]}),
            json!({"egress": "sometimes"}),
        ] {
            let (s, v) = call(
                c,
                Method::PUT,
                &format!("/v1/sandboxes/{id}/network"),
                Some(bad.clone()),
            )
            .await;
            assert!(s.is_client_error(), "{bad} -> {s} {v}");
        }
        assert_eq!(connect(c, &id, &format!("{NET}.3"), PORT).await, "ok");
        let (s, _) = call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
    }
}

/// DNS queries over TCP to the sandbox's resolver, by hand (the image has no DNS
/// tools): prints each answer's response code, whether it holds the test's address, and
/// how many answers it has.
const TCP_QUERIES: &str = r#"python3 - <<'EOF'
import socket, struct
def ask(name):
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    msg = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
    s = socket.create_connection(("10.254.254.1", 53), timeout=5)
    s.sendall(struct.pack(">H", len(msg)) + msg)
    data = b""
    while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    reply = data[2:]
    print(reply[3] & 15, socket.inet_aton("203.0.113.10") in reply, struct.unpack(">H", reply[6:8])[0])
ask("allowed.test")
ask("other.test")
ask("big.test")
EOF"#;

/// What `socket.gethostbyname(name)` says in the child (the error's name if it fails).
async fn resolve(c: &forkd_daemon::client::Client, id: &str, name: &str) -> String {
    socket_call(c, id, &format!("print(socket.gethostbyname('{name}'))")).await
}

async fn names_resolve_only_when_allowed_and_open_only_what_they_resolved_to(
    c: &forkd_daemon::client::Client,
) {
    let id = fork_with(
        c,
        json!({"allow": ["allowed.test", "*.private.test", "private.test", BIG_NAME]}),
    )
    .await;
    // Nothing resolved yet: the address is not open.
    assert_ne!(connect(c, &id, "203.0.113.10", PORT).await, "ok");
    assert_eq!(resolve(c, &id, "allowed.test").await, "203.0.113.10");
    assert_eq!(connect(c, &id, "203.0.113.10", PORT).await, "ok");
    // The same over TCP (RFC 1035 4.2.2): the answer's code, address and count, then a
    // refusal, then a name whose answer the upstream server truncates over UDP: the
    // resolver asks again over TCP, and the guest gets every address.
    let tcp = exec(c, &id, TCP_QUERIES).await;
    assert_eq!(
        String::from_utf8(common::b64(&tcp["stdout_b64"])).unwrap(),
        format!("0 True 1\n5 False 0\n0 False {BIG_COUNT}\n"),
        "{tcp}"
    );
    // A name not in the list is not answered, and its address stays shut.
    assert_eq!(resolve(c, &id, "other.test").await, "gaierror");
    assert_ne!(connect(c, &id, "203.0.113.11", PORT).await, "ok");
    // A name that points into a closed network resolves, and opens nothing.
    assert_eq!(resolve(c, &id, "private.test").await, format!("{NET}.4"));
    assert_ne!(connect(c, &id, &format!("{NET}.4"), PORT).await, "ok");
    // A new policy takes back what the old one's names had opened.
    set_network(c, &id, json!({"allow": ["other.test"]})).await;
    assert_ne!(connect(c, &id, "203.0.113.10", PORT).await, "ok");
    assert_eq!(resolve(c, &id, "allowed.test").await, "gaierror");
    assert_eq!(resolve(c, &id, "other.test").await, "203.0.113.11");
    assert_eq!(connect(c, &id, "203.0.113.11", PORT).await, "ok");
    call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
}

/// The address of a child's end of its uplink, as the host sees it.
fn uplink_addr(pid: u32) -> String {
    let out = Command::new("nsenter")
        .args([
            "-t",
            &pid.to_string(),
            "-n",
            "ip",
            "-4",
            "-o",
            "addr",
            "show",
            "uplink",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let word = text
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .unwrap_or_else(|| panic!("no uplink address in {text:?}"));
    word.split('/').next().unwrap().to_owned()
}

async fn children_reach_neither_each_other_nor_the_host_nor_the_daemon(
    c: &forkd_daemon::client::Client,
    daemon: &Daemon,
) {
    {
        // Even with every private range they might try listed: closed networks stay
        // closed, and the host's own rules refuse traffic between sandboxes and to the
        // host itself.
        let open =
            json!({"egress": "allow", "allow": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]});
        let a = fork_with(c, open.clone()).await;
        let b = fork_with(c, open).await;
        let pid = |id: &str| {
            let c = &c;
            let id = id.to_owned();
            async move {
                let (_, v) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
                u32::try_from(v["pid"].as_u64().unwrap()).unwrap()
            }
        };
        let (pa, pb) = (pid(&a).await, pid(&b).await);
        let ls = daemon.forkd().arg("ls").output().unwrap();
        let ls = String::from_utf8(ls.stdout).unwrap();
        let row = ls
            .lines()
            .find(|l| l.starts_with(&a))
            .unwrap_or_else(|| panic!("{ls}"));
        assert!(row.contains(" allow "), "{ls}");
        // A server in B, and B's address as the host routes it.
        exec(
            c,
            &b,
            // Until it listens (a loaded TCG guest can take seconds to start Python).
            "nohup python3 -m http.server 9000 >/dev/null 2>&1 & python3 -c \"\
             import socket, time\nfor _ in range(600):\n    try:\n        \
             socket.create_connection(('127.0.0.1', 9000), 1).close(); break\n    \
             except OSError: time.sleep(0.1)\n\"",
        )
        .await;
        assert_eq!(connect(c, &b, "127.0.0.1", 9000).await, "ok");
        let b_addr = uplink_addr(pb);
        assert_ne!(connect(c, &a, &b_addr, 9000).await, "ok");
        // Both children have the same address inside: A cannot reach B by it either
        // (it is A itself).
        let host_side = {
            let a_addr = uplink_addr(pa);
            let last: u8 = a_addr.rsplit('.').next().unwrap().parse().unwrap();
            format!("{}.{}", a_addr.rsplit_once('.').unwrap().0, last - 1)
        };
        // The daemon listens on every address of the host: on A's gateway on the host,
        // and on the test hosts' side of the host.
        assert!(std::net::TcpStream::connect(("127.0.0.1", DAEMON_PORT)).is_ok());
        assert_ne!(connect(c, &a, &host_side, DAEMON_PORT).await, "ok");
        assert_ne!(connect(c, &a, &format!("{NET}.1"), DAEMON_PORT).await, "ok");
        // While the test hosts, beyond the host, are reachable.
        assert_eq!(connect(c, &a, &format!("{NET}.2"), PORT).await, "ok");

        // B's server, reached through the daemon: as HTTP, and through a forwarded port.
        let (s, listing) = call(
            c,
            Method::GET,
            &format!("/v1/sandboxes/{b}/ports/9000/?q=1"),
            None,
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        assert!(
            listing
                .as_str()
                .unwrap()
                .contains("Directory listing for /?q=1"),
            "{listing}"
        );
        let (s, v) = call(
            c,
            Method::GET,
            &format!("/v1/sandboxes/{b}/ports/9001/"),
            None,
        )
        .await;
        assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
        let local: u16 = common::free_port()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let mut forward = daemon
            .forkd()
            .args([
                "port-forward",
                &b,
                "9000",
                "--local-port",
                &local.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let answer = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            for _ in 0..100 {
                if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", local)) {
                    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
                    let mut answer = String::new();
                    s.read_to_string(&mut answer).unwrap();
                    return answer;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            panic!("port-forward did not listen");
        })
        .await
        .unwrap();
        let _ = forward.kill();
        let _ = forward.wait();
        assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
        assert!(answer.contains("Directory listing for /"), "{answer}");
        for id in [a, b] {
            call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        }
    }
}

/// An address of every IPv4 special-purpose range the host routes (Linux forwards
/// nothing to 0.0.0.0/8, loopback, multicast or the broadcast address, which need no
/// rule), and five IPv6 ones.
const CLOSED_V4: [&str; 15] = [
    "10.11.12.13",
    "100.64.1.2",
    "169.254.7.7",
    "172.16.5.5",
    "192.0.0.9",
    "192.0.2.5",
    "192.31.196.5",
    "192.52.193.5",
    "192.88.99.5",
    "192.168.77.5",
    "192.175.48.5",
    "198.18.0.5",
    "198.51.100.5",
    "240.0.0.5",
    // One of the host's own networks, not opened.
    "10.252.77.4",
];
const CLOSED_V6: [&str; 5] = [
    "fd00:f0::5",
    "2001:db8::5",
    "2001:2::5",
    "64:ff9b::c000:205",
    "100::5",
];

/// In a child allowed everywhere: TCP and UDP to each closed address fail, while the
/// same probe reaches an opened address set up the same way; the child then turns IPv6
/// back on and writes IPv6 frames to each IPv6 address itself (a raw socket), and the
/// test hosts, listening on them, receive none, while the same raw frame to the opened
/// IPv4 address arrives.
async fn every_closed_network_stays_closed_from_inside(
    c: &forkd_daemon::client::Client,
    hosts: &TestHosts,
) {
    hosts.add_addresses(&CLOSED_V4, &CLOSED_V6);
    // The host reaches every one of them: only the sandbox's rules stand in between.
    for a in CLOSED_V4 {
        assert!(
            std::net::TcpStream::connect_timeout(
                &format!("{a}:{PORT}").parse().unwrap(),
                std::time::Duration::from_secs(3)
            )
            .is_ok(),
            "the host does not reach {a}"
        );
    }
    let id = fork_with(c, json!({"egress": "allow"})).await;
    let mut targets: Vec<&str> = CLOSED_V4.to_vec();
    targets.push(OPEN_PROBE);
    let probe = format!(
        "python3 - {} <<'EOF'
{PROBE}
EOF",
        targets.join(" ")
    );
    let r = exec(c, &id, &probe).await;
    let out = String::from_utf8(common::b64(&r["stdout_b64"])).unwrap();
    let reached: Value = serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("{r}"));
    assert_eq!(reached[OPEN_PROBE], json!(["tcp"]), "{reached}");
    for a in CLOSED_V4 {
        assert_eq!(reached[a], json!([]), "{a} was reached over TCP: {reached}");
    }
    let raw = format!(
        "python3 - {OPEN_PROBE} {} <<'EOF'
{RAW_FRAMES}
EOF",
        CLOSED_V6.join(" ")
    );
    let r = exec(c, &id, &raw).await;
    assert_eq!(common::b64(&r["stdout_b64"]), b"sent\n", "{r}");
    // What the test hosts' UDP listener received, by the probe's payload.
    let mut got = String::new();
    for _ in 0..50 {
        got = std::fs::read_to_string(hosts.udp_log()).unwrap_or_default();
        if got.contains("raw4") && got.contains(&format!("udp {OPEN_PROBE} ")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        got.contains("raw4"),
        "the raw IPv4 frame did not arrive: {got:?}"
    );
    assert!(!got.contains("raw6"), "an IPv6 frame got out: {got:?}");
    // The probe's datagrams: the opened address's arrived, no closed one's did.
    assert!(got.contains(&format!("udp {OPEN_PROBE} ")), "{got:?}");
    for a in CLOSED_V4 {
        assert!(
            !got.contains(&format!("udp {a} ")),
            "{a} was reached over UDP: {got:?}"
        );
    }
    call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
}

/// One child under the default policy runs a fork bomb and a memory hog (as root in
/// its guest); another child still answers an exec, and so does the first one's
/// neighbourhood on the host: the daemon lists both.
async fn a_fork_bomb_and_a_memory_hog_leave_a_neighbour_answering(
    c: &forkd_daemon::client::Client,
) {
    let ids = create(c, "python", 2).await;
    let (hostile, neighbour) = (&ids[0], &ids[1]);
    let r = exec(
        c,
        hostile,
        "nohup python3 -c 'b = []\nwhile True: b.append(bytearray(1 << 20))' >/dev/null 2>&1 & \
         nohup sh -c 'f() { f | f & }; f' >/dev/null 2>&1 & echo started",
    )
    .await;
    assert_eq!(common::b64(&r["stdout_b64"]), b"started\n", "{r}");
    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    for _ in 0..3 {
        let r = exec(c, neighbour, "echo alive").await;
        assert_eq!(common::b64(&r["stdout_b64"]), b"alive\n", "{r}");
    }
    let (s, listed) = call(c, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK);
    for id in &ids {
        assert!(listed.to_string().contains(id.as_str()), "{listed}");
        call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    }
}

/// The opened address the probes must reach.
const OPEN_PROBE: &str = "203.0.113.10";

/// TCP to port 8000 of each address in `argv`, at once, and three datagrams `udp ADDR`
/// to its port 8001 (what arrives, the test hosts' log says: a reply would leave from
/// their main address, which the sandbox's NAT would not take for the answer); prints
/// what each reached over TCP, as JSON.
const PROBE: &str = r#"import socket, sys, threading, json
res = {}
def probe(a):
    r = []
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(3):
        try:
            u.sendto(("udp " + a + " ").encode(), (a, 8001))
        except OSError:
            pass
    try:
        socket.create_connection((a, 8000), timeout=3).close()
        r.append("tcp")
    except OSError:
        pass
    res[a] = r
ts = [threading.Thread(target=probe, args=(a,)) for a in sys.argv[1:]]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps(res))"#;

/// Turns IPv6 back on, then writes Ethernet frames itself to the gateway's MAC: a UDP
/// datagram `raw4` to the IPv4 address `argv[1]`, and `raw6` to each IPv6 address after
/// it (from a unique local address, three times each).
const RAW_FRAMES: &str = r#"import socket, struct, sys
open("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "w").write("0")
def csum(b):
    if len(b) % 2:
        b += b"\0"
    t = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while t >> 16:
        t = (t & 0xFFFF) + (t >> 16)
    return ~t & 0xFFFF
mac = bytes.fromhex(open("/sys/class/net/eth0/address").read().strip().replace(":", ""))
gw = bytes.fromhex("02666b000001")
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
def udp(src, dst, pseudo, data):
    n = 8 + len(data)
    c = csum(pseudo(n) + struct.pack("!HHHH", 40000, 8001, n, 0) + data) or 0xFFFF
    return struct.pack("!HHHH", 40000, 8001, n, c) + data
src4, dst4 = socket.inet_aton("10.254.254.2"), socket.inet_aton(sys.argv[1])
d = udp(src4, dst4, lambda n: src4 + dst4 + struct.pack("!BBH", 0, 17, n), b"raw4")
h = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(d), 1, 0, 64, 17, 0) + src4 + dst4
h = h[:10] + struct.pack("!H", csum(h)) + h[12:]
for _ in range(3):
    s.send(gw + mac + b"\x08\x00" + h + d)
src6 = socket.inet_pton(socket.AF_INET6, "fd00:beef::2")
for a in sys.argv[2:]:
    dst6 = socket.inet_pton(socket.AF_INET6, a)
    d = udp(src6, dst6, lambda n: src6 + dst6 + struct.pack("!I3xB", n, 17), b"raw6 " + a.encode())
    h = struct.pack("!IHBB", 0x60000000, len(d), 17, 64) + src6 + dst6
    for _ in range(3):
        s.send(gw + mac + b"\x86\xdd" + h + d)
print("sent")"#;

async fn a_template_built_without_network_has_no_nic(c: &forkd_daemon::client::Client) {
    {
        let id = create(c, "nonet", 1).await.remove(0);
        let r = exec(c, &id, "ls /sys/class/net").await;
        assert_eq!(common::b64(&r["stdout_b64"]), b"lo\n");
        let (_, info) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        assert!(info["network"].is_null(), "{info}");
        let (s, v) = call(
            c,
            Method::PUT,
            &format!("/v1/sandboxes/{id}/network"),
            Some(json!({"egress": "allow"})),
        )
        .await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        let (s, v) = call(
            c,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"snapshot": "nonet", "network": {"egress": "allow"}})),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;

        // A recipe's [egress] is its children's default; without a NIC it is refused.
        let (s, op) = common::build_recipe(
            c,
            "open",
            "image = \"minimal\"\nmemory_mib = 256\n[egress]\nmode = \"allow\"\ndeny = [\"203.0.113.0/24\"]\n",
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        common::wait_operation(c, op["id"].as_str().unwrap()).await;
        let id = create(c, "open", 1).await.remove(0);
        let (_, info) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(
            info["network"],
            json!({"egress": "allow", "allow": [], "deny": ["203.0.113.0/24"]})
        );
        call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        let (s, op) = common::build_recipe(
            c,
            "nonet2",
            "image = \"minimal\"\nnetwork = \"none\"\n[egress]\nmode = \"allow\"\n",
        )
        .await;
        // Refused when the recipe is read, or by the build.
        if s == StatusCode::ACCEPTED {
            let op = common::finish_operation(c, op["id"].as_str().unwrap()).await;
            assert_eq!(op["status"], "failed", "{op}");
            assert!(op["error"].as_str().unwrap().contains("no NIC"), "{op}");
        } else {
            assert!(s.is_client_error(), "{s} {op}");
        }
    }
}
