//! The Debian packages a recipe asks for, downloaded on the host for a guest that has
//! no network of its own: the host's apt resolves them against the guest's own dpkg
//! database (so only what the guest lacks comes down), from the Debian archive the host
//! already reaches, for the guest's release. The guest then installs the .debs with
//! `dpkg -i`.

use std::fs;
use std::path::{Path, PathBuf};

use crate::apt_sources::debian_mirror;
use crate::command::Tool;
use crate::error::{ImageError, Result};
use crate::progress::Progress;

const APT_GET: Tool = Tool {
    name: "apt-get",
    package: "apt",
    hint: "check the package names and that the host reaches the Debian archive of the image's release",
};

/// Debian's archive keyring, named in the sources so that apt checks the archive's
/// signature whatever else the host trusts.
const ARCHIVE_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// What a guest's `/etc/os-release` says of it, as far as packages go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    /// `ID`.
    pub id: String,
    /// `VERSION_CODENAME` (e.g. bookworm).
    pub codename: Option<String>,
}

impl Release {
    /// Parses `/etc/os-release`.
    pub fn parse(text: &str) -> Release {
        let field = |key: &str| {
            text.lines()
                .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
                .map(|v| v.trim().trim_matches('"').to_owned())
                .find(|v| !v.is_empty())
        };
        Release {
            id: field("ID").unwrap_or_default(),
            codename: field("VERSION_CODENAME"),
        }
    }

    /// The Debian suite packages come from, or why there is none.
    pub fn debian_suite(&self) -> std::result::Result<&str, String> {
        if self.id != "debian" {
            let says = match self.id.as_str() {
                "" => "it has no /etc/os-release naming it".to_owned(),
                id => format!("its /etc/os-release says ID={id:?}"),
            };
            return Err(format!(
                "packages are installed from Debian's archive, and this image is not Debian ({says}); install them in the image itself, or with a [[build]] step"
            ));
        }
        self.codename.as_deref().ok_or_else(|| {
            "its /etc/os-release names no VERSION_CODENAME (a Debian testing or sid image?), so there is no release to take packages from".to_owned()
        })
    }
}

/// Whether `name` can be a Debian package name (optionally `=version`): what apt is
/// given must not be an option or a path.
pub fn valid_package(name: &str) -> bool {
    let (pkg, version) = match name.split_once('=') {
        Some((p, v)) => (p, Some(v)),
        None => (name, None),
    };
    let pkg_ok = pkg.len() >= 2
        && pkg.len() <= 128
        && pkg.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && pkg
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c));
    let version_ok = match version {
        None => true,
        Some(v) => {
            !v.is_empty()
                && v.len() <= 128
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.:~".contains(c))
        }
    };
    pkg_ok && version_ok
}

