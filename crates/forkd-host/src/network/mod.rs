//! A network of its own for each sandbox.
//!
//! Every sandbox with a NIC gets a network namespace, made on a thread of its own
//! before its QEMU starts, holding:
//! - `tap0`, the guest's link: QEMU is handed its descriptor (`-netdev tap,fd=`), and
//!   it has the gateway's address and MAC. Both are the same in every namespace, as
//!   are the guest's: all children of a snapshot wake up with the parent's address,
//!   routes and neighbour cache, frozen in their memory.
//! - `uplink`, one end of a veth pair whose other end (`fkd<N>`) is in the host's
//!   namespace, each end with an address of a /30 that is this sandbox's alone.
//! - the rules of [`rules`]: the guest's address is masqueraded as the uplink's (so
//!   that replies find their way back to the right child), and its traffic is let out
//!   only as its [`EgressPolicy`] says.
//!
//! QEMU then joins the namespace (between fork and exec), which keeps it alive exactly
//! as long as the VM: when QEMU exits the kernel removes the namespace, its links, the
//! host's end of the veth pair, its address and its rules, leaving nothing to clean up.
//! forkd finds a running sandbox's namespace again through its QEMU's pid.

pub mod closed;
mod links;
pub mod policy;
pub mod rules;
pub mod spares;

use nix::sched::CloneFlags;
use policy::EgressPolicy;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::OnceLock;

/// The guest's address on its link (the same in every sandbox).
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 254, 254, 2);
/// The address of the tap's end, the guest's gateway.
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(10, 254, 254, 1);
/// The prefix length of the guest's link.
pub const GUEST_PREFIX: u8 = 30;
/// The guest NIC's MAC address (locally administered).
pub const GUEST_MAC: [u8; 6] = [0x02, 0x66, 0x6b, 0x00, 0x00, 0x02];
/// The MAC of the tap's end. Fixed, since every child's neighbour cache already holds
/// the parent's gateway.
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x66, 0x6b, 0x00, 0x00, 0x01];
/// The guest's link in the sandbox's namespace.
pub const GUEST_LINK: &str = "tap0";
/// The namespace's end of its veth pair.
pub const UPLINK: &str = "uplink";
/// The host's ends of sandboxes' veth pairs are `fkd<N>`, `N` the index of the /30.
pub const HOST_LINK_PREFIX: &str = "fkd";
/// The range the uplinks' /30s are cut from.
pub const UPLINK_RANGE: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 253, 0, 0), 16);
/// How many /30s [`UPLINK_RANGE`] holds.
const UPLINKS: u32 = 1 << (32 - 16 - 2);

/// What a VM's network is, as its VM configuration records it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// What the sandbox may reach.
    #[serde(default)]
    pub policy: EgressPolicy,
}

/// The kernel command line that tells forkd's guest agent to configure its NIC.
pub fn guest_cmdline() -> String {
    format!("forkd.ip={GUEST_ADDR}/{GUEST_PREFIX} forkd.gw={GATEWAY_ADDR} forkd.dns={GATEWAY_ADDR}")
}

/// `GUEST_MAC` as QEMU writes it.
pub fn guest_mac() -> String {
    GUEST_MAC
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Why this host cannot give sandboxes a network, if it cannot.
pub fn unavailable() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some(
            "forkd does not run as root, so it cannot make network namespaces; build templates with network = \"none\"".into(),
        );
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing (load the tun module)".into());
    }
    if which("nft").is_none() {
        return Some("nft is not installed (apt-get install nftables)".into());
    }
    None
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(program))
        .find(|p| p.is_file())
}

/// Why a sandbox's network could not be made or changed (the whole sentence).
#[derive(Debug)]
pub struct NetworkError(String);

impl std::fmt::Display for NetworkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NetworkError {}

/// A sandbox's namespace, ready for its QEMU.
#[derive(Debug)]
pub struct SandboxNetwork {
    /// The namespace (QEMU joins it before exec).
    pub netns: OwnedFd,
    /// The guest's tap (QEMU's `-netdev tap,fd=`).
    pub tap: OwnedFd,
    /// The host's end of its veth pair.
    pub host_link: String,
}

