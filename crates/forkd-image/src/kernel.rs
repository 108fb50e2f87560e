//! The guest kernel: Debian's cloud kernel package, unpacked (never installed on
//! the host) into `kernel/<release>/` with its vmlinuz and only the modules the
//! guest needs.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::asset::{self, Asset};
use crate::command::{APT_CACHE, APT_GET, DPKG_DEB, XZ, ZSTD};
use crate::elf;
use crate::error::{ImageError, Result};
use crate::fsutil::{self, ScratchDir};
use crate::home::Home;
use crate::inputs::Inputs;
use crate::lock::BuildLock;
use crate::modules::{self, Builtin, DepDb, PlanError, GUEST_MODULES, ROOT_FS_MODULE};
use crate::progress::Progress;
use crate::BuildOptions;

/// Debian's metapackage that always depends on the current cloud kernel.
pub const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// Bump when the kernel directory's layout or contents change for the same .deb.
const KERNEL_LAYOUT: &str = "1";

/// The unpacked guest kernel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelAsset {
    pub vmlinuz: Asset,
    /// `uname -r` of the kernel, e.g. `6.1.0-27-cloud-amd64`.
    pub release: String,
    /// The Debian package it came from and its version.
    pub package: String,
    pub package_version: String,
    /// `lib/modules/<release>` equivalent: modules.dep, modules.builtin and the
    /// needed `.ko` files (uncompressed).
    pub modules_dir: PathBuf,
}

/// `kernel/current.json`: the kernel `ensure_kernel` returns without asking apt.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Current {
    release: String,
    /// Digest of the layout version and module list, so that a forkd that wants
    /// different modules does not take an old kernel directory as current.
    layout: String,
}

fn layout_key() -> String {
    Inputs::new("kernel-layout")
        .field("layout", KERNEL_LAYOUT)
        .list("modules", &requested_modules())
        .digest()
}

/// GUEST_MODULES plus the root file system driver (skipped when built in).
fn requested_modules() -> Vec<&'static str> {
    let mut m = GUEST_MODULES.to_vec();
    m.push(ROOT_FS_MODULE);
    m
}

fn current_path(home: &Home) -> PathBuf {
    home.kernel_dir().join("current.json")
}

fn manifest_path(release_dir: &Path) -> PathBuf {
    release_dir.join("kernel.json")
}

/// The kernel asset of `release`, if it is built and intact.
fn load_release(home: &Home, release: &str) -> Option<KernelAsset> {
    let dir = home.kernel_dir().join(release);
    let vmlinuz = dir.join("vmlinuz");
    let mut k: KernelAsset = asset::load_manifest(&manifest_path(&dir))?;
    k.vmlinuz.path = vmlinuz;
    k.modules_dir = dir.join("modules");
    let ok = k.release == release
        && k.vmlinuz.file_intact()
        && k.modules_dir.join("modules.dep").is_file();
    ok.then_some(k)
}

fn load_current(home: &Home) -> Option<KernelAsset> {
    let cur: Current = asset::load_manifest(&current_path(home))?;
    if cur.layout != layout_key() || !valid_release(&cur.release) {
        return None;
    }
    load_release(home, &cur.release)
}

fn set_current(home: &Home, release: &str) -> Result<()> {
    let cur = Current {
        release: release.to_string(),
        layout: layout_key(),
    };
    if asset::load_manifest::<Current>(&current_path(home)).as_ref() == Some(&cur) {
        return Ok(());
    }
    asset::store_manifest(&current_path(home), &cur)
}

/// Builds (or reuses) the guest kernel. Without `kernel_deb` or `force`, an
/// existing kernel is returned without any apt query, so this is cheap per run;
/// `force` re-resolves the metapackage and picks up a newer kernel.
pub fn ensure_kernel(home: &Home, opts: &BuildOptions) -> Result<KernelAsset> {
    if !opts.force {
        if opts.kernel_deb.is_none() {
            if let Some(k) = load_current(home) {
                return Ok(k);
            }
        } else if let Some(deb) = &opts.kernel_deb {
            // Hashing a given .deb is cheap enough to do before taking the lock.
            let info = DebInfo::read(deb)?;
            if let Some(k) = reusable(home, &info) {
                set_current(home, &k.release)?;
                return Ok(k);
            }
        }
    }

    let _lock = BuildLock::acquire(home, &opts.progress)?;
    if !opts.force && opts.kernel_deb.is_none() {
        // Another process may have built it while we waited for the lock.
        if let Some(k) = load_current(home) {
            return Ok(k);
        }
    }
    fsutil::create_dir_all(&home.kernel_dir())?;
    let scratch = ScratchDir::new(&home.tmp_dir(), "kernel-")?;
    let deb = match &opts.kernel_deb {
        Some(d) => d.clone(),
        None => download(scratch.path(), &opts.progress)?,
    };
    let info = DebInfo::read(&deb)?;
    if !opts.force {
        if let Some(k) = reusable(home, &info) {
            set_current(home, &k.release)?;
            return Ok(k);
        }
    }
    let k = build(home, &info, scratch.path(), &opts.progress)?;
    set_current(home, &k.release)?;
    Ok(k)
}

