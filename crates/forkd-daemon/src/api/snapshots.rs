//! `/v1/snapshots`: list, inspect, build from a template (a long-running operation),
//! delete.

use super::error::ErrorBody;
use super::types::{
    BuildSnapshotBody, ChainBody, CompactBody, SnapshotInfo, SnapshotList, Verified,
};
use super::{ApiError, App, JsonBody, PathParams, QueryParams};
use crate::state::OperationRow;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use forkd_core::template::{self, Recipe};
use forkd_storage::snapshot::{chain, Snapshot, SnapshotError, Tag};
use serde::Deserialize;

fn info(app: &App, tag: &str, res: Result<Snapshot, SnapshotError>) -> SnapshotInfo {
    let store = app.registry.store();
    let dependents = Tag::parse(tag)
        .map(|t| store.dependents(&t))
        .unwrap_or_default();
    let children = app.registry.children_of(tag);
    let chained = res.and_then(|s| {
        let c = chain::info(store, &s)?;
        Ok((s, c))
    });
    match chained {
        Ok((s, c)) => SnapshotInfo {
            tag: tag.to_owned(),
            status: "ok".into(),
            error: None,
            template: Some(s.manifest.template.clone()),
            created_at: Some(s.manifest.created_at.clone()),
            parent: s.manifest.parent.clone(),
            vcpus: Some(s.manifest.machine.vcpus),
            memory_mib: Some(s.manifest.machine.memory_mib),
            accel: Some(s.manifest.machine.accel.to_string()),
            size_bytes: Some(s.manifest.parts.values().map(|p| p.size).sum()),
            disk_bytes: Some(s.disk_usage()),
            dependents,
            children,
            pool: Some(app.registry.pool_status(&s)),
            chain: Some(ChainBody {
                depth: u32::try_from(c.depth).unwrap_or(u32::MAX),
                ancestors: c.ancestors,
                own_bytes: c.own_bytes,
                memory_image_bytes: c.memory_image_bytes,
                total_bytes: c.total_bytes,
            }),
            branch: s.manifest.branch.clone(),
        },
        Err(e) => SnapshotInfo {
            tag: tag.to_owned(),
            status: "damaged".into(),
            error: Some(e.to_string()),
            template: None,
            created_at: None,
            parent: None,
            vcpus: None,
            memory_mib: None,
            accel: None,
            size_bytes: None,
            disk_bytes: None,
            dependents,
            children,
            pool: None,
            chain: None,
            branch: None,
        },
    }
}

/// Every snapshot, by tag (damaged ones too, with their error).
#[utoipa::path(get, path = "/v1/snapshots", responses((status = 200, body = SnapshotList)))]
pub async fn list(State(app): State<App>) -> Json<SnapshotList> {
    let snapshots = app
        .registry
        .store()
        .list()
        .into_iter()
        .map(|(tag, res)| info(&app, &tag, res))
        .collect();
    Json(SnapshotList { snapshots })
}

