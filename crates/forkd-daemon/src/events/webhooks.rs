//! Webhooks: each event POSTed as JSON to the URLs registered for its type, signed,
//! retried with backoff, each delivery's outcome recorded.
//!
//! A delivery carries `forkd-signature: t=<unix seconds>,v1=<hex>`, where the hex is
//! HMAC-SHA256 under the webhook's secret of `<t>.<body>`: a receiver recomputes it and
//! checks `t` is recent, so a replayed or altered delivery is refused. Deliveries run on
//! their own tasks, at most [`CONCURRENT`] at once: a receiver that hangs or fails delays
//! only its own deliveries, never the operation whose event it is.

use super::{now_ms, Events};
use crate::state::{Delivery, EventRow, State, WebhookRow};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::Semaphore;

/// The signature's header.
pub const SIGNATURE_HEADER: &str = "forkd-signature";
/// The event number's header (the same as the body's `id`).
pub const EVENT_HEADER: &str = "forkd-event-id";
/// Attempts before a delivery is given up.
pub const ATTEMPTS: u32 = 6;
/// Deliveries in flight at once.
const CONCURRENT: usize = 32;
/// How long one attempt may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Registers a webhook for `url` (http or https) and event `types` (empty: all), signed
/// with `secret` (default: 32 random bytes, hex). The error says what is wrong.
pub fn register(
    state: &State,
    url: String,
    types: Vec<String>,
    secret: Option<String>,
) -> Result<WebhookRow, String> {
    let parsed = reqwest::Url::parse(&url).map_err(|e| format!("url {url:?}: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(format!(
            "url {url:?} is not an http or https URL with a host"
        ));
    }
    for t in &types {
        if super::EventKind::parse(t).is_none() {
            let all: Vec<&str> = super::EventKind::ALL.iter().map(|k| k.as_str()).collect();
            return Err(format!("event type {t:?} is not one of {}", all.join(", ")));
        }
    }
    let secret = match secret {
        Some(s) if s.len() < 16 => {
            return Err("secret: at least 16 characters (or none, for a random one)".into())
        }
        Some(s) => s,
        None => forkd_host::ids::random_hex(32),
    };
    let w = WebhookRow {
        id: format!("wh-{}", forkd_host::ids::random_hex(6)),
        url,
        types,
        secret,
        created_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
    };
    state
        .insert_webhook(&w)
        .map_err(|e| format!("recording the webhook: {e}"))?;
    Ok(w)
}

/// The signature header's value for `body` sent at `t` (Unix seconds).
pub fn signature(secret: &str, t: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// The wait before attempt `n` (from 1): 1 s, 2 s, 4 s... at most a minute.
fn backoff(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

/// Starts delivering the events announced from now on.
pub fn spawn(events: Arc<Events>, state: Arc<State>) -> tokio::task::JoinHandle<()> {
    let mut rx = events.subscribe();
    tokio::spawn(async move {
        // reqwest's rustls takes the process's provider: the workspace's is ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = match reqwest::Client::builder()
            .timeout(ATTEMPT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("webhooks are off: no HTTP client: {e}");
                return;
            }
        };
        let slots = Arc::new(Semaphore::new(CONCURRENT));
        let mut last = 0i64;
        loop {
            let batch = match rx.recv().await {
                // With what else is waiting (a fork's children come together): the
                // webhooks are read once for them all.
                Ok(e) => {
                    let mut batch = vec![e];
                    loop {
                        match rx.try_recv() {
                            Ok(e) => batch.push(e),
                            Err(TryRecvError::Lagged(_)) => {
                                batch = events.after(last, 100_000).unwrap_or_default();
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    batch
                }
                // Fallen behind: what was missed is in the database.
                Err(RecvError::Lagged(_)) => events.after(last, 100_000).unwrap_or_default(),
                Err(RecvError::Closed) => return,
            };
            let hooks = match state.webhooks() {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!("reading the webhooks: {e}");
                    continue;
                }
            };
            for e in batch {
                if e.id <= last {
                    continue;
                }
                last = e.id;
                for hook in hooks.iter().filter(|h| wants(h, &e)) {
                    let (client, state, slots) = (client.clone(), state.clone(), slots.clone());
                    let (hook, e) = (hook.clone(), e.clone());
                    tokio::spawn(async move {
                        let Ok(_slot) = slots.acquire_owned().await else {
                            return;
                        };
                        deliver(&client, &state, &hook, &e).await;
                    });
                }
            }
        }
    })
}

fn wants(hook: &WebhookRow, e: &EventRow) -> bool {
    hook.types.is_empty() || hook.types.contains(&e.kind)
}

/// Delivers `e` to `hook`, retrying, and records each attempt's outcome.
async fn deliver(client: &reqwest::Client, state: &State, hook: &WebhookRow, e: &EventRow) {
    let body = serde_json::to_vec(e).expect("events serialize");
    let mut d = Delivery {
        event: e.id,
        status: "retrying".into(),
        attempts: 0,
        http_status: None,
        error: None,
        at_ms: now_ms(),
    };
    for n in 1..=ATTEMPTS {
        if n > 1 {
            tokio::time::sleep(backoff(n - 1)).await;
        }
        d.attempts = n;
        let t = now_ms() / 1000;
        let sent = client
            .post(&hook.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, signature(&hook.secret, t, &body))
            .header(EVENT_HEADER, e.id.to_string())
            .body(body.clone())
            .send()
            .await;
        let ok = match sent {
            Ok(resp) => {
                d.http_status = Some(resp.status().as_u16());
                d.error = (!resp.status().is_success())
                    .then(|| format!("the receiver answered {}", resp.status()));
                resp.status().is_success()
            }
            Err(err) => {
                d.http_status = None;
                d.error = Some(err.to_string());
                false
            }
        };
        d.status = match (ok, n == ATTEMPTS) {
            (true, _) => "delivered",
            (false, false) => "retrying",
            (false, true) => "failed",
        }
        .into();
        d.at_ms = now_ms();
        if let Err(err) = state.record_delivery(&hook.id, &d) {
            tracing::warn!(webhook = %hook.id, "recording a delivery: {err}");
        }
        if ok {
            return;
        }
        tracing::debug!(webhook = %hook.id, event = e.id, attempt = n, "delivery failed: {:?}", d.error);
    }
    tracing::warn!(webhook = %hook.id, event = e.id, "delivery given up after {ATTEMPTS} attempts: {:?}", d.error);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_covers_the_time_and_the_body() {
        let a = signature("key", 1_700_000_000, b"{}");
        assert!(a.starts_with("t=1700000000,v1="), "{a}");
        assert_eq!(a.len(), "t=1700000000,v1=".len() + 64);
        assert_ne!(a, signature("key", 1_700_000_001, b"{}"));
        assert_ne!(a, signature("key", 1_700_000_000, b"{ }"));
        assert_ne!(a, signature("other", 1_700_000_000, b"{}"));
        assert_eq!(a, signature("key", 1_700_000_000, b"{}"));
    }

    #[test]
    fn retries_back_off_up_to_a_minute() {
        let waits: Vec<u64> = (1..=8).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 32, 60, 60]);
    }
}
