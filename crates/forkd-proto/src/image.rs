//! What the container image a template was built from says about running commands: the
//! image builder writes it into the guest's root filesystem, the agent reads it at
//! start and makes it the defaults of commands and code contexts.

use serde::{Deserialize, Serialize};

/// Where it is in the guest.
pub const IMAGE_CONFIG_PATH: &str = "/etc/forkd/image.json";

/// The image's run configuration (its config's `config`), and where it came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageDefaults {
    /// The reference it was pulled as.
    #[serde(default)]
    pub reference: String,
    /// `sha256:` digest of its manifest.
    #[serde(default)]
    pub digest: String,
    /// `K=V` entries, added to the default environment.
    #[serde(default)]
    pub env: Vec<String>,
    /// The default working directory.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// The default user: a name, or `uid[:gid]`.
    #[serde(default)]
    pub user: Option<String>,
    /// Recorded, not run.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// Recorded, not run.
    #[serde(default)]
    pub cmd: Vec<String>,
}
