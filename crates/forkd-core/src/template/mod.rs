//! Templates: a recipe (`templates/<name>.toml`) for a warm parent VM, and the build
//! that boots it, warms it and freezes it into a snapshot.
//!
//! The build, step by step: the parent boots with its RAM in a file of the staging
//! snapshot (`memory-backend-file`, `share=on`), so that once it is paused the file *is*
//! its memory image; its disk is a qcow2 layer in the same directory over a link to the
//! rootfs image. The warm-up commands run, the code contexts start and run their
//! preload, the guest syncs its disks, the agent session is closed (nothing may be in
//! flight at the freeze), the VM is paused and its device state saved with
//! `x-ignore-shared`. QEMU quits, and the directory is hashed, sealed and published.

use crate::agent::ExecOutput;
use crate::error::SandboxError;
use crate::output_tail::OutputTail;
use crate::sandbox::{kernel_cmdline, new_sandbox_dir, Launch, Sandbox, SandboxOptions};
use forkd_hypervisor::{
    accel, AccelChoice, DiskFormat, DiskLayer, Hypervisor, MemoryBackend, VmConfig,
};
use forkd_image::{GuestAssets, Home};
use forkd_proto::context::{CreateContextRequest, RunCodeRequest};
use forkd_proto::exec::{Command, ExecRequest};
use forkd_storage::snapshot::manifest::{parts, BuildTimes, Machine, Manifest, Versions, FORMAT};
use forkd_storage::snapshot::{Snapshot, Store, Tag};
use std::path::Path;
use std::time::{Duration, Instant};

mod recipe;
pub use recipe::{
    Base, ContextRecipe, FileRecipe, NetworkChoice, Recipe, RecipeFiles, WarmupStep, BUILTIN,
};

/// How to build.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// `auto`, `kvm` or `tcg`. The snapshot can only be restored with the same.
    pub accel: AccelChoice,
    /// QEMU's seccomp filter.
    pub seccomp: bool,
    /// How long the parent may take to boot.
    pub boot_timeout: Duration,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            accel: AccelChoice::Auto,
            seccomp: true,
            boot_timeout: Duration::from_secs(120),
        }
    }
}

