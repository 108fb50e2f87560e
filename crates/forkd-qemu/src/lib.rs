//! The QEMU backend: one `qemu-system-x86_64` process per VM, driven over QMP.

mod branch;
pub mod cmdline;
pub mod console;
pub mod jail;
mod launch;
pub mod qcow2;
pub mod qmp;
mod ram;
pub mod version;
mod vm;

pub use vm::{PreparedQemu, QemuVm};

use async_trait::async_trait;
use forkd_hypervisor::{HypervisorError, Vm, VmConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vm::Start;

/// How long QEMU may take to bring up its QMP socket.
const QMP_TIMEOUT: Duration = Duration::from_secs(20);

/// Longest unix socket path the kernel accepts (`sun_path` minus the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The QEMU backend as the hypervisor the rest of forkd holds, as an
/// `Arc<dyn Hypervisor>` that never names a backend: `$FORKD_QEMU`, else
/// `qemu-system-x86_64` from `PATH`, under KVM or TCG as each [`VmConfig`] says.
pub fn hypervisor() -> std::sync::Arc<dyn forkd_hypervisor::Hypervisor> {
    std::sync::Arc::new(Qemu::from_env())
}

/// The QEMU backend.
#[derive(Debug, Clone)]
pub struct Qemu {
    binary: PathBuf,
}

impl Qemu {
    /// Uses `$FORKD_QEMU`, else `qemu-system-x86_64` from `PATH`.
    pub fn from_env() -> Qemu {
        let binary = std::env::var_os("FORKD_QEMU")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"));
        Qemu { binary }
    }

    /// The QEMU program this backend starts.
    pub fn binary(&self) -> &Path {
        &self.binary
    }
}

#[async_trait]
impl forkd_hypervisor::Hypervisor for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn version(&self) -> Result<String, HypervisorError> {
        version::current_version(&self.binary)
            .map(|v| v.to_string())
            .map_err(HypervisorError::Config)
    }

    async fn create_disk_layer(
        &self,
        layer: forkd_hypervisor::DiskLayer<'_>,
    ) -> Result<(), HypervisorError> {
        let format = match layer.base_format {
            forkd_hypervisor::DiskFormat::Raw => qcow2::BaseFormat::Raw,
            forkd_hypervisor::DiskFormat::Layer => qcow2::BaseFormat::Qcow2,
        };
        let (base, name) = if let Some(named) = layer.named {
            let name = named.to_str().map(str::to_owned).ok_or_else(|| {
                HypervisorError::Config(format!("{} is not UTF-8", named.display()))
            })?;
            (layer.base.to_owned(), name)
        } else if layer.relative {
            // Named relative to the layer's directory, so that the two move together.
            let name = layer
                .base
                .to_str()
                .filter(|n| !n.contains('/'))
                .ok_or_else(|| {
                    HypervisorError::Config(format!(
                        "relative backing file {} must be a plain UTF-8 file name",
                        layer.base.display()
                    ))
                })?;
            let dir = layer.path.parent().unwrap_or(Path::new("."));
            (dir.join(name), name.to_owned())
        } else {
            let abs = std::path::absolute(layer.base).map_err(|e| {
                HypervisorError::io(format!("resolving {}", layer.base.display()), e)
            })?;
            let name = abs.to_str().map(str::to_owned).ok_or_else(|| {
                HypervisorError::Config(format!("{} is not UTF-8", abs.display()))
            })?;
            (abs, name)
        };
        let (path, base2) = (layer.path.to_owned(), base.clone());
        // A few small writes and an fsync: off the async threads.
        tokio::task::spawn_blocking(move || qcow2::create_overlay(&path, &base2, &name, format))
            .await
            .map_err(|e| HypervisorError::io("creating a disk layer", std::io::Error::other(e)))?
            .map_err(|e| {
                HypervisorError::io(
                    format!(
                        "creating the disk layer {} over {}",
                        layer.path.display(),
                        base.display()
                    ),
                    e,
                )
            })
    }

    fn layer_base(&self, layer: &Path) -> Result<Option<PathBuf>, HypervisorError> {
        let name = qcow2::backing_name(layer)
            .map_err(|e| HypervisorError::io(format!("reading {}", layer.display()), e))?;
        Ok(name.map(|n| layer.parent().unwrap_or(Path::new("/")).join(n)))
    }

    fn layer_base_name(&self, layer: &Path) -> std::io::Result<Option<String>> {
        qcow2::backing_name(layer)
    }

    fn set_layer_base_name(&self, layer: &Path, name: &str) -> std::io::Result<()> {
        qcow2::set_backing_name(layer, name)
    }

    fn check_foreign_layer(&self, layer: &Path) -> std::io::Result<()> {
        qcow2::check_foreign(layer)
    }

    async fn layer_to_raw(&self, top: &Path, out: &Path) -> Result<(), HypervisorError> {
        qcow2::to_raw(top, out).await
    }

    fn restore_refusal(&self, made: &str) -> Option<String> {
        version::release_refusal(made, &self.version().ok()?)
    }

    fn disk_size(&self, layer: &Path) -> Option<u64> {
        qcow2::virtual_size(layer, qcow2::BaseFormat::Qcow2).ok()
    }

    async fn flatten_disk(
        &self,
        top: &Path,
        base: &Path,
        out: &Path,
    ) -> Result<(), HypervisorError> {
        qcow2::flatten(top, base, out).await
    }

    async fn boot(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError> {
        Ok(Box::new(
            QemuVm::start(&self.binary, config, Start::Boot).await?,
        ))
    }

    async fn prepare_restore(
        &self,
        config: &VmConfig,
        state: &Path,
    ) -> Result<Box<dyn forkd_hypervisor::PreparedVm>, HypervisorError> {
        let file = std::fs::File::open(state)
            .map_err(|e| HypervisorError::io(format!("opening {}", state.display()), e))?;
        let vm = QemuVm::start(&self.binary, config, Start::Restore(file)).await?;
        // Set now, so that finishing is only the migration and `cont`.
        if let Err(e) = vm.set_ignore_shared().await {
            vm.kill();
            vm.wait_exit().await;
            return Err(vm.explain_exit(e));
        }
        vm.steps.end("migration set-up");
        Ok(Box::new(PreparedQemu(vm)))
    }

    async fn adopt(
        &self,
        config: &VmConfig,
        pid: u32,
        start_time: u64,
    ) -> Result<Box<dyn Vm>, HypervisorError> {
        Ok(Box::new(
            QemuVm::adopt(&self.binary, config, pid, start_time).await?,
        ))
    }
}
