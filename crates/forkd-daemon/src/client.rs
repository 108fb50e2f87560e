//! A small HTTP client for the daemon's API, over its unix socket or TCP: what the CLI
//! and the tests use. One connection per request keeps it simple and is cheap locally.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use std::path::PathBuf;

/// `resp` if it is a 101 (Switching Protocols), else the daemon's error it carries.
async fn switched(resp: Response<Incoming>) -> Result<Response<Incoming>> {
    if resp.status() == hyper::StatusCode::SWITCHING_PROTOCOLS {
        return Ok(resp);
    }
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Err(failure(status, &body).into())
}

/// A WebSocket to the daemon ([`Client::websocket`]).
pub type WebSocket = tokio_tungstenite::WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// Where the daemon is.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// Its unix socket.
    Unix(PathBuf),
    /// `host:port` over plain TCP.
    Tcp(String),
    /// `host:port` over TLS, trusting the CA certificates in `ca` (PEM).
    Https {
        /// `host:port`.
        addr: String,
        /// The CA bundle.
        ca: PathBuf,
    },
}

/// A client of one daemon.
/// The `Upgrade:` protocol that turns a request for a sandbox's port into a tunnel to
/// it (`/v1/sandboxes/{id}/ports/{port}`).
pub const TUNNEL_PROTOCOL: &str = "tcp";

#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
}

/// An error answer of the daemon, with its status, code and message.
#[derive(Debug, thiserror::Error)]
#[error("{message} ({status}, {code})")]
pub struct ApiFailure {
    /// HTTP status.
    pub status: StatusCode,
    /// The API's error code.
    pub code: String,
    /// The message.
    pub message: String,
}

impl Client {
    /// A client of the daemon at `endpoint`, sending `token` if given.
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Client {
        Client { endpoint, token }
    }

    /// `FORKD_URL` (`unix:/path`, `http://host:port` or `https://host:port` with the
    /// CA bundle in `FORKD_CA`) and `FORKD_TOKEN`, else the default socket of `home`.
    pub fn from_env(home: &forkd_image::Home) -> Result<Client> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let endpoint = match var("FORKD_URL") {
            None => Endpoint::Unix(crate::config::default_socket(home)),
            Some(url) => parse_url(&url, var("FORKD_CA").map(PathBuf::from))?,
        };
        Ok(Client::new(endpoint, var("FORKD_TOKEN")))
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Sends one request and returns the response with its body unread.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Response<Incoming>> {
        let json = body.is_some();
        let mut req = self.request(method, path);
        if json {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        self.dispatch(req).await
    }

    /// Sends one request whose body is streamed from `body` (`len` bytes, of
    /// `content_type`), and returns the response with its body unread.
    pub async fn send_stream<B>(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        len: Option<u64>,
        body: B,
    ) -> Result<Response<Incoming>>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut req = self
            .request(method, path)
            .header(hyper::header::CONTENT_TYPE, content_type);
        // Without a length (a pipe), hyper sends the body chunked.
        if let Some(len) = len {
            req = req.header(hyper::header::CONTENT_LENGTH, len);
        }
        let req = req.body(body)?;
        self.dispatch(req).await
    }

