//! The initramfs: the agent as /init plus the virtio modules it loads before
//! mounting the root disk, as an uncompressed newc cpio (the kernel unpacks it
//! without needing a decompressor, and it shares pages better uncompressed).

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::agent;
use crate::asset::{self, Asset};
use crate::error::{ImageError, Result};
use crate::fsutil::{self, HashingWriter, ScratchDir};
use crate::home::Home;
use crate::inputs::Inputs;
use crate::kernel::KernelAsset;
use crate::lock::BuildLock;
use crate::modules::{self, Builtin, DepDb, Module, PlanError, GUEST_MODULES, ROOT_FS_MODULE};
use crate::newc::NewcWriter;
use crate::BuildOptions;

/// Bump when the archive's layout changes (entries, names, modes).
const INITRAMFS_LAYOUT: &str = "1";

/// The file the agent checks to know it is running from the initramfs (stage 1).
pub const INITRAMFS_MARKER: &str = "forkd-initramfs";

/// Key length (hex digits of the inputs digest) used in file names.
const KEY_LEN: usize = 16;

/// Builds (or reuses) the initramfs for `kernel` with `agent_binary` as /init.
pub fn ensure_initramfs(
    home: &Home,
    kernel: &KernelAsset,
    agent_binary: &Path,
    opts: &BuildOptions,
) -> Result<Asset> {
    let agent = fs::read(agent_binary).map_err(|e| ImageError::io("read", agent_binary, e))?;
    agent::check_agent_bytes(agent_binary, &agent)?;
    let load = module_load_order(kernel)?;
    let inputs = Inputs::new("initramfs")
        .field("layout", INITRAMFS_LAYOUT)
        .field("vmlinuz_sha256", &kernel.vmlinuz.sha256)
        .list(
            "modules",
            &load
                .iter()
                .map(|m| format!("{} {}", m.name, m.path))
                .collect::<Vec<_>>(),
        )
        .field("agent_sha256", hex::encode(Sha256::digest(&agent)))
        .digest();
    let key = &inputs[..KEY_LEN];
    let file = home.initramfs_dir().join(format!("{key}.cpio"));
    let manifest = home.initramfs_dir().join(format!("{key}.json"));
    let current = || asset::load_asset(&manifest, &file).filter(|a| a.is_current(&inputs));
    let _lock = match BuildLock::reuse_or_acquire(home, opts, current)? {
        Ok(asset) => return Ok(asset),
        Err(lock) => lock,
    };

    let started = Instant::now();
    let step = opts.progress.step(format!(
        "initramfs {key}: agent + {} modules for {}",
        load.len(),
        kernel.release
    ));
    fsutil::create_dir_all(&home.initramfs_dir())?;
    let scratch = ScratchDir::new(&home.tmp_dir(), "initramfs-")?;
    let tmp = scratch.path().join("initramfs.cpio");
    let (sha256, size) = write_archive(&tmp, &agent, kernel, &load)?;
    asset::retract_manifest(&manifest)?;
    fsutil::publish(&tmp, &file)?;
    let a = Asset::record(file, sha256, size, started, inputs.clone());
    asset::store_manifest(&manifest, &a)?;
    step.finish();
    Ok(a)
}

/// The modules the agent loads, in order, resolved from the kernel asset's
/// modules.dep; built-in ones are left out.
fn module_load_order(kernel: &KernelAsset) -> Result<Vec<Module>> {
    let dir = &kernel.modules_dir;
    let dep_path = dir.join("modules.dep");
    let text = fs::read_to_string(&dep_path).map_err(|e| ImageError::ModuleData {
        path: dep_path.clone(),
        reason: e.to_string(),
    })?;
    let db = DepDb::parse(&text).map_err(|reason| ImageError::ModuleData {
        path: dep_path.clone(),
        reason,
    })?;
    let mut builtin =
        Builtin::parse(&fs::read_to_string(dir.join("modules.builtin")).unwrap_or_default());
    if let Some(kdir) = dir.parent() {
        builtin.add_from_config(&fs::read_to_string(kdir.join("config")).unwrap_or_default());
    }
    let mut requested = GUEST_MODULES.to_vec();
    requested.push(ROOT_FS_MODULE);
    let plan = modules::plan(&db, &builtin, &requested).map_err(|e| match e {
        PlanError::Missing(module) => ImageError::ModuleMissing {
            release: kernel.release.clone(),
            module,
        },
        PlanError::Broken(reason) => ImageError::ModuleData {
            path: dep_path.clone(),
            reason,
        },
    })?;
    Ok(plan.load)
}

/// `modules/NN-<name>.ko`: the index makes the load order visible to the agent
/// (it loads them sorted by name) without it needing modules.dep.
fn module_entry_name(index: usize, count: usize, name: &str) -> String {
    let width = count.saturating_sub(1).to_string().len().max(2);
    format!("modules/{index:0width$}-{name}.ko")
}

fn write_archive(
    tmp: &Path,
    agent: &[u8],
    kernel: &KernelAsset,
    load: &[Module],
) -> Result<(String, u64)> {
    let io_err = |e| ImageError::io("write", tmp, e);
    let f = File::create(tmp).map_err(io_err)?;
    let mut w = NewcWriter::new(HashingWriter::new(BufWriter::new(f)));
    for d in ["dev", "proc", "sys", "newroot", "modules"] {
        w.dir(d, 0o755).map_err(io_err)?;
    }
    // The kernel opens /dev/console for PID 1's stdio before /init runs; without
    // the node the agent starts with no stdin/stdout/stderr.
    w.char_device("dev/console", 0o600, 5, 1).map_err(io_err)?;
    w.file("init", 0o755, agent).map_err(io_err)?;
    w.file(INITRAMFS_MARKER, 0o644, b"").map_err(io_err)?;
    for (i, m) in load.iter().enumerate() {
        let src: PathBuf = kernel.modules_dir.join(&m.path);
        let mut f = File::open(&src).map_err(|e| ImageError::io("open", &src, e))?;
        let size = f
            .metadata()
            .map_err(|e| ImageError::io("stat", &src, e))?
            .len();
        w.file_from(
            &module_entry_name(i, load.len(), &m.name),
            0o644,
            size,
            &mut f,
        )
        .map_err(io_err)?;
    }
    let hashing = w.finish().map_err(io_err)?;
    let (buf, sha256, size) = hashing.finish();
    let mut f = buf.into_inner().map_err(|e| io_err(e.into_error()))?;
    f.flush().map_err(io_err)?;
    Ok((sha256, size))
}

/// Every initramfs built under `home`, for listing.
pub(crate) fn list(home: &Home) -> Vec<(String, Asset)> {
    asset::list_manifests(&home.initramfs_dir(), "initramfs", "cpio")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_sort_in_load_order() {
        assert_eq!(
            module_entry_name(0, 9, "virtio_ring"),
            "modules/00-virtio_ring.ko"
        );
        assert_eq!(
            module_entry_name(8, 9, "virtio_rng"),
            "modules/08-virtio_rng.ko"
        );
        assert_eq!(module_entry_name(7, 120, "x"), "modules/007-x.ko");
    }
}