/// One snapshot, with its sizes, parent, dependents and live children.
#[utoipa::path(get, path = "/v1/snapshots/{tag}", params(("tag" = String, Path)),
    responses((status = 200, body = SnapshotInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn get(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let tag = Tag::parse(&tag)?;
    match app.registry.store().open(&tag) {
        Err(e @ SnapshotError::NotFound { .. }) => Err(e.into()),
        res => Ok(Json(info(&app, tag.as_str(), res))),
    }
}

/// `?force=true&cascade=true`
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeleteQuery {
    /// Stop the snapshot's live children first (with `cascade`, its dependents' too).
    #[serde(default)]
    force: bool,
    /// Remove the snapshots that depend on it too (deepest first).
    #[serde(default)]
    cascade: bool,
}

/// Deletes a snapshot. Refused (409, naming them) while children run from it, unless
/// `force` stops them first, or while other snapshots depend on it, unless `cascade`
/// removes those too (all or nothing: refused if any of them is in use).
#[utoipa::path(delete, path = "/v1/snapshots/{tag}", params(("tag" = String, Path), DeleteQuery),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
    QueryParams(q): QueryParams<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    let tag = Tag::parse(&tag)?;
    let store = app.registry.store();
    if !store.path(&tag).is_dir() {
        return Err(SnapshotError::NotFound {
            tag: tag.to_string(),
        }
        .into());
    }
    let mut doomed = if q.cascade {
        chain::descendants(store, &tag)
    } else {
        Vec::new()
    };
    doomed.push(tag.to_string());
    if q.cascade && !q.force {
        // All or nothing: say everything that stands in the way before removing any.
        let users: Vec<String> = doomed
            .iter()
            .flat_map(|t| {
                app.registry
                    .users_of(t)
                    .into_iter()
                    .map(move |u| format!("{u} (of {t})"))
            })
            .collect();
        if !users.is_empty() {
            return Err(SnapshotError::InUse {
                tag: tag.to_string(),
                users: users.join(", "),
            }
            .into());
        }
    }
    for t in &doomed {
        crate::service::snapshot::remove(&app, &Tag::parse(t)?, q.force).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Writes a standalone copy of a chain link: its memory image and device state copied,
/// its disk flattened, no parent. Its ancestors can then be removed.
#[utoipa::path(post, path = "/v1/snapshots/{tag}/compact", params(("tag" = String, Path)),
    request_body = CompactBody,
    responses((status = 201, body = SnapshotInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 507, body = ErrorBody)))]
pub async fn compact(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
    JsonBody(b): JsonBody<CompactBody>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let head = app.registry.store().open(&Tag::parse(&tag)?)?;
    let new = Tag::parse(&b.tag)?;
    if head.manifest.parent.is_none() {
        return Err(ApiError::conflict(format!(
            "snapshot {tag} has no parent: it is standalone already"
        )));
    }
    crate::service::tags::check_free(&app, &new).await?;
    let snap = forkd_core::compact::compact(
        app.registry.hypervisor().as_ref(),
        app.registry.store(),
        &head,
        &new,
    )
    .await?;
    let new_tag = snap.tag.to_string();
    crate::service::tags::claim_made(&app, std::slice::from_ref(&new_tag)).await?;
    let info = info(&app, &new_tag, Ok(snap));
    Ok((StatusCode::CREATED, Json(info)))
}

/// A snapshot's warm pool: its size, where the size comes from, members ready and
/// being prepared.
#[utoipa::path(get, path = "/v1/snapshots/{tag}/pool", params(("tag" = String, Path)),
    responses((status = 200, body = crate::pool::PoolStatus), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn get_pool(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
) -> Result<Json<crate::pool::PoolStatus>, ApiError> {
    let snap = app.registry.store().open(&Tag::parse(&tag)?)?;
    Ok(Json(app.registry.pool_status(&snap)))
}

/// Sets how many children of a snapshot the daemon keeps prepared for forks (0 to
/// 256; null: its recipe's `pool`). Members are made in the background while no fork
/// runs; a smaller size ends the extra ones at once.
#[utoipa::path(put, path = "/v1/snapshots/{tag}/pool", params(("tag" = String, Path)),
    request_body = super::types::SetPoolBody,
    responses((status = 200, body = crate::pool::PoolStatus), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn set_pool(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
    JsonBody(b): JsonBody<super::types::SetPoolBody>,
) -> Result<Json<crate::pool::PoolStatus>, ApiError> {
    let snap = app.registry.store().open(&Tag::parse(&tag)?)?;
    let max = forkd_core::fork::MAX_POOL;
    if b.size.is_some_and(|n| n as usize > max) {
        return Err(ApiError::bad_request(format!(
            "a pool holds at most {max} members"
        )));
    }
    let status = app
        .registry
        .set_pool_size(&snap, b.size.map(|n| n as usize))
        .await?;
    Ok(Json(status))
}

/// Builds a template into a snapshot. Answers at once with an operation to poll.
#[utoipa::path(post, path = "/v1/snapshots", request_body = BuildSnapshotBody,
    responses((status = 202, body = OperationRow), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn build(
    State(app): State<App>,
    JsonBody(b): JsonBody<BuildSnapshotBody>,
) -> Result<(StatusCode, Json<OperationRow>), ApiError> {
    let (recipe, files, imported) = match &b.recipe {
        Some(text) => {
            let recipe = Recipe::parse(&b.template, text)?;
            let imported = open_host_path(&app, &recipe)?;
            let files = sent_files(&recipe, &b.files)?;
            (recipe, files, imported)
        }
        None => {
            let recipe = Recipe::find(&b.template, &[app.config.home.root().join("templates")])?;
            let files = recipe.read_files()?;
            (recipe, files, None)
        }
    };
    let tag = Tag::parse(b.tag.as_deref().unwrap_or(&recipe.name))?;
    if app.registry.store().exists(&tag) {
        return Err(SnapshotError::Exists {
            tag: tag.to_string(),
        }
        .into());
    }
    // The build runs on after this answer: say at once when it cannot fit. (It checks
    // again, knowing whether the assets can be hard-linked, before it writes.)
    forkd_host::space::ensure_room(
        app.registry.store().root(),
        (u64::from(recipe.memory_mib) << 20) + (64 << 20),
        &format!("building snapshot {tag}"),
    )?;
    if let Some(op) = app.registry.state().running_operation_on(tag.as_str())? {
        return Err(ApiError::conflict(format!(
            "snapshot {tag} is being built already (operation {})",
            op.id
        )));
    }
    crate::service::tags::check_free(&app, &tag).await?;
    let op = OperationRow::running("build_snapshot", tag.as_str(), 0, None);
    app.registry.state().insert_operation(&op)?;
    let app2 = app.clone();
    let op_id = op.id.clone();
    tokio::spawn(async move {
        let r = build_snapshot(&app2, &op_id, &recipe, &files, imported, &tag).await;
        app2.registry.clear_progress(&op_id);
        let r = match r {
            Ok(()) => crate::service::tags::claim_made(&app2, &[tag.to_string()])
                .await
                .map_err(|e| e.message),
            Err(e) => Err(e.to_string()),
        };
        let (status, error) = match &r {
            Ok(()) => ("succeeded", None),
            Err(e) => ("failed", Some(e.clone())),
        };
        tracing::info!(op = %op_id, %tag, "snapshot build {status}");
        if let Err(e) = app2.registry.state().finish_operation(
            &op_id,
            status,
            error.as_deref(),
            &crate::now_rfc3339(),
        ) {
            tracing::warn!(op = %op_id, "recording the end of the build: {e}");
        }
    });
    Ok((StatusCode::ACCEPTED, Json(op)))
}

/// The host path a recipe sent through the API names, opened, if the daemon may open
/// it for a client (see [`crate::import_dirs`]): refused before anything is opened
/// otherwise.
fn open_host_path(
    app: &App,
    recipe: &Recipe,
) -> Result<Option<crate::import_dirs::Opened>, ApiError> {
    let Some(from) = recipe.from.as_deref() else {
        return Ok(None);
    };
    let source = forkd_storage::oci::image::ImageSource::parse(from)?;
    app.config.import_dirs.open(&source).map_err(|e| match e {
        crate::import_dirs::Refused::Outside { .. } => {
            ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string())
        }
        crate::import_dirs::Refused::Unreadable { .. } => ApiError::bad_request(e.to_string()),
    })
}

/// The image opened under an import directory, kept as an upload is; what a recipe's
/// `from` names it by.
async fn import(app: &App, opened: crate::import_dirs::Opened) -> anyhow::Result<String> {
    use forkd_storage::oci::upload;
    let home = app.config.home.clone();
    let scratch = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let (reader, tag) = opened.reader()?;
        Ok(upload::receive(&home, reader, tag.as_deref())?)
    })
    .await??;
    let kept = upload::install(&app.config.home, scratch.path(), &|m| {
        tracing::debug!("importing an image: {m}")
    })
    .await?;
    Ok(kept.from)
}

/// The recipe's `files` as the request carried them (base64 by `src`): each one, and
/// nothing else.
fn sent_files(
    recipe: &Recipe,
    sent: &std::collections::BTreeMap<String, String>,
) -> Result<template::RecipeFiles, ApiError> {
    use base64::Engine;
    if let Some(extra) = sent
        .keys()
        .find(|k| !recipe.files.iter().any(|f| &f.src == *k))
    {
        return Err(ApiError::bad_request(format!(
            "file {extra:?} was sent but the recipe does not copy it"
        )));
    }
    let mut files = template::RecipeFiles::new();
    for f in &recipe.files {
        let text = sent.get(&f.src).ok_or_else(|| {
            ApiError::bad_request(format!(
                "the recipe copies {} but its contents were not sent (`files` of the request)",
                f.src
            ))
        })?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| ApiError::bad_request(format!("file {}: not base64: {e}", f.src)))?;
        files.insert(f.src.clone(), bytes);
    }
    Ok(files)
}

