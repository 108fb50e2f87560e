//! `forkd doctor`: can this host run forkd, and if not, what to do.

use anyhow::Result;
use forkd_hypervisor::accel::probe_kvm;
use forkd_image::Home;
use forkd_qemu::{version, Qemu};
use serde::Serialize;
use std::path::Path;
use std::process::Command;

/// Arguments of `forkd doctor`.
#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, Serialize)]
struct Check {
    name: &'static str,
    level: Level,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    fix: Option<String>,
}

fn ok(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Ok,
        detail: detail.into(),
        fix: None,
    }
}

fn bad(
    name: &'static str,
    level: Level,
    detail: impl Into<String>,
    fix: impl Into<String>,
) -> Check {
    Check {
        name,
        level,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}

/// Runs every check; exits 1 when one fails.
pub fn run(home: &Home, args: DoctorArgs) -> Result<i32> {
    let checks = vec![
        check_qemu(),
        check_tool("qemu-img", &["--version"], "apt-get install qemu-utils"),
        check_accel(),
        check_tool("debootstrap", &["--version"], "apt-get install debootstrap"),
        check_mkfs(),
        check_tool("dpkg-deb", &["--version"], "dpkg-deb comes with dpkg: forkd needs a Debian-based host"),
        check_tool("apt-get", &["--version"], "forkd fetches the guest kernel with apt-get download: use a Debian-based host or pass --kernel-deb"),
        check_cgroups(),
        check_network(),
        check_closed_networks(home),
        check_data_directory(home),
        check_isolation(),
        check_disk(home),
        check_agent(),
        check_assets(home),
    ];
    let failed = checks.iter().any(|c| c.level == Level::Fail);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checks)?);
    } else {
        for c in &checks {
            let tag = match c.level {
                Level::Ok => " ok ",
                Level::Warn => "warn",
                Level::Fail => "FAIL",
            };
            println!("[{tag}] {:<12} {}", c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("       {:<12} fix: {fix}", "");
            }
        }
        println!();
        println!(
            "{}",
            if failed {
                "Some checks failed: forkd will not work until they are fixed."
            } else {
                "This host can run forkd."
            }
        );
    }
    Ok(if failed { 1 } else { 0 })
}

fn check_qemu() -> Check {
    let qemu = Qemu::from_env();
    let bin = qemu.binary();
    let v = match version::current_version(bin) {
        Ok(v) => v,
        Err(e) => {
            return bad(
                "qemu",
                Level::Fail,
                e,
                "apt-get install qemu-system-x86 (or set FORKD_QEMU to a qemu-system-x86_64)",
            )
        }
    };
    if v < version::QemuVersion(7, 2, 0) {
        return bad(
            "qemu",
            Level::Fail,
            format!("QEMU {v} is older than 7.2"),
            "install QEMU 7.2 or newer (Debian bookworm's qemu-system-x86)",
        );
    }
    match version::machine_types(bin) {
        // Under TCG, QEMU before 9.0 loses guest writes during a live migration.
        Ok(types)
            if types.iter().any(|t| t == "microvm")
                && v < version::QemuVersion(9, 0, 0)
                && !probe_kvm().usable =>
        {
            bad(
                "qemu",
                Level::Warn,
                format!(
                    "QEMU {v} ({}): under TCG its live migration loses guest writes, so branches pause the sandbox for the whole copy",
                    bin.display()
                ),
                "install QEMU 9.0 or newer (Debian bookworm: qemu-system-x86 and qemu-utils from bookworm-backports; ./dev setup does it)",
            )
        }
        Ok(types) if types.iter().any(|t| t == "microvm") => ok(
            "qemu",
            format!(
                "QEMU {v} ({}), machine type microvm available",
                bin.display()
            ),
        ),
        Ok(_) => bad(
            "qemu",
            Level::Fail,
            format!("QEMU {v} has no microvm machine type"),
            "install a QEMU built with microvm (Debian's qemu-system-x86 has it)",
        ),
        Err(e) => bad("qemu", Level::Fail, e, "apt-get install qemu-system-x86"),
    }
}

fn check_accel() -> Check {
    let kvm = probe_kvm();
    if kvm.usable {
        ok(
            "accel",
            format!("KVM: {}; --accel auto uses KVM", kvm.reason),
        )
    } else {
        bad(
            "accel",
            Level::Warn,
            format!("KVM not used: {}; --accel auto uses TCG (software emulation, ~10-50x slower)", kvm.reason),
            "for hardware speed run forkd on a host (or VM with nested virtualisation) whose CPU exposes vmx/svm, and load kvm_intel/kvm_amd",
        )
    }
}

