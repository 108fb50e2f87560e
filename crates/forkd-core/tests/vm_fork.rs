//! Fork children of the `minimal` template: each is its own VM on its own disk layer,
//! the template is never written, and a damaged snapshot is refused before any child
//! starts.

mod common;

use common::{build_template, fork, fork_options, home, sh, TestStore};
use forkd_core::template::Recipe;
use forkd_core::SandboxError;
use forkd_storage::snapshot::manifest::parts;
use forkd_storage::snapshot::Tag;
use std::os::unix::fs::PermissionsExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_children_of_minimal_are_isolated_and_leave_the_template_untouched() {
    let ts = TestStore::new();
    let recipe = Recipe::find("minimal", &[]).unwrap();
    let snap = build_template(&ts.store, &recipe, "minimal-five").await;
    // Pinned to the accelerator's named model, which its children run with too.
    let m = &snap.manifest.machine;
    assert_eq!(m.cpu, m.accel.default_cpu_model());
    let disk_before = common::sha256(&snap.part(parts::DISK));
    let memory_before = common::sha256(&snap.part(parts::MEMORY));

    let children = fork(&home(), &snap, &fork_options(5))
        .await
        .expect("fork 5");
    assert_eq!(children.len(), 5);
    let mut ids: Vec<_> = children.iter().map(|c| c.id().to_owned()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5, "ids are distinct");

    for (i, c) in children.iter().enumerate() {
        let out = c
            .exec(
                sh(&format!("echo child-{i} > /root/mine-{i} && hostname")),
                None,
            )
            .await
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        // The resume hook gave every child its own hostname.
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), c.id());
    }
    for (i, c) in children.iter().enumerate() {
        let out = c
            .exec(sh("ls /root | grep mine- || true"), None)
            .await
            .unwrap();
        let seen = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert_eq!(
            seen,
            format!("mine-{i}"),
            "child {i} sees only its own file"
        );
        let out = c
            .exec(sh(&format!("cat /root/mine-{i}")), None)
            .await
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("child-{i}")
        );
    }
    for c in children {
        c.destroy().await.unwrap();
    }
    assert_eq!(common::sha256(&snap.part(parts::DISK)), disk_before);
    assert_eq!(common::sha256(&snap.part(parts::MEMORY)), memory_before);
    // Still sealed: forks again.
    ts.store.open(&snap.tag).expect("the template is intact");
    let again = fork(&home(), &snap, &fork_options(1)).await.unwrap();
    assert!(again[0]
        .exec(sh("true"), None)
        .await
        .unwrap()
        .status
        .success());
    // Under TCG (and FORKD_VM_SCHED unset) every thread of a child's QEMU runs as
    // SCHED_BATCH, which the threads QEMU started after exec inherited.
    if m.accel == forkd_hypervisor::Accel::Tcg
        && std::env::var_os(forkd_host::sched::SCHED_ENV).is_none()
    {
        let pid = again[0].pid().expect("the child's QEMU runs");
        let policies: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
            .map(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap();
                // Field 41, counted from the state (field 3) after the command name.
                let after_name = &stat[stat.rfind(')').unwrap() + 2..];
                after_name.split(' ').nth(41 - 3).unwrap().to_owned()
            })
            .collect();
        assert!(policies.len() > 1, "{policies:?}");
        assert!(policies.iter().all(|p| p == "3"), "{policies:?}");
    }
    // Its QEMU holds no capability and can gain none beyond what its jail needed.
    let pid = again[0].pid().expect("the child's QEMU runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let caps = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
    };
    assert_eq!(caps("CapAmb:"), 0, "{status}");
    if nix::unistd::geteuid().is_root() {
        let jailed = forkd_host::caps::mask(forkd_host::caps::JAILED);
        assert_eq!(caps("CapBnd:") & !jailed, 0, "{status}");
        assert_eq!(caps("CapEff:"), 0, "{status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_snapshots_and_bad_tags_are_refused_before_any_child_starts() {
    let ts = TestStore::new();
    let recipe = Recipe::find("minimal", &[]).unwrap();
    let snap = build_template(&ts.store, &recipe, "minimal-damaged").await;
    ts.store
        .verify(&snap.tag)
        .expect("a fresh snapshot verifies");
    // Other tests fork in parallel: count only the VMs that run from this snapshot
    // (each names its files on its command line).
    let children_of = |snap: &forkd_storage::snapshot::Snapshot| -> Vec<(u32, u64)> {
        forkd_host::process::find_inside(&snap.dir)
    };

    // A part whose contents changed (same size): the seal no longer matches, and
    // verification names the digest.
    let state = snap.part(parts::STATE);
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&state, &bytes).unwrap();
    let err = ts.store.open(&snap.tag).unwrap_err().to_string();
    assert!(err.contains("state.bin was modified"), "{err}");
    let err = ts.store.verify(&snap.tag).unwrap_err().to_string();
    assert!(err.contains("state.bin does not match its digest"), "{err}");
    // Forking goes through open(): refused, and no child was started.
    assert!(children_of(&snap).is_empty());

    // A manifest whose digest was edited: refused at open, and verification finds the
    // part no longer matches what the manifest claims.
    let snap2 = build_template(&ts.store, &recipe, "minimal-edited").await;
    let mpath = snap2.dir.join(forkd_storage::snapshot::MANIFEST);
    let text = std::fs::read_to_string(&mpath).unwrap();
    let digest = &snap2.manifest.parts[parts::DISK].sha256;
    std::fs::set_permissions(&mpath, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&mpath, text.replace(digest.as_str(), &"0".repeat(64))).unwrap();
    let err = ts.store.open(&snap2.tag).unwrap_err().to_string();
    assert!(err.contains("manifest.json was modified"), "{err}");
    let err = ts.store.verify(&snap2.tag).unwrap_err().to_string();
    assert!(
        err.contains("disk.qcow2 does not match its digest"),
        "{err}"
    );

    // A truncated part.
    let mem = snap2.part(parts::MEMORY);
    let f = std::fs::OpenOptions::new().write(true).open(&mem).unwrap();
    f.set_len(4096).unwrap();
    let err = ts.store.open(&snap2.tag).unwrap_err();
    assert!(
        matches!(err, forkd_storage::snapshot::SnapshotError::Damaged { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("memory.ram is 4096 bytes"),
        "{err}"
    );

    // Bad tags never reach the filesystem.
    for bad in ["../x", "a/b", "", &"x".repeat(300)] {
        let e = Tag::parse(bad).unwrap_err();
        let e: SandboxError = e.into();
        assert!(e.to_string().starts_with("invalid snapshot tag"), "{e}");
    }
    assert!(children_of(&snap2).is_empty());
}

/// A guest CPU model the host cannot provide (or QEMU does not know) stops the VM at
/// its start with an error naming the model and what is missing: what a snapshot made
/// on a richer host gets when forked here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_model_the_host_lacks_is_refused_by_name() {
    let ts = TestStore::new();
    let assets = common::assets(forkd_image::RootfsImage::Minimal).await;
    let accel = forkd_hypervisor::accel::resolve(Default::default()).unwrap();
    let mut models = vec![("Nonexistent-v9", "QEMU does not know it")];
    if accel == forkd_hypervisor::Accel::Tcg {
        // Haswell asks for the TSC deadline timer and PCID, which TCG lacks.
        models.push(("Haswell-v4", "missing"));
    }
    for (model, why) in models {
        let recipe = Recipe::parse(
            "pinned",
            &format!("image = \"minimal\"\ncpu = \"{model}\"\n"),
        )
        .unwrap();
        let err = forkd_core::template::build(
            common::hv().as_ref(),
            &home(),
            &ts.store,
            &recipe,
            &Tag::parse("pinned").unwrap(),
            &assets,
            &Default::default(),
            &|_| {},
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(&format!(
                "the guest CPU model {model} is not available with {accel}"
            )) && err.contains(why),
            "{err}"
        );
        assert!(!ts.store.exists(&Tag::parse("pinned").unwrap()));
    }
}

/// Children share the template's memory image: what each one copies on write stays
/// small, and ten of them together cost about one template's resident memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_children_share_the_template_memory() {
    use std::os::unix::fs::MetadataExt;
    const MIB: u64 = 1 << 20;
    let ts = TestStore::new();
    let recipe = Recipe::find("minimal", &[]).unwrap();
    assert_eq!(recipe.memory_mib, 512);
    let snap = build_template(&ts.store, &recipe, "minimal-shared").await;
    // What the template had resident when it was frozen: the pages of its RAM file that
    // hold data (the rest of the file is a hole).
    let template_resident = std::fs::metadata(snap.part(parts::MEMORY))
        .unwrap()
        .blocks()
        * 512;
    assert!(template_resident > 16 * MIB, "{template_resident}");

    let children = fork(&home(), &snap, &fork_options(10))
        .await
        .expect("fork 10");
    for c in &children {
        let out = c
            .exec(sh("echo hello > /tmp/x && cat /tmp/x"), None)
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hello");
    }
    let usage: Vec<_> = children
        .iter()
        .map(|c| c.guest_ram_usage().expect("the child maps its RAM file"))
        .collect();
    let mut pss_sum = 0;
    for (c, u) in children.iter().zip(&usage) {
        eprintln!(
            "{}: guest RAM rss {} KiB, pss {} KiB, private dirty {} KiB",
            c.id(),
            u.rss / 1024,
            u.pss / 1024,
            u.private_dirty / 1024
        );
        assert_eq!(u.size, 512 * MIB, "the whole RAM file is mapped");
        assert!(u.rss > 0, "{u:?}");
        assert!(u.private_dirty < 4 * MIB, "{}: {u:?}", c.id());
        pss_sum += u.pss;
    }
    assert!(
        pss_sum * 2 < template_resident * 3,
        "10 children's guest RAM PSS {pss_sum} is not under 1.5x the template's {template_resident}"
    );
    for c in children {
        c.destroy().await.unwrap();
    }
}
