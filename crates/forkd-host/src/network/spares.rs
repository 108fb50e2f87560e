//! Sandbox namespaces made ahead of the VMs that take them.
//!
//! Making a namespace (its links, addresses, routes and rules) took 20–45 ms on the
//! 2-core development host: a fifth of a fork that no warm pool serves. A namespace
//! holds nothing of a snapshot or a guest, so a few are made in the background with the
//! default policy (nothing leaves) and the next VM takes one; a fork with another policy
//! replaces the egress rules of the one it takes (one `nft` call). A spare's rules also
//! carry the networks closed to sandboxes when it was made: when those change, the
//! spares are dropped ([`discard`]) and made again.
//!
//! Spares live only in this process: a namespace exists while a descriptor of it is
//! open, so those of a process that exits, however it exits, go with it.

use super::policy::EgressPolicy;
use super::SandboxNetwork;
use std::sync::Mutex;

struct Spares {
    /// How many to keep ready (0: none, and nothing made in the background).
    wanted: usize,
    ready: Vec<SandboxNetwork>,
    /// A namespace being made in the background (one at a time: the host's cores
    /// belong to the VMs).
    making: bool,
    /// Bumped by [`discard`]: a spare made under an older generation is dropped when it
    /// arrives.
    generation: u64,
}

static SPARES: Mutex<Spares> = Mutex::new(Spares {
    wanted: 0,
    ready: Vec::new(),
    making: false,
    generation: 0,
});

fn lock() -> std::sync::MutexGuard<'static, Spares> {
    SPARES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Keeps `n` namespaces ready from the first sandbox network made on (none made
/// before: a host whose templates have no NIC never gets one).
pub fn keep(n: usize) {
    let mut s = lock();
    s.wanted = n;
    s.ready.truncate(n);
}

/// How many namespaces are ready now.
pub fn ready() -> usize {
    lock().ready.len()
}

/// Drops every spare, and those being made, so that the next ones get rules made now.
pub fn discard() {
    let dropped = {
        let mut s = lock();
        s.generation += 1;
        std::mem::take(&mut s.ready)
    };
    drop(dropped);
}

/// A spare namespace, if one is ready; one more is made in the background either way.
pub(super) fn take() -> Option<SandboxNetwork> {
    let taken = lock().ready.pop();
    refill();
    taken
}

/// Starts making spares if fewer are ready than wanted and none are being made.
fn refill() {
    let generation = {
        let mut s = lock();
        if s.making || s.ready.len() >= s.wanted {
            return;
        }
        s.making = true;
        s.generation
    };
    // This thread stays in the host's namespace: each spare is made on a thread of its
    // own, which the making moves into the new namespace (a thread started from there
    // would make its namespace's uplink inside the previous one).
    let made = std::thread::Builder::new()
        .name("forkd-spares".into())
        .spawn(move || loop {
            let net = std::thread::Builder::new()
                .name("forkd-netns".into())
                .spawn(|| super::create_blocking(&EgressPolicy::default()))
                .map_err(|e| e.to_string())
                .and_then(|t| {
                    t.join()
                        .map_err(|_| "the thread panicked".to_string())?
                        .map_err(|e| e.to_string())
                });
            let mut s = lock();
            match net {
                Ok(net) if s.generation == generation && s.ready.len() < s.wanted => {
                    s.ready.push(net);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!("making a spare sandbox network failed: {e}");
                    s.making = false;
                    return;
                }
            }
            if s.generation != generation || s.ready.len() >= s.wanted {
                s.making = false;
                return;
            }
        });
    if let Err(e) = made {
        tracing::warn!("starting the thread of spare sandbox networks failed: {e}");
        lock().making = false;
    }
}

#[cfg(test)]
mod tests {
    use super::super::{create, create_blocking, unavailable};
    use super::*;
    use crate::network::policy::EgressMode;
    use std::os::fd::AsFd;

    /// The ruleset of `net`'s namespace, as `nft` lists it.
    fn ruleset(net: &SandboxNetwork) -> String {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(net.netns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("entering the namespace");
                let out = std::process::Command::new("nft")
                    .args(["list", "ruleset"])
                    .output()
                    .expect("running nft");
                assert!(out.status.success(), "nft: {:?}", out);
                String::from_utf8(out.stdout).expect("nft prints text")
            })
            .join()
            .expect("the nft thread")
        })
    }

    async fn wait_ready(n: usize) {
        for _ in 0..500 {
            if ready() == n {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("{n} spare namespaces were not ready within 10 s");
    }

    #[tokio::test]
    async fn spares_are_made_ahead_in_the_host_namespace_and_take_the_policy_of_their_fork() {
        if let Some(why) = unavailable() {
            eprintln!("skipped: {why}");
            return;
        }
        keep(2);
        let first = create(&EgressPolicy::default())
            .await
            .expect("first network");
        wait_ready(2).await;
        let policy = EgressPolicy {
            egress: EgressMode::Allow,
            allow: Vec::new(),
            deny: vec!["192.0.2.0/24".parse().expect("a network")],
        };
        let taken = create(&policy).await.expect("a spare");
        let made = std::thread::spawn({
            let policy = policy.clone();
            move || create_blocking(&policy)
        })
        .join()
        .expect("the making thread")
        .expect("a namespace made with the policy");
        assert_eq!(ruleset(&taken), ruleset(&made));
        assert_ne!(ruleset(&taken), ruleset(&first));
        // Every uplink's peer is in the host's namespace: spares made one after another
        // on the same background thread too.
        wait_ready(2).await;
        let second = create(&EgressPolicy::default()).await.expect("a spare");
        let third = create(&EgressPolicy::default()).await.expect("a spare");
        for net in [&first, &taken, &made, &second, &third] {
            assert!(
                std::path::Path::new("/sys/class/net")
                    .join(&net.host_link)
                    .exists(),
                "{} is not in the host's namespace",
                net.host_link
            );
        }
        // A change of the closed networks drops the spares.
        wait_ready(2).await;
        discard();
        assert_eq!(ready(), 0);
        keep(0);
    }
}