/// What identifies a kernel .deb.
struct DebInfo {
    path: PathBuf,
    package: String,
    version: String,
    release: String,
    inputs: String,
}

impl DebInfo {
    fn read(path: &Path) -> Result<DebInfo> {
        let bad = |reason: String| ImageError::KernelDeb {
            path: path.to_path_buf(),
            reason,
        };
        if !path.is_file() {
            return Err(bad("the file does not exist".into()));
        }
        let (sha256, _) = fsutil::sha256_file(path)?;
        let mut cmd = DPKG_DEB.command()?;
        cmd.arg("-f").arg(path).args(["Package", "Version"]);
        let control = DPKG_DEB.output(cmd).map_err(|e| match e {
            ImageError::ToolFailed { output, .. } => {
                bad(format!("dpkg-deb cannot read it: {output}"))
            }
            other => other,
        })?;
        let control = String::from_utf8_lossy(&control);
        let field = |name: &str| {
            control
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let package = field("Package").ok_or_else(|| bad("it has no Package field".into()))?;
        let version = field("Version").ok_or_else(|| bad("it has no Version field".into()))?;
        let release = release_of_package(&package)
            .ok_or_else(|| bad(format!("{package} is not a linux-image-<release> package")))?;
        let inputs = Inputs::new("kernel")
            .field("deb_sha256", &sha256)
            .field("package", &package)
            .field("version", &version)
            .field("layout", layout_key())
            .digest();
        Ok(DebInfo {
            path: path.to_path_buf(),
            package,
            version,
            release,
            inputs,
        })
    }
}

fn reusable(home: &Home, info: &DebInfo) -> Option<KernelAsset> {
    load_release(home, &info.release).filter(|k| k.vmlinuz.inputs == info.inputs)
}

/// `linux-image-6.1.0-27-cloud-amd64[-unsigned]` -> `6.1.0-27-cloud-amd64`.
fn release_of_package(package: &str) -> Option<String> {
    let r = package.strip_prefix("linux-image-")?;
    let r = r.strip_suffix("-unsigned").unwrap_or(r);
    // Debug-symbol packages have no vmlinuz to boot.
    if r.ends_with("-dbg") || !valid_release(r) {
        return None;
    }
    Some(r.to_string())
}

/// The release becomes a directory name: allow only what kernel releases use.
fn valid_release(r: &str) -> bool {
    !r.is_empty()
        && !r.starts_with('.')
        && r.chars().next().is_some_and(|c| c.is_ascii_digit())
        && r.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._+-~".contains(c))
}

/// The ABI package `linux-image-cloud-amd64` currently depends on.
fn resolve_metapackage() -> Result<String> {
    let mut cmd = APT_CACHE.command()?;
    cmd.args(["depends", KERNEL_METAPACKAGE]);
    let none = || ImageError::NoKernelPackage {
        package: KERNEL_METAPACKAGE.to_string(),
    };
    // apt-cache fails ("No packages found") when its lists do not know the package.
    let out = match APT_CACHE.output(cmd) {
        Ok(out) => out,
        Err(ImageError::ToolFailed { .. }) => return Err(none()),
        Err(e) => return Err(e),
    };
    parse_depends(&String::from_utf8_lossy(&out)).ok_or_else(none)
}

fn parse_depends(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|l| l.trim().trim_start_matches('|').strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-") && !p.starts_with('<'))
        .map(str::to_string)
}

/// Downloads the current cloud kernel .deb into `dir` (not installing it).
fn download(dir: &Path, progress: &Progress) -> Result<PathBuf> {
    let package = resolve_metapackage()?;
    let step = progress.step(format!("kernel: apt-get download {package}"));
    let mut cmd = APT_GET.command()?;
    cmd.current_dir(dir).args(["-q", "download"]);
    if nix::unistd::geteuid().is_root() {
        // apt would try to drop to its _apt user, which cannot write to our 0700
        // scratch dir, and fall back to root with a warning; say root up front.
        cmd.args(["-o", "APT::Sandbox::User=root"]);
    }
    cmd.arg(&package);
    APT_GET.run_logged(cmd, &step, &dir.join("apt-get.log"))?;
    let deb = fs::read_dir(dir)
        .map_err(|e| ImageError::io("list", dir, e))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .ok_or_else(|| ImageError::NoKernelPackage {
            package: package.clone(),
        })?;
    step.finish();
    Ok(deb)
}

/// A module selected for the guest.
struct Selected {
    name: String,
    /// Where it is in the unpacked package.
    source: PathBuf,
    /// Where it goes under `modules/` (compression suffix dropped).
    dest: String,
    /// Dependency names, in load order.
    deps: Vec<String>,
}

fn build(home: &Home, info: &DebInfo, scratch: &Path, progress: &Progress) -> Result<KernelAsset> {
    let started = Instant::now();
    let release = &info.release;
    let step = progress.step(format!(
        "kernel {release}: unpacking {} {}",
        info.package, info.version
    ));
    let unpacked = scratch.join("unpacked");
    let mut cmd = DPKG_DEB.command()?;
    cmd.arg("-x").arg(&info.path).arg(&unpacked);
    DPKG_DEB.output(cmd)?;
    let bad = |reason: String| ImageError::KernelDeb {
        path: info.path.clone(),
        reason,
    };
    let vmlinuz_src = unpacked.join(format!("boot/vmlinuz-{release}"));
    if !vmlinuz_src.is_file() {
        return Err(bad(format!("it has no boot/vmlinuz-{release}")));
    }
    // Bookworm ships /lib/modules; merged-/usr releases ship /usr/lib/modules.
    let mod_root = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| unpacked.join(d).join(release))
        .find(|p| p.is_dir())
        .ok_or_else(|| bad(format!("it has no lib/modules/{release}")))?;
    let config =
        fs::read_to_string(unpacked.join(format!("boot/config-{release}"))).unwrap_or_default();
    let builtin_text = fs::read_to_string(mod_root.join("modules.builtin")).unwrap_or_default();
    let mut builtin = Builtin::parse(&builtin_text);
    builtin.add_from_config(&config);
    step.finish();

