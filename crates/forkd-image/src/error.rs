//! The one error type of this crate. Every message says what failed and what the
//! user can do about it, because these errors end up verbatim in the CLI's output.

use std::io;
use std::path::PathBuf;

/// An error while finding, building or reading a guest asset.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("could not {action} {path}: {source}; check that the path is writable and the disk is not full")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("{tool} is not installed: apt-get install {package}")]
    ToolMissing {
        tool: &'static str,
        package: &'static str,
    },

    #[error("{tool} failed ({status}): {hint}; its last output was:\n{output}")]
    ToolFailed {
        tool: &'static str,
        status: String,
        /// What to check or do, specific to the tool.
        hint: &'static str,
        output: String,
    },

    #[error("apt knows no package {package}: run `apt-get update` (with a Debian source configured), or pass a kernel .deb (--kernel-deb)")]
    NoKernelPackage { package: String },

    #[error("kernel package {path} is not usable: {reason}; pass a Debian linux-image-*-cloud-amd64 .deb")]
    KernelDeb { path: PathBuf, reason: String },

    #[error("kernel {release} has no module {module} and does not have it built in: use a Debian cloud kernel (linux-image-*-cloud-amd64)")]
    ModuleMissing { release: String, module: String },

    #[error("kernel module data in {path} is unusable: {reason}; rebuild the kernel asset (forkd image build --force)")]
    ModuleData { path: PathBuf, reason: String },

    #[error("the guest agent binary forkd-agent was not found (looked at: {tried}); build it with `RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p forkd-agent --target x86_64-unknown-linux-gnu` or set FORKD_AGENT_BIN to its path")]
    AgentNotFound { tried: String },

    #[error("guest agent {path} is dynamically linked, but it runs as /init before any root filesystem with a loader exists; build it with `RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p forkd-agent --target x86_64-unknown-linux-gnu`")]
    AgentDynamic { path: PathBuf },

    #[error("guest agent {path} is not an x86-64 Linux executable ({reason}); point FORKD_AGENT_BIN at the forkd-agent binary")]
    AgentNotElf { path: PathBuf, reason: String },

    #[error("no Debian mirror for suite {suite} found in the host's apt sources; pass --mirror <URL> or set FORKD_DEBIAN_MIRROR")]
    NoMirror { suite: String },

    #[error("only {free_mib} MiB are free under {path}, a rootfs build needs at least {need_mib} MiB; free some space or set FORKD_HOME to a directory on a larger disk")]
    LowDiskSpace {
        path: PathBuf,
        free_mib: u64,
        need_mib: u64,
    },

    #[error("an image layer ({path}) cannot be applied: {detail}")]
    BadLayer { path: PathBuf, detail: String },

    #[error("building {what} needs root (debootstrap creates device nodes and files owned by other users); run it as root")]
    NeedRoot { what: String },

    #[error("packages cannot be installed: {detail}")]
    Package { detail: String },

    #[error("unknown rootfs image {0:?}; use one of: minimal, python")]
    UnknownImage(String),

    #[error(
        "could not lock {path} to serialise builds: {source}; check that the directory is writable"
    )]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl ImageError {
    /// Shorthand for the many I/O call sites, which all want the same wording.
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        ImageError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

pub(crate) type Result<T, E = ImageError> = std::result::Result<T, E>;
