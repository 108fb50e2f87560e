//! `forkd pack` and `forkd unpack`: a snapshot (and its ancestors) to and from an
//! archive file, an OCI image layout in a tar, through the daemon's API (which streams
//! both ways, so the daemon may be on another host).

use crate::image::human_size;
use crate::remote::fail;
use anyhow::{bail, Context, Result};
use forkd_daemon::client::Client;
use forkd_storage::snapshot::Tag;
use futures::StreamExt;
use http_body_util::BodyExt;
use hyper::body::Bytes;
use hyper::Method;
use std::path::PathBuf;
use tokio::io::AsyncWriteExt;

/// `forkd pack`.
#[derive(clap::Args)]
pub struct PackArgs {
    /// The snapshot; a branch is packed with its ancestors.
    pub tag: String,
    /// The archive to write (replaced if it exists); `-` writes it to standard output,
    /// e.g. into `forkd unpack -` on another host.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Print what was written as JSON (path, bytes, snapshots); not with `-o -`, whose
    /// standard output is the archive.
    #[arg(long)]
    pub json: bool,
}

/// `forkd unpack`.
#[derive(clap::Args)]
pub struct UnpackArgs {
    /// The archive (written by `forkd pack`); `-` reads it from standard input.
    pub file: PathBuf,
    /// Install the archive's snapshot under this tag (its ancestors keep theirs).
    #[arg(long)]
    pub tag: Option<String>,
    /// Print what was installed as JSON (tag, installed, present).
    #[arg(long)]
    pub json: bool,
}

/// A bytes progress bar on a terminal's stderr (hidden elsewhere); without a length
/// (a pipe), a count of bytes.
pub(crate) fn bar(len: Option<u64>, what: &str) -> indicatif::ProgressBar {
    let bar = if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        indicatif::ProgressBar::hidden()
    } else if let Some(len) = len {
        indicatif::ProgressBar::new(len)
    } else {
        indicatif::ProgressBar::no_length()
    };
    let template = match len {
        Some(_) => format!("{what} {{bar:30}} {{bytes}}/{{total_bytes}} ({{elapsed}})"),
        None => format!("{what} {{bytes}} ({{elapsed}})"),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(&template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// The path that names standard input or output.
fn is_std(path: &std::path::Path) -> bool {
    path.as_os_str() == "-"
}

/// Writes the archive of `args.tag` to `args.output`.
pub async fn pack(client: &Client, args: PackArgs) -> Result<()> {
    let tag = Tag::parse(&args.tag)?;
    let to_stdout = is_std(&args.output);
    if to_stdout && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        bail!("not writing an archive to a terminal: redirect standard output or give a file");
    }
    if to_stdout && args.json {
        bail!("--json cannot go with `-o -`: standard output carries the archive");
    }
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("packing {tag}: compressing its parts...");
    }
    if to_stdout {
        let (resp, len, snapshots) = request_archive(client, &tag).await?;
        let written = receive(
            resp.into_body(),
            tokio::io::stdout(),
            "standard output",
            len,
        )
        .await?;
        // Standard output carries the archive: the summary goes to standard error.
        eprintln!("wrote {}: {}", human_size(written), snapshots.join(", "));
        return Ok(());
    }
    let (written, snapshots) = download(client, &tag, &args.output).await?;
    if args.json {
        return crate::remote::print_json(&serde_json::json!({
            "path": args.output,
            "bytes": written,
            "snapshots": snapshots,
        }));
    }
    println!(
        "wrote {} ({}): {}",
        args.output.display(),
        human_size(written),
        snapshots.join(", ")
    );
    Ok(())
}

/// Asks the daemon for the archive of `tag`; returns the response (its body unread),
/// its length and the snapshots in it, root first.
async fn request_archive(
    client: &Client,
    tag: &Tag,
) -> Result<(hyper::Response<hyper::body::Incoming>, u64, Vec<String>)> {
    let path = format!("/v1/snapshots/{tag}/archive");
    let resp = client.send(Method::GET, &path, None).await?;
    if !resp.status().is_success() {
        return Err(fail(resp).await);
    }
    let len: u64 = resp
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .context("the daemon did not say how long the archive is")?;
    let snapshots = resp
        .headers()
        .get("x-forkd-snapshots")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    Ok((resp, len, snapshots))
}