/// Makes a sandbox's namespace with `policy` in force.
pub async fn create(policy: &EgressPolicy) -> Result<SandboxNetwork, NetworkError> {
    // Checked once: whether forkd is root, the tun device and nft are there does not
    // change while it runs, and the fork path need not look again.
    static UNAVAILABLE: OnceLock<Option<String>> = OnceLock::new();
    if let Some(why) = UNAVAILABLE.get_or_init(unavailable) {
        return Err(NetworkError(format!(
            "its snapshot's guest has a NIC, and this host cannot give it a network: {why}"
        )));
    }
    let policy = policy.clone();
    let Some(spare) = spares::take() else {
        return on_own_thread(move || create_blocking(&policy))
            .await
            .map_err(|e| NetworkError(format!("making its network: {e}")));
    };
    if policy == EgressPolicy::default() {
        return Ok(spare);
    }
    on_own_thread(move || {
        nix::sched::setns(spare.netns.as_fd(), CloneFlags::CLONE_NEWNET)?;
        nft(&rules::replace_egress(&policy))?;
        Ok(spare)
    })
    .await
    .map_err(|e| NetworkError(format!("setting the egress policy of its network: {e}")))
}

/// Replaces the egress policy in the namespace of the process `pid` (a sandbox's QEMU).
pub async fn set_egress(pid: u32, policy: &EgressPolicy) -> Result<(), NetworkError> {
    let policy = policy.clone();
    on_own_thread(move || {
        enter_sandbox_netns(pid)?;
        nft(&rules::replace_egress(&policy))
    })
    .await
    .map_err(|e| NetworkError(format!("changing its egress policy: {e}")))
}

/// Opens a TCP connection to the guest's `port` from the namespace of the process `pid`
/// (a sandbox's QEMU): the way in for port forwarding, which needs no rule, since the
/// namespace's own connections to its guest are not forwarded traffic.
pub async fn connect_guest(pid: u32, port: u16) -> std::io::Result<tokio::net::TcpStream> {
    let stream = on_own_thread(move || {
        enter_sandbox_netns(pid)?;
        let addr = std::net::SocketAddr::from((GUEST_ADDR, port));
        let stream = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        stream.set_nonblocking(true)?;
        Ok(stream)
    })
    .await?;
    tokio::net::TcpStream::from_std(stream)
}

/// Binds the sockets of the sandbox's resolver (UDP and TCP on the gateway's port 53)
/// in the namespace of the process `pid` (a sandbox's QEMU). The guest's `resolv.conf`
/// names it; whoever holds the sockets answers for the sandbox.
pub async fn bind_resolver(
    pid: u32,
) -> std::io::Result<(tokio::net::UdpSocket, tokio::net::TcpListener)> {
    let (udp, tcp) = on_own_thread(move || {
        enter_sandbox_netns(pid)?;
        let udp = std::net::UdpSocket::bind((GATEWAY_ADDR, 53))?;
        udp.set_nonblocking(true)?;
        let tcp = std::net::TcpListener::bind((GATEWAY_ADDR, 53))?;
        tcp.set_nonblocking(true)?;
        Ok((udp, tcp))
    })
    .await?;
    Ok((
        tokio::net::UdpSocket::from_std(udp)?,
        tokio::net::TcpListener::from_std(tcp)?,
    ))
}

/// Lets `addrs` out of the namespace of the process `pid` for `ttl` seconds (on every
/// port if `ports` is empty): the addresses its resolver answered for a name the
/// policy allows.
pub async fn let_out(
    pid: u32,
    addrs: Vec<Ipv4Addr>,
    ports: Vec<u16>,
    ttl: u32,
) -> std::io::Result<()> {
    on_own_thread(move || {
        enter_sandbox_netns(pid)?;
        nft(&rules::let_out(&addrs, &ports, ttl))
    })
    .await
}

/// How long a connection to a guest's port may take to be accepted.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Moves the calling thread into the namespace of the process `pid`, which must be a
/// namespace of its own: never the daemon's, where rules would land on the host.
fn enter_sandbox_netns(pid: u32) -> std::io::Result<()> {
    let netns = File::open(format!("/proc/{pid}/ns/net"))?;
    let own = File::open("/proc/self/ns/net")?;
    let ino = |f: &File| {
        f.metadata()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
    };
    if ino(&netns)? == ino(&own)? {
        return Err(std::io::Error::other(
            "its QEMU is not in a network namespace of its own",
        ));
    }
    nix::sched::setns(netns.as_fd(), CloneFlags::CLONE_NEWNET)?;
    Ok(())
}

/// Runs `f` on a thread of its own, which may change namespaces and then ends.
async fn on_own_thread<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("forkd-netns".into())
        .spawn(move || {
            let _ = tx.send(f());
        })?;
    rx.await
        .map_err(|_| std::io::Error::other("the network thread panicked"))?
}