async fn build_snapshot(
    app: &App,
    op: &str,
    recipe: &Recipe,
    files: &template::RecipeFiles,
    imported: Option<crate::import_dirs::Opened>,
    tag: &Tag,
) -> anyhow::Result<()> {
    let home = app.config.home.clone();
    let assets = match recipe.base() {
        template::Base::Builtin(image) => {
            tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                let agent = forkd_image::find_agent_binary()?;
                Ok(forkd_image::ensure_all(
                    &home,
                    image,
                    &agent,
                    &forkd_image::BuildOptions::default(),
                )?)
            })
            .await??
        }
        template::Base::Oci(from) => {
            // What was opened under an import directory is read, not the path again.
            let from = match imported {
                Some(opened) => import(app, opened).await?,
                None => from,
            };
            let shown = tag.to_string();
            let pulled = forkd_storage::oci::image::pull_image(
                &home,
                &from,
                &app.config.registries,
                &|m| tracing::info!(tag = %shown, "{m}"),
            )
            .await?;
            tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                let agent = forkd_image::find_agent_binary()?;
                let opts = forkd_image::BuildOptions::default();
                let kernel = forkd_image::ensure_kernel(&home, &opts)?;
                let initramfs = forkd_image::ensure_initramfs(&home, &kernel, &agent, &opts)?;
                Ok(forkd_image::GuestAssets {
                    kernel,
                    initramfs,
                    rootfs: pulled.rootfs,
                })
            })
            .await??
        }
    };
    let id = tag.to_string();
    let opts = template::BuildOptions::default();
    let progress = |m: &str| {
        tracing::info!(tag = %id, "{m}");
        app.registry.add_step(op, m);
    };
    let assets = forkd_core::customise::ensure(
        app.registry.hypervisor().as_ref(),
        &app.config.home,
        &assets,
        recipe,
        files,
        &opts,
        &progress,
    )
    .await?;
    template::build(
        app.registry.hypervisor().as_ref(),
        &app.config.home,
        app.registry.store(),
        recipe,
        tag,
        &assets,
        &opts,
        &progress,
    )
    .await?;
    Ok(())
}

