//! Builds the real guest kernel asset (one `apt-get download` of Debian's cloud
//! kernel; needs `apt-get update` to have run) and an initramfs from it.

use std::path::{Path, PathBuf};
use std::process::Command;

use forkd_image::{
    ensure_initramfs, ensure_kernel, list_assets, BuildOptions, Home, ImageError, KernelAsset,
};

/// A static (and, for the negative case, a dynamic) stand-in for the agent: the
/// builder only cares that /init is a static x86-64 ELF.
fn compile(dir: &Path, name: &str, code: i32, static_link: bool) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, format!("int main(void) {{ return {code}; }}\n")).unwrap();
    let out = dir.join(name);
    let mut cc = Command::new("cc");
    if static_link {
        cc.arg("-static");
    }
    let status = cc
        .arg("-O2")
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(status.success(), "cc failed");
    out
}

fn cpio_list(archive: &Path) -> Vec<String> {
    let out = Command::new("cpio")
        .args(["-it", "--quiet"])
        .stdin(std::fs::File::open(archive).unwrap())
        .output()
        .expect("cpio");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn modules_in(kernel: &KernelAsset) -> Vec<String> {
    let dep = std::fs::read_to_string(kernel.modules_dir.join("modules.dep")).unwrap();
    dep.lines()
        .map(|l| {
            let path = l.split(':').next().unwrap();
            let file = path.rsplit('/').next().unwrap();
            file.trim_end_matches(".ko").replace('-', "_")
        })
        .collect()
}

#[test]
fn real_kernel_then_initramfs() {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::new(dir.path().join("home"));
    let opts = BuildOptions::default();

    // Two builders at once: the lock makes one wait, and it then reuses the
    // other's kernel instead of downloading again.
    let (a, b) = std::thread::scope(|s| {
        let t1 = s.spawn(|| ensure_kernel(&home, &opts));
        let t2 = s.spawn(|| ensure_kernel(&home, &opts));
        (t1.join().unwrap(), t2.join().unwrap())
    });
    let kernel = a.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(b.unwrap(), kernel);

    assert!(
        kernel.package.starts_with("linux-image-"),
        "{}",
        kernel.package
    );
    assert!(
        kernel.release.ends_with("-cloud-amd64"),
        "{}",
        kernel.release
    );
    assert!(!kernel.package_version.is_empty());
    let md = std::fs::metadata(&kernel.vmlinuz.path).unwrap();
    assert_eq!(md.len(), kernel.vmlinuz.size);
    assert!(md.len() > 1 << 20, "vmlinuz is implausibly small");
    assert_eq!(kernel.vmlinuz.sha256.len(), 64);
    let mods = modules_in(&kernel);
    for m in [
        "virtio_ring",
        "virtio",
        "virtio_mmio",
        "virtio_blk",
        "virtio_console",
        "virtio_net",
        "net_failover",
        "failover",
    ] {
        assert!(mods.contains(&m.to_string()), "{m} missing from {mods:?}");
    }
    let dep = std::fs::read_to_string(kernel.modules_dir.join("modules.dep")).unwrap();
    for line in dep.lines() {
        let path = line.split(':').next().unwrap();
        assert!(
            kernel.modules_dir.join(path).is_file(),
            "{path} listed but not kept"
        );
    }
    // Only what the guest needs is kept, not the package's ~1100 modules.
    assert!(mods.len() < 20, "{mods:?}");

    // Cheap path: same asset, nothing rebuilt.
    let again = ensure_kernel(&home, &opts).unwrap();
    assert_eq!(again, kernel);

    let agent = compile(dir.path(), "agent", 0, true);
    let initramfs = ensure_initramfs(&home, &kernel, &agent, &opts).unwrap();
    assert_eq!(
        std::fs::metadata(&initramfs.path).unwrap().len(),
        initramfs.size
    );
    let entries = cpio_list(&initramfs.path);
    for e in [
        "init",
        "forkd-initramfs",
        "dev",
        "dev/console",
        "proc",
        "sys",
        "newroot",
        "modules",
    ] {
        assert!(
            entries.contains(&e.to_string()),
            "{e} missing from {entries:?}"
        );
    }
    let loaded: Vec<&str> = entries
        .iter()
        .filter_map(|e| e.strip_prefix("modules/"))
        .collect();
    assert_eq!(
        loaded.first().copied(),
        Some("00-virtio_ring.ko"),
        "{loaded:?}"
    );
    let pos = |m: &str| {
        loaded
            .iter()
            .position(|e| e.ends_with(&format!("-{m}.ko")))
            .unwrap_or_else(|| panic!("{m} not in {loaded:?}"))
    };
    assert!(pos("virtio") < pos("virtio_mmio"));
    assert!(pos("failover") < pos("net_failover"));
    assert!(pos("net_failover") < pos("virtio_net"));

    // Same inputs: reused. Different agent: a new archive under a new key.
    assert_eq!(
        ensure_initramfs(&home, &kernel, &agent, &opts).unwrap(),
        initramfs
    );
    let agent2 = compile(dir.path(), "agent2", 1, true);
    let other = ensure_initramfs(&home, &kernel, &agent2, &opts).unwrap();
    assert_ne!(other.path, initramfs.path);
    assert_ne!(other.sha256, initramfs.sha256);

    // A dynamically linked agent cannot be /init.
    let dynamic = compile(dir.path(), "dynamic", 0, false);
    let err = ensure_initramfs(&home, &kernel, &dynamic, &opts).unwrap_err();
    assert!(matches!(err, ImageError::AgentDynamic { .. }), "{err}");

    let listed: Vec<String> = list_assets(&home).into_iter().map(|(n, _)| n).collect();
    assert!(
        listed.contains(&format!("kernel/{}", kernel.release)),
        "{listed:?}"
    );
    assert_eq!(
        listed
            .iter()
            .filter(|n| n.starts_with("initramfs/"))
            .count(),
        2,
        "{listed:?}"
    );
    // Nothing left in the scratch area.
    let tmp = home.images_dir().join("tmp");
    assert_eq!(std::fs::read_dir(&tmp).map(|d| d.count()).unwrap_or(0), 0);
}