    let step = progress.step(format!("kernel {release}: selecting modules"));
    let (selected, builtin_requested) = select_modules(&mod_root, &builtin, release)?;

    let staging = scratch.join("release");
    let staged_modules = staging.join("modules");
    fsutil::create_dir_all(&staged_modules)?;
    let mut direct = BTreeMap::new();
    for m in &selected {
        let dest = staged_modules.join(&m.dest);
        if let Some(parent) = dest.parent() {
            fsutil::create_dir_all(parent)?;
        }
        let bytes = read_module(&m.source)?;
        fs::write(&dest, &bytes).map_err(|e| ImageError::io("write", &dest, e))?;
        direct.insert(m.name.clone(), (m.dest.clone(), m.deps.clone()));
    }
    let db = DepDb::from_direct(&direct).map_err(|reason| ImageError::ModuleData {
        path: info.path.clone(),
        reason,
    })?;
    write_file(&staged_modules.join("modules.dep"), db.render().as_bytes())?;
    write_file(
        &staged_modules.join("modules.builtin"),
        builtin_text.as_bytes(),
    )?;
    write_file(&staging.join("config"), config.as_bytes())?;
    let vmlinuz_staged = staging.join("vmlinuz");
    fs::copy(&vmlinuz_src, &vmlinuz_staged).map_err(|e| ImageError::io("copy", &vmlinuz_src, e))?;
    let (sha256, size) = fsutil::sha256_file(&vmlinuz_staged)?;

    let final_dir = home.kernel_dir().join(release);
    let kernel = KernelAsset {
        vmlinuz: Asset::record(
            final_dir.join("vmlinuz"),
            sha256,
            size,
            started,
            info.inputs.clone(),
        ),
        release: release.clone(),
        package: info.package.clone(),
        package_version: info.version.clone(),
        modules_dir: final_dir.join("modules"),
    };
    asset::store_manifest(&manifest_path(&staging), &kernel)?;
    sync_tree(&staging)?;

