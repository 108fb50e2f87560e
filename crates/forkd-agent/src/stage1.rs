//! Stage 1: the agent as `/init` of the initramfs. It loads the virtio modules, mounts
//! the root disk, copies itself onto it and switches root into PID 1 mode.
//!
//! Everything here is synchronous and prints to the console (fd 2): there is nothing
//! else to see a failure by. A fatal error stops the machine (see [`pid1::die`]).

use crate::error::InitError;
use crate::{cmdline, pid1};
use nix::mount::{mount, MsFlags};
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The file the image builder puts into the initramfs to mark it as such.
pub const MARKER: &str = "/forkd-initramfs";

/// Where the modules to load are, loaded in lexical order of their names.
const MODULES_DIR: &str = "/modules";

/// Where the root disk is mounted before the switch.
const NEWROOT: &str = "/newroot";

/// The agent's path inside the new root (on the tmpfs at /run).
pub const AGENT_PATH: &str = "/run/forkd/forkd-agent";

/// How long to wait for the root device node.
const ROOT_TIMEOUT: Duration = Duration::from_secs(10);

/// True when this process is `/init` of a forkd initramfs.
pub fn is_stage1() -> bool {
    nix::unistd::getpid().as_raw() == 1 && Path::new(MARKER).exists()
}

/// Runs stage 1; returns only by failing (on success it has exec'd PID 1 mode).
pub fn run() -> ! {
    match switch() {
        Ok(never) => match never {},
        Err(e) => pid1::die(&e.to_string()),
    }
}

fn sys(action: impl Into<String>) -> impl FnOnce(nix::Error) -> InitError {
    let action = action.into();
    move |source| InitError::Sys { action, source }
}

fn io(action: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> InitError {
    let path = path.into();
    move |source| InitError::Io {
        action,
        path,
        source,
    }
}

fn mount_fs(
    device: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), InitError> {
    std::fs::create_dir_all(target).map_err(io("creating", target))?;
    match mount(Some(device), target, Some(fstype), flags, data) {
        // Already mounted (a kernel with CONFIG_DEVTMPFS_MOUNT, a re-run): fine.
        Ok(()) | Err(nix::Error::EBUSY) => Ok(()),
        Err(source) => Err(InitError::Mount {
            what: fstype.to_string(),
            target: target.into(),
            source,
        }),
    }
}

fn switch() -> Result<std::convert::Infallible, InitError> {
    pid1::log("stage 1: starting");
    let common = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs("proc", "/proc", "proc", common, None)?;
    mount_fs("sysfs", "/sys", "sysfs", common, None)?;
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    pid1::ensure_stdio();

    load_modules();

    let cmdline = cmdline::read();
    let root = cmdline::get(&cmdline, "forkd.root").unwrap_or("/dev/vda");
    let fstype = cmdline::get(&cmdline, "forkd.rootfstype").unwrap_or("ext4");
    let ro = cmdline::flag(&cmdline, "forkd.ro");
    wait_for(root)?;

    let flags = if ro {
        MsFlags::MS_RDONLY
    } else {
        MsFlags::empty()
    };
    std::fs::create_dir_all(NEWROOT).map_err(io("creating", NEWROOT))?;
    // ext4 would zero its uninitialised inode tables and read its block bitmaps ahead
    // in a kernel thread for a while after the mount: a parent frozen meanwhile leaves
    // every child to go on with it, writing zeros into its own disk layer while its
    // first requests wait (under TCG that work showed on the critical path of every
    // fresh restore).
    let data = (fstype == "ext4").then_some("noinit_itable,no_prefetch_block_bitmaps");
    mount(Some(root), NEWROOT, Some(fstype), flags, data).map_err(|source| InitError::Mount {
        what: format!("{root} ({fstype}{})", if ro { ", read-only" } else { "" }),
        target: NEWROOT.into(),
        source,
    })?;
    pid1::log(&format!(
        "stage 1: mounted {root} ({fstype}{}) on {NEWROOT}",
        if ro { ", read-only" } else { "" }
    ));

    for dir in ["run", "dev", "proc", "sys"] {
        let path = Path::new(NEWROOT).join(dir);
        if !path.is_dir() {
            std::fs::create_dir_all(&path).map_err(|source| InitError::Io {
                action: "creating (the root filesystem needs it)",
                path: path.clone(),
                source,
            })?;
        }
    }
    let run = format!("{NEWROOT}/run");
    mount(
        Some("tmpfs"),
        run.as_str(),
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )
    .map_err(|source| InitError::Mount {
        what: "tmpfs".into(),
        target: run.clone().into(),
        source,
    })?;

    // The agent lives on a tmpfs so that it runs whatever the root filesystem holds
    // (or lacks), and so that the root can be remounted read-only at shutdown.
    let agent = format!("{NEWROOT}{AGENT_PATH}");
    let agent_dir = format!("{NEWROOT}/run/forkd");
    std::fs::create_dir_all(&agent_dir).map_err(io("creating", agent_dir.as_str()))?;
    let me = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/init"));
    std::fs::copy(&me, &agent).map_err(io("copying the agent to", agent.as_str()))?;
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755))
        .map_err(io("setting the mode of", agent.as_str()))?;

    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("{NEWROOT}{dir}");
        mount(
            Some(dir),
            target.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(|source| InitError::Mount {
            what: format!("{dir} (moving it)"),
            target: target.clone().into(),
            source,
        })?;
    }

    free_initramfs();

    std::env::set_current_dir(NEWROOT).map_err(io("entering", NEWROOT))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(sys("moving the new root onto /"))?;
    nix::unistd::chroot(".").map_err(sys("chroot into the new root"))?;
    std::env::set_current_dir("/").map_err(io("entering", "/"))?;

    pid1::log("stage 1: switching to the root filesystem");
    let path = CString::new(AGENT_PATH).map_err(|_| InitError::Sys {
        action: "building the agent's path".into(),
        source: nix::Error::EINVAL,
    })?;
    let argv = [c"forkd-agent".to_owned(), c"pid1".to_owned()];
    nix::unistd::execv(&path, &argv).map_err(sys(format!("executing {AGENT_PATH}")))
}

