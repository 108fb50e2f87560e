//! The guest's links: loopback always, and the NIC when the host gave the guest one.
//!
//! The host says how to configure the NIC on the kernel command line (`forkd.ip=
//! ADDR/PREFIX forkd.gw=GATEWAY`). It is configured once, in the template's parent:
//! every child wakes up with this configuration in its memory, in a namespace on the
//! host that looks the same to it.

use crate::cmdline;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The NIC's name (the first virtio-net device; nothing renames it in forkd's guest).
const NIC: &str = "eth0";

/// Brings up `lo`, and the NIC if the command line configures one.
pub fn setup(cmdline: &str) -> Result<(), String> {
    let sock = socket().map_err(|e| format!("opening a socket: {e}"))?;
    // The kernel gives lo 127.0.0.1 and ::1 when it comes up.
    set_up(&sock, "lo").map_err(|e| format!("bringing up lo: {e}"))?;
    let Some(ip) = cmdline::get(cmdline, "forkd.ip") else {
        return Ok(());
    };
    // The host forwards IPv4 only: without IPv6 the guest does not solicit routers or
    // probe its addresses on the link, which nobody answers.
    for conf in ["all", "default"] {
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6"), "1");
    }
    let (addr, prefix) =
        parse_cidr(ip).ok_or_else(|| format!("forkd.ip={ip} is not ADDR/PREFIX"))?;
    set_addr(&sock, NIC, addr, prefix).map_err(|e| format!("giving {NIC} {ip}: {e}"))?;
    set_up(&sock, NIC).map_err(|e| format!("bringing up {NIC}: {e}"))?;
    if let Some(gw) = cmdline::get(cmdline, "forkd.gw") {
        let gw: Ipv4Addr = gw
            .parse()
            .map_err(|_| format!("forkd.gw={gw} is not an IPv4 address"))?;
        default_route(&sock, gw).map_err(|e| format!("routing through {gw}: {e}"))?;
    }
    if let Some(dns) = cmdline::get(cmdline, "forkd.dns") {
        let dns: Ipv4Addr = dns
            .parse()
            .map_err(|_| format!("forkd.dns={dns} is not an IPv4 address"))?;
        // The image's may be a link into a resolver daemon's directory, which does not
        // run here.
        let _ = std::fs::remove_file(RESOLV_CONF);
        std::fs::write(RESOLV_CONF, format!("nameserver {dns}\n"))
            .map_err(|e| format!("writing {RESOLV_CONF}: {e}"))?;
    }
    Ok(())
}

/// Where the guest's C library looks for its name server.
const RESOLV_CONF: &str = "/etc/resolv.conf";

fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (addr, len) = s.split_once('/')?;
    let len: u8 = len.parse().ok().filter(|l| *l <= 32)?;
    Some((addr.parse().ok()?, len))
}

fn socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is checked before use.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data for which all-zero bytes are a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = libc::c_char::from_ne_bytes([src]);
    }
    ifr
}

fn sockaddr(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).expect("AF_INET fits sa_family_t"),
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; the kernel reads it back as
    // the sockaddr_in its family says it is.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// ioctl(2) on `sock` with a pointer to `arg`.
fn ioctl<T>(sock: &OwnedFd, request: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
    // SAFETY: every request used here takes a pointer to the type `T` it is given with
    // (ifreq or rtentry), valid and exclusively borrowed for the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, arg as *mut T) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `ip link set NAME up`.
fn set_up(sock: &OwnedFd, name: &str) -> std::io::Result<()> {
    let mut ifr = ifreq(name);
    ioctl(sock, libc::SIOCGIFFLAGS, &mut ifr)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe {
        ifr.ifr_ifru.ifru_flags |= libc::c_short::try_from(libc::IFF_UP | libc::IFF_RUNNING)
            .expect("the flags fit the short the kernel takes");
    }
    ioctl(sock, libc::SIOCSIFFLAGS, &mut ifr)
}

/// `ip addr add ADDR/PREFIX dev NAME`.
fn set_addr(sock: &OwnedFd, name: &str, addr: Ipv4Addr, prefix: u8) -> std::io::Result<()> {
    let mut ifr = ifreq(name);
    ifr.ifr_ifru.ifru_addr = sockaddr(addr);
    ioctl(sock, libc::SIOCSIFADDR, &mut ifr)?;
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    let mut ifr = ifreq(name);
    ifr.ifr_ifru.ifru_netmask = sockaddr(Ipv4Addr::from(mask));
    ioctl(sock, libc::SIOCSIFNETMASK, &mut ifr)
}

/// `ip route add default via GW`.
fn default_route(sock: &OwnedFd, gw: Ipv4Addr) -> std::io::Result<()> {
    // SAFETY: rtentry is plain old data for which all-zero bytes are a valid value
    // (null device pointer: the kernel picks the link the gateway is on).
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr(gw);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    ioctl(sock, libc::SIOCADDRT, &mut rt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(
            parse_cidr("10.254.254.2/30"),
            Some((Ipv4Addr::new(10, 254, 254, 2), 30))
        );
        assert_eq!(parse_cidr("10.254.254.2"), None);
        assert_eq!(parse_cidr("10.254.254.2/40"), None);
    }
}