    // Swap the directory in: the old one (if any) moves into scratch and goes with it.
    if final_dir.exists() {
        let old = scratch.join("old");
        fs::rename(&final_dir, &old).map_err(|e| ImageError::io("move aside", &final_dir, e))?;
    }
    fs::rename(&staging, &final_dir)
        .map_err(|e| ImageError::io("rename into place", &final_dir, e))?;
    fsutil::fsync_dir(&home.kernel_dir())?;
    let names: Vec<&str> = selected.iter().map(|m| m.name.as_str()).collect();
    step.message(&names.join(" "));
    tracing::info!(release = %release, modules = ?names, "kernel asset built");
    step.finish();
    // After the step, so the warning does not tear through a spinner.
    for name in builtin_requested {
        progress.warn(&format!(
            "kernel {release} has {name} built in; the initramfs will not load it"
        ));
    }
    Ok(kernel)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).map_err(|e| ImageError::io("write", path, e))
}

/// fsyncs every file and directory of a freshly written tree, so that renaming it
/// into place publishes complete contents even across a crash.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(|e| ImageError::io("list", dir, e))? {
        let path = entry.map_err(|e| ImageError::io("list", dir, e))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| ImageError::io("sync", &path, e))?;
        }
    }
    fsutil::fsync_dir(dir)
}

/// The dependency closure of the requested modules, from the package's
/// modules.dep if it ships one, else from each module's `.modinfo` (Debian's
/// packages leave modules.dep to depmod at install time).
/// Also returns the requested modules that are built in (to warn about).
fn select_modules(
    mod_root: &Path,
    builtin: &Builtin,
    release: &str,
) -> Result<(Vec<Selected>, Vec<String>)> {
    let requested = requested_modules();
    let shipped_dep = mod_root.join("modules.dep");
    let (db, source) = if shipped_dep.is_file() {
        let text = fs::read_to_string(&shipped_dep)
            .map_err(|e| ImageError::io("read", &shipped_dep, e))?;
        let db = DepDb::parse(&text).map_err(|reason| ImageError::ModuleData {
            path: shipped_dep.clone(),
            reason,
        })?;
        (db, "modules.dep")
    } else {
        (
            db_from_modinfo(mod_root, builtin, &requested, release)?,
            ".modinfo",
        )
    };
    tracing::debug!(source, "module dependencies");
    let plan = modules::plan(&db, builtin, &requested).map_err(|e| match e {
        PlanError::Missing(module) => ImageError::ModuleMissing {
            release: release.to_string(),
            module,
        },
        PlanError::Broken(reason) => ImageError::ModuleData {
            path: mod_root.to_path_buf(),
            reason,
        },
    })?;
    let mut out = Vec::new();
    for m in &plan.load {
        let deps = db.deps_in_load_order(&m.name).unwrap_or_default();
        out.push(Selected {
            name: m.name.clone(),
            source: mod_root.join(&m.path),
            dest: strip_compression(&m.path),
            deps,
        });
    }
    let builtin_requested = plan
        .builtin
        .into_iter()
        .filter(|n| n != ROOT_FS_MODULE)
        .collect();
    Ok((out, builtin_requested))
}

fn strip_compression(path: &str) -> String {
    for ext in [".xz", ".zst", ".gz"] {
        if let Some(p) = path.strip_suffix(ext) {
            return p.to_string();
        }
    }
    path.to_string()
}

/// Builds a modules.dep database for the closure of `requested` by reading the
/// `.modinfo` section of each module in it.
fn db_from_modinfo(
    mod_root: &Path,
    builtin: &Builtin,
    requested: &[&str],
    release: &str,
) -> Result<DepDb> {
    let index = index_modules(mod_root)?;
    let mut direct: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    let mut queue: VecDeque<String> = requested.iter().map(|r| modules::normalise(r)).collect();
    let mut seen: HashSet<String> = HashSet::new();
    while let Some(name) = queue.pop_front() {
        if !seen.insert(name.clone()) || builtin.contains(&name) {
            continue;
        }
        // A requested module that does not exist is reported by the planner.
        let Some(rel) = index.get(&name) else {
            continue;
        };
        let path = mod_root.join(rel);
        let bytes = read_module(&path)?;
        let modinfo = elf::relocatable_section(&bytes, ".modinfo")
            .map_err(|reason| ImageError::ModuleData {
                path: path.clone(),
                reason,
            })?
            .unwrap_or_default();
        let declared = modules::modinfo_deps(modinfo);
        let mut deps = Vec::new();
        for d in declared.soft_pre {
            if index.contains_key(&d) && !builtin.contains(&d) {
                deps.push(d);
            }
        }
        for d in declared.hard {
            if builtin.contains(&d) {
                continue;
            }
            if !index.contains_key(&d) {
                return Err(ImageError::ModuleMissing {
                    release: release.to_string(),
                    module: d,
                });
            }
            deps.push(d);
        }
        let mut uniq = HashSet::new();
        deps.retain(|d| uniq.insert(d.clone()));
        queue.extend(deps.iter().cloned());
        direct.insert(name, (rel.clone(), deps));
    }
    DepDb::from_direct(&direct).map_err(|reason| ImageError::ModuleData {
        path: mod_root.to_path_buf(),
        reason,
    })
}