/// Loads every module in [`MODULES_DIR`] in lexical order. A module that fails is
/// reported and skipped: what it was needed for fails later with a clearer message.
fn load_modules() {
    let mut paths: Vec<PathBuf> = match std::fs::read_dir(MODULES_DIR) {
        Ok(rd) => rd.flatten().map(|e| e.path()).collect(),
        Err(e) => {
            pid1::log(&format!("stage 1: no modules loaded ({MODULES_DIR}: {e})"));
            return;
        }
    };
    paths.sort();
    for path in paths {
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                pid1::log(&format!("stage 1: opening {} failed: {e}", path.display()));
                continue;
            }
        };
        match nix::kmod::finit_module(&file, c"", nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::Error::EEXIST) => {}
            Err(e) => pid1::log(&format!("stage 1: loading {} failed: {e}", path.display())),
        }
    }
}

/// Waits for the root device node (devtmpfs creates it once the driver probed the disk).
fn wait_for(dev: &str) -> Result<(), InitError> {
    let deadline = Instant::now() + ROOT_TIMEOUT;
    while !Path::new(dev).exists() {
        if Instant::now() >= deadline {
            let present = std::fs::read_dir("/sys/class/block")
                .map(|rd| {
                    let mut v: Vec<String> = rd
                        .flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect();
                    v.sort();
                    v.join(", ")
                })
                .unwrap_or_default();
            let present = if present.is_empty() {
                "none".to_string()
            } else {
                present
            };
            return Err(InitError::NoRootDevice(dev.to_string(), present));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Deletes the initramfs's files (its memory is not freed otherwise), staying on the
/// initramfs: nothing on another filesystem is touched, and /newroot is skipped.
fn free_initramfs() {
    let Ok(root) = std::fs::symlink_metadata("/") else {
        return;
    };
    remove_tree(Path::new("/"), root.dev());
}

fn remove_tree(dir: &Path, dev: u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in rd.flatten() {
        let path = entry.path();
        if path == Path::new(NEWROOT) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.dev() != dev {
            continue;
        }
        if meta.is_dir() {
            remove_tree(&path, dev);
            let _ = std::fs::remove_dir(&path);
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
}
