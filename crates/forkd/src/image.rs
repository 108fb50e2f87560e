//! `forkd image`: the guest assets.

use anyhow::{Context, Result};
use forkd_image::{BuildOptions, GuestAssets, Home, RootfsImage};
use std::path::PathBuf;

/// `forkd image ...`
#[derive(clap::Subcommand, Debug)]
pub enum ImageCommand {
    /// Build (or check, when up to date) the kernel, the initramfs and rootfs images.
    Build(BuildArgs),
    /// Pull a container image (REGISTRY/REPO:TAG, REGISTRY/REPO@sha256:...,
    /// oci-layout:PATH[:TAG] or docker-archive:FILE[:REPO:TAG]) and make its root
    /// filesystem, for recipes that say `from = "..."`.
    Pull {
        /// The image.
        reference: String,
        /// Reach its registry over plain HTTP (loopback registries always are).
        #[arg(long)]
        insecure: bool,
        /// Print the result as JSON (reference, digest, rootfs path and size).
        #[arg(long)]
        json: bool,
    },
    /// Remove the root filesystem made from a pulled image (`oci-...`) or for a recipe's
    /// packages, files and build steps (`custom-...`), by its name in `forkd image ls`.
    Rm {
        /// The name.
        name: String,
    },
    /// List the built assets with their digests.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// What to build.
#[derive(clap::Args, Debug)]
pub struct BuildArgs {
    /// `all`, `kernel`, `initramfs`, or a rootfs image name (`minimal`, `python`).
    #[arg(default_value = "all")]
    target: String,
    /// Rebuild even if the inputs did not change.
    #[arg(long)]
    force: bool,
    /// Take the kernel from this linux-image-*-cloud-amd64 .deb instead of apt.
    #[arg(long)]
    kernel_deb: Option<PathBuf>,
    /// Debian mirror for debootstrap (default: the one the host's apt uses).
    #[arg(long)]
    mirror: Option<String>,
    /// Debian suite for debootstrap (default: the host's).
    #[arg(long)]
    suite: Option<String>,
}

/// Runs `forkd image`.
pub async fn run(home: &Home, cmd: ImageCommand) -> Result<()> {
    match cmd {
        ImageCommand::Ls { json } => {
            let assets = forkd_image::list_assets(home);
            if json {
                let list: Vec<_> = assets
                    .iter()
                    .map(|(name, a)| {
                        let image = pulled_image(home, name);
                        serde_json::json!({"name": name, "asset": a, "image": image})
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if assets.is_empty() {
                println!(
                    "no guest assets built yet in {} (run: forkd image build)",
                    home.root().display()
                );
            } else {
                println!(
                    "{:<24} {:>10}  {:<14} {:>8}  PATH",
                    "NAME", "SIZE", "SHA256", "BUILD"
                );
                for (name, a) in assets {
                    println!(
                        "{:<24} {:>10}  {:<14} {:>7.1}s  {}",
                        name,
                        human_size(a.size),
                        &a.sha256[..a.sha256.len().min(12)],
                        a.build_seconds,
                        a.path.display()
                    );
                    if let Some(image) = pulled_image(home, &name) {
                        println!("{:<24} from {} ({})", "", image.reference, image.digest);
                    }
                }
            }
            Ok(())
        }
        ImageCommand::Pull {
            reference,
            insecure,
            json,
        } => {
            let mut opts = forkd_storage::oci::registry::RegistryOptions::default();
            if insecure {
                if let Ok(r) = forkd_storage::oci::registry::parse_reference(&reference) {
                    opts.insecure.push(r.resolve_registry().to_owned());
                }
            }
            let pulled = forkd_storage::oci::image::pull_image(home, &reference, &opts, &|m| {
                eprintln!("[forkd] {m}")
            })
            .await?;
            if json {
                return crate::remote::print_json(&serde_json::json!({
                    "reference": reference,
                    "digest": pulled.defaults.digest,
                    "rootfs": pulled.rootfs.path,
                    "size": pulled.rootfs.size,
                }));
            }
            println!(
                "{reference}: {} ({}), root filesystem {}",
                pulled.defaults.digest,
                human_size(pulled.rootfs.size),
                pulled.rootfs.path.display()
            );
            Ok(())
        }
        ImageCommand::Rm { name } => {
            if !(name.starts_with("oci-") || name.starts_with("custom-")) || name.contains('/') {
                anyhow::bail!(
                    "{name:?} is neither a pulled image's root filesystem (oci-...) nor a recipe's (custom-...); see forkd image ls"
                );
            }
            let dir = home.rootfs_dir();
            let (file, manifest, image) = (
                dir.join(format!("{name}.ext4")),
                dir.join(format!("{name}.json")),
                dir.join(format!("{name}.image")),
            );
            if !manifest.exists() && !file.exists() {
                anyhow::bail!("no {name} (see forkd image ls)");
            }
            for p in [&manifest, &file, &image] {
                match std::fs::remove_file(p) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).with_context(|| format!("removing {}", p.display())),
                }
            }
            println!("removed {name}");
            Ok(())
        }
        ImageCommand::Build(args) => {
            let opts = BuildOptions {
                force: args.force,
                kernel_deb: args.kernel_deb,
                mirror: args.mirror,
                suite: args.suite,
                progress: forkd_image::Progress::auto(),
            };
            let home = home.clone();
            let target = args.target;
            tokio::task::spawn_blocking(move || build(&home, &target, &opts))
                .await
                .context("image build task")?
        }
    }
}

/// For a rootfs made from a container image (`rootfs/oci-...`), what it was pulled as.
fn pulled_image(home: &Home, asset: &str) -> Option<forkd_image::oci_rootfs::ImageDefaults> {
    let name = asset
        .strip_prefix("rootfs/")
        .filter(|n| n.starts_with("oci-"))?;
    forkd_image::oci_rootfs::image_of(home, name)
}

fn build(home: &Home, target: &str, opts: &BuildOptions) -> Result<()> {
    match target {
        "kernel" => {
            forkd_image::ensure_kernel(home, opts)?;
        }
        "initramfs" => {
            let kernel = forkd_image::ensure_kernel(home, opts)?;
            let agent = forkd_image::find_agent_binary()?;
            forkd_image::ensure_initramfs(home, &kernel, &agent, opts)?;
        }
        "all" => {
            let agent = forkd_image::find_agent_binary()?;
            for image in [RootfsImage::Minimal, RootfsImage::Python] {
                forkd_image::ensure_all(home, image, &agent, opts)?;
            }
        }
        name => {
            let image: RootfsImage = name.parse().map_err(|e| {
                anyhow::anyhow!("{e} (targets: all, kernel, initramfs, minimal, python)")
            })?;
            let agent = forkd_image::find_agent_binary()?;
            forkd_image::ensure_all(home, image, &agent, opts)?;
        }
    }
    Ok(())
}

/// Makes sure the assets for `image` exist (building what is missing, with progress) and
/// returns them. Cheap when everything is built.
pub async fn ensure_assets(home: &Home, image: RootfsImage, force: bool) -> Result<GuestAssets> {
    let home = home.clone();
    tokio::task::spawn_blocking(move || -> Result<GuestAssets> {
        let agent = forkd_image::find_agent_binary()?;
        let opts = BuildOptions {
            force,
            progress: forkd_image::Progress::auto(),
            ..BuildOptions::default()
        };
        Ok(forkd_image::ensure_all(&home, image, &agent, &opts)?)
    })
    .await
    .context("image build task")?
}

/// `1.2 GiB`-style sizes.
#[expect(clippy::cast_precision_loss, reason = "a size shown to one decimal")]
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