    /// Sends `req` as it is (its method, path, headers and streamed body) to this
    /// client's daemon, with this client's `Host` and token in place of its own; the
    /// answer comes back with its body unread, and an upgrade (`101`) can be taken from
    /// it. This is how a host of a cluster forwards a request to the sandbox's owner.
    pub async fn forward<B>(&self, mut req: Request<B>) -> Result<Response<Incoming>>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let headers = req.headers_mut();
        headers.insert(hyper::header::HOST, self.host().parse()?);
        headers.remove(hyper::header::AUTHORIZATION);
        if let Some(t) = self.bearer() {
            headers.insert(hyper::header::AUTHORIZATION, t.parse()?);
        }
        self.dispatch(req).await
    }

    /// Sends `req` exactly as it is, its `Host` and credentials included (E2B's
    /// in-sandbox requests are routed by their host name and carry their own tokens);
    /// the answer comes back as from [`Client::forward`].
    pub async fn relay<B>(&self, mut req: Request<B>) -> Result<Response<Incoming>>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if !req.headers().contains_key(hyper::header::HOST) {
            req.headers_mut()
                .insert(hyper::header::HOST, self.host().parse()?);
        }
        self.dispatch(req).await
    }

    /// Asks for `path` to become a byte stream speaking `protocol` (`Upgrade:`); returns
    /// the stream once the daemon answers 101, else its error.
    pub async fn upgrade(&self, path: &str, protocol: &str) -> Result<hyper::upgrade::Upgraded> {
        let req = self
            .request(Method::GET, path)
            .header(hyper::header::CONNECTION, "upgrade")
            .header(hyper::header::UPGRADE, protocol)
            .body(Full::new(Bytes::new()))?;
        let resp = switched(self.dispatch(req).await?).await?;
        Ok(hyper::upgrade::on(resp).await?)
    }

    /// Opens the WebSocket at `path` (a terminal: `/v1/sandboxes/{id}/pty?...`); the
    /// daemon's error answer if it does not upgrade.
    pub async fn websocket(&self, path: &str) -> Result<WebSocket> {
        use tokio_tungstenite::tungstenite::handshake;
        let key = handshake::client::generate_key();
        let req = self
            .request(Method::GET, path)
            .header(hyper::header::CONNECTION, "upgrade")
            .header(hyper::header::UPGRADE, "websocket")
            .header(hyper::header::SEC_WEBSOCKET_VERSION, "13")
            .header(hyper::header::SEC_WEBSOCKET_KEY, &key)
            .body(Full::new(Bytes::new()))?;
        let resp = switched(self.dispatch(req).await?).await?;
        let accept = resp
            .headers()
            .get(hyper::header::SEC_WEBSOCKET_ACCEPT)
            .map(hyper::header::HeaderValue::as_bytes);
        if accept != Some(handshake::derive_accept_key(key.as_bytes()).as_bytes()) {
            bail!("the daemon answered the WebSocket handshake with a wrong Sec-WebSocket-Accept");
        }
        let io = TokioIo::new(hyper::upgrade::on(resp).await?);
        Ok(tokio_tungstenite::WebSocketStream::from_raw_socket(
            io,
            tokio_tungstenite::tungstenite::protocol::Role::Client,
            None,
        )
        .await)
    }

    fn request(&self, method: Method, path: &str) -> hyper::http::request::Builder {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.host());
        if let Some(t) = self.bearer() {
            req = req.header(hyper::header::AUTHORIZATION, t);
        }
        req
    }

    /// The `Host` this client's requests name.
    fn host(&self) -> &str {
        match &self.endpoint {
            Endpoint::Unix(_) => "localhost",
            Endpoint::Tcp(a) | Endpoint::Https { addr: a, .. } => a.as_str(),
        }
    }

    /// The `Authorization` this client's requests carry, if it has a token.
    fn bearer(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    async fn dispatch<B>(&self, req: Request<B>) -> Result<Response<Incoming>>
    where
        B: hyper::body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        match &self.endpoint {
            Endpoint::Unix(p) => {
                let s = tokio::net::UnixStream::connect(p).await.with_context(|| {
                    format!(
                        "no forkd daemon answers on {} (start one: forkd daemon)",
                        p.display()
                    )
                })?;
                exchange(s, req).await
            }
            Endpoint::Tcp(a) => {
                let s = tokio::net::TcpStream::connect(a)
                    .await
                    .with_context(|| format!("no forkd daemon answers at {a}"))?;
                exchange(s, req).await
            }
            Endpoint::Https { addr, ca } => {
                let connector = tls_connector(ca)?;
                let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                    .with_context(|| format!("{host} is not a valid TLS server name"))?;
                let s = tokio::net::TcpStream::connect(addr)
                    .await
                    .with_context(|| format!("no forkd daemon answers at {addr}"))?;
                let s = connector
                    .connect(name, s)
                    .await
                    .with_context(|| format!("TLS with {addr}"))?;
                exchange(s, req).await
            }
        }
    }

    /// Sends a request with an optional JSON body and reads the whole answer:
    /// the status and the body.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(StatusCode, Bytes)> {
        let body = body.map(serde_json::to_vec).transpose()?;
        let resp = self.send(method, path, body).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    }

    /// `DELETE path`: Ok on 204, the daemon's [`ApiFailure`] otherwise.
    pub async fn delete(&self, path: &str) -> Result<()> {
        let (status, body) = self.call(Method::DELETE, path, None).await?;
        if status != StatusCode::NO_CONTENT {
            return Err(failure(status, &body).into());
        }
        Ok(())
    }

    /// Like [`Client::call`], decoding a success as `T` and an error as [`ApiFailure`].
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<T> {
        let (status, bytes) = self.call(method, path, body).await?;
        if !status.is_success() {
            return Err(failure(status, &bytes).into());
        }
        serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "the daemon's answer is not what was expected: {}",
                String::from_utf8_lossy(&bytes)
            )
        })
    }
}

/// Longest NDJSON line accepted from the daemon. Far above any it sends (exec output
/// comes in pieces of at most 1 MiB, 1.4 MiB as base64; a code cell's value is one
/// line, PNGs included), and a bound on what a broken peer can make the client buffer.
pub const MAX_LINE: usize = 64 << 20;