/// Builds `recipe` into the snapshot `tag` of `store`, from `assets` (whose rootfs must
/// be the recipe's image), on `hv`. `progress` hears each step.
// Each argument is a different thing the build needs; bundling them would only rename them.
#[allow(clippy::too_many_arguments)]
pub async fn build(
    hv: &dyn Hypervisor,
    home: &Home,
    store: &Store,
    recipe: &Recipe,
    tag: &Tag,
    assets: &GuestAssets,
    opts: &BuildOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Snapshot, SandboxError> {
    let t0 = Instant::now();
    forkd_host::space::ensure_room(
        store.root(),
        build_needs(recipe, assets, store.root()),
        &format!("building snapshot {tag}"),
    )?;
    let staging = store.stage(tag)?;
    progress(&format!("linking the guest assets into snapshot {tag}"));
    link_or_copy(&assets.kernel.vmlinuz.path, &staging.part(parts::KERNEL))?;
    link_or_copy(&assets.initramfs.path, &staging.part(parts::INITRAMFS))?;
    link_or_copy(&assets.rootfs.path, &staging.part(parts::ROOTFS))?;
    hv.create_disk_layer(DiskLayer {
        path: &staging.part(parts::DISK),
        base: std::path::Path::new(parts::ROOTFS),
        base_format: DiskFormat::Raw,
        relative: true,
        named: None,
    })
    .await?;

    let accel = accel::resolve(opts.accel)?;
    let nic = recipe
        .network
        .nic()
        .map_err(|detail| SandboxError::Template {
            name: recipe.name.clone(),
            detail,
        })?;
    if let Some(egress) = &recipe.egress {
        let bad = |detail: String| SandboxError::Template {
            name: recipe.name.clone(),
            detail,
        };
        egress.check().map_err(|e| bad(format!("[egress]: {e}")))?;
        if !nic {
            return Err(bad(
                "[egress] is set, but its children have no NIC (network = \"none\", or a host without networking)".into(),
            ));
        }
    }
    if !nic && recipe.network == NetworkChoice::Auto {
        if let Some(why) = forkd_host::network::unavailable() {
            progress(&format!("its children will have no network: {why}"));
        }
    }
    progress(&format!(
        "booting the parent ({} vCPU, {} MiB, {accel}, {})",
        recipe.vcpus,
        recipe.memory_mib,
        if nic { "a NIC" } else { "no NIC" }
    ));
    let parent = boot_vm(
        hv,
        home,
        recipe,
        opts,
        BootDisk {
            kernel: staging.part(parts::KERNEL),
            initramfs: staging.part(parts::INITRAMFS),
            root_disk: staging.part(parts::DISK),
        },
        MemoryBackend::File {
            path: staging.part(parts::MEMORY),
            shared: true,
        },
        nic,
    )
    .await?;
    let config = parent.config().clone();
    let boot = t0.elapsed();
    let t_warm = Instant::now();
    let warmed = match seed_parent(&parent).await {
        Ok(protocol) => warm(&parent, recipe, progress)
            .await
            .map(|contexts| (protocol, contexts)),
        Err(e) => Err(e),
    };
    let (agent_protocol, contexts) = match warmed {
        Ok(c) => c,
        Err(e) => {
            let _ = parent.destroy().await;
            return Err(e);
        }
    };
    let warmup = t_warm.elapsed();
    progress("freezing the parent (pause, save the device state)");
    let t_freeze = Instant::now();
    let frozen = parent.freeze(&staging.part(parts::STATE)).await;
    let freeze = t_freeze.elapsed();
    parent.destroy().await?;
    frozen?;
    if forkd_host::space::fill_holes_on_tmpfs(&staging.part(parts::MEMORY))? {
        progress("allocated the memory image on its tmpfs (children's first touches then never need a page of it)");
    }
    let manifest = Manifest {
        format: FORMAT,
        tag: tag.to_string(),
        template: recipe.name.clone(),
        created_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
        parent: None,
        parent_digest: None,
        branch: None,
        machine: Machine {
            vcpus: recipe.vcpus,
            memory_mib: recipe.memory_mib,
            accel,
            cpu: config.cpu.clone(),
            cmdline: config.cmdline.clone(),
            clock: config.clock,
            pit: config.pit,
            nic: config.network.is_some(),
        },
        versions: Versions {
            kernel: assets.kernel.release.clone(),
            rootfs: recipe.base_name(),
            initramfs_sha256: assets.initramfs.sha256.clone(),
            forkd: env!("CARGO_PKG_VERSION").into(),
            // The guest's own: what its children's greetings may carry depends on it.
            agent_protocol,
            hypervisor: hv.name().to_owned(),
            hypervisor_version: hypervisor_version(hv),
        },
        parts: Default::default(),
        contexts,
        build: BuildTimes {
            boot_ms: ms(boot),
            warmup_ms: ms(warmup),
            freeze_ms: ms(freeze),
            // Filled in by `publish`, which times its hashing before it writes the
            // manifest.
            publish_ms: 0,
            total_ms: ms(t0.elapsed()),
        },
        pool: recipe.pool,
        egress: recipe.egress.clone(),
        lifecycle: forkd_storage::snapshot::manifest::ChildLifecycle {
            on_timeout: recipe.on_timeout.unwrap_or_default(),
            auto_pause_after_s: recipe.auto_pause_after,
        },
    };
    progress("hashing and publishing the snapshot");
    // Hashing reads hundreds of MiB: off the async threads.
    let snap = tokio::task::spawn_blocking(move || staging.publish(manifest, &|_| {}))
        .await
        .map_err(|e| SandboxError::Io {
            context: "publishing the snapshot".into(),
            source: std::io::Error::other(e.to_string()),
        })??;
    progress(&format!(
        "snapshot {tag} written in {:.1} s (boot {:.1} s, warm-up {:.1} s, freeze {} ms)",
        t0.elapsed().as_secs_f64(),
        boot.as_secs_f64(),
        warmup.as_secs_f64(),
        ms(freeze)
    ));
    Ok(snap)
}

/// What a recipe's VM boots from.
pub(crate) struct BootDisk {
    /// The kernel.
    pub(crate) kernel: std::path::PathBuf,
    /// The initramfs.
    pub(crate) initramfs: std::path::PathBuf,
    /// Its disk layer (qcow2, over the root filesystem).
    pub(crate) root_disk: std::path::PathBuf,
}

/// Boots a VM of `recipe`'s shape (vCPUs, RAM, CPU model) from `disk` with its RAM in
/// `memory`: a template's parent, or the build VM that customises its base.
pub(crate) async fn boot_vm(
    hv: &dyn Hypervisor,
    home: &Home,
    recipe: &Recipe,
    opts: &BuildOptions,
    disk: BootDisk,
    memory: MemoryBackend,
    nic: bool,
) -> Result<Sandbox, SandboxError> {
    let accel = accel::resolve(opts.accel)?;
    let (id, dir, guard) = new_sandbox_dir(home)?;
    let mut cmdline = kernel_cmdline(&id);
    if nic {
        cmdline.push(' ');
        cmdline.push_str(&forkd_host::network::guest_cmdline());
    }
    // The parent's network lets nothing out: what it is built from comes in as files.
    let network = nic.then(forkd_host::network::NetworkConfig::default);
    let clock = crate::sandbox::clock_for(accel);
    let config = VmConfig {
        cmdline,
        network,
        id,
        dir,
        kernel: disk.kernel,
        initramfs: disk.initramfs,
        root_disk: disk.root_disk,
        vcpus: recipe.vcpus,
        memory_mib: recipe.memory_mib,
        memory,
        accel,
        cpu: recipe.cpu_model(accel),
        clock,
        pit: clock.needs_pit(accel),
        limits: Some(forkd_host::cgroup::ResourceLimits::for_vm(
            recipe.vcpus,
            recipe.memory_mib,
        )),
        seccomp: opts.seccomp,
        detached: false,
    };
    let sopts = SandboxOptions {
        vcpus: recipe.vcpus,
        memory_mib: recipe.memory_mib,
        accel: opts.accel,
        boot_timeout: opts.boot_timeout,
        agent_timeout: Duration::from_secs(60),
        limits: Default::default(),
        seccomp: opts.seccomp,
        env: Default::default(),
    };
    Sandbox::launch(hv, config, Launch::Boot, &sopts, guard).await
}

/// Gives the parent's kernel RNG entropy from the host, and its clock, before anything
/// warms up: the RNG is then initialised in the snapshot. Otherwise every child's resume
/// hook is the guest's first credit of entropy, and the kernel switches its
/// `crng_is_ready` static key there: code patching that, under TCG, throws away
/// translated code on every fresh restore. (Each child still gets entropy of its own.)
/// Returns the protocol the parent's agent speaks.
async fn seed_parent(parent: &Sandbox) -> Result<u32, SandboxError> {
    let no_env = std::collections::BTreeMap::new();
    let req = crate::sandbox::resume_request(crate::sandbox::FirstCall::NewChild {
        id: parent.id(),
        env: &no_env,
        settle: false,
    })
    .expect("a new child's first call is the resume hook");
    parent
        .call(|agent| async move { agent.resume(&req).await })
        .await?;
    let ping = parent
        .call(|agent| async move { agent.ping().await })
        .await?;
    Ok(ping.protocol)
}

/// Runs the warm-up commands and starts the contexts; returns the contexts.
async fn warm(
    parent: &Sandbox,
    recipe: &Recipe,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<forkd_proto::context::ContextInfo>, SandboxError> {
    let fail = |detail: String| SandboxError::Template {
        name: recipe.name.clone(),
        detail,
    };
    for step in &recipe.warmup {
        progress(&format!("warm-up: {}", step.run));
        let mut req = ExecRequest::new(Command::Shell(step.run.clone()));
        req.timeout_ms = Some(step.timeout_s.unwrap_or(600) * 1000);
        let out = run_step(parent, req).await?;
        if out.dropped > 0 {
            progress(&format!(
                "warm-up: {} printed {} bytes more than the {} kept for errors",
                step.run, out.dropped, out.cap
            ));
        }
        if !out.status.success() {
            return Err(fail(
                out.failure(&format!("warm-up command {:?}", step.run)),
            ));
        }
    }
    let mut contexts = Vec::new();
    for c in &recipe.contexts {
        progress(&format!("starting a {:?} context", c.language).to_lowercase());
        let info = parent
            .call(|a| async move {
                a.create_context(&CreateContextRequest {
                    language: c.language,
                    cwd: c.cwd.clone(),
                    env: Default::default(),
                })
                .await
            })
            .await?;
        if !c.preload.trim().is_empty() {
            progress(&format!(
                "preloading {}: {}",
                info.id,
                first_line(&c.preload)
            ));
            let id = info.id.clone();
            let code = c.preload.clone();
            let x = parent
                .call(|a| async move {
                    a.run_code(
                        &id,
                        &RunCodeRequest {
                            code,
                            timeout_ms: None,
                            env: Default::default(),
                        },
                    )
                    .await
                })
                .await?;
            if let Some(e) = x.error {
                return Err(fail(format!(
                    "the preload of context {} failed: {}: {}\n{}",
                    info.id, e.name, e.value, e.traceback
                )));
            }
        }
        contexts.push(info);
    }
    // The disk layer must hold what the frozen page cache already believes is on disk.
    // A `sync` process where the image has one: measured here, children of a parent
    // frozen right after the agent's own sync(2) each dirtied about 3 MiB more after the
    // restore (6.3 against 3.1 MiB of private guest RAM). An image without `sync` (a
    // busybox one) gets the agent's.
    let flushed = parent
        .exec(ExecRequest::new(Command::Argv(vec!["sync".into()])), None)
        .await;
    match flushed {
        Ok(_) => {}
        Err(SandboxError::Agent(e)) if e.code() == Some(forkd_proto::ErrorCode::SpawnFailed) => {
            parent.call(|a| async move { a.sync().await }).await?;
        }
        Err(e) => return Err(e),
    }
    Ok(contexts)
}

/// What a warm-up step left: its exit and the end of its output.
pub(crate) struct StepOutput {
    pub(crate) status: forkd_proto::exec::ExitStatus,
    pub(crate) stdout: OutputTail,
    pub(crate) stderr: OutputTail,
    /// Bytes of output not kept, both streams together.
    pub(crate) dropped: u64,
    /// Bytes kept per stream.
    pub(crate) cap: u64,
}

impl StepOutput {
    /// `what` failed: how it exited and the end of what it printed.
    pub(crate) fn failure(&self, what: &str) -> String {
        format!(
            "{what} failed (exit {}{}): {}{}",
            self.status.shell_code(),
            if self.status.timed_out {
                ", timed out"
            } else {
                ""
            },
            self.stdout.render(),
            self.stderr.render()
        )
    }
}

/// Runs one warm-up step, keeping only the end of its output (`FORKD_WARMUP_OUTPUT_CAP`
/// bytes of each stream): a step that prints gigabytes costs no memory.
pub(crate) async fn run_step(
    parent: &Sandbox,
    req: ExecRequest,
) -> Result<StepOutput, SandboxError> {
    let cap = forkd_proto::limits::get().warmup_output;
    let keep = usize::try_from(cap).unwrap_or(usize::MAX);
    let (mut stdout, mut stderr) = (OutputTail::new(keep), OutputTail::new(keep));
    let mut stream = parent.exec_stream(req, None).await?;
    while let Some(out) = stream.next().await? {
        match out {
            ExecOutput::Stdout(b) => stdout.push(&b),
            ExecOutput::Stderr(b) => stderr.push(&b),
            ExecOutput::Started(_) => {}
            ExecOutput::Exited(status) => {
                return Ok(StepOutput {
                    status,
                    dropped: stdout.dropped() + stderr.dropped(),
                    stdout,
                    stderr,
                    cap,
                })
            }
        }
    }
    Err(SandboxError::Agent(crate::agent::AgentError::Malformed(
        "warm-up output ended without an exit status".into(),
    )))
}

/// A hard link (same filesystem: free, and the image builder replaces files by rename,
/// so a linked image never changes under the snapshot), else a copy.
fn link_or_copy(from: &Path, to: &Path) -> Result<(), SandboxError> {
    if std::fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    std::fs::copy(from, to)
        .map(drop)
        .map_err(|source| SandboxError::Io {
            context: format!("copying {} to {}", from.display(), to.display()),
            source,
        })
}

/// What a build writes into the store: the parent's RAM file (as much as its memory),
/// copies of the guest assets where they cannot be hard-linked (another filesystem),
/// and room for the disk layer, the device state and the manifest.
fn build_needs(recipe: &Recipe, assets: &GuestAssets, store: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let store_dev = store
        .ancestors()
        .find_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.dev());
    let copies: u64 = [
        &assets.kernel.vmlinuz.path,
        &assets.initramfs.path,
        &assets.rootfs.path,
    ]
    .iter()
    .filter_map(|p| std::fs::metadata(p).ok())
    .filter(|m| Some(m.dev()) != store_dev)
    .map(|m| m.len())
    .sum();
    (u64::from(recipe.memory_mib) << 20) + copies + (64 << 20)
}

/// The hypervisor's version, `unknown (why)` when it cannot be read.
pub fn hypervisor_version(hv: &dyn Hypervisor) -> String {
    hv.version().unwrap_or_else(|e| format!("unknown ({e})"))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn first_line(s: &str) -> String {
    let lines: Vec<&str> = s.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    match lines.len() {
        0 => String::new(),
        1 => lines[0].to_owned(),
        n => format!("{} (+{} lines)", lines[0], n - 1),
    }
}
