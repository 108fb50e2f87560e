//! `GET /v1/events` (Server-Sent Events) and `/v1/webhooks`: the sandboxes' lifecycle
//! events, streamed or delivered (see [`crate::events`]).

use super::error::ErrorBody;
use super::{ApiError, App, JsonBody, PathParams};
use crate::events::{EventKind, Filter};
use crate::state::{Delivery, EventRow, WebhookRow};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde::{Deserialize, Serialize};
use std::convert::Infallible;
use std::time::Duration;
use tokio::sync::broadcast::error::RecvError;

/// Events read from the database per query while catching up.
const PAGE: usize = 1000;

/// What `GET /v1/events` was asked for.
struct EventsQuery {
    filter: Filter,
    /// Events after this number (`Last-Event-ID`, else `after`, else 0).
    after: i64,
    /// Stay open for new events (the default), or end after the kept ones.
    follow: bool,
}

fn parse_query(q: Option<&str>, headers: &HeaderMap) -> Result<EventsQuery, ApiError> {
    let mut out = EventsQuery {
        filter: Filter::default(),
        after: 0,
        follow: true,
    };
    let pairs = super::form_pairs(q.unwrap_or(""));
    for (k, v) in pairs {
        match k.as_str() {
            "sandbox" => out.filter.sandbox = Some(v),
            "label" => {
                let (k, v) = v.split_once('=').ok_or_else(|| {
                    ApiError::bad_request(format!("label {v:?} is not KEY=VALUE"))
                })?;
                out.filter.label = Some((k.to_owned(), v.to_owned()));
            }
            "type" => {
                for t in v.split(',').filter(|t| !t.is_empty()) {
                    let kind = EventKind::parse(t).ok_or_else(|| {
                        let all: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
                        ApiError::bad_request(format!(
                            "event type {t:?} is not one of {}",
                            all.join(", ")
                        ))
                    })?;
                    out.filter.types.push(kind);
                }
            }
            "after" => {
                out.after = v.parse().map_err(|_| {
                    ApiError::bad_request(format!("after {v:?} is not an event number"))
                })?
            }
            "follow" => {
                out.follow = match v.as_str() {
                    "true" | "1" | "" => true,
                    "false" | "0" => false,
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "follow {v:?} is not true or false"
                        )))
                    }
                }
            }
            other => {
                return Err(ApiError::bad_request(format!(
                    "unknown parameter {other:?} (sandbox, label, type, after, follow)"
                )))
            }
        }
    }
    if let Some(id) = headers.get("last-event-id") {
        out.after = id
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| ApiError::bad_request("Last-Event-ID is not an event number"))?;
    }
    Ok(out)
}

fn sse(e: &EventRow) -> Event {
    Event::default()
        .id(e.id.to_string())
        .event(e.kind.clone())
        .json_data(e)
        .unwrap_or_else(|_| Event::default().comment("an event that does not serialize"))
}

/// The sandboxes' lifecycle events as Server-Sent Events (`id` is the event's number,
/// `event` its type, `data` the event as JSON): those kept after `Last-Event-ID` (or
/// `after`), then, unless `follow=false`, each new one as it happens. Filters:
/// `sandbox=ID`, `label=KEY=VALUE`, `type=created,killed,...`.
#[utoipa::path(get, path = "/v1/events",
    params(("sandbox" = Option<String>, Query), ("label" = Option<String>, Query),
        ("type" = Option<String>, Query), ("after" = Option<i64>, Query),
        ("follow" = Option<bool>, Query)),
    responses((status = 200, content_type = "text/event-stream", body = EventMessage,
            description = "a stream of events, each `data` an EventRow as JSON"),
        (status = 400, body = ErrorBody)))]
pub async fn stream(
    State(app): State<App>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Result<Response, ApiError> {
    let q = parse_query(q.as_deref(), &headers)?;
    let events = app.registry.events().clone();
    // Subscribed before the kept events are read: nothing falls between the two.
    let live = events.subscribe();
    let stream = events_stream(events, live, q);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

fn events_stream(
    events: std::sync::Arc<crate::events::Events>,
    live: tokio::sync::broadcast::Receiver<EventRow>,
    q: EventsQuery,
) -> impl Stream<Item = Result<Event, Infallible>> {
    struct S {
        events: std::sync::Arc<crate::events::Events>,
        live: tokio::sync::broadcast::Receiver<EventRow>,
        q: EventsQuery,
        /// The last event number passed on (or skipped by the filter).
        last: i64,
        /// Kept events read but not sent yet.
        pending: std::collections::VecDeque<EventRow>,
        /// Still reading kept events from the database.
        catching_up: bool,
    }
    let last = q.after;
    let s = S {
        events,
        live,
        q,
        last,
        pending: Default::default(),
        catching_up: true,
    };
    futures::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.pending.pop_front() {
                s.last = e.id;
                if s.q.filter.matches(&e) {
                    return Some((Ok(sse(&e)), s));
                }
                continue;
            }
            if s.catching_up {
                match s.events.after(s.last, PAGE) {
                    Ok(page) if !page.is_empty() => {
                        s.pending.extend(page);
                        continue;
                    }
                    Ok(_) => s.catching_up = false,
                    Err(e) => {
                        tracing::warn!("reading events: {e}");
                        return None;
                    }
                }
                if !s.q.follow {
                    return None;
                }
            }
            match s.live.recv().await {
                Ok(e) if e.id <= s.last => {}
                Ok(e) => s.pending.push_back(e),
                // Fallen behind: read what was missed from the database.
                Err(RecvError::Lagged(_)) => s.catching_up = true,
                Err(RecvError::Closed) => return None,
            }
        }
    })
}

