//! A template's recipe (`templates/<name>.toml`): what the parent VM is made from, its
//! shape, its warm-up and code contexts, read and checked before anything is built.

use crate::error::SandboxError;
use forkd_hypervisor::accel::is_cpu_model_name;
use forkd_hypervisor::Accel;
use forkd_image::RootfsImage;
use forkd_proto::context::Language;
use forkd_storage::snapshot::Tag;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The recipes shipped with forkd (the files in `templates/`), built into the binary so
/// that `forkd template build python` works from any directory.
pub const BUILTIN: [(&str, &str); 2] = [
    (
        "minimal",
        include_str!("../../../../templates/minimal.toml"),
    ),
    ("python", include_str!("../../../../templates/python.toml")),
];

/// A template recipe.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The template's name (the file's stem; also the default snapshot tag).
    #[serde(skip)]
    pub name: String,
    /// One line about it.
    #[serde(default)]
    pub description: String,
    /// The built-in rootfs image (`minimal`, `python`); or
    #[serde(default)]
    pub image: Option<String>,
    /// a container image: `REGISTRY/REPO:TAG`, `REGISTRY/REPO@sha256:...`,
    /// `oci-layout:PATH[:TAG]` or `docker-archive:FILE[:REPO:TAG]` (paths relative to
    /// the recipe's directory).
    #[serde(default)]
    pub from: Option<String>,
    /// vCPUs of the parent (and so of every child).
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// Guest RAM of the parent, MiB.
    #[serde(default = "default_memory")]
    pub memory_mib: u32,
    /// Debian packages installed into its root filesystem at build time (see
    /// [`crate::customise`]).
    #[serde(default)]
    pub packages: Vec<String>,
    /// Files copied into its root filesystem from the recipe's directory.
    #[serde(default)]
    pub files: Vec<FileRecipe>,
    /// Commands run once at build time, after the packages and files, whose changes to
    /// the disk become part of its root filesystem (`[[build]] run = "..."`).
    #[serde(default)]
    pub build: Vec<WarmupStep>,
    /// Commands run in the parent, in order, before the contexts start.
    #[serde(default)]
    pub warmup: Vec<WarmupStep>,
    /// Code contexts started in the parent; every child inherits them warm.
    #[serde(default)]
    pub contexts: Vec<ContextRecipe>,
    /// The guest CPU model (a QEMU model name) its snapshot is pinned to; by default
    /// the accelerator's ([`Accel::default_cpu_model`]). `host` or `max` take whatever
    /// the machine offers, and such a snapshot may not fork on another host.
    #[serde(default)]
    pub cpu: Option<String>,
    /// Children a daemon keeps prepared for forks of the snapshot (its warm pool; the
    /// API can change it).
    #[serde(default)]
    pub pool: u32,
    /// What a child's timeout does when its fork does not say: `kill` (the default) or
    /// `pause`.
    #[serde(default)]
    pub on_timeout: Option<forkd_storage::snapshot::manifest::OnTimeout>,
    /// Pause a child after this many seconds without a request, when its fork does not
    /// say.
    #[serde(default)]
    pub auto_pause_after: Option<u64>,
    /// Whether the parent, and so every child, has a NIC.
    #[serde(default)]
    pub network: NetworkChoice,
    /// What children may reach when their fork does not say (`[egress]`: `mode`,
    /// `allow`, `deny`, as the API's `network`); by default nothing.
    #[serde(default)]
    pub egress: Option<forkd_host::network::policy::EgressPolicy>,
    /// The directory it was read from, which its `files` are relative to.
    #[serde(skip)]
    pub dir: Option<PathBuf>,
}

/// A file a recipe copies into its root filesystem.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileRecipe {
    /// Its path relative to the recipe's directory (never outside it).
    pub src: String,
    /// Where it goes in the guest (absolute).
    pub dest: String,
    /// Its mode in octal (default `0644`).
    #[serde(default)]
    pub mode: Option<String>,
}

impl FileRecipe {
    /// Its mode.
    pub fn mode(&self) -> u32 {
        self.mode
            .as_deref()
            .and_then(|m| u32::from_str_radix(m.trim_start_matches("0o"), 8).ok())
            .unwrap_or(0o644)
    }

