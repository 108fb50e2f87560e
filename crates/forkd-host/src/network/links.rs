//! The links of a sandbox's namespace, over netlink: the tap's address and MAC, the
//! veth pair and its /30, the default route.

use super::{
    GATEWAY_ADDR, GATEWAY_MAC, GUEST_LINK, GUEST_PREFIX, HOST_LINK_PREFIX, UPLINK, UPLINKS,
    UPLINK_RANGE,
};
use futures::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};
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
    set_up(ns, lo).await.map_err(step("bringing up lo"))?;
    let tap = index(ns, GUEST_LINK).await?;
    ns.link()
        .set(
            LinkUnspec::new_with_index(tap)
                .address(GATEWAY_MAC.to_vec())
                .build(),
        )
        .execute()
        .await
        .map_err(io)
        .map_err(step("setting the tap's MAC"))?;
    address_and_up(ns, tap, GATEWAY_ADDR, GUEST_PREFIX)
        .await
        .map_err(step("addressing the tap"))?;

    // The veth pair is made here, and its peer moves to the host under the name of a
    // free /30: the kernel refuses a move into a namespace that has the link's name
    // already (EEXIST), so two sandboxes, of one daemon or of two, never take the same
    // /30, and nothing needs a lock or a list of the links. The peer gets each name
    // here, where no other link can have it, and is then moved without a name: a move
    // that also renames moves the link first and renames it after, so a refused name
    // would leave the link in the host under its old one.
    let start = random_block();
    let name_of = |attempt: u32| format!("{HOST_LINK_PREFIX}{}", (start + attempt) % UPLINKS);
    ns.link()
        .add(LinkVeth::new(UPLINK, &name_of(0)).build())
        .execute()
        .await
        .map_err(io)
        .map_err(step("making the veth pair"))?;
    let peer = index(ns, &name_of(0)).await?;
    let mut taken = None;
    for attempt in 0..MAX_ATTEMPTS {
        let block = (start + attempt) % UPLINKS;
        let name = name_of(attempt);
        if attempt > 0 {
            ns.link()
                .set(LinkUnspec::new_with_index(peer).name(name.clone()).build())
                .execute()
                .await
                .map_err(io)
                .map_err(step(&format!("naming the uplink's peer {name}")))?;
        }
        let moved = ns
            .link()
            .set(
                LinkUnspec::new_with_index(peer)
                    .setns_by_fd(host_ns.as_raw_fd())
                    .build(),
            )
            .execute()
            .await;
        match moved {
            Ok(()) => {
                taken = Some((block, name));
                break;
            }
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => continue,
            Err(e) => {
                return Err(step(&format!(
                    "moving the uplink's peer {name} to the host"
                ))(io(e)))
            }
        }
    }
    let (block, host_link) = taken.ok_or_else(|| {
        std::io::Error::other(format!(
            "no free sandbox uplink after {MAX_ATTEMPTS} tries (too many sandboxes on this host?)"
        ))
    })?;
    let (host_addr, ns_addr) = block_addrs(block);
    let peer = index(host, &host_link).await?;
    address_and_up(host, peer, host_addr, 30)
        .await
        .map_err(step(&format!("addressing {host_link} (index {peer})")))?;
    let uplink = index(ns, UPLINK).await?;
    address_and_up(ns, uplink, ns_addr, 30)
        .await
        .map_err(step("addressing the uplink"))?;
    ns.route()
        .add(
            RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(host_addr)
                .build(),
        )
        .execute()
        .await
        .map_err(io)
        .map_err(step("adding the default route"))?;
    Ok(host_link)
}

/// The host's and the namespace's address in the /30 number `block`.
pub fn block_addrs(block: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(UPLINK_RANGE.0) + block * 4;
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

/// Where the search for a free /30 starts: anywhere, so that sandboxes made at once
/// rarely try the same names.
fn random_block() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    u32::try_from(h.finish() % u64::from(UPLINKS)).expect("below UPLINKS, a u32")
}

/// How many taken /30s the search passes over before it gives up.
const MAX_ATTEMPTS: u32 = 1024;

async fn index(handle: &Handle, name: &str) -> std::io::Result<u32> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await.map_err(io)? {
        Some(msg) => Ok(msg.header.index),
        None => Err(std::io::Error::other(format!("no link {name}"))),
    }
}

/// `ip addr add ADDR/PREFIX dev INDEX; ip link set INDEX up`.
async fn address_and_up(
    handle: &Handle,
    index: u32,
    addr: Ipv4Addr,
    prefix: u8,
) -> std::io::Result<()> {
    handle
        .address()
        .add(index, addr.into(), prefix)
        .execute()
        .await
        .map_err(io)?;
    set_up(handle, index).await
}

async fn set_up(handle: &Handle, index: u32) -> std::io::Result<()> {
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(io)
}

/// Names the step an error happened in.
fn step(what: &str) -> impl FnOnce(std::io::Error) -> std::io::Error + '_ {
    move |e| std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn io(e: rtnetlink::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}