/// Writes the archive of `tag` to `output` (through `output.partial`, renamed when
/// whole); returns its size and the snapshots in it, root first.
pub async fn download(
    client: &Client,
    tag: &Tag,
    output: &std::path::Path,
) -> Result<(u64, Vec<String>)> {
    let (resp, len, snapshots) = request_archive(client, tag).await?;
    let mut partial = output.to_owned().into_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let written = async {
        let file = tokio::fs::File::create(&partial)
            .await
            .with_context(|| format!("creating {}", partial.display()))?;
        let shown = partial.display().to_string();
        let (n, file) = receive_into(resp.into_body(), file, &shown, len).await?;
        file.sync_all()
            .await
            .with_context(|| format!("writing {shown}"))?;
        anyhow::Ok(n)
    }
    .await;
    let written = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    std::fs::rename(&partial, output)
        .with_context(|| format!("renaming {} into place", partial.display()))?;
    Ok((written, snapshots))
}

/// Writes the archive `body` (`len` bytes) to `out`, named `shown` in errors.
async fn receive(
    body: hyper::body::Incoming,
    out: impl tokio::io::AsyncWrite + Unpin,
    shown: &str,
    len: u64,
) -> Result<u64> {
    receive_into(body, out, shown, len).await.map(|(n, _)| n)
}

/// [`receive`], handing `out` back (to be synced).
async fn receive_into<W: tokio::io::AsyncWrite + Unpin>(
    mut body: hyper::body::Incoming,
    mut out: W,
    shown: &str,
    len: u64,
) -> Result<(u64, W)> {
    let progress = bar(Some(len), "receiving");
    let mut written = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.context("the archive stream broke off (see the daemon's log)")?;
        if let Ok(data) = frame.into_data() {
            out.write_all(&data)
                .await
                .with_context(|| format!("writing {shown}"))?;
            written += data.len() as u64;
            progress.set_position(written);
        }
    }
    progress.finish_and_clear();
    if written != len {
        bail!("the archive ended after {written} of {len} bytes (see the daemon's log)");
    }
    out.flush()
        .await
        .with_context(|| format!("writing {shown}"))?;
    Ok((written, out))
}

/// Sends `args.file` to the daemon to install.
pub async fn unpack(client: &Client, args: UnpackArgs) -> Result<()> {
    let tag = args.tag.as_deref().map(Tag::parse).transpose()?;
    let v = upload(client, &args.file, tag.as_ref()).await?;
    if args.json {
        return crate::remote::print_json(&v);
    }
    print_installed(&v);
    Ok(())
}

/// Says what an unpack or pull installed (`{tag, installed, present}`).
pub(crate) fn print_installed(v: &serde_json::Value) {
    let list = |k: &str| -> Vec<&str> {
        v[k].as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_str).collect())
            .unwrap_or_default()
    };
    let (installed, present) = (list("installed"), list("present"));
    if installed.is_empty() {
        println!("{} is here already", v["tag"].as_str().unwrap_or_default());
    } else if present.is_empty() {
        println!("installed {}", installed.join(", "));
    } else {
        println!(
            "installed {} (on {}, here already)",
            installed.join(", "),
            present.join(", ")
        );
    }
}

/// Sends the archive `file` to the daemon to install (its head under `tag` if given);
/// returns the daemon's answer (`tag`, `installed`, `present`).
pub async fn upload(
    client: &Client,
    file: &std::path::Path,
    tag: Option<&Tag>,
) -> Result<serde_json::Value> {
    let query = tag.map(|t| format!("?tag={t}")).unwrap_or_default();
    let (source, len): (Box<dyn tokio::io::AsyncRead + Send + Unpin>, Option<u64>) = if is_std(file)
    {
        if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
            bail!("standard input is a terminal: pipe an archive into `forkd unpack -`");
        }
        (Box::new(tokio::io::stdin()), None)
    } else {
        let f = tokio::fs::File::open(file)
            .await
            .with_context(|| format!("opening {}", file.display()))?;
        let len = f.metadata().await?.len();
        (Box::new(f), Some(len))
    };
    send_tar(client, &format!("/v1/archives{query}"), source, len).await
}

/// Posts the tar read from `source` (`len` bytes, when known) to `path`, with a
/// progress bar; returns the daemon's JSON answer.
pub(crate) async fn send_tar(
    client: &Client,
    path: &str,
    source: Box<dyn tokio::io::AsyncRead + Send + Unpin>,
    len: Option<u64>,
) -> Result<serde_json::Value> {
    let progress = bar(len, "sending");
    let sent = progress.clone();
    let stream = tokio_util::io::ReaderStream::with_capacity(source, 1 << 20).map(move |chunk| {
        chunk.map(|data: Bytes| {
            sent.inc(data.len() as u64);
            hyper::body::Frame::data(data)
        })
    });
    let body = http_body_util::StreamBody::new(stream);
    let resp = client
        .send_stream(Method::POST, path, "application/x-tar", len, body)
        .await?;
    progress.finish_and_clear();
    if !resp.status().is_success() {
        return Err(fail(resp).await);
    }
    Ok(serde_json::from_slice(
        &resp.into_body().collect().await?.to_bytes(),
    )?)
}
