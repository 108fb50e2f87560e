//! A fork placed on the hosts of a cluster: which hosts, how many children each, and
//! the snapshot brought to the hosts that lack it through the cluster's registry.
//!
//! The host a fork request reaches plans it from the hosts' registrations: hosts that
//! are up, match the request's labels and have free slots; those that hold the
//! snapshot (the same manifest digest) first. `pack` fills one host before the next
//! (this one first); `spread` gives each child to the host with the most free slots.
//! Its share is forked here; each other host's is forwarded to it as a fork of its
//! own. A host without the snapshot pulls it from the registry (`--registry`), which
//! this host pushed it to, by digest, and checks its manifest against the digest this
//! host holds before forking. A failure on one host follows the `partial` rule of a
//! single fork: without `partial`, the children made elsewhere are removed.

use super::cluster::{peer, FORWARDED_BY};
use super::ApiError;
use crate::api::types::{CreateSandboxes, CreatedSandboxes, SandboxInfo};
use crate::api::App;
use crate::cluster::keys::HostLive;
use crate::cluster::{Cluster, HostState, HostView};
use axum::http::StatusCode;
use forkd_storage::snapshot::Tag;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Sent with a share of a fork to a host that lacks the snapshot: the registry
/// reference to pull it from (by digest).
pub const PULL_FROM: &str = "x-forkd-pull-from";

/// Sent with a whole fork handed to a host that holds its snapshot by one that does not:
/// it places the fork itself, and never hands it on again.
pub const HANDED_BY: &str = "x-forkd-handed-by";

/// Sent with a share of a fork: the digest of the snapshot's manifest the children
/// must be forked from.
pub const SNAPSHOT_DIGEST: &str = "x-forkd-snapshot-digest";

/// How a fork's children are spread over the hosts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Fill one host (this one first) before the next.
    #[default]
    Pack,
    /// Each child to the host with the most free slots.
    Spread,
}

/// Where a fork's children may go.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// `pack` (default) or `spread`.
    #[serde(default)]
    pub policy: Policy,
    /// Only hosts with all these labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A host a fork may use.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Its name.
    pub name: String,
    /// Its free slots.
    pub free: usize,
    /// It holds the snapshot.
    pub holds: bool,
    /// It is the host planning the fork.
    pub here: bool,
}

/// How many children each host gets (hosts with none left out), at most `n` in all.
pub fn plan(n: usize, mut hosts: Vec<Candidate>, policy: Policy) -> Vec<(String, usize)> {
    hosts.retain(|h| h.free > 0);
    let holders_room: usize = hosts.iter().filter(|h| h.holds).map(|h| h.free).sum();
    // Hosts that must pull the snapshot are used only for what the holders cannot take.
    if holders_room >= n {
        hosts.retain(|h| h.holds);
    }
    let mut shares: BTreeMap<String, usize> = BTreeMap::new();
    match policy {
        Policy::Pack => {
            // Holders first, this host first among them, then the fullest.
            hosts.sort_by_key(|h| (!h.holds, !h.here, h.free, h.name.clone()));
            let mut left = n;
            for h in &hosts {
                let k = left.min(h.free);
                if k > 0 {
                    shares.insert(h.name.clone(), k);
                }
                left -= k;
            }
        }
        Policy::Spread => {
            let mut free: Vec<(String, usize, bool)> = hosts
                .iter()
                .map(|h| (h.name.clone(), h.free, h.holds))
                .collect();
            for _ in 0..n {
                // The most free slots; holders, then names, break ties.
                let Some(best) = free
                    .iter_mut()
                    .filter(|(_, f, _)| *f > 0)
                    .max_by(|a, b| (a.1, a.2, &b.0).cmp(&(b.1, b.2, &a.0)))
                else {
                    break;
                };
                best.1 -= 1;
                *shares.entry(best.0.clone()).or_default() += 1;
            }
        }
    }
    shares.into_iter().collect()
}

