//! A recipe's image on this host (`from = "docker-archive:FILE"` or
//! `"oci-layout:DIR"`), sent to the daemon: the daemon opens no host path for a client,
//! and may be on another host anyway. The archive (or a tar of the layout, written as it
//! is sent) goes to `POST /v1/images`, and the recipe the daemon receives names the
//! upload (`from = "upload:sha256:<hex>"`) instead of the path.

use crate::archive::send_tar;
use anyhow::{Context, Result};
use forkd_daemon::client::Client;
use forkd_storage::oci::image::ImageSource;
use std::path::{Path, PathBuf};

/// The recipe `text` with its local image sent and `from` naming the upload; `None`
/// when its image is not on this host.
pub async fn send_local_image(client: &Client, text: &str, from: &str) -> Result<Option<String>> {
    let (source, len, name): (Box<dyn tokio::io::AsyncRead + Send + Unpin>, _, _) =
        match ImageSource::parse(from)? {
            ImageSource::DockerArchive { file, tag } => {
                let f = tokio::fs::File::open(&file)
                    .await
                    .with_context(|| format!("opening {}", file.display()))?;
                let len = f.metadata().await?.len();
                (Box::new(f), Some(len), tag)
            }
            ImageSource::Layout { dir, tag } => (Box::new(layout_tar(dir)?), None, tag),
            ImageSource::Registry(_) | ImageSource::Upload(_) => return Ok(None),
        };
    eprintln!("sending the image {from} to the daemon");
    let query = name
        .map(|n| {
            format!(
                "?{}",
                serde_urlencoded::to_string([("name", n)]).unwrap_or_default()
            )
        })
        .unwrap_or_default();
    let answer = send_tar(client, &format!("/v1/images{query}"), source, len).await?;
    let uploaded = answer["from"]
        .as_str()
        .context("the daemon's answer to the image upload has no `from`")?;
    let mut recipe: toml::Table = toml::from_str(text).context("reading the recipe")?;
    recipe.insert("from".into(), toml::Value::String(uploaded.to_owned()));
    Ok(Some(toml::to_string(&recipe)?))
}

/// A tar of the OCI layout `dir` (`oci-layout`, `index.json`, `blobs/sha256/*`), written
/// by a thread as it is read.
fn layout_tar(dir: PathBuf) -> Result<tokio::io::DuplexStream> {
    for f in ["oci-layout", "index.json"] {
        if !dir.join(f).is_file() {
            anyhow::bail!("{} has no {f}: not an OCI image layout", dir.display());
        }
    }
    let (reader, writer) = tokio::io::duplex(1 << 20);
    let bridge = tokio_util::io::SyncIoBridge::new(writer);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = write_layout_tar(&dir, bridge) {
            // The upload ends short and the daemon refuses it; this says why.
            eprintln!("reading {}: {e:#}", dir.display());
        }
    });
    Ok(reader)
}

fn write_layout_tar(dir: &Path, w: impl std::io::Write) -> Result<()> {
    let mut tar = tar::Builder::new(w);
    tar.follow_symlinks(true);
    for f in ["oci-layout", "index.json"] {
        tar.append_path_with_name(dir.join(f), f)?;
    }
    let blobs = dir.join("blobs/sha256");
    let mut names: Vec<_> = std::fs::read_dir(&blobs)
        .with_context(|| format!("reading {}", blobs.display()))?
        .collect::<std::io::Result<_>>()?;
    names.sort_by_key(|e| e.file_name());
    for e in names {
        let name = format!("blobs/sha256/{}", e.file_name().to_string_lossy());
        tar.append_path_with_name(e.path(), name)?;
    }
    tar.into_inner()?.flush()?;
    Ok(())
}
