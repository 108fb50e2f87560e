//! `GET /v1/files/watch`: changes under a directory, streamed as NDJSON until the host
//! hangs up.
//!
//! inotify does the watching (one watch per directory; with `recursive`, the ones made
//! later get theirs as they appear). Events go through a queue of [`QUEUE`] lines to
//! the response: when the host reads slower than the guest changes files, what does not
//! fit is dropped and counted, and one `overflow` event says so once there is room
//! again. The same event repeated (a file written in many small writes) is sent once.
//! So a storm costs the agent a bounded queue, never memory that grows with it.

use crate::error::ApiError;
use crate::server::parse_query;
use axum::body::{Body, Bytes};
use axum::extract::RawQuery;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use forkd_proto::files::{WatchEvent, WatchKind, WatchQuery};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

/// Events waiting for the host at most.
pub const QUEUE: usize = 1024;

fn flags() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// An inotify instance as tokio's reactor takes it.
struct InotifyFd(Inotify);

impl std::os::fd::AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

fn inotify_error(e: &std::io::Error) -> ApiError {
    ApiError::new(forkd_proto::ErrorCode::Io, format!("inotify: {e}"))
}

/// The directories watched, by watch.
struct Watched {
    inotify: AsyncFd<InotifyFd>,
    dirs: HashMap<WatchDescriptor, PathBuf>,
    recursive: bool,
}

impl Watched {
    /// Watches `dir` (and, recursively, the directories under it).
    fn add(&mut self, dir: &Path) -> nix::Result<()> {
        let wd = self.inotify.get_ref().0.add_watch(dir, flags())?;
        self.dirs.insert(wd, dir.to_owned());
        if self.recursive {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    // A directory gone meanwhile, or past the watch limit: the rest
                    // is still watched.
                    let _ = self.add(&entry.path());
                }
            }
        }
        Ok(())
    }

    /// What an inotify event means for the host, if anything.
    fn translate(&mut self, e: &InotifyEvent) -> Option<WatchEvent> {
        let m = e.mask;
        if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            return Some(WatchEvent {
                kind: WatchKind::Overflow,
                path: String::new(),
                dir: false,
                dropped: None,
            });
        }
        let dir = self.dirs.get(&e.wd)?.clone();
        if m.contains(AddWatchFlags::IN_IGNORED) {
            self.dirs.remove(&e.wd);
            return None;
        }
        let path = match &e.name {
            Some(name) => dir.join(name),
            None => dir,
        };
        let is_dir = m.contains(AddWatchFlags::IN_ISDIR);
        let kind = if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
            if is_dir && self.recursive {
                // As above: a directory that cannot be watched leaves the rest watched.
                let _ = self.add(&path);
            }
            WatchKind::Create
        } else if m.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
            WatchKind::Write
        } else if m.intersects(AddWatchFlags::IN_DELETE | AddWatchFlags::IN_DELETE_SELF) {
            WatchKind::Remove
        } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
            WatchKind::Rename
        } else if m.contains(AddWatchFlags::IN_ATTRIB) {
            WatchKind::Chmod
        } else {
            return None;
        };
        // A directory's own removal is reported by its parent's watch too.
        if m.contains(AddWatchFlags::IN_DELETE_SELF) && e.name.is_none() && self.dirs.len() > 1 {
            return None;
        }
        Some(WatchEvent {
            kind,
            path: path.to_string_lossy().into_owned(),
            dir: is_dir,
            dropped: None,
        })
    }
}

/// Passes events to the queue: the same one twice in a row once; what does not fit
/// counted, and said with one overflow event when there is room.
struct Sender {
    tx: mpsc::Sender<WatchEvent>,
    last: Option<(WatchKind, String)>,
    dropped: u64,
}

impl Sender {
    /// The overflow event for what was dropped.
    fn overflow(&self) -> WatchEvent {
        WatchEvent {
            kind: WatchKind::Overflow,
            path: String::new(),
            dir: false,
            dropped: Some(self.dropped),
        }
    }

