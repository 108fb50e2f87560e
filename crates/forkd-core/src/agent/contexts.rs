//! Code contexts and the resume hook.

use super::{empty, json_body, AgentClient, AgentError};
use forkd_proto::context::{
    ContextEvent, ContextInfo, CreateContextRequest, Execution, ResumeRequest, ResumeResponse,
    RunCodeRequest,
};
use forkd_proto::routes;
use http::Method;
use http_body_util::BodyExt;
use hyper::body::Incoming;

/// Largest single event accepted from the agent (the driver sends output in pieces far
/// smaller than this; a line without end would otherwise grow without limit).
const MAX_EVENT: usize = 64 << 20;

/// The streamed events of one run.
pub struct RunStream {
    body: Incoming,
    buf: Vec<u8>,
    done: bool,
}

impl RunStream {
    /// The next event; `None` after [`ContextEvent::Done`].
    pub async fn next(&mut self) -> Result<Option<ContextEvent>, AgentError> {
        loop {
            if self.done {
                return Ok(None);
            }
            if let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                let event: ContextEvent = serde_json::from_slice(&line[..end])
                    .map_err(|e| AgentError::Malformed(format!("bad run event: {e}")))?;
                self.done = matches!(event, ContextEvent::Done { .. });
                return Ok(Some(event));
            }
            if self.buf.len() > MAX_EVENT {
                return Err(AgentError::Malformed(format!(
                    "a run event is larger than {MAX_EVENT} bytes"
                )));
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Err(AgentError::Http(e.to_string())),
                None => {
                    return Err(AgentError::Malformed(
                        "run output ended without a done event".into(),
                    ))
                }
            }
        }
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
        let resp = self
            .send(Method::POST, &routes::context_run(context), json_body(req))
            .await?;
        Ok(RunStream {
            body: resp.into_body(),
            buf: Vec::new(),
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
