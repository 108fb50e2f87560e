//! `forkd events`: the daemon's lifecycle events (created, started, paused, resumed,
//! branched, failed, killed, timed out), read from `GET /v1/events`.

use crate::remote::fail;
use anyhow::{Context, Result};
use forkd_daemon::client::{Client, Lines};
use hyper::{Method, StatusCode};
use serde_json::Value;

/// Arguments of `forkd events`.
#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    /// Stay and print each new event as it happens.
    #[arg(long, short)]
    follow: bool,
    /// Only this sandbox's events.
    #[arg(long)]
    sandbox: Option<String>,
    /// Only events of sandboxes with this label (KEY=VALUE).
    #[arg(long)]
    label: Option<String>,
    /// Only these types (comma-separated: created,started,paused,resumed,branched,
    /// failed,killed,timed_out).
    #[arg(long = "type")]
    types: Option<String>,
    /// Only events after this number.
    #[arg(long)]
    after: Option<i64>,
    /// Print each event as a line of JSON.
    #[arg(long)]
    json: bool,
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b',' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prints the events, and with `--follow` goes on until interrupted.
pub async fn run(client: &Client, args: EventsArgs) -> Result<()> {
    let mut query = vec![format!("follow={}", args.follow)];
    for (k, v) in [
        ("sandbox", &args.sandbox),
        ("label", &args.label),
        ("type", &args.types),
    ] {
        if let Some(v) = v {
            query.push(format!("{k}={}", encode(v)));
        }
    }
    if let Some(a) = args.after {
        query.push(format!("after={a}"));
    }
    let path = format!("/v1/events?{}", query.join("&"));
    let resp = client.send(Method::GET, &path, None).await?;
    if resp.status() != StatusCode::OK {
        return Err(fail(resp).await);
    }
    let mut lines = Lines::new(resp);
    let mut data = String::new();
    while let Some(line) = lines.next_text().await? {
        if let Some(d) = line.strip_prefix("data:") {
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
            continue;
        }
        if !line.is_empty() || data.is_empty() {
            continue;
        }
        let e: Value = serde_json::from_str(&data).context("an event that is not JSON")?;
        data.clear();
        if args.json {
            println!("{e}");
        } else {
            print_event(&e);
        }
    }
    Ok(())
}

fn print_event(e: &Value) {
    let at = e["at_ms"]
        .as_i64()
        .and_then(|ms| u64::try_from(ms).ok())
        .map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .map(forkd_image::timestamp::rfc3339_utc)
        .unwrap_or_default();
    let reason = e["reason"]
        .as_str()
        .map(|r| format!("  {r}"))
        .unwrap_or_default();
    println!(
        "{:>6}  {at}  {:<9}  {}{reason}",
        e["id"],
        e["type"].as_str().unwrap_or("?"),
        e["sandbox"].as_str().unwrap_or("?")
    );
}