/// `?kind=&limit=`
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct OperationsQuery {
    /// Only operations of this kind (`build_snapshot`, `fork`, `branch`).
    #[serde(default)]
    kind: Option<String>,
    /// At most this many (1 to 1000; default 100), newest first.
    #[serde(default)]
    limit: Option<u32>,
}

/// The latest operations, newest first.
#[utoipa::path(get, path = "/v1/operations", params(OperationsQuery),
    responses((status = 200, body = super::types::OperationList), (status = 400, body = ErrorBody)))]
pub async fn operations(
    State(app): State<App>,
    QueryParams(q): QueryParams<OperationsQuery>,
) -> Result<Json<super::types::OperationList>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit = {limit} is outside 1..=1000"
        )));
    }
    let operations = app.registry.state().operations(q.kind.as_deref(), limit)?;
    Ok(Json(super::types::OperationList { operations }))
}

/// A long-running operation.
#[utoipa::path(get, path = "/v1/operations/{id}", params(("id" = String, Path)),
    responses((status = 200, body = OperationRow), (status = 404, body = ErrorBody)))]
pub async fn operation(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<OperationRow>, ApiError> {
    let mut op = app
        .registry
        .state()
        .operation(&id)?
        .ok_or_else(|| ApiError::not_found(format!("no operation {id}")))?;
    // A running fork's progress is kept in memory, not written per child, and so is
    // what a running build is doing.
    if let Some(done) = app.registry.progress(&id) {
        op.done = done;
    }
    if op.status == "running" {
        op.steps = app.registry.steps(&id);
    }
    Ok(Json(op))
}

/// Cancels a running fork: children not started yet are not, started ones are stopped
/// and removed; the operation ends `cancelled`. (A template build cannot be cancelled.)
#[utoipa::path(delete, path = "/v1/operations/{id}", params(("id" = String, Path)),
    responses((status = 202, body = OperationRow), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn cancel_operation(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<(StatusCode, Json<OperationRow>), ApiError> {
    let op = app
        .registry
        .state()
        .operation(&id)?
        .ok_or_else(|| ApiError::not_found(format!("no operation {id}")))?;
    if op.status != "running" {
        return Err(ApiError::conflict(format!(
            "operation {id} is {} already",
            op.status
        )));
    }
    if !app.registry.cancel(&id) {
        return Err(ApiError::conflict(format!(
            "operation {id} ({}) cannot be cancelled; only forks can",
            op.kind
        )));
    }
    Ok((StatusCode::ACCEPTED, Json(op)))
}

/// Re-hashes every part of a snapshot against its manifest (slow: reads every byte).
#[utoipa::path(post, path = "/v1/snapshots/{tag}/verify", params(("tag" = String, Path)),
    responses((status = 200, body = Verified), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn verify(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
) -> Result<Json<Verified>, ApiError> {
    let tag = Tag::parse(&tag)?;
    let store = app.registry.store().clone();
    let t = std::time::Instant::now();
    let links = tokio::task::spawn_blocking(move || chain::verify(&store, &tag))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    let snap = links.last().expect("a chain holds its head");
    Ok(Json(Verified {
        tag: snap.tag.to_string(),
        links: u32::try_from(links.len()).unwrap_or(u32::MAX),
        bytes: links
            .iter()
            .flat_map(|l| l.manifest.parts.values())
            .map(|p| p.size)
            .sum(),
        millis: u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX),
    }))
}
