//! Finding the guest agent binary and checking that it can run as /init: it must
//! be a static x86-64 executable, because the initramfs has no dynamic loader.

use std::path::{Path, PathBuf};

use crate::elf::{self, Linkage};
use crate::error::{ImageError, Result};

const AGENT: &str = "forkd-agent";
const TARGET_DIR: &str = "x86_64-unknown-linux-gnu/release";

/// The forkd-agent binary: `$FORKD_AGENT_BIN` if set (and then only that), else
/// the first static one of `<exe dir>/forkd-agent`,
/// `<exe dir>/../x86_64-unknown-linux-gnu/release/forkd-agent` and
/// `<exe dir>/../../x86_64-unknown-linux-gnu/release/forkd-agent`. The last two
/// are where cargo puts the static build when forkd runs from `target/<profile>/`
/// (or a test from `target/<profile>/deps/`).
pub fn find_agent_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("FORKD_AGENT_BIN").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            return Err(ImageError::AgentNotFound {
                tried: format!("{} (from FORKD_AGENT_BIN)", p.display()),
            });
        }
        check_agent_binary(&p)?;
        return Ok(p);
    }
    let exe = std::env::current_exe()
        .map_err(|e| ImageError::io("locate", "the running executable", e))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let candidates = [
        dir.join(AGENT),
        dir.join("..").join(TARGET_DIR).join(AGENT),
        dir.join("../..").join(TARGET_DIR).join(AGENT),
    ];
    pick(&candidates)
}

/// The first static candidate. A dynamic one is skipped, since `cargo build`
/// without the static flags puts one next to the host binaries, but if nothing
/// better exists the error names it: it is most likely the user's mistake.
fn pick(candidates: &[PathBuf]) -> Result<PathBuf> {
    let mut first_error = None;
    for c in candidates.iter().filter(|c| c.is_file()) {
        match check_agent_binary(c) {
            Ok(()) => return Ok(c.clone()),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| ImageError::AgentNotFound {
        tried: candidates
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    }))
}

/// Refuses anything that is not a static x86-64 ELF executable.
pub(crate) fn check_agent_binary(path: &Path) -> Result<()> {
    let data = std::fs::read(path).map_err(|e| ImageError::io("read", path, e))?;
    check_agent_bytes(path, &data)
}

/// [`check_agent_binary`] on contents already read (so the bytes checked are the
/// bytes archived).
pub(crate) fn check_agent_bytes(path: &Path, data: &[u8]) -> Result<()> {
    match elf::check_static_executable(data) {
        Ok(Linkage::Static) => Ok(()),
        Ok(Linkage::Dynamic) => Err(ImageError::AgentDynamic {
            path: path.to_path_buf(),
        }),
        Err(reason) => Err(ImageError::AgentNotElf {
            path: path.to_path_buf(),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elf::tests::fabricate_executable;

    #[test]
    fn picks_first_static_and_explains_dynamic() {
        let dir = tempfile::tempdir().unwrap();
        let dynamic = dir.path().join("dyn");
        let stat = dir.path().join("static");
        let missing = dir.path().join("missing");
        std::fs::write(&dynamic, fabricate_executable(3, &[1, 3])).unwrap();
        std::fs::write(&stat, fabricate_executable(3, &[1, 2])).unwrap();

        let got = pick(&[missing.clone(), dynamic.clone(), stat.clone()]).unwrap();
        assert_eq!(got, stat);

        let err = pick(&[missing.clone(), dynamic.clone()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dynamically linked") && err.contains("crt-static"),
            "{err}"
        );

        let err = pick(std::slice::from_ref(&missing))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not found") && err.contains("cargo build --release -p forkd-agent"),
            "{err}"
        );
        assert!(err.contains(&missing.display().to_string()));

        std::fs::write(&missing, b"#!/bin/sh\n").unwrap();
        let err = check_agent_binary(&missing).unwrap_err().to_string();
        assert!(err.contains("not an x86-64 Linux executable"), "{err}");
    }
}
