//! The links of a sandbox's namespace, over netlink: the tap's address and MAC, the
//! veth pair and its /30, the default route.

use super::{
    GATEWAY_ADDR, GATEWAY_MAC, GUEST_LINK, GUEST_PREFIX, HOST_LINK_PREFIX, UPLINK, UPLINKS,
    UPLINK_LOCK, UPLINK_RANGE,
};
use futures::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::fd::BorrowedFd;

/// Brings up `lo`, configures the tap, and makes and configures the veth pair
/// (`ns` is a netlink handle in the sandbox's namespace, `host` one in the host's).
/// Returns the name of the host's end.
pub async fn configure(
    ns: &Handle,
    host: &Handle,
    host_ns: BorrowedFd<'_>,
) -> std::io::Result<String> {
    let lo = index(ns, "lo").await?;
    set_up(ns, lo).await?;
    let tap = index(ns, GUEST_LINK).await?;
    ns.link()
        .set(
            LinkUnspec::new_with_index(tap)
                .address(GATEWAY_MAC.to_vec())
                .build(),
        )
        .execute()
        .await
        .map_err(io)?;
    ns.address()
        .add(tap, GATEWAY_ADDR.into(), GUEST_PREFIX)
        .execute()
        .await
        .map_err(io)?;
    set_up(ns, tap).await?;

    let (block, host_link) = {
        let _lock = uplink_lock()?;
        let block = free_block(host).await?;
        let host_link = format!("{HOST_LINK_PREFIX}{block}");
        ns.link()
            .add(LinkVeth::new(UPLINK, &host_link).build())
            .execute()
            .await
            .map_err(io)?;
        let peer = index(ns, &host_link).await?;
        ns.link()
            .set(
                LinkUnspec::new_with_index(peer)
                    .setns_by_fd(host_ns.as_raw_fd())
                    .build(),
            )
            .execute()
            .await
            .map_err(io)?;
        (block, host_link)
    };
    let (host_addr, ns_addr) = block_addrs(block);
    let peer = index(host, &host_link).await?;
    host.address()
        .add(peer, host_addr.into(), 30)
        .execute()
        .await
        .map_err(io)?;
    set_up(host, peer).await?;
    let uplink = index(ns, UPLINK).await?;
    ns.address()
        .add(uplink, ns_addr.into(), 30)
        .execute()
        .await
        .map_err(io)?;
    set_up(ns, uplink).await?;
    ns.route()
        .add(
            RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(host_addr)
                .build(),
        )
        .execute()
        .await
        .map_err(io)?;
    Ok(host_link)
}

/// The host's and the namespace's address in the /30 number `block`.
pub fn block_addrs(block: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(UPLINK_RANGE.0) + block * 4;
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

/// The first /30 no `fkd<N>` link on the host uses.
async fn free_block(host: &Handle) -> std::io::Result<u32> {
    let mut used = std::collections::HashSet::new();
    let mut links = host.link().get().execute();
    while let Some(msg) = links.try_next().await.map_err(io)? {
        for attr in msg.attributes {
            if let rtnetlink::packet_route::link::LinkAttribute::IfName(name) = attr {
                if let Some(n) = name
                    .strip_prefix(HOST_LINK_PREFIX)
                    .and_then(|n| n.parse::<u32>().ok())
                {
                    used.insert(n);
                }
            }
        }
    }
    (0..UPLINKS)
        .find(|n| !used.contains(n))
        .ok_or_else(|| std::io::Error::other("every sandbox uplink is taken"))
}

fn uplink_lock() -> std::io::Result<nix::fcntl::Flock<File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(UPLINK_LOCK)?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| e.into())
}

async fn index(handle: &Handle, name: &str) -> std::io::Result<u32> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await.map_err(io)? {
        Some(msg) => Ok(msg.header.index),
        None => Err(std::io::Error::other(format!("no link {name}"))),
    }
}

async fn set_up(handle: &Handle, index: u32) -> std::io::Result<()> {
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(io)
}

fn io(e: rtnetlink::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}