/// The bytes of a response body, as a stream of chunks.
type BodyBytes = std::pin::Pin<Box<dyn futures::Stream<Item = std::io::Result<Bytes>> + Send>>;

/// Reads an NDJSON response body line by line: tokio-util's `LinesCodec`, which looks
/// at each byte once however the body is cut into frames, and refuses a line past
/// [`MAX_LINE`] instead of buffering it.
pub struct Lines {
    inner: tokio_util::codec::FramedRead<
        tokio_util::io::StreamReader<BodyBytes, Bytes>,
        tokio_util::codec::LinesCodec,
    >,
}

impl Lines {
    /// Lines of `resp`'s body.
    pub fn new(resp: Response<Incoming>) -> Lines {
        use futures::TryStreamExt;
        let body = resp
            .into_body()
            .into_data_stream()
            .map_err(std::io::Error::other);
        Lines::of(Box::pin(body), MAX_LINE)
    }

    fn of(body: BodyBytes, max: usize) -> Lines {
        Lines {
            inner: tokio_util::codec::FramedRead::new(
                tokio_util::io::StreamReader::new(body),
                tokio_util::codec::LinesCodec::new_with_max_length(max),
            ),
        }
    }

    /// The next line, parsed; `None` at the end of the body.
    pub async fn next(&mut self) -> Result<Option<serde_json::Value>> {
        let Some(line) = self.next_text().await? else {
            return Ok(None);
        };
        let v = serde_json::from_str(&line).with_context(|| {
            let shown: String = line.chars().take(200).collect();
            format!("a streamed line is not JSON (or the stream was cut short): {shown}")
        })?;
        Ok(Some(v))
    }

    /// The next line as it is (a Server-Sent Events stream's, say); `None` at the end.
    pub async fn next_text(&mut self) -> Result<Option<String>> {
        use futures::StreamExt;
        use tokio_util::codec::LinesCodecError;
        let line = match self.inner.next().await {
            None => return Ok(None),
            Some(Ok(line)) => line,
            Some(Err(LinesCodecError::MaxLineLengthExceeded)) => bail!(
                "a line of the daemon's stream is longer than {} bytes: the daemon or \
                 something between it and this client is broken",
                self.inner.decoder().max_length()
            ),
            Some(Err(LinesCodecError::Io(e))) => {
                return Err(anyhow::Error::new(e).context("reading the daemon's stream"))
            }
        };
        Ok(Some(line))
    }

    /// The next line of a streamed exec, its output decoded; `None` at the end.
    pub async fn next_exec(&mut self) -> Result<Option<ExecLine>> {
        let Some(v) = self.next().await? else {
            return Ok(None);
        };
        ExecLine::from_json(v).map(Some)
    }
}

/// One line of a streamed exec (`"stream": true`) with its output decoded to bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecLine {
    /// Bytes the command wrote to stdout.
    Stdout(Vec<u8>),
    /// Bytes the command wrote to stderr.
    Stderr(Vec<u8>),
    /// It ended with this exit code (128 + signal for a signal); the last line.
    Exit(i32),
    /// The sandbox failed mid-way; the last line.
    Error(String),
}

impl ExecLine {
    /// From a parsed NDJSON line.
    pub fn from_json(v: serde_json::Value) -> Result<ExecLine> {
        use crate::api::types::ExecEventBody as E;
        let event: E = serde_json::from_value(v.clone()).with_context(|| {
            format!("the daemon sent an exec event this client does not know: {v}")
        })?;
        Ok(match event {
            E::Stdout { data_b64 } => ExecLine::Stdout(decode_b64("stdout data_b64", &data_b64)?),
            E::Stderr { data_b64 } => ExecLine::Stderr(decode_b64("stderr data_b64", &data_b64)?),
            E::Exit { exit_code, .. } => ExecLine::Exit(exit_code),
            E::Error { message } => ExecLine::Error(message),
        })
    }
}

/// Decodes a base64 field of the API (RFC 4648 standard alphabet, padded).
pub fn decode_b64(field: &str, b64: &str) -> Result<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(b64.as_bytes())
        .with_context(|| format!("the daemon's {field} is not valid base64"))
}

/// The [`ApiFailure`] an error body describes.
pub fn failure(status: StatusCode, body: &[u8]) -> ApiFailure {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    ApiFailure {
        status,
        code: v["error"]["code"].as_str().unwrap_or("unknown").to_owned(),
        message: v["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned()),
    }
}

/// A TLS client trusting the CA certificates of the PEM file `ca`.
fn tls_connector(ca: &std::path::Path) -> Result<tokio_rustls::TlsConnector> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in
        CertificateDer::pem_file_iter(ca).with_context(|| format!("reading {}", ca.display()))?
    {
        roots
            .add(cert.with_context(|| format!("{} is not a PEM bundle", ca.display()))?)
            .with_context(|| format!("a certificate of {} is not usable", ca.display()))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(std::sync::Arc::new(
        config,
    )))
}

