//! Shared set-up for the tests that boot real guests under QEMU.
//!
//! The guest assets come from `FORKD_HOME` (CI points it at its cache) and are built on
//! first use; the static guest agent must have been built beforehand (`./dev test` and
//! `.ci/run` do it).
#![allow(dead_code)]

use forkd_core::{Sandbox, SandboxOptions};
use forkd_image::{BuildOptions, GuestAssets, Home, RootfsImage};
use forkd_proto::exec::{Command, ExecRequest};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The hypervisor every test VM runs on.
pub fn hv() -> std::sync::Arc<dyn forkd_hypervisor::Hypervisor> {
    forkd_qemu::hypervisor()
}

/// Forks through [`hv`].
pub async fn fork(
    home: &Home,
    snap: &forkd_storage::snapshot::Snapshot,
    opts: &forkd_core::fork::ForkOptions,
) -> Result<Vec<Sandbox>, forkd_core::SandboxError> {
    forkd_core::fork::fork(hv().as_ref(), home, snap, opts).await
}

pub fn home() -> Home {
    Home::from_env()
}

pub async fn assets(image: RootfsImage) -> GuestAssets {
    tokio::task::spawn_blocking(move || {
        let agent = forkd_image::find_agent_binary().expect("the static guest agent is built");
        forkd_image::ensure_all(&home(), image, &agent, &BuildOptions::default())
            .unwrap_or_else(|e| panic!("building the {image} assets: {e}"))
    })
    .await
    .unwrap()
}

pub fn options() -> SandboxOptions {
    SandboxOptions {
        // Tests run several guests at once on two emulated cores: be patient.
        boot_timeout: Duration::from_secs(300),
        agent_timeout: Duration::from_secs(60),
        ..SandboxOptions::default()
    }
}

pub async fn boot(image: RootfsImage) -> Sandbox {
    boot_with(image, options()).await
}

pub async fn boot_with(image: RootfsImage, opts: SandboxOptions) -> Sandbox {
    let assets = assets(image).await;
    Sandbox::boot(hv().as_ref(), &home(), &assets, &opts)
        .await
        .unwrap_or_else(|e| panic!("booting a {image} sandbox: {e}"))
}

/// What a sandbox leaves on the host while it runs, to check after teardown.
pub struct Footprint {
    pub id: String,
    pub dir: PathBuf,
    pub pid: u32,
}

impl Footprint {
    pub fn of(sb: &Sandbox) -> Footprint {
        Footprint {
            id: sb.id().to_owned(),
            dir: sb.dir().to_owned(),
            pid: sb.pid().expect("QEMU runs"),
        }
    }

    /// Asserts that nothing of the sandbox is left: no QEMU process, no runtime directory
    /// (overlay, sockets, logs), no process naming the sandbox.
    pub fn assert_gone(&self) {
        // QEMU is reaped asynchronously after a kill: give it a moment.
        for _ in 0..100 {
            if !forkd_host::process::is_alive(self.pid) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !forkd_host::process::is_alive(self.pid),
            "QEMU (pid {}) of {} still runs",
            self.pid,
            self.id
        );
        assert!(!self.dir.exists(), "{} was left behind", self.dir.display());
        assert!(
            processes_naming(&self.id).is_empty(),
            "processes naming {} remain: {:?}",
            self.id,
            processes_naming(&self.id)
        );
    }
}

/// Pids of live processes whose command line mentions `needle`.
pub fn processes_naming(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmd).contains(needle) && forkd_host::process::is_alive(pid) {
            out.push(pid);
        }
    }
    out
}

pub fn sh(script: &str) -> ExecRequest {
    ExecRequest::new(Command::Shell(script.to_owned()))
}

pub fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest::new(Command::Argv(args.iter().map(|s| s.to_string()).collect()))
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// A snapshot store of its own for one test binary, on the same filesystem as the guest
/// assets (so that they are linked, not copied, into its snapshots). Removed on drop.
pub struct TestStore {
    pub store: forkd_storage::snapshot::Store,
    _dir: tempfile::TempDir,
}

impl TestStore {
    pub fn new() -> TestStore {
        let tmp = home().tmp_dir();
        std::fs::create_dir_all(&tmp).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("test-store-")
            .tempdir_in(&tmp)
            .unwrap();
        TestStore {
            store: forkd_storage::snapshot::Store::at(dir.path()),
            _dir: dir,
        }
    }
}

/// Builds `recipe` into `store` under `tag`.
pub async fn build_template(
    store: &forkd_storage::snapshot::Store,
    recipe: &forkd_core::template::Recipe,
    tag: &str,
) -> forkd_storage::snapshot::Snapshot {
    let assets = assets(recipe.rootfs_image().expect("a built-in image")).await;
    let tag = forkd_storage::snapshot::Tag::parse(tag).unwrap();
    let opts = forkd_core::template::BuildOptions {
        boot_timeout: Duration::from_secs(300),
        ..Default::default()
    };
    forkd_core::template::build(
        hv().as_ref(),
        &home(),
        store,
        recipe,
        &tag,
        &assets,
        &opts,
        &|m| eprintln!("[template {}] {m}", recipe.name),
    )
    .await
    .unwrap_or_else(|e| panic!("building template {}: {e}", recipe.name))
}

pub fn fork_options(count: usize) -> forkd_core::fork::ForkOptions {
    forkd_core::fork::ForkOptions {
        count,
        ready_timeout: Duration::from_secs(300),
        agent_timeout: Duration::from_secs(120),
        ..Default::default()
    }
}

/// sha256 of a file, hex.
pub fn sha256(path: &Path) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut f = std::fs::File::open(path).unwrap();
    std::io::copy(&mut f, &mut h).unwrap();
    hex::encode(h.finalize())
}

/// Runs `code` in the sandbox's first code context (a template's warm one); it must
/// raise nothing.
pub async fn run_code(sb: &Sandbox, code: &str) -> forkd_proto::context::Execution {
    let code = code.to_owned();
    let x = sb
        .call(|a| async move {
            let ctx = a.list_contexts().await?.remove(0).id;
            a.run_code(
                &ctx,
                &forkd_proto::context::RunCodeRequest {
                    code,
                    timeout_ms: None,
                    env: Default::default(),
                },
            )
            .await
        })
        .await
        .unwrap();
    assert!(x.error.is_none(), "{x:?}");
    x
}