fn check_tool(name: &'static str, args: &[&str], fix: &str) -> Check {
    match Command::new(name).args(args).output() {
        Ok(out) if out.status.success() || !out.stdout.is_empty() => {
            let text = String::from_utf8_lossy(&out.stdout);
            ok(
                name,
                text.lines()
                    .next()
                    .unwrap_or("installed")
                    .trim()
                    .to_string(),
            )
        }
        Ok(out) => bad(
            name,
            Level::Fail,
            format!("{name} failed: {}", out.status),
            fix,
        ),
        Err(e) => bad(name, Level::Fail, format!("{name} not found: {e}"), fix),
    }
}

fn check_mkfs() -> Check {
    // `mkfs.ext4 -V` prints to stderr: "mke2fs 1.47.0 (5-Feb-2023)". `-d` needs >= 1.43.
    let out = match Command::new("mkfs.ext4").arg("-V").output() {
        Ok(o) => o,
        Err(e) => {
            return bad(
                "mkfs.ext4",
                Level::Fail,
                format!("mkfs.ext4 not found: {e}"),
                "apt-get install e2fsprogs",
            )
        }
    };
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    let ver = text
        .split_whitespace()
        .nth(1)
        .map(|v| {
            v.split('.')
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    if ver.len() >= 2 && (ver[0], ver[1]) >= (1, 43) {
        ok(
            "mkfs.ext4",
            text.lines().next().unwrap_or_default().trim().to_string(),
        )
    } else {
        bad(
            "mkfs.ext4",
            Level::Fail,
            format!(
                "mkfs.ext4 too old or unrecognised ({}) : -d needs e2fsprogs 1.43+",
                text.trim()
            ),
            "apt-get install e2fsprogs (1.43 or newer)",
        )
    }
}

fn check_network() -> Check {
    match forkd_host::network::unavailable() {
        None => ok(
            "network",
            "templates get a NIC (network = \"auto\"); each child is in a network namespace of its own behind NAT, with egress denied unless its policy allows it, and no route to other sandboxes or the host",
        ),
        Some(why) => bad(
            "network",
            Level::Warn,
            format!("templates built here get no NIC, so sandboxes have no network: {why}"),
            "run the daemon as root with nftables installed (./dev setup installs it)",
        ),
    }
}

/// What no sandbox reaches: the special-purpose ranges, the host's networks as they
/// are now, less what the daemon's last start opened (its audit log says).
fn check_closed_networks(home: &Home) -> Check {
    use forkd_host::network::closed;
    if let Err(e) = closed::refresh_host() {
        return bad(
            "closed nets",
            Level::Warn,
            format!("cannot read the host's routes: {e}"),
            "check that /proc/net/route is readable",
        );
    }
    let show = |v: &[String]| {
        if v.is_empty() {
            "none".to_owned()
        } else {
            v.join(", ")
        }
    };
    let host: Vec<String> = closed::current()
        .host()
        .iter()
        .map(|n| n.to_string())
        .collect();
    let log = forkd_daemon::DaemonConfig::new(home.clone()).audit_log();
    let opened = match forkd_daemon::audit::last_egress_open(&log) {
        Some(v) => format!(
            "opened by the daemon's last start (--egress-open): {}",
            show(&v)
        ),
        None => "no daemon has started on this data directory yet".to_owned(),
    };
    ok(
        "closed nets",
        format!(
            "sandboxes reach no special-purpose range (IANA's registry, {} blocks) and none of the host's networks ({}); {opened}",
            closed::SPECIAL_PURPOSE.len(),
            show(&host)
        ),
    )
}

fn check_cgroups() -> Check {
    use forkd_host::cgroup;
    use forkd_host::enforcement::Enforcement;
    let policy = match Enforcement::from_env(cgroup::ENV) {
        Ok(p) => p,
        Err(e) => return bad("cgroups", Level::Fail, e, "unset FORKD_CGROUPS or fix it"),
    };
    if policy == Enforcement::Off {
        return bad(
            "cgroups",
            Level::Warn,
            "FORKD_CGROUPS=off: sandboxes run without memory, CPU and pids limits",
            "unset FORKD_CGROUPS",
        );
    }
    match cgroup::host() {
        Ok(c) => ok(
            "cgroups",
            format!(
                "each sandbox's QEMU runs in a cgroup {} of its own (memory, cpu, pids) under {}",
                c.version().as_str(),
                c.parents()
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
        Err(why) => bad(
            "cgroups",
            if policy == Enforcement::Required {
                Level::Fail
            } else {
                Level::Warn
            },
            format!("sandboxes run without memory, CPU and pids limits: {why}"),
            "run forkd as root, or in a cgroup v2 subtree delegated to it (systemd: Delegate=yes)",
        ),
    }
}

/// Whether other users are kept out of the data directory (the daemon makes it 0700 at
/// start; a directory made by other means may be open).
fn check_data_directory(home: &Home) -> Check {
    use std::os::unix::fs::PermissionsExt;
    let root = home.root();
    match std::fs::metadata(root) {
        Err(_) => ok(
            "data dir",
            format!("{} does not exist yet; the daemon makes it 0700", root.display()),
        ),
        Ok(m) if m.permissions().mode() & 0o007 == 0 => ok(
            "data dir",
            format!(
                "{} is mode {:04o}: other users cannot read snapshots, disks or logs",
                root.display(),
                m.permissions().mode() & 0o7777
            ),
        ),
        Ok(m) => bad(
            "data dir",
            Level::Warn,
            format!(
                "{} is mode {:04o}: other users may read templates' memory, children's disks and logs",
                root.display(),
                m.permissions().mode() & 0o7777
            ),
            format!("start the daemon (it closes it), or chmod 700 {}", root.display()),
        ),
    }
}

/// What stands between a guest and the host, said plainly, with what is not there yet.
fn check_isolation() -> Check {
    use forkd_host::enforcement::Enforcement;
    use forkd_qemu::jail;
    let qemu = Qemu::from_env();
    let jail = match (
        Enforcement::from_env(jail::ENV),
        version::current_version(qemu.binary()),
    ) {
        (Err(e), _) => Err(e),
        (Ok(Enforcement::Off), _) => Err(format!("{}=off", jail::ENV)),
        (Ok(_), Err(e)) => Err(e),
        (Ok(_), Ok(v)) => match jail::unjailable(v) {
            Some(why) => Err(why),
            None => Ok(()),
        },
    };
    let missing = "its network, if it has one, is a namespace of its own (see the network check)";
    match jail {
        Ok(()) => {
            let bound = match forkd_host::lifeline::unavailable() {
                None => "every VM is jailed once it runs (a user id of its own, no capabilities, an empty root directory; a child maps the template's RAM read-only), and one bound to the command that starts it (a template build, `forkd run`) dies with that command through its PID namespace".to_owned(),
                Some(why) => format!("forked children are jailed once they run (a user id of their own, no capabilities, an empty root directory, the template's RAM read-only); VMs bound to the command that starts them (template builds, `forkd run`) are not, since {why}"),
            };
            bad(
            "isolation",
            Level::Warn,
            format!(
                "each sandbox is its own QEMU VM under QEMU's seccomp filter; {bound}; each is limited by a cgroup of its own where the cgroups check says so; {missing}"
            ),
            "under TCG, QEMU is not a security boundary: run untrusted code on a host that holds nothing else of value",
            )
        }
        Err(why) => bad(
            "isolation",
            Level::Warn,
            format!(
                "each sandbox is its own QEMU VM under QEMU's seccomp filter, not jailed ({why}); {missing}"
            ),
            "run the daemon as root with QEMU 9.1 or newer (./dev setup installs it) so that each QEMU drops to a user of its own in an empty root",
        ),
    }
}

fn check_disk(home: &Home) -> Check {
    let mut dir = home.root().to_path_buf();
    while !dir.exists() {
        if !dir.pop() {
            break;
        }
    }
    match nix::sys::statvfs::statvfs(dir.as_path()) {
        Ok(s) => {
            let free = s.blocks_available() * s.fragment_size();
            #[expect(clippy::cast_precision_loss, reason = "a size shown to one decimal")]
            let gib = free as f64 / f64::from(1u32 << 30);
            let detail = format!("{gib:.1} GiB free for {}", home.root().display());
            if gib < 2.0 {
                bad("disk", Level::Fail, detail, "free at least 2 GiB (the python image alone needs ~1 GiB) or set FORKD_HOME elsewhere")
            } else {
                ok("disk", detail)
            }
        }
        Err(e) => bad(
            "disk",
            Level::Fail,
            format!("cannot stat {}: {e}", dir.display()),
            "set FORKD_HOME to a writable directory",
        ),
    }
}

fn check_agent() -> Check {
    match forkd_image::find_agent_binary() {
        Ok(p) => ok("agent", format!("static guest agent at {}", p.display())),
        Err(e) => bad(
            "agent",
            Level::Fail,
            e.to_string(),
            "RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p forkd-agent --target x86_64-unknown-linux-gnu",
        ),
    }
}

fn check_assets(home: &Home) -> Check {
    let assets = forkd_image::list_assets(home);
    let has = |n: &str| {
        assets
            .iter()
            .any(|(name, a)| name.contains(n) && Path::new(&a.path).exists())
    };
    let missing: Vec<&str> = ["kernel", "initramfs", "minimal", "python"]
        .into_iter()
        .filter(|n| !has(n))
        .collect();
    if missing.is_empty() {
        ok(
            "assets",
            format!(
                "kernel, initramfs, minimal and python built in {}",
                home.images_dir().display()
            ),
        )
    } else {
        bad(
            "assets",
            Level::Warn,
            format!("not built yet: {}", missing.join(", ")),
            "forkd image build (forkd run builds what it needs on first use)",
        )
    }
}