fn parse_url(url: &str, ca: Option<PathBuf>) -> Result<Endpoint> {
    if let Some(rest) = url.strip_prefix("https://") {
        let addr = rest.trim_end_matches('/');
        if addr.is_empty() || addr.contains('/') {
            bail!("FORKD_URL {url:?} is not https://HOST:PORT");
        }
        let Some(ca) = ca else {
            bail!("FORKD_URL is https: set FORKD_CA to the PEM file of the CA that signed the daemon's certificate");
        };
        return Ok(Endpoint::Https {
            addr: addr.to_owned(),
            ca,
        });
    }
    if let Some(p) = url.strip_prefix("unix:") {
        return Ok(Endpoint::Unix(PathBuf::from(p)));
    }
    if let Some(rest) = url.strip_prefix("http://") {
        let hostport = rest.trim_end_matches('/');
        if hostport.is_empty() || hostport.contains('/') {
            bail!("FORKD_URL {url:?} is not http://HOST:PORT");
        }
        return Ok(Endpoint::Tcp(hostport.to_owned()));
    }
    bail!("FORKD_URL {url:?} is none of unix:/path/to/socket, http://HOST:PORT, https://HOST:PORT")
}

async fn exchange<S, B>(stream: S, req: Request<B>) -> Result<Response<Incoming>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("talking to the daemon")?;
    tokio::spawn(async move {
        // With upgrades: a port-forward's connection becomes a tunnel.
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("daemon connection: {e}");
        }
    });
    sender
        .send_request(req)
        .await
        .context("talking to the daemon")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(chunks: Vec<&'static [u8]>, max: usize) -> Lines {
        let s = futures::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from_static(c))));
        Lines::of(Box::pin(s), max)
    }

    #[tokio::test]
    async fn lines_split_however_the_stream_is_cut() {
        let text: &'static [u8] = b"{\"a\":1}\n{\"b\":\"x y\"}\n[]\n";
        for cut in 1..text.len() {
            let mut l = lines_of(text.chunks(cut).collect(), 100);
            let mut got = Vec::new();
            while let Some(v) = l.next().await.unwrap() {
                got.push(v.to_string());
            }
            assert_eq!(got, ["{\"a\":1}", "{\"b\":\"x y\"}", "[]"], "cut {cut}");
        }
    }

    #[tokio::test]
    async fn a_line_over_the_limit_or_cut_short_is_an_error() {
        let mut l = lines_of(vec![b"[1,2,3]\n", b"[12345", b"6789]\n"], 8);
        assert_eq!(
            l.next().await.unwrap().unwrap(),
            serde_json::json!([1, 2, 3])
        );
        let e = l.next().await.unwrap_err().to_string();
        assert!(e.contains("longer than 8 bytes"), "{e}");
        let mut l = lines_of(vec![b"{\"a\":1}\n{\"b\""], 100);
        assert!(l.next().await.unwrap().is_some());
        let e = l.next().await.unwrap_err().to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn exec_lines_decode_to_bytes() {
        let bytes = vec![0xff, 0x00, 0xe2, 0x82];
        let v = serde_json::json!({"type": "stdout", "data_b64": "/wDigg=="});
        assert_eq!(ExecLine::from_json(v).unwrap(), ExecLine::Stdout(bytes));
        let v = serde_json::json!({"type": "exit", "exit_code": 3, "signal": null,
            "timed_out": false, "duration_ms": 1});
        assert_eq!(ExecLine::from_json(v).unwrap(), ExecLine::Exit(3));
        let v = serde_json::json!({"type": "stderr", "data_b64": "not base64!"});
        let e = format!("{:#}", ExecLine::from_json(v).unwrap_err());
        assert!(e.contains("stderr data_b64 is not valid base64"), "{e}");
    }

    #[test]
    fn urls() {
        assert!(
            matches!(parse_url("unix:/run/forkd.sock", None).unwrap(), Endpoint::Unix(p) if p == std::path::Path::new("/run/forkd.sock"))
        );
        assert!(
            matches!(parse_url("http://127.0.0.1:7070/", None).unwrap(), Endpoint::Tcp(a) if a == "127.0.0.1:7070")
        );
        assert!(parse_url("ftp://x", None).is_err());
        assert!(parse_url("http://", None).is_err());
        let e = parse_url("https://h:1", None).unwrap_err().to_string();
        assert!(e.contains("FORKD_CA"), "{e}");
        assert!(
            matches!(parse_url("https://h:1", Some("/ca.pem".into())).unwrap(), Endpoint::Https { addr, .. } if addr == "h:1")
        );
    }
}
