//! A recipe's own root filesystem: its base image with the recipe's `packages`, `files`
//! and `[[build]]` steps applied, made once and kept by the digest of everything that
//! went in (the base image's bytes, the package list, each file's destination, mode and
//! contents, each step), so a template is rebuilt on it only when one of those changes.
//!
//! The work happens in a build VM, never on the host: the base boots with a qcow2 layer
//! over it, the agent writes the files and runs the steps, and the layer is converted
//! into a new raw image. Packages come from Debian's archive through the host's apt (the
//! guest has no network): the host resolves them against the guest's own dpkg database,
//! downloads the .debs, and the guest installs them with `dpkg -i`.

use crate::agent::WriteOptions;
use crate::error::SandboxError;
use crate::sandbox::Sandbox;
use crate::template::{boot_vm, run_step, BootDisk, BuildOptions, Recipe, RecipeFiles};
use forkd_hypervisor::{DiskFormat, DiskLayer, Hypervisor, MemoryBackend};
use forkd_image::{custom_rootfs, packages, GuestAssets, Home};
use forkd_proto::exec::{Command, ExecRequest};
use sha2::{Digest, Sha256};
use std::time::Instant;

/// Removes the scratch directories of customisations, docker-archive reads and image
/// uploads that a stopped process left in the images' scratch area. Only when none is
/// in progress: at the daemon's start. (The image builders' own sweep leaves them alone: a build VM
/// runs without their lock.)
pub fn remove_leftovers(home: &Home) {
    let Ok(entries) = std::fs::read_dir(home.tmp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(custom_rootfs::SCRATCH_PREFIX)
            || name.starts_with("docker-archive-")
            || name.starts_with(forkd_storage::oci::upload::SCRATCH_PREFIX)
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Where the .debs wait in the guest until `dpkg -i` installs them.
const GUEST_DEBS: &str = "/var/cache/forkd-packages";

/// The digest of everything that makes the recipe's root filesystem.
pub fn inputs(base_sha256: &str, recipe: &Recipe, files: &RecipeFiles) -> String {
    let files: Vec<_> = recipe
        .files
        .iter()
        .map(|f| {
            let data = files.get(&f.src).map(Vec::as_slice).unwrap_or_default();
            serde_json::json!({
                "dest": f.dest,
                "mode": f.mode(),
                "sha256": hex::encode(Sha256::digest(data)),
            })
        })
        .collect();
    let steps: Vec<_> = recipe
        .build
        .iter()
        .map(|s| serde_json::json!({ "run": s.run, "timeout_s": s.timeout_s }))
        .collect();
    let all = serde_json::json!({
        "customise": 1,
        "base": base_sha256,
        "packages": recipe.packages,
        "files": files,
        "build": steps,
    });
    hex::encode(Sha256::digest(all.to_string().as_bytes()))
}

/// `assets` with the recipe's own root filesystem in place of its base's, made now
/// unless a current one exists. A recipe that changes nothing gets `assets` back.
pub async fn ensure(
    hv: &dyn Hypervisor,
    home: &Home,
    assets: &GuestAssets,
    recipe: &Recipe,
    files: &RecipeFiles,
    opts: &BuildOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<GuestAssets, SandboxError> {
    if !recipe.customises() {
        return Ok(assets.clone());
    }
    let inputs = inputs(&assets.rootfs.sha256, recipe, files);
    let name = custom_rootfs::name(&inputs);
    let with = |rootfs| GuestAssets {
        rootfs,
        ..assets.clone()
    };
    if let Some(rootfs) = custom_rootfs::current(home, &inputs) {
        progress(&format!(
            "reusing root filesystem {name} (its packages, files and build steps have not changed)"
        ));
        return Ok(with(rootfs));
    }
    let started = Instant::now();
    let image_err = |e: forkd_image::ImageError| SandboxError::Template {
        name: recipe.name.clone(),
        detail: e.to_string(),
    };
    let scratch = custom_rootfs::scratch(home, &inputs).map_err(image_err)?;
    forkd_host::space::ensure_room(
        scratch.path(),
        2 * assets.rootfs.size,
        &format!("making root filesystem {name}"),
    )?;
    let disk = scratch.path().join("disk.qcow2");
    hv.create_disk_layer(DiskLayer {
        path: &disk,
        base: &assets.rootfs.path,
        base_format: DiskFormat::Raw,
        relative: false,
        named: None,
    })
    .await?;
    progress(&format!(
        "making root filesystem {name}: booting a build VM on {}",
        recipe.base_name()
    ));
    let vm = boot_vm(
        hv,
        home,
        recipe,
        opts,
        BootDisk {
            kernel: assets.kernel.vmlinuz.path.clone(),
            initramfs: assets.initramfs.path.clone(),
            root_disk: disk.clone(),
        },
        MemoryBackend::Anonymous,
        false,
    )
    .await?;
    let applied = apply(&vm, recipe, files, scratch.path(), progress).await;
    // QEMU flushes the layer as it quits.
    let stopped = vm.destroy().await;
    applied?;
    stopped?;
    progress(&format!("making root filesystem {name}: writing the image"));
    let image = scratch.path().join(format!("{name}.ext4"));
    hv.layer_to_raw(&disk, &image).await?;
    let home2 = home.clone();
    let rootfs = tokio::task::spawn_blocking(move || {
        custom_rootfs::publish(&home2, &inputs, &image, started)
    })
    .await
    .map_err(|e| SandboxError::Io {
        context: "publishing the root filesystem".into(),
        source: std::io::Error::other(e.to_string()),
    })?
    .map_err(image_err)?;
    progress(&format!(
        "root filesystem {name} made in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(with(rootfs))
}

/// Installs the packages, writes the files and runs the build steps in `vm`, then
/// flushes its disk.
async fn apply(
    vm: &Sandbox,
    recipe: &Recipe,
    files: &RecipeFiles,
    scratch: &std::path::Path,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<(), SandboxError> {
    let fail = |detail: String| SandboxError::Template {
        name: recipe.name.clone(),
        detail,
    };
    if !recipe.packages.is_empty() {
        install_packages(vm, recipe, scratch, progress).await?;
    }
    for f in &recipe.files {
        let data = files
            .get(&f.src)
            .cloned()
            .ok_or_else(|| fail(format!("file {} was not sent with the recipe", f.src)))?;
        progress(&format!("copying {} to {}", f.src, f.dest));
        write_guest_file(vm, &f.dest, data, f.mode()).await?;
    }
    for (i, step) in recipe.build.iter().enumerate() {
        progress(&format!("build step {}: {}", i + 1, step.run));
        let mut req = ExecRequest::new(Command::Shell(step.run.clone()));
        req.timeout_ms = Some(step.timeout_s.unwrap_or(600) * 1000);
        let out = run_step(vm, req).await?;
        if !out.status.success() {
            return Err(fail(out.failure(&format!("build step {:?}", step.run))));
        }
    }
    vm.call(|a| async move { a.sync().await }).await?;
    Ok(())
}

/// Writes `data` to `dest` in the guest with `mode`, making its directories.
async fn write_guest_file(
    vm: &Sandbox,
    dest: &str,
    data: Vec<u8>,
    mode: u32,
) -> Result<(), SandboxError> {
    vm.call(|a| async move {
        a.write_file_bytes(
            dest,
            data,
            WriteOptions {
                mode: Some(mode),
                parents: true,
                owner: None,
            },
        )
        .await
    })
    .await
    .map(drop)
}

/// Downloads the recipe's packages on the host for the guest's release and installs
/// them in the guest.
async fn install_packages(
    vm: &Sandbox,
    recipe: &Recipe,
    scratch: &std::path::Path,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<(), SandboxError> {
    let fail = |detail: String| SandboxError::Template {
        name: recipe.name.clone(),
        detail,
    };
    let read = |path: &'static str, max: u64| {
        vm.call(move |a| async move { a.read_file_capped(path, max).await })
    };
    // An image without /etc/os-release says nothing of itself: not Debian, then.
    let release = read("/etc/os-release", 64 << 10)
        .await
        .map(|b| packages::Release::parse(&String::from_utf8_lossy(&b)))
        .unwrap_or(packages::Release {
            id: String::new(),
            codename: None,
        });
    let suite = release
        .debian_suite()
        .map_err(|e| fail(format!("packages: {e}")))?
        .to_owned();
    let status = read("/var/lib/dpkg/status", 64 << 20)
        .await
        .map_err(|e| fail(format!("packages: the image has no dpkg database ({e})")))?;
    progress(&format!(
        "packages: resolving and downloading {} for {suite} on the host",
        recipe.packages.join(" ")
    ));
    let dir = scratch.join("apt");
    let wanted = recipe.packages.clone();
    let debs = tokio::task::spawn_blocking(move || {
        packages::download(
            &dir,
            &suite,
            &status,
            &wanted,
            &forkd_image::Progress::Silent,
        )
    })
    .await
    .map_err(|e| fail(format!("packages: {e}")))?
    .map_err(|e| fail(e.to_string()))?;
    if debs.is_empty() {
        progress("packages: the image has them all already");
        return Ok(());
    }
    let mut argv = vec!["dpkg".to_owned(), "-i".to_owned()];
    for deb in &debs {
        let name = deb
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let dest = format!("{GUEST_DEBS}/{name}");
        let data = std::fs::read(deb).map_err(|source| SandboxError::Io {
            context: format!("reading {}", deb.display()),
            source,
        })?;
        write_guest_file(vm, &dest, data, 0o644).await?;
        argv.push(dest);
    }
    progress(&format!("packages: dpkg -i ({} packages)", debs.len()));
    let mut req = ExecRequest::new(Command::Argv(argv));
    req.env
        .insert("DEBIAN_FRONTEND".into(), "noninteractive".into());
    req.timeout_ms = Some(1_800_000);
    let out = run_step(vm, req).await?;
    if !out.status.success() {
        return Err(fail(out.failure("packages: dpkg -i")));
    }
    let done = vm
        .exec(
            ExecRequest::new(Command::Argv(vec![
                "rm".into(),
                "-rf".into(),
                GUEST_DEBS.into(),
            ])),
            None,
        )
        .await?;
    if !done.status.success() {
        return Err(fail(format!("packages: removing {GUEST_DEBS} failed")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(text: &str) -> Recipe {
        Recipe::parse("t", text).unwrap()
    }

    #[test]
    fn every_input_changes_the_digest_and_nothing_else_does() {
        let base = "image = \"minimal\"\npackages = [\"jq\"]\nfiles = [{ src = \"a\", dest = \"/opt/a\" }]\n[[build]]\nrun = \"true\"\n";
        let files = RecipeFiles::from([("a".to_owned(), b"one".to_vec())]);
        let d = inputs("base", &recipe(base), &files);
        assert_eq!(d, inputs("base", &recipe(base), &files));
        // A warm-up step or the memory size does not change the filesystem.
        let warm = format!("memory_mib = 1024\n{base}[[warmup]]\nrun = \"echo\"\n");
        assert_eq!(d, inputs("base", &recipe(&warm), &files));
        let changed = [
            inputs("other", &recipe(base), &files),
            inputs(
                "base",
                &recipe(base),
                &RecipeFiles::from([("a".to_owned(), b"two".to_vec())]),
            ),
            inputs("base", &recipe(&base.replace("jq", "curl")), &files),
            inputs("base", &recipe(&base.replace("/opt/a", "/opt/b")), &files),
            inputs(
                "base",
                &recipe(&base.replace("dest = \"/opt/a\"", "dest = \"/opt/a\", mode = \"0600\"")),
                &files,
            ),
            inputs("base", &recipe(&base.replace("true", "false")), &files),
        ];
        for (i, c) in changed.iter().enumerate() {
            assert_ne!(&d, c, "change {i}");
        }
    }
}
