//! A watch of a guest directory ([`forkd_proto::routes::FILES_WATCH`]): its events as
//! they come.

use super::lines::Lines;
use super::{empty, with_query, AgentClient, AgentError};
use bytes::Bytes;
use forkd_proto::files::{WatchEvent, WatchQuery};
use forkd_proto::routes;
use futures::stream::BoxStream;
use futures::TryStreamExt;
use http::Method;
use http_body_util::BodyDataStream;

/// The agent protocol from which directories can be watched.
pub const WATCH: u32 = 6;

/// The events of a watch, until the caller drops it (or the directory goes).
pub struct WatchStream {
    lines: Lines<BoxStream<'static, std::io::Result<Bytes>>>,
}

impl WatchStream {
    /// The next event; `None` once the watched directory is gone.
    pub async fn next(&mut self) -> Result<Option<WatchEvent>, AgentError> {
        let Some(line) = self.lines.next().await? else {
            return Ok(None);
        };
        serde_json::from_str(&line)
            .map(Some)
            .map_err(|e| AgentError::Malformed(format!("bad watch event: {e}")))
    }
}

impl AgentClient {
    /// Watches the guest directory `path` (and its subdirectories, if `recursive`).
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<WatchStream, AgentError> {
        self.needs(WATCH, "watch files")?;
        let q = WatchQuery {
            path: path.to_owned(),
            recursive,
        };
        let resp = self
            .send(Method::GET, &with_query(routes::FILES_WATCH, &q), empty())
            .await?;
        let body = BodyDataStream::new(resp.into_body()).map_err(std::io::Error::other);
        let max = usize::try_from(forkd_proto::limits::get().event_line).unwrap_or(usize::MAX);
        Ok(WatchStream {
            lines: Lines::new(
                Box::pin(body),
                max,
                "a watch event line",
                "FORKD_EVENT_LINE_LIMIT",
            ),
        })
    }
}