/// One message of the event stream, as Server-Sent Events frame it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct EventMessage {
    /// The event's number (what `Last-Event-ID` resumes after).
    pub id: String,
    /// Its type.
    pub event: String,
    /// The event ([`EventRow`]) as JSON.
    #[schema(content_media_type = "application/json")]
    pub data: String,
}

/// A webhook to register.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewWebhook {
    /// Where to POST events (`http` or `https`).
    pub url: String,
    /// Event types to send (default: all).
    #[serde(default)]
    pub types: Vec<String>,
    /// The key deliveries are signed with (default: a random one, shown once in the
    /// answer).
    #[serde(default)]
    pub secret: Option<String>,
}

/// A webhook as registration answers it: with its secret, which is not shown again.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RegisteredWebhook {
    /// The webhook.
    #[serde(flatten)]
    pub webhook: WebhookRow,
    /// Its signing key.
    pub secret: String,
}

/// A webhook with its latest deliveries.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WebhookDetail {
    /// The webhook.
    #[serde(flatten)]
    pub webhook: WebhookRow,
    /// Its last 100 deliveries, newest first.
    pub deliveries: Vec<Delivery>,
}

/// Registers a webhook: every event of its types is POSTed to it as JSON, signed
/// (`forkd-signature: t=<unix>,v1=<hex HMAC-SHA256 of "<t>.<body>">`), retried with
/// backoff (6 attempts), each outcome kept.
#[utoipa::path(post, path = "/v1/webhooks", request_body = NewWebhook,
    responses((status = 201, body = RegisteredWebhook), (status = 400, body = ErrorBody)))]
pub async fn register(
    State(app): State<App>,
    JsonBody(req): JsonBody<NewWebhook>,
) -> Result<(StatusCode, Json<RegisteredWebhook>), ApiError> {
    let w = crate::events::webhooks::register(app.registry.state(), req.url, req.types, req.secret)
        .map_err(ApiError::bad_request)?;
    let secret = w.secret.clone();
    Ok((
        StatusCode::CREATED,
        Json(RegisteredWebhook { webhook: w, secret }),
    ))
}

/// The registered webhooks.
#[utoipa::path(get, path = "/v1/webhooks", responses((status = 200, body = Vec<WebhookRow>)))]
pub async fn list(State(app): State<App>) -> Result<Json<Vec<WebhookRow>>, ApiError> {
    Ok(Json(app.registry.state().webhooks().map_err(state_error)?))
}

/// A webhook and its latest deliveries.
#[utoipa::path(get, path = "/v1/webhooks/{id}", params(("id" = String, Path)),
    responses((status = 200, body = WebhookDetail), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<WebhookDetail>, ApiError> {
    let state = app.registry.state();
    let webhook = state
        .webhooks()
        .map_err(state_error)?
        .into_iter()
        .find(|w| w.id == id)
        .ok_or_else(|| ApiError::not_found(format!("no webhook {id}")))?;
    let deliveries = state.deliveries(&id, 100).map_err(state_error)?;
    Ok(Json(WebhookDetail {
        webhook,
        deliveries,
    }))
}

/// Removes a webhook (deliveries under way end after their current attempt).
#[utoipa::path(delete, path = "/v1/webhooks/{id}", params(("id" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<StatusCode, ApiError> {
    if app
        .registry
        .state()
        .delete_webhook(&id)
        .map_err(state_error)?
    {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("no webhook {id}")))
    }
}

fn state_error(e: crate::state::StateError) -> ApiError {
    ApiError::internal(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_read_and_bad_ones_are_named() {
        let h = HeaderMap::new();
        let q = parse_query(
            Some("sandbox=sb-1&label=team%3Dx%3Dy&type=created,killed&after=7&follow=false"),
            &h,
        )
        .unwrap();
        assert_eq!(q.filter.sandbox.as_deref(), Some("sb-1"));
        assert_eq!(q.filter.label, Some(("team".into(), "x=y".into())));
        assert_eq!(q.filter.types, vec![EventKind::Created, EventKind::Killed]);
        assert_eq!((q.after, q.follow), (7, false));
        let mut h = HeaderMap::new();
        h.insert("last-event-id", "42".parse().unwrap());
        assert_eq!(parse_query(Some("after=7"), &h).unwrap().after, 42);
        for bad in [
            "type=exploded",
            "after=x",
            "label=nokey",
            "follow=maybe",
            "color=red",
        ] {
            let e = parse_query(Some(bad), &HeaderMap::new()).err().expect(bad);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