/// Downloads into `dir` the .debs that installing `packages` on a system whose dpkg
/// database is `status` needs, from `suite` of the host's Debian mirror. Returns them.
pub fn download(
    dir: &Path,
    suite: &str,
    status: &[u8],
    packages: &[String],
    progress: &Progress,
) -> Result<Vec<PathBuf>> {
    if let Some(bad) = packages.iter().find(|p| !valid_package(p)) {
        return Err(ImageError::Package {
            detail: format!("{bad:?} is not a Debian package name"),
        });
    }
    if suite.is_empty()
        || !suite
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(ImageError::Package {
            detail: format!("{suite:?} is not a Debian release name"),
        });
    }
    let mirror = debian_mirror(None, suite)?;
    for sub in [
        "lists/partial",
        "archives/partial",
        "parts",
        "conf",
        "preferences",
    ] {
        crate::fsutil::create_dir_all(&dir.join(sub))?;
    }
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        fs::write(&p, bytes).map_err(|e| ImageError::io("write", p, e))
    };
    let signed = if Path::new(ARCHIVE_KEYRING).is_file() {
        format!("[signed-by={ARCHIVE_KEYRING}] ")
    } else {
        String::new()
    };
    write(
        "sources.list",
        format!("deb {signed}{mirror} {suite} main\n").as_bytes(),
    )?;
    write("status", status)?;
    // Of the host's configuration only how it fetches (its proxy, say): none of its
    // hooks (apt.conf.d's Pre- and Post-Invoke commands would run as root, and some
    // clean the host's own cache), none of its pins.
    write("conf/host-acquire.conf", &host_acquire_config())?;
    write("empty.conf", b"")?;
    // Read before anything else (APT_CONFIG): it points apt away from the host's
    // apt.conf, apt.conf.d and preferences (options given with -o come too late for
    // that: the host's files are read first).
    let at = |name: &str| dir.join(name).display().to_string();
    write(
        "apt.conf",
        format!(
            "Dir::Etc::Parts \"{}\";\nDir::Etc::main \"{}\";\nDir::Etc::Preferences \"{}\";\nDir::Etc::PreferencesParts \"{}\";\n",
            at("conf"),
            at("empty.conf"),
            at("empty.conf"),
            at("preferences")
        )
        .as_bytes(),
    )?;
    // apt with its state, lists and cache in `dir`, the guest's package database as the
    // installed set, and the host's keys.
    let apt = |args: &[&str]| -> Result<std::process::Command> {
        let mut cmd = APT_GET.command()?;
        let set = |k: &str, v: &Path| format!("{k}={}", v.display());
        cmd.env("APT_CONFIG", dir.join("apt.conf"))
            .arg("-q")
            .args(["-o", &set("Dir::State", dir)])
            .args(["-o", &set("Dir::State::Lists", &dir.join("lists"))])
            .args(["-o", &set("Dir::State::status", &dir.join("status"))])
            .args(["-o", &set("Dir::Cache", dir)])
            .args(["-o", &set("Dir::Cache::Archives", &dir.join("archives"))])
            .args([
                "-o",
                &set("Dir::Etc::SourceList", &dir.join("sources.list")),
            ])
            .args(["-o", &set("Dir::Etc::SourceParts", &dir.join("parts"))])
            .args(["-o", "APT::Architecture=amd64"])
            .args(["-o", "Debug::NoLocking=1"]);
        if nix::unistd::geteuid().is_root() {
            // apt would drop to _apt, which cannot write into the 0700 scratch directory.
            cmd.args(["-o", "APT::Sandbox::User=root"]);
        }
        cmd.args(args);
        Ok(cmd)
    };
    let step = progress.step(format!("packages: apt-get update ({suite})"));
    APT_GET.run_logged(apt(&["update"])?, &step, &dir.join("apt-update.log"))?;
    step.finish();
    let step = progress.step(format!("packages: downloading {}", packages.join(" ")));
    let mut args = vec![
        "install",
        "--download-only",
        "--no-install-recommends",
        "-y",
        "--",
    ];
    args.extend(packages.iter().map(String::as_str));
    APT_GET.run_logged(apt(&args)?, &step, &dir.join("apt-install.log"))?;
    step.finish();
    let archives = dir.join("archives");
    let mut debs: Vec<PathBuf> = fs::read_dir(&archives)
        .map_err(|e| ImageError::io("list", &archives, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    debs.sort();
    Ok(debs)
}

/// The host's `Acquire::` settings (proxies, timeouts), as apt.conf text: what apt run
/// with none of the host's configuration files still needs to reach the archive the
/// way the host does. Index targets are left to apt's defaults.
fn host_acquire_config() -> Vec<u8> {
    let dump = std::process::Command::new("apt-config")
        .arg("dump")
        .env("LC_ALL", "C")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    String::from_utf8_lossy(&dump)
        .lines()
        .filter(|l| l.starts_with("Acquire::") && !l.starts_with("Acquire::IndexTargets"))
        .flat_map(|l| [l, "\n"])
        .collect::<String>()
        .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_and_names() {
        let r = Release::parse("PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nID=debian\nVERSION_CODENAME=bookworm\n");
        assert_eq!(r.debian_suite(), Ok("bookworm"));
        let r = Release::parse("ID=alpine\nVERSION_ID=3.20\n");
        assert!(r.debian_suite().unwrap_err().contains("ID=\"alpine\""));
        let r = Release::parse("ID=debian\n");
        assert!(r.debian_suite().unwrap_err().contains("VERSION_CODENAME"));
        for ok in ["jq", "python3-numpy", "libc6=2.36-9+deb12u4", "g++"] {
            assert!(valid_package(ok), "{ok}");
        }
        for bad in [
            "-o",
            "--allow-unauthenticated",
            "J",
            "a/b",
            "../x.deb",
            "x=",
            "",
        ] {
            assert!(!valid_package(bad), "{bad}");
        }
    }
}
