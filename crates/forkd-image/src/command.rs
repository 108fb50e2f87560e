//! Running the host tools this crate shells out to (apt-get, apt-cache, dpkg-deb,
//! debootstrap, mkfs.ext4, xz): finding them, capturing or relaying their output,
//! and turning failures into errors that carry the tool's last words.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{ImageError, Result};
use crate::progress::Step;

/// A host program and the Debian package that provides it (for the error message).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tool {
    pub(crate) name: &'static str,
    pub(crate) package: &'static str,
    /// What to do when it fails, for the error message.
    pub(crate) hint: &'static str,
}

pub(crate) const APT_GET: Tool = Tool {
    name: "apt-get",
    package: "apt",
    hint: "run `apt-get update` (the archive may have moved on to a newer kernel), or pass a kernel .deb (--kernel-deb)",
};
pub(crate) const APT_CACHE: Tool = Tool {
    name: "apt-cache",
    package: "apt",
    hint: "run `apt-get update`, or pass a kernel .deb (--kernel-deb)",
};
pub(crate) const DPKG_DEB: Tool = Tool {
    name: "dpkg-deb",
    package: "dpkg",
    hint: "the kernel .deb may be damaged: download it again or rebuild with --force",
};
pub(crate) const DEBOOTSTRAP: Tool = Tool {
    name: "debootstrap",
    package: "debootstrap",
    hint: "check the network and that the mirror serves the suite (--mirror, --suite, FORKD_DEBIAN_MIRROR, FORKD_DEBIAN_SUITE)",
};
pub(crate) const MKFS_EXT4: Tool = Tool {
    name: "mkfs.ext4",
    package: "e2fsprogs",
    hint: "check free space under FORKD_HOME and that e2fsprogs is 1.43 or newer (for -d)",
};
pub(crate) const XZ: Tool = Tool {
    name: "xz",
    package: "xz-utils",
    hint: "a module in the kernel package is damaged: pass another kernel .deb or rebuild with --force",
};
pub(crate) const ZSTD: Tool = Tool {
    name: "zstd",
    package: "zstd",
    hint: "a module in the kernel package is damaged: pass another kernel .deb or rebuild with --force",
};

/// How many lines of a failed tool's output go into the error.
const TAIL_LINES: usize = 25;

impl Tool {
    /// The program's path: `$PATH`, then the sbin directories, which a non-root
    /// `$PATH` often lacks although debootstrap and mkfs.ext4 live there.
    fn locate(&self) -> Option<PathBuf> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
            .map(|d| d.join(self.name))
            .find(|p| p.is_file())
    }

    /// A command for this tool with a C locale, so output parsing does not depend
    /// on the user's language.
    pub(crate) fn command(&self) -> Result<Command> {
        let program = self.locate().ok_or(ImageError::ToolMissing {
            tool: self.name,
            package: self.package,
        })?;
        let mut cmd = Command::new(program);
        cmd.env("LC_ALL", "C")
            .env("DEBIAN_FRONTEND", "noninteractive");
        Ok(cmd)
    }

    fn failed(&self, status: std::process::ExitStatus, output: String) -> ImageError {
        ImageError::ToolFailed {
            tool: self.name,
            status: status.to_string(),
            hint: self.hint,
            output,
        }
    }

    fn spawn_error(&self, e: std::io::Error) -> ImageError {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImageError::ToolMissing {
                tool: self.name,
                package: self.package,
            }
        } else {
            ImageError::io("run", self.name, e)
        }
    }

    /// Runs to completion and returns stdout; on failure the error carries stderr.
    pub(crate) fn output(&self, mut cmd: Command) -> Result<Vec<u8>> {
        tracing::debug!(command = ?cmd, "running");
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| self.spawn_error(e))?;
        if !out.status.success() {
            let text = String::from_utf8_lossy(&out.stderr);
            return Err(self.failed(out.status, tail(text.lines(), TAIL_LINES)));
        }
        Ok(out.stdout)
    }

    /// Runs to completion with stdout and stderr merged into `log`, showing each
    /// line as the step's message as it arrives. On failure the error carries the
    /// log's tail.
    pub(crate) fn run_logged(&self, mut cmd: Command, step: &Step, log: &Path) -> Result<()> {
        tracing::debug!(command = ?cmd, log = %log.display(), "running");
        let mut log_file = File::create(log).map_err(|e| ImageError::io("create", log, e))?;
        // One pipe for both streams keeps their lines in the order they were written.
        // CLOEXEC so that only the child's stdout/stderr hold the write end.
        let (reader, writer): (OwnedFd, OwnedFd) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| ImageError::io("create a pipe for", self.name, e.into()))?;
        let writer2 = writer
            .try_clone()
            .map_err(|e| ImageError::io("create a pipe for", self.name, e))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(writer))
            .stderr(Stdio::from(writer2));
        let spawned = cmd.spawn();
        // The Command holds the pipe's write ends; drop it so the read below sees
        // EOF when the child (and its children) exit.
        drop(cmd);
        let mut child = spawned.map_err(|e| self.spawn_error(e))?;

        let mut last: VecDeque<String> = VecDeque::with_capacity(TAIL_LINES);
        let mut lines = BufReader::new(File::from(reader));
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match lines.read_until(b'\n', &mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!("reading {} output: {e}", self.name);
                    break;
                }
            }
            if let Err(e) = log_file.write_all(&buf) {
                tracing::warn!("writing {}: {e}", log.display());
            }
            // Progress bars of tools use \r; the text after the last one is current.
            let text = String::from_utf8_lossy(&buf);
            let line = text
                .rsplit('\r')
                .find(|s| !s.trim().is_empty())
                .unwrap_or("");
            let line = line.trim();
            if !line.is_empty() {
                step.message(&truncate(line, 120));
                if last.len() == TAIL_LINES {
                    last.pop_front();
                }
                last.push_back(line.to_string());
            }
        }
        let status = child
            .wait()
            .map_err(|e| ImageError::io("wait for", self.name, e))?;
        if !status.success() {
            return Err(self.failed(status, tail(last.iter().map(String::as_str), TAIL_LINES)));
        }
        Ok(())
    }
}

fn tail<'a>(lines: impl Iterator<Item = &'a str>, n: usize) -> String {
    let all: Vec<&str> = lines.collect();
    let start = all.len().saturating_sub(n);
    let text = all[start..].join("\n");
    if text.trim().is_empty() {
        "(no output)".to_string()
    } else {
        text
    }
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::Progress;

    #[test]
    fn missing_tool_says_what_to_install() {
        let t = Tool {
            name: "forkd-no-such-tool",
            package: "forkd-pkg",
            hint: "",
        };
        let err = t.command().unwrap_err().to_string();
        assert_eq!(
            err,
            "forkd-no-such-tool is not installed: apt-get install forkd-pkg"
        );
    }

    #[test]
    fn logged_failure_carries_tail() {
        // xz is one of the required tools; `xz --bogus` fails with a message.
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let mut cmd = XZ.command().unwrap();
        cmd.arg("--forkd-bogus-flag");
        let step = Progress::Silent.step("t");
        let err = XZ.run_logged(cmd, &step, &log).unwrap_err().to_string();
        assert!(err.starts_with("xz failed"), "{err}");
        assert!(err.contains("forkd-bogus-flag"), "{err}");
        assert!(std::fs::read_to_string(&log)
            .unwrap()
            .contains("forkd-bogus-flag"));
    }

    #[test]
    fn truncates_on_char_boundary() {
        assert_eq!(truncate("ééé", 2), "éé...");
        assert_eq!(truncate("ab", 5), "ab");
    }
}