/// Module name -> path relative to `mod_root`, for every `.ko*` file. A module
/// under `updates/` overrides the stock one, as depmod's default search order does.
fn index_modules(mod_root: &Path) -> Result<BTreeMap<String, String>> {
    let mut index = BTreeMap::new();
    let mut stack = vec![mod_root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(|e| ImageError::io("list", &dir, e))? {
            let path = entry.map_err(|e| ImageError::io("list", &dir, e))?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let Ok(rel) = path.strip_prefix(mod_root) else {
                continue;
            };
            let rel = rel.to_string_lossy().into_owned();
            let file = rel.rsplit('/').next().unwrap_or(&rel);
            if !(file.ends_with(".ko") || file.contains(".ko.")) {
                continue;
            }
            let name = modules::module_name(&rel);
            let keep_existing = index
                .get(&name)
                .is_some_and(|e: &String| e.starts_with("updates/"));
            if !keep_existing {
                index.insert(name, rel);
            }
        }
    }
    Ok(index)
}

/// A module's bytes, decompressed if the package ships compressed modules
/// (this one ships plain `.ko`; newer Debian kernels use `.ko.xz`).
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        Some(XZ)
    } else if name.ends_with(".ko.zst") {
        Some(ZSTD)
    } else {
        None
    };
    match tool {
        None => fs::read(path).map_err(|e| ImageError::io("read", path, e)),
        Some(t) => {
            let mut cmd = t.command()?;
            cmd.arg("-dc").arg(path);
            t.output(cmd)
        }
    }
}

/// Every kernel built under `home`, for listing.
pub(crate) fn list(home: &Home) -> Vec<(String, Asset)> {
    let Ok(entries) = fs::read_dir(home.kernel_dir()) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Asset)> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|r| valid_release(r))
        .filter_map(|r| load_release(home, &r))
        .map(|k| (format!("kernel/{}", k.release), k.vmlinuz))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_names() {
        assert_eq!(
            release_of_package("linux-image-6.1.0-57-cloud-amd64").as_deref(),
            Some("6.1.0-57-cloud-amd64")
        );
        assert_eq!(
            release_of_package("linux-image-6.12.9+bpo-cloud-amd64-unsigned").as_deref(),
            Some("6.12.9+bpo-cloud-amd64")
        );
        assert_eq!(release_of_package("linux-image-cloud-amd64"), None);
        assert_eq!(
            release_of_package("linux-image-6.1.0-57-cloud-amd64-dbg"),
            None
        );
        assert_eq!(release_of_package("linux-image-../../etc"), None);
        assert_eq!(
            release_of_package("linux-headers-6.1.0-57-cloud-amd64"),
            None
        );
    }

    #[test]
    fn metapackage_depends() {
        let text = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(
            parse_depends(text).as_deref(),
            Some("linux-image-6.1.0-57-cloud-amd64")
        );
        assert_eq!(
            parse_depends("linux-image-cloud-amd64\n  Depends: <linux-image-x>\n"),
            None
        );
        assert_eq!(parse_depends(""), None);
    }

    #[test]
    fn compression_suffixes() {
        assert_eq!(strip_compression("kernel/a.ko.xz"), "kernel/a.ko");
        assert_eq!(strip_compression("kernel/a.ko"), "kernel/a.ko");
    }

    #[test]
    fn current_needs_matching_layout() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::new(dir.path());
        fsutil::create_dir_all(&home.kernel_dir()).unwrap();
        asset::store_manifest(
            &current_path(&home),
            &Current {
                release: "6.1.0-1-cloud-amd64".into(),
                layout: "old".into(),
            },
        )
        .unwrap();
        assert!(load_current(&home).is_none());
    }
}