/// The digest of the local snapshot `tag`, as hosts advertise it
/// ([`crate::cluster::snapshot_digest`]).
pub(crate) fn local_digest(app: &App, tag: &Tag) -> Option<String> {
    let snap = app.registry.store().open(tag).ok()?;
    crate::cluster::snapshot_digest(app.registry.store(), &snap)
}

/// Whether `labels` has every label of `want`.
fn matches(labels: &BTreeMap<String, String>, want: &BTreeMap<String, String>) -> bool {
    want.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// This host's free slots, as its registry counts them now.
pub(crate) fn free_here(app: &App) -> usize {
    app.registry
        .capacity()
        .saturating_sub(app.registry.running())
}

/// The living, undrained host other than this one with the most free slots among
/// those `fits` lets through, with what it last said of itself.
pub(crate) fn roomiest_other<'a>(
    cluster: &Cluster,
    hosts: &'a [HostView],
    fits: impl Fn(&HostLive) -> bool,
) -> Option<(&'a HostView, &'a HostLive)> {
    hosts
        .iter()
        .filter(|h| h.state == HostState::Up && h.name != cluster.host_name())
        .filter_map(|h| Some((h, h.live.as_ref()?)))
        .filter(|(_, l)| !l.draining && l.free_slots() > 0 && fits(l))
        .max_by_key(|(_, l)| l.free_slots())
}