    /// The drops were said.
    fn said(&mut self) {
        self.dropped = 0;
        self.last = None;
    }

    /// False once the host is gone.
    fn send(&mut self, e: WatchEvent) -> bool {
        let key = (e.kind, e.path.clone());
        if e.kind != WatchKind::Overflow && self.last.as_ref() == Some(&key) {
            return true;
        }
        if self.dropped > 0 {
            let overflow = self.overflow();
            let tx = self.tx.clone();
            match tx.try_reserve() {
                Ok(permit) => {
                    permit.send(overflow);
                    self.said();
                }
                Err(mpsc::error::TrySendError::Full(())) => {
                    self.dropped += 1;
                    return true;
                }
                Err(mpsc::error::TrySendError::Closed(())) => return false,
            };
        }
        match self.tx.try_send(e) {
            Ok(()) => {
                self.last = Some(key);
                true
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.dropped += 1;
                self.last = None;
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// `GET /v1/files/watch?path=&recursive=`.
pub async fn watch(RawQuery(query): RawQuery) -> Result<Response, ApiError> {
    let q: WatchQuery = parse_query(query.as_deref())?;
    let root = PathBuf::from(&q.path);
    if !root.is_absolute() {
        return Err(ApiError::invalid(format!(
            "{} is not an absolute path",
            q.path
        )));
    }
    let meta = std::fs::metadata(&root).map_err(|e| {
        ApiError::new(
            forkd_proto::ErrorCode::from_io(&e),
            format!("watching {}: {e}", q.path),
        )
    })?;
    if !meta.is_dir() {
        return Err(ApiError::new(
            forkd_proto::ErrorCode::NotADirectory,
            format!("{} is not a directory", q.path),
        ));
    }
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| inotify_error(&e.into()))?;
    let mut watched = Watched {
        // SAFETY: the Inotify owns its descriptor, moves into the AsyncFd and stays
        // there, unclosed, for the AsyncFd's whole life; as_raw_fd always returns it.
        inotify: unsafe { AsyncFd::register(InotifyFd(inotify)) }
            .map_err(|e| inotify_error(&e.into()))?,
        dirs: HashMap::new(),
        recursive: q.recursive,
    };
    watched.add(&root).map_err(|e| {
        ApiError::new(
            forkd_proto::ErrorCode::from_io(&std::io::Error::from(e)),
            format!("watching {}: {e}", q.path),
        )
    })?;
    // Watching from here: the answer's head tells the host so.
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::spawn(pump(watched, tx));
    let lines = futures::stream::unfold(rx, |mut rx| async move {
        let e = rx.recv().await?;
        let mut line = serde_json::to_vec(&e).expect("events serialize");
        line.push(b'\n');
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(line)), rx))
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::contexts::NDJSON)],
        Body::from_stream(lines),
    )
        .into_response())
}

/// Reads inotify until the host hangs up or the watched directory goes.
async fn pump(mut w: Watched, tx: mpsc::Sender<WatchEvent>) {
    let mut out = Sender {
        tx,
        last: None,
        dropped: 0,
    };
    loop {
        let tx = out.tx.clone();
        let ready = tokio::select! {
            r = w.inotify.readable() => r,
            () = out.tx.closed() => return,
            // Events were dropped: say so as soon as there is room, even if no other
            // event comes.
            permit = tx.reserve(), if out.dropped > 0 => {
                let Ok(permit) = permit else { return };
                permit.send(out.overflow());
                out.said();
                continue;
            }
        };
        let Ok(mut guard) = ready else { return };
        let events = match guard.get_inner().0.read_events() {
            Ok(e) => e,
            Err(nix::errno::Errno::EAGAIN) => {
                guard.clear_ready();
                continue;
            }
            // inotify itself failed: the stream ends, which the host sees.
            Err(_) => return,
        };
        drop(guard);
        for e in &events {
            if let Some(ev) = w.translate(e) {
                if !out.send(ev) {
                    return;
                }
            }
        }
        if w.dirs.is_empty() {
            // The watched directory is gone: nothing more will come.
            return;
        }
    }
}