    fn check(&self) -> Result<(), String> {
        let src = Path::new(&self.src);
        if self.src.is_empty()
            || src.is_absolute()
            || src
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(format!(
                "file src {:?} must be a path inside the recipe's directory (relative, no `..`)",
                self.src
            ));
        }
        let dest = Path::new(&self.dest);
        if !dest.is_absolute()
            || dest
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
            || self.dest.ends_with('/')
        {
            return Err(format!(
                "file dest {:?} must be an absolute file path in the guest (no `..`)",
                self.dest
            ));
        }
        if let Some(m) = &self.mode {
            match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
                Ok(v) if v <= 0o7777 => {}
                _ => {
                    return Err(format!(
                        "file mode {m:?} is not an octal mode like \"0644\""
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The contents of a recipe's `files`, by `src`.
pub type RecipeFiles = std::collections::BTreeMap<String, Vec<u8>>;

/// The most a recipe's files may hold together (they travel in the build request).
pub const MAX_RECIPE_FILES: u64 = 512 << 10;

/// One command: a warm-up step, or a build step (`[[build]]`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WarmupStep {
    /// Run with `/bin/sh -c`; it must exit 0.
    pub run: String,
    /// Seconds it may take (default 600).
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// One warm code context.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ContextRecipe {
    /// The interpreter.
    #[serde(default)]
    pub language: Language,
    /// Code run in the context before the freeze (imports, loaded data, a model).
    #[serde(default)]
    pub preload: String,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<String>,
}

fn default_vcpus() -> u32 {
    1
}

fn default_memory() -> u32 {
    512
}

impl Recipe {
    /// Parses a recipe's TOML text.
    pub fn parse(name: &str, text: &str) -> Result<Recipe, SandboxError> {
        let bad = |detail: String| SandboxError::Template {
            name: name.to_owned(),
            detail,
        };
        Tag::parse(name).map_err(|e| bad(e.to_string()))?;
        let mut r: Recipe = toml::from_str(text).map_err(|e| bad(format!("bad recipe: {e}")))?;
        r.name = name.to_owned();
        match (&r.image, &r.from) {
            (Some(image), None) => {
                image.parse::<RootfsImage>().map_err(|e| bad(e.to_string()))?;
            }
            (None, Some(from)) => {
                forkd_storage::oci::image::ImageSource::parse(from).map_err(|e| bad(e.to_string()))?;
            }
            _ => {
                return Err(bad(
                    "give one of `image` (a built-in rootfs: minimal, python) and `from` (a container image)".into(),
                ))
            }
        }
        if !(1..=64).contains(&r.vcpus) {
            return Err(bad(format!("vcpus = {} is outside 1..=64", r.vcpus)));
        }
        if !(128..=262_144).contains(&r.memory_mib) {
            return Err(bad(format!(
                "memory_mib = {} is outside 128..=262144",
                r.memory_mib
            )));
        }
        if let Some(p) = r
            .packages
            .iter()
            .find(|p| !forkd_image::packages::valid_package(p))
        {
            return Err(bad(format!("{p:?} is not a Debian package name")));
        }
        for f in &r.files {
            f.check().map_err(bad)?;
        }
        if let Some(i) = r.build.iter().position(|b| b.run.trim().is_empty()) {
            return Err(bad(format!("build step {} has nothing to run", i + 1)));
        }
        if let Some(cpu) = r.cpu.as_deref().filter(|c| !is_cpu_model_name(c)) {
            return Err(bad(format!("cpu = {cpu:?} is not a QEMU CPU model name")));
        }
        // As the API's auto_pause_after_s (30 days at most).
        if r.auto_pause_after
            .is_some_and(|t| !(1..=2_592_000).contains(&t))
        {
            return Err(bad(format!(
                "auto_pause_after = {} is outside 1..=2592000 seconds",
                r.auto_pause_after.unwrap_or(0)
            )));
        }
        if r.pool as usize > crate::fork::MAX_POOL {
            return Err(bad(format!(
                "pool = {} is above {}",
                r.pool,
                crate::fork::MAX_POOL
            )));
        }
        Ok(r)
    }

    /// Reads a recipe file; the template is named after the file's stem.
    pub fn load(path: &Path) -> Result<Recipe, SandboxError> {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        let text = std::fs::read_to_string(path).map_err(|source| SandboxError::Io {
            context: format!("reading template {}", path.display()),
            source,
        })?;
        let mut r = Recipe::parse(&name, &text)?;
        r.dir = Some(path.parent().unwrap_or(Path::new(".")).to_path_buf());
        // A layout or archive named by a relative path is the recipe's neighbour.
        for kind in ["oci-layout:", "docker-archive:"] {
            if let Some(rest) = r.from.as_deref().and_then(|f| f.strip_prefix(kind)) {
                if !rest.starts_with('/') {
                    let dir = path.parent().unwrap_or(Path::new("."));
                    r.from = Some(format!("{kind}{}", dir.join(rest).display()));
                }
            }
        }
        Ok(r)
    }

    /// Finds the recipe `name`: `<dir>/<name>.toml` in the first of `dirs` that has it,
    /// else the built-in recipe of that name.
    pub fn find(name: &str, dirs: &[PathBuf]) -> Result<Recipe, SandboxError> {
        Tag::parse(name).map_err(|e| SandboxError::Template {
            name: name.chars().take(40).collect(),
            detail: e.to_string(),
        })?;
        for d in dirs {
            let p = d.join(format!("{name}.toml"));
            if p.is_file() {
                return Recipe::load(&p);
            }
        }
        match BUILTIN.iter().find(|(n, _)| *n == name) {
            Some((n, text)) => Recipe::parse(n, text),
            None => Err(SandboxError::Template {
                name: name.to_owned(),
                detail: format!(
                    "no such template (built in: {}; or pass a recipe file)",
                    BUILTIN.map(|(n, _)| n).join(", ")
                ),
            }),
        }
    }

    /// What its root filesystem is made from.
    pub fn base(&self) -> Base {
        match (&self.image, &self.from) {
            (_, Some(from)) => Base::Oci(from.clone()),
            (Some(image), None) => Base::Builtin(image.parse().expect("checked when parsed")),
            (None, None) => unreachable!("checked when parsed"),
        }
    }

    /// The guest CPU model its VMs run with under `accel`.
    pub fn cpu_model(&self, accel: Accel) -> String {
        self.cpu
            .clone()
            .unwrap_or_else(|| accel.default_cpu_model().to_owned())
    }

    /// Whether it changes its base (packages, files or build steps), which then gets a
    /// root filesystem of its own.
    pub fn customises(&self) -> bool {
        !(self.packages.is_empty() && self.files.is_empty() && self.build.is_empty())
    }

    /// Reads its `files` from the directory it was read from; each must be a regular
    /// file that is inside it (after symbolic links are followed).
    pub fn read_files(&self) -> Result<RecipeFiles, SandboxError> {
        let bad = |detail: String| SandboxError::Template {
            name: self.name.clone(),
            detail,
        };
        let mut out = RecipeFiles::new();
        if self.files.is_empty() {
            return Ok(out);
        }
        let dir = self.dir.as_deref().ok_or_else(|| {
            bad("its files are read from the recipe's directory: give the recipe as a file".into())
        })?;
        let root = dir
            .canonicalize()
            .map_err(|e| bad(format!("reading {}: {e}", dir.display())))?;
        let mut total = 0u64;
        for f in &self.files {
            let path = root.join(&f.src);
            let real = path
                .canonicalize()
                .map_err(|e| bad(format!("file {}: {e}", f.src)))?;
            if !real.starts_with(&root) || !real.is_file() {
                return Err(bad(format!(
                    "file {} is not a regular file inside {}",
                    f.src,
                    root.display()
                )));
            }
            let bytes =
                std::fs::read(&real).map_err(|e| bad(format!("reading file {}: {e}", f.src)))?;
            total += bytes.len() as u64;
            if total > MAX_RECIPE_FILES {
                return Err(bad(format!(
                    "its files hold more than {} KiB; copy big things in with a [[build]] step or put them in the image",
                    MAX_RECIPE_FILES >> 10
                )));
            }
            out.insert(f.src.clone(), bytes);
        }
        Ok(out)
    }

    /// The built-in rootfs image it needs, if it is built on one.
    pub fn rootfs_image(&self) -> Option<RootfsImage> {
        match self.base() {
            Base::Builtin(i) => Some(i),
            Base::Oci(_) => None,
        }
    }

    /// Its base, named: the built-in image's name or the container image's reference.
    pub fn base_name(&self) -> String {
        match self.base() {
            Base::Builtin(i) => i.name().to_owned(),
            Base::Oci(from) => from,
        }
    }
}

/// What a template's root filesystem is made from.
#[derive(Debug, Clone, PartialEq)]
pub enum Base {
    /// One of forkd's Debian images.
    Builtin(RootfsImage),
    /// A container image (see [`forkd_storage::oci::image`]).
    Oci(String),
}

/// Whether a template's guest has a NIC. A restored child has exactly its snapshot's
/// devices, so this is the template's choice, not a fork's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetworkChoice {
    /// A NIC where the host can give children networks (see
    /// [`forkd_host::network::unavailable`]), else none.
    #[default]
    Auto,
    /// A NIC, each child's in a network namespace of its own behind NAT.
    Nat,
    /// No NIC.
    None,
}

impl NetworkChoice {
    /// Whether the guest gets a NIC on this host; an error when `nat` cannot be had.
    pub fn nic(self) -> Result<bool, String> {
        let why = forkd_host::network::unavailable;
        match self {
            NetworkChoice::None => Ok(false),
            NetworkChoice::Auto => Ok(why().is_none()),
            NetworkChoice::Nat => match why() {
                None => Ok(true),
                Some(why) => Err(format!("network = \"nat\" cannot be had here: {why}")),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_recipes_parse() {
        for (name, text) in BUILTIN {
            let r = Recipe::parse(name, text).unwrap();
            assert_eq!(r.name, name);
            assert_eq!(r.memory_mib, 512);
        }
        let py = Recipe::find("python", &[]).unwrap();
        assert!(py.contexts[0].preload.contains("import pandas"));
    }

    #[test]
    fn a_recipe_sets_what_its_children_s_timeout_and_idleness_do() {
        let r = Recipe::parse(
            "t",
            "image = \"minimal\"\non_timeout = \"pause\"\nauto_pause_after = 600",
        )
        .unwrap();
        assert_eq!(
            r.on_timeout,
            Some(forkd_storage::snapshot::manifest::OnTimeout::Pause)
        );
        assert_eq!(r.auto_pause_after, Some(600));
        for bad in ["on_timeout = \"sleep\"", "auto_pause_after = 0"] {
            let text = format!("image = \"minimal\"\n{bad}");
            assert!(Recipe::parse("t", &text).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_recipes_are_explained() {
        let e = Recipe::parse("t", "image = \"nope\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope"), "{e}");
        let e = Recipe::parse("t", "image = \"minimal\"\nvcpus = 0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("vcpus"), "{e}");
        let e = Recipe::parse("t", "image = \"minimal\"\ncolour = 1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("colour"), "{e}");
        let e = Recipe::find("../x", &[]).unwrap_err().to_string();
        assert!(e.contains("'/'"), "{e}");
        let e = Recipe::find("nosuch", &[]).unwrap_err().to_string();
        assert!(e.contains("built in: minimal, python"), "{e}");
        for both_or_none in [
            "image = \"minimal\"\nfrom = \"127.0.0.1:5000/a:1\"",
            "vcpus = 1",
        ] {
            let e = Recipe::parse("t", both_or_none).unwrap_err().to_string();
            assert!(e.contains("give one of `image`"), "{e}");
        }
    }

    #[test]
    fn customisations_are_checked_and_files_stay_in_the_recipe_s_directory() {
        let bad = |extra: &str| {
            Recipe::parse("t", &format!("image = \"minimal\"\n{extra}"))
                .unwrap_err()
                .to_string()
        };
        assert!(bad("packages = [\"-o\"]").contains("not a Debian package name"));
        for src in ["../x", "/etc/passwd", "a/../../b", ""] {
            let e = bad(&format!("files = [{{ src = \"{src}\", dest = \"/x\" }}]"));
            assert!(e.contains("inside the recipe's directory"), "{src}: {e}");
        }
        for dest in ["rel", "/a/../b", "/dir/"] {
            let e = bad(&format!("files = [{{ src = \"a\", dest = \"{dest}\" }}]"));
            assert!(e.contains("absolute file path"), "{dest}: {e}");
        }
        let e = bad("files = [{ src = \"a\", dest = \"/a\", mode = \"999\" }]");
        assert!(e.contains("octal"), "{e}");
        assert!(bad("[[build]]\nrun = \" \"").contains("nothing to run"));

        let dir = tempfile::tempdir().unwrap();
        let recipes = dir.path().join("recipes");
        std::fs::create_dir(&recipes).unwrap();
        std::fs::write(dir.path().join("secret"), "outside").unwrap();
        std::fs::write(recipes.join("app.conf"), "inside").unwrap();
        std::os::unix::fs::symlink("../secret", recipes.join("link")).unwrap();
        let path = recipes.join("app.toml");
        let write = |src: &str| {
            std::fs::write(
                &path,
                format!("image = \"minimal\"\nfiles = [{{ src = \"{src}\", dest = \"/etc/app\", mode = \"0600\" }}]"),
            )
            .unwrap();
            Recipe::load(&path).unwrap()
        };
        let r = write("app.conf");
        assert!(r.customises());
        assert_eq!(r.files[0].mode(), 0o600);
        assert_eq!(r.read_files().unwrap()["app.conf"], b"inside");
        let e = write("link").read_files().unwrap_err().to_string();
        assert!(e.contains("not a regular file inside"), "{e}");
        // Given as text (no directory), its files cannot be read here.
        let mut r = write("app.conf");
        r.dir = None;
        assert!(r.read_files().is_err());
    }

    #[test]
    fn a_recipe_from_an_image_names_its_base_and_a_layout_beside_it() {
        let r = Recipe::parse("t", "from = \"127.0.0.1:5000/team/app:1\"").unwrap();
        assert_eq!(r.base(), Base::Oci("127.0.0.1:5000/team/app:1".into()));
        assert_eq!(r.rootfs_image(), None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.toml");
        std::fs::write(&path, "from = \"oci-layout:img:v2\"").unwrap();
        let r = Recipe::load(&path).unwrap();
        assert_eq!(
            r.base_name(),
            format!("oci-layout:{}:v2", dir.path().join("img").display())
        );
    }
}