/// Forks `req` (whose JSON is `raw`) across the cluster of `app`; answers as a single
/// fork does, each child with its host. A host without the snapshot hands the whole
/// fork to one that holds it (unless it was `handed` one itself). While etcd cannot be
/// reached, a fork that asked for no placement is made on this host alone.
pub async fn fork(
    app: &App,
    req: CreateSandboxes,
    raw: &serde_json::Value,
    handed: bool,
) -> Result<CreatedSandboxes, ApiError> {
    let cluster = crate::api::cluster::cluster_of(app)?;
    let tag = Tag::parse(&req.snapshot)?;
    // `pack` takes this host first: when it holds the snapshot, matches the labels and
    // has room for every child, that is the whole plan, and etcd need not be asked.
    let placement = req.placement.clone().unwrap_or_default();
    if placement.policy == Policy::Pack
        && !cluster.is_draining()
        && matches(&cluster.config().labels, &placement.labels)
        && free_here(app) >= req.n as usize
        && app.registry.store().exists(&tag)
    {
        return super::fork::create_here(app, req).await;
    }
    let hosts = match cluster.hosts().await {
        Ok(h) => h,
        Err(e) if req.placement.is_none() && app.registry.store().exists(&tag) => {
            tracing::warn!(%tag, "forking on this host alone: {e}");
            return super::fork::create_here(app, req).await;
        }
        Err(e) => return Err(e.into()),
    };
    let Some(digest) = local_digest(app, &tag) else {
        let holder = hosts.iter().find(|h| {
            h.state == HostState::Up
                && h.live
                    .as_ref()
                    .is_some_and(|l| l.snapshots.contains_key(tag.as_str()))
        });
        return match (holder, handed) {
            (Some(h), false) => hand_over(app, cluster, h, raw).await,
            _ => Err(ApiError::not_found(format!(
                "no host of the cluster that is up holds the snapshot {tag}"
            ))),
        };
    };
    let candidates: Vec<Candidate> = hosts
        .iter()
        .filter(|h| h.state == HostState::Up && matches(&h.labels, &placement.labels))
        .filter_map(|h| {
            let here = h.name == cluster.host_name();
            // A host being drained takes no new sandboxes (this one's record may not
            // say so yet).
            let draining = here && cluster.is_draining();
            let live = h.live.as_ref().filter(|l| !l.draining && !draining)?;
            // This host's own count is fresh; the others' as of their last refresh.
            let free = if here {
                free_here(app)
            } else {
                live.free_slots()
            };
            Some(Candidate {
                name: h.name.clone(),
                free,
                // This host's record may predate the snapshot: it holds it.
                holds: here || live.snapshots.get(tag.as_str()) == Some(&digest),
                here,
            })
        })
        .collect();
    let n = req.n as usize;
    let shares = plan(n, candidates.clone(), placement.policy);
    let room: usize = shares.iter().map(|(_, k)| k).sum();
    if room == 0 || (room < n && !req.partial) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "at_capacity",
            format!(
                "the cluster has room for {room} of the {n} children of {tag} (free slots of the hosts up{}: {}); \
                 with partial: true the fork takes what fits",
                if placement.labels.is_empty() { String::new() } else { " with the labels asked".into() },
                if candidates.is_empty() {
                    "none".to_owned()
                } else {
                    candidates
                        .iter()
                        .map(|c| format!("{} {}", c.name, c.free))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        ));
    }
    let needs_pull = shares
        .iter()
        .any(|(name, _)| candidates.iter().any(|c| &c.name == name && !c.holds));
    let pull_from = if needs_pull {
        Some(publish(app, cluster, &tag).await?)
    } else {
        None
    };
    tracing::info!(%tag, n, ?shares, "placing a fork on the cluster");
    let runs = shares.iter().map(|(host, k)| {
        let mut share = req.clone();
        share.n = u32::try_from(*k).unwrap_or(u32::MAX);
        share.placement = None;
        let mut raw = raw.clone();
        if let Some(o) = raw.as_object_mut() {
            o.insert("n".into(), (*k).into());
            o.remove("placement");
        }
        let view = hosts
            .iter()
            .find(|h| &h.name == host)
            .expect("planned from these");
        let holds = candidates.iter().any(|c| &c.name == host && c.holds);
        let pull = (!holds).then(|| pull_from.clone()).flatten();
        let digest = digest.clone();
        async move {
            let r = fork_on(app, cluster, view, share, &raw, pull, &digest).await;
            (host.clone(), r)
        }
    });
    let results = futures::future::join_all(runs).await;
    let mut created = CreatedSandboxes {
        sandboxes: Vec::new(),
        errors: Vec::new(),
        operation: String::new(),
    };
    let mut failed = None;
    for (host, r) in results {
        match r {
            Ok(mut c) => {
                for s in &mut c.sandboxes {
                    s.host = Some(host.clone());
                }
                created.sandboxes.extend(c.sandboxes);
                created
                    .errors
                    .extend(c.errors.into_iter().map(|e| format!("{host}: {e}")));
                if created.operation.is_empty() || host == cluster.host_name() {
                    created.operation = c.operation;
                }
            }
            Err(e) => {
                created.errors.push(format!("{host}: {}", e.message));
                failed.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failed {
        if !req.partial || created.sandboxes.is_empty() {
            remove_all(app, &created.sandboxes).await;
            return Err(e);
        }
    }
    created
        .sandboxes
        .sort_by(|a, b| (&a.created_at, &a.id).cmp(&(&b.created_at, &b.id)));
    Ok(created)
}

/// Forks `share` on `host`: here, or forwarded to it as a fork of its own.
async fn fork_on(
    app: &App,
    cluster: &Cluster,
    host: &HostView,
    share: CreateSandboxes,
    raw: &serde_json::Value,
    pull: Option<String>,
    digest: &str,
) -> Result<CreatedSandboxes, ApiError> {
    if host.name == cluster.host_name() {
        return super::fork::create_here(app, share).await;
    }
    let mut headers = vec![(SNAPSHOT_DIGEST, digest.to_owned())];
    if let Some(p) = pull {
        headers.push((PULL_FROM, p));
    }
    post_fork(app, cluster, host, raw, &headers).await
}

/// Hands the whole fork `raw` to `host`, which holds its snapshot, to place it.
async fn hand_over(
    app: &App,
    cluster: &Cluster,
    host: &HostView,
    raw: &serde_json::Value,
) -> Result<CreatedSandboxes, ApiError> {
    tracing::info!(host = %host.name, "handing a fork to a host that holds its snapshot");
    let headers = [(HANDED_BY, cluster.host_name().to_owned())];
    let mut created = post_fork(app, cluster, host, raw, &headers).await?;
    for s in created.sandboxes.iter_mut().filter(|s| s.host.is_none()) {
        s.host = Some(host.name.clone());
    }
    Ok(created)
}

/// `POST /v1/sandboxes` with `raw` on `host`, with `headers` added.
async fn post_fork(
    app: &App,
    cluster: &Cluster,
    host: &HostView,
    raw: &serde_json::Value,
    headers: &[(&str, String)],
) -> Result<CreatedSandboxes, ApiError> {
    let body = serde_json::to_vec(raw).expect("JSON serializes");
    let mut req = http::Request::builder()
        .method(http::Method::POST)
        .uri("/v1/sandboxes")
        .header(http::header::CONTENT_TYPE, "application/json");
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    if !headers.iter().any(|(n, _)| *n == HANDED_BY) {
        req = req.header(FORWARDED_BY, cluster.host_name());
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let unreachable = |e: String| super::cluster::unreachable("(a fork's share)", &host.name, &e);
    let answer = peer(app, cluster, &host.address, true)
        .forward(req)
        .await
        .map_err(|e| unreachable(format!("{e:#}")))?;
    let status = answer.status();
    use http_body_util::BodyExt;
    let bytes = answer
        .into_body()
        .collect()
        .await
        .map_err(|e| unreachable(e.to_string()))?
        .to_bytes();
    if status == StatusCode::CREATED {
        return serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::internal(format!("host {}'s fork answered {e}", host.name)));
    }
    let failure = crate::client::failure(status, &bytes);
    // The API's codes a fork answers with, kept as the host gave them.
    let code = [
        "bad_request",
        "not_found",
        "conflict",
        "at_capacity",
        "insufficient_memory",
        "insufficient_storage",
        "cluster_unavailable",
    ]
    .into_iter()
    .find(|c| *c == failure.code)
    .unwrap_or("sandbox_failed");
    Err(ApiError::new(
        status,
        code,
        format!("host {}: {}", host.name, failure.message),
    ))
}

/// Removes the children a failed placement made (on whichever host).
async fn remove_all(app: &App, made: &[SandboxInfo]) {
    let cluster = app.cluster.as_deref();
    for s in made {
        let r = match (cluster, s.host.as_deref()) {
            (Some(c), Some(h)) if h != c.host_name() => match c.live(h).await {
                Ok(Some(live)) => peer(app, c, &live.address, true)
                    .delete(&format!("/v1/sandboxes/{}", s.id))
                    .await
                    .map_err(|e| e.to_string()),
                other => Err(format!("host {h} is not reachable: {other:?}")),
            },
            _ => super::sandbox::delete(app, &s.id)
                .await
                .map_err(|e| e.message),
        };
        if let Err(e) = r {
            tracing::warn!(id = %s.id, "removing a child of a failed placement: {e}");
        }
    }
}

/// Makes the snapshot `tag` of this host available in the cluster's registry, once
/// per manifest digest; returns the reference (by digest) to pull it by.
pub(crate) async fn publish(app: &App, cluster: &Cluster, tag: &Tag) -> Result<String, ApiError> {
    let registry = cluster.config().registry.as_deref().ok_or_else(|| {
        ApiError::conflict(format!(
            "the fork needs hosts that lack {tag}, and the cluster has no registry to bring it to them (start the daemons with --registry)"
        ))
    })?;
    let reference = format!("{registry}:{tag}");
    static PUSHES: tokio::sync::Mutex<BTreeMap<String, String>> =
        tokio::sync::Mutex::const_new(BTreeMap::new());
    let mut pushed = PUSHES.lock().await;
    let digest = local_digest(app, tag).unwrap_or_default();
    let key = format!("{tag}@{digest}");
    if let Some(r) = pushed.get(&key) {
        return Ok(r.clone());
    }
    tracing::info!(%tag, %reference, "pushing the snapshot to the cluster's registry");
    let p = forkd_storage::oci::registry::push(
        app.registry.store(),
        tag,
        &reference,
        &app.config.registries,
        &|_, _, _| {},
    )
    .await
    .map_err(|e| ApiError::internal(format!("pushing {tag} to {reference}: {e}")))?;
    let by_digest = format!("{registry}@{}", p.digest);
    pushed.insert(key, by_digest.clone());
    Ok(by_digest)
}

/// Brings the snapshot `tag` to this host for a forwarded fork: pulled from `from` if
/// it is not here, then checked against `digest` (its manifest's, on the host that
/// placed the fork).
pub async fn ensure_snapshot(
    app: &App,
    tag: &str,
    from: Option<&str>,
    digest: &str,
) -> Result<(), ApiError> {
    let tag = Tag::parse(tag)?;
    static PULLS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = PULLS.lock().await;
    if local_digest(app, &tag).is_none() {
        let Some(from) = from else {
            return Err(ApiError::not_found(format!(
                "no snapshot {tag} on this host"
            )));
        };
        tracing::info!(%tag, %from, "pulling the snapshot from the cluster's registry");
        let u = forkd_storage::oci::registry::pull(
            app.registry.store(),
            app.registry.hypervisor().clone(),
            from,
            Some(&tag),
            &app.config.registries,
            &|_, _, _| {},
        )
        .await
        .map_err(|e| ApiError::internal(format!("pulling {tag} from {from}: {e}")))?;
        for t in &u.installed {
            app.registry.reopen_pool(t, false);
        }
        super::tags::claim_made(app, &u.installed).await?;
    }
    match local_digest(app, &tag) {
        Some(d) if d == digest => Ok(()),
        Some(d) => Err(ApiError::conflict(format!(
            "the snapshot {tag} here has the manifest digest {d}, not the {digest} the fork was placed for"
        ))),
        None => Err(ApiError::not_found(format!("no snapshot {tag} on this host"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, free: usize, holds: bool, here: bool) -> Candidate {
        Candidate {
            name: name.into(),
            free,
            holds,
            here,
        }
    }

    fn shares(v: &[(&str, usize)]) -> Vec<(String, usize)> {
        v.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    }

    #[test]
    fn pack_fills_this_host_then_the_fullest_holders_then_the_others() {
        let hosts = vec![
            host("a", 5, true, true),
            host("b", 5, false, false),
            host("c", 2, true, false),
        ];
        assert_eq!(plan(4, hosts.clone(), Policy::Pack), shares(&[("a", 4)]));
        assert_eq!(
            plan(6, hosts.clone(), Policy::Pack),
            shares(&[("a", 5), ("c", 1)])
        );
        assert_eq!(
            plan(12, hosts.clone(), Policy::Pack),
            shares(&[("a", 5), ("b", 5), ("c", 2)])
        );
        assert_eq!(
            plan(9, hosts, Policy::Pack),
            shares(&[("a", 5), ("b", 2), ("c", 2)])
        );
    }

    #[test]
    fn spread_gives_each_child_to_the_host_with_most_room() {
        let hosts = vec![
            host("a", 5, true, true),
            host("b", 5, false, false),
            host("c", 5, false, false),
        ];
        // The holder has room for all: the others do not pull for nothing.
        assert_eq!(plan(3, hosts.clone(), Policy::Spread), shares(&[("a", 3)]));
        assert_eq!(
            plan(12, hosts.clone(), Policy::Spread),
            shares(&[("a", 4), ("b", 4), ("c", 4)])
        );
        // More than all hold: as much as there is.
        assert_eq!(
            plan(20, hosts, Policy::Spread),
            shares(&[("a", 5), ("b", 5), ("c", 5)])
        );
        let even = vec![host("a", 2, true, true), host("b", 2, true, false)];
        assert_eq!(plan(3, even, Policy::Spread), shares(&[("a", 2), ("b", 1)]));
    }

    #[test]
    fn full_hosts_get_nothing() {
        let hosts = vec![host("a", 0, true, true), host("b", 1, true, false)];
        assert_eq!(plan(3, hosts, Policy::Pack), shares(&[("b", 1)]));
    }
}
