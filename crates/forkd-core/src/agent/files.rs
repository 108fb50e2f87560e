//! Files in the guest.

use super::exec::tokio_stream;
use super::{with_query, AgentClient, AgentError, ReqBody};
use bytes::Bytes;
use forkd_proto::files::{
    FileStat, MkdirRequest, PathQuery, RemoveRequest, RenameRequest, WriteQuery,
};
use forkd_proto::routes;
use http::Method;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::body::Incoming;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How a file is written.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Permission bits (0o644 when unset).
    pub mode: Option<u32>,
    /// Create missing parent directories.
    pub parents: bool,
    /// Give the file (and the directories created for it) to this user of the guest.
    pub owner: Option<String>,
}

impl AgentClient {
    /// Streams `data` into the file at `path` (replaced atomically).
    pub async fn write_file(
        &self,
        path: &str,
        mut data: impl AsyncRead + Send + Unpin + 'static,
        opts: WriteOptions,
    ) -> Result<FileStat, AgentError> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 20];
            loop {
                match data.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx
                            .send(Ok(Frame::data(Bytes::copy_from_slice(&buf[..n]))))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        break;
                    }
                }
            }
        });
        let body: ReqBody = StreamBody::new(tokio_stream(rx)).boxed();
        let q = WriteQuery {
            path: path.to_owned(),
            mode: opts.mode,
            parents: opts.parents,
            owner: opts.owner,
        };
        let resp = self
            .send(Method::PUT, &with_query(routes::FILES, &q), body)
            .await?;
        super::read_json(resp).await
    }

    /// Writes `bytes` to `path`.
    pub async fn write_file_bytes(
        &self,
        path: &str,
        bytes: Vec<u8>,
        opts: WriteOptions,
    ) -> Result<FileStat, AgentError> {
        self.write_file(path, std::io::Cursor::new(bytes), opts)
            .await
    }

    /// Streams the file at `path` into `out`; returns the number of bytes.
    pub async fn read_file(
        &self,
        path: &str,
        out: &mut (impl AsyncWrite + Unpin),
    ) -> Result<u64, AgentError> {
        let mut body = self.open_file(path).await?;
        let mut total = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            if let Ok(data) = frame.into_data() {
                out.write_all(&data)
                    .await
                    .map_err(|source| AgentError::Io {
                        context: format!("writing the contents of {path}"),
                        source,
                    })?;
                total += data.len() as u64;
            }
        }
        out.flush().await.map_err(|source| AgentError::Io {
            context: format!("writing the contents of {path}"),
            source,
        })?;
        Ok(total)
    }

    /// Opens the file at `path` for reading: returns once the agent has answered, so a
    /// missing file or a directory is an error here, and the contents follow as the
    /// body's data frames.
    pub async fn open_file(&self, path: &str) -> Result<Incoming, AgentError> {
        let q = PathQuery {
            path: path.to_owned(),
        };
        let resp = self
            .send(Method::GET, &with_query(routes::FILES, &q), super::empty())
            .await?;
        Ok(resp.into_body())
    }

    /// Reads the file at `path` into memory, refusing one longer than `max` bytes (a
    /// guest's file may be anything, `/dev/zero` included).
    pub async fn read_file_capped(&self, path: &str, max: u64) -> Result<Vec<u8>, AgentError> {
        let mut body = self.open_file(path).await?;
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                if (out.len() + data.len()) as u64 > max {
                    return Err(AgentError::Io {
                        context: format!("reading {path}"),
                        source: std::io::Error::other(format!("it is longer than {max} bytes")),
                    });
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    }

    /// Reads the whole file at `path` into memory.
    pub async fn read_file_bytes(&self, path: &str) -> Result<Vec<u8>, AgentError> {
        let mut out = Vec::new();
        self.read_file(path, &mut out).await?;
        Ok(out)
    }

    /// The entries of the directory at `path`, sorted by name.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<FileStat>, AgentError> {
        self.get_json(&with_query(
            routes::FILES_LIST,
            &PathQuery {
                path: path.to_owned(),
            },
        ))
        .await
    }

    /// Metadata of `path` (symlinks are not followed).
    pub async fn stat(&self, path: &str) -> Result<FileStat, AgentError> {
        self.get_json(&with_query(
            routes::FILES_STAT,
            &PathQuery {
                path: path.to_owned(),
            },
        ))
        .await
    }

    /// `mkdir -p path`.
    pub async fn mkdir(&self, path: &str) -> Result<FileStat, AgentError> {
        self.mkdir_owned(path, None).await
    }

    /// `mkdir -p path`, giving the directories it creates to the guest's user `owner`.
    pub async fn mkdir_owned(
        &self,
        path: &str,
        owner: Option<&str>,
    ) -> Result<FileStat, AgentError> {
        self.post_json(
            routes::FILES_MKDIR,
            &MkdirRequest {
                path: path.to_owned(),
                owner: owner.map(str::to_owned),
            },
        )
        .await
    }

    /// Removes `path`; a non-empty directory only with `recursive`.
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        let resp = self
            .send(
                Method::POST,
                routes::FILES_REMOVE,
                super::json_body(&RemoveRequest {
                    path: path.to_owned(),
                    recursive,
                }),
            )
            .await?;
        // 204: nothing to read, but drain so the stream is released (bounded: a guest
        // that sends a body anyway is not believed).
        let limit = forkd_proto::limits::AGENT_ERROR_BODY_LIMIT as u64;
        super::collect_limited(resp.into_body(), limit)
            .await
            .map_err(|e| {
                e.unwrap_or_else(|| {
                    AgentError::Malformed(format!("a body of over {limit} bytes with a 204"))
                })
            })?;
        Ok(())
    }

    /// Renames `from` to `to`.
    pub async fn rename(&self, from: &str, to: &str) -> Result<FileStat, AgentError> {
        self.post_json(
            routes::FILES_RENAME,
            &RenameRequest {
                from: from.to_owned(),
                to: to.to_owned(),
            },
        )
        .await
    }
}
