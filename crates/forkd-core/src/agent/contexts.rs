//! Code contexts and the resume hook.

use super::lines::Lines;
use super::{empty, json_body, AgentClient, AgentError};
use bytes::Bytes;
use forkd_proto::context::{
    ContextEvent, ContextInfo, CreateContextRequest, Execution, ResumeRequest, ResumeResponse,
    RunCodeRequest,
};
use forkd_proto::routes;
use futures::stream::BoxStream;
use futures::TryStreamExt;
use http::Method;
use http_body_util::BodyDataStream;

/// The streamed events of one run: JSON lines, each at most the event line limit
/// (`FORKD_EVENT_LINE_LIMIT`).
pub struct RunStream {
    lines: Lines<BoxStream<'static, std::io::Result<Bytes>>>,
    done: bool,
}

impl RunStream {
    /// The next event; `None` after [`ContextEvent::Done`].
    pub async fn next(&mut self) -> Result<Option<ContextEvent>, AgentError> {
        if self.done {
            return Ok(None);
        }
        let Some(line) = self.lines.next().await? else {
            return Err(AgentError::Malformed(
                "run output ended without a done event".into(),
            ));
        };
        let event: ContextEvent = serde_json::from_str(&line)
            .map_err(|e| AgentError::Malformed(format!("bad run event: {e}")))?;
        self.done = matches!(event, ContextEvent::Done { .. });
        Ok(Some(event))
    }

    /// Reads the rest of the run and collects it.
    pub async fn collect(mut self) -> Result<Execution, AgentError> {
        let mut x = Execution::default();
        while let Some(e) = self.next().await? {
            x.push(e);
        }
        Ok(x)
    }
}

impl AgentClient {
    /// Starts a code context (`POST /v1/contexts`).
    pub async fn create_context(
        &self,
        req: &CreateContextRequest,
    ) -> Result<ContextInfo, AgentError> {
        self.post_json(routes::CONTEXTS, req).await
    }

    /// Lists the code contexts.
    pub async fn list_contexts(&self) -> Result<Vec<ContextInfo>, AgentError> {
        self.get_json(routes::CONTEXTS).await
    }

    /// Runs code in a context; the events stream as the code produces them.
    pub async fn run_code_stream(
        &self,
        context: &str,
        req: &RunCodeRequest,
    ) -> Result<RunStream, AgentError> {
        if !req.env.is_empty() {
            // An older agent would run the cell without them, silently.
            self.needs(forkd_proto::context::RUN_ENV, "set variables for one run")?;
        }
        let resp = self
            .send(Method::POST, &routes::context_run(context), json_body(req))
            .await?;
        let body = BodyDataStream::new(resp.into_body()).map_err(std::io::Error::other);
        let max = usize::try_from(forkd_proto::limits::get().event_line).unwrap_or(usize::MAX);
        Ok(RunStream {
            lines: Lines::new(
                Box::pin(body),
                max,
                "a code-context event line",
                "FORKD_EVENT_LINE_LIMIT",
            ),
            done: false,
        })
    }

    /// Runs code in a context and collects what it produced.
    pub async fn run_code(
        &self,
        context: &str,
        req: &RunCodeRequest,
    ) -> Result<Execution, AgentError> {
        self.run_code_stream(context, req).await?.collect().await
    }

    /// Restarts a context's interpreter with empty state.
    pub async fn reset_context(&self, context: &str) -> Result<ContextInfo, AgentError> {
        let resp = self
            .send(Method::POST, &routes::context_reset(context), empty())
            .await?;
        super::read_json(resp).await
    }

    /// Ends a context.
    pub async fn delete_context(&self, context: &str) -> Result<ContextInfo, AgentError> {
        self.request_json(Method::DELETE, &routes::context(context))
            .await
    }

    /// Runs the resume hook of a restored child.
    pub async fn resume(&self, req: &ResumeRequest) -> Result<ResumeResponse, AgentError> {
        self.post_json(routes::RESUME, req).await
    }
}