/// Applies a ruleset in the calling thread's namespace.
fn nft(ruleset: &nftables::schema::Nftables) -> std::io::Result<()> {
    nftables::helper::apply_ruleset(ruleset).map_err(|e| std::io::Error::other(e.to_string()))
}

/// Reads the host's routes again and, when the networks closed to sandboxes changed
/// and the host's rules are in place, applies them again (see [`closed`]).
pub async fn refresh_closed() -> std::io::Result<bool> {
    if !closed::refresh_host()? {
        return Ok(false);
    }
    // Spares carry the closed networks of their making.
    spares::discard();
    if HOST_READY.get().is_some_and(Result::is_ok) {
        on_own_thread(|| nft(&rules::host())).await?;
    }
    Ok(true)
}

/// Puts the host's rules in place now (where this host can give sandboxes networks),
/// so that sandboxes a restarted daemon adopts are held to the closed networks it
/// starts with, not to what the last daemon left.
pub async fn apply_host_rules() -> std::io::Result<()> {
    if unavailable().is_some() {
        return Ok(());
    }
    on_own_thread(host_ready).await?;
    // The first apply of this process may have come before the routes were read.
    on_own_thread(|| nft(&rules::host())).await
}

static HOST_READY: OnceLock<Result<(), String>> = OnceLock::new();

/// The host's side, once per process: forwarding on and the host's rules in place.
fn host_ready() -> std::io::Result<()> {
    HOST_READY
        .get_or_init(|| {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .map_err(|e| format!("turning on IPv4 forwarding: {e}"))?;
            nft(&rules::host()).map_err(|e| format!("the host's rules: {e}"))
        })
        .clone()
        .map_err(std::io::Error::other)
}

fn create_blocking(policy: &EgressPolicy) -> std::io::Result<SandboxNetwork> {
    let t0 = std::time::Instant::now();
    host_ready()?;
    let host_ns = File::open("/proc/thread-self/ns/net")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Opened before the thread leaves: this socket stays in the host's namespace.
    let (host_conn, host, _) = runtime.block_on(async { rtnetlink::new_connection() })?;
    nix::sched::unshare(CloneFlags::CLONE_NEWNET)?;
    let netns = File::open("/proc/thread-self/ns/net")?;
    let tap = open_tap(GUEST_LINK)?;
    // Opened from this thread, /proc/sys/net is the new namespace's.
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
    let host_link = runtime.block_on(async {
        tokio::spawn(host_conn);
        let (conn, ns, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        links::configure(&ns, &host, host_ns.as_fd()).await
    })?;
    let linked = t0.elapsed();
    nft(&rules::sandbox(policy))?;
    tracing::debug!(
        "made a sandbox network: links in {:.1} ms, rules in {:.1} ms",
        linked.as_secs_f64() * 1000.0,
        (t0.elapsed() - linked).as_secs_f64() * 1000.0
    );
    Ok(SandboxNetwork {
        netns: netns.into(),
        tap,
        host_link,
    })
}

/// Opens a tap device (`IFF_TAP | IFF_NO_PI`) named `name` in the calling thread's
/// namespace. It lasts as long as the descriptor.
fn open_tap(name: &str) -> std::io::Result<OwnedFd> {
    nix::ioctl_write_ptr_bad!(tunsetiff, 0x4004_54ca, libc::ifreq);
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    // SAFETY: ifreq is plain old data for which all-zero bytes are a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    ifr.ifr_ifru.ifru_flags = libc::c_short::try_from(libc::IFF_TAP | libc::IFF_NO_PI)
        .expect("the flags fit the short the kernel takes");
    // SAFETY: TUNSETIFF reads an ifreq with a NUL-terminated name (the name is shorter
    // than IFNAMSIZ) and flags; `tun` is an open /dev/net/tun.
    unsafe { tunsetiff(tun.as_raw_fd(), &ifr) }?;
    Ok(tun.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uplink_blocks_are_disjoint_30s_inside_the_range() {
        assert_eq!(
            links::block_addrs(0),
            (Ipv4Addr::new(10, 253, 0, 1), Ipv4Addr::new(10, 253, 0, 2))
        );
        assert_eq!(
            links::block_addrs(UPLINKS - 1),
            (
                Ipv4Addr::new(10, 253, 255, 253),
                Ipv4Addr::new(10, 253, 255, 254)
            )
        );
        assert_eq!(guest_mac(), "02:66:6b:00:00:02");
    }
}
