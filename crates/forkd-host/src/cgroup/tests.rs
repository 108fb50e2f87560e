use super::*;

/// This kind of host: v1 hierarchies, cpu and cpuacct apart, an empty unified tree,
/// and the process in a nested memory cgroup.
const HYBRID_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
const HYBRID_MEMBERSHIP: &str = "\
8:pids:/
4:memory:/jobs/42
2:cpuacct:/
1:cpu:/
0::/
";

#[test]
fn v1_parents_nest_under_the_processs_own_cgroups() {
    let cgroups = Cgroups::locate(HYBRID_MOUNTS, HYBRID_MEMBERSHIP).unwrap();
    assert_eq!(cgroups.version(), CgroupVersion::V1);
    assert_eq!(
        cgroups.parents(),
        [
            PathBuf::from("/sys/fs/cgroup/memory/jobs/42/forkd"),
            PathBuf::from("/sys/fs/cgroup/cpu/forkd"),
            PathBuf::from("/sys/fs/cgroup/pids/forkd"),
        ]
    );
    assert_eq!(
        cgroups.dirs("sbx-1")[0],
        PathBuf::from("/sys/fs/cgroup/memory/jobs/42/forkd/sbx-1")
    );
}

#[test]
fn co_mounted_v1_controllers_share_one_directory() {
    let mounts = "\
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
";
    let membership = "4:memory:/\n2:cpu,cpuacct:/svc\n8:pids:/\n";
    let cgroups = Cgroups::locate(mounts, membership).unwrap();
    assert_eq!(
        cgroups.parents()[1],
        PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/svc/forkd")
    );
}

#[test]
fn a_unified_host_uses_v2_under_a_namespaced_root() {
    // In a cgroup namespace the mount's root and the membership path are both relative
    // to the namespace.
    let mounts = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
    let cgroups = Cgroups::locate(mounts, "0::/system.slice/forkd.service\n").unwrap();
    assert_eq!(cgroups.version(), CgroupVersion::V2);
    assert_eq!(
        cgroups.parents(),
        [PathBuf::from(
            "/sys/fs/cgroup/system.slice/forkd.service/forkd"
        )]
    );
    let at_root = Cgroups::locate(mounts, "0::/\n").unwrap();
    assert_eq!(at_root.parents(), [PathBuf::from("/sys/fs/cgroup/forkd")]);
}

#[test]
fn controllers_split_between_versions_are_refused_by_name() {
    let mounts = "\
35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
";
    let err = Cgroups::locate(mounts, "4:memory:/\n0::/\n").unwrap_err();
    assert!(err.contains("cpu, pids controllers"), "{err}");
    let err = Cgroups::locate("", "").unwrap_err();
    assert!(err.contains("memory, cpu, pids"), "{err}");
}

#[test]
fn limits_no_cgroup_would_take_are_refused() {
    let ok = ResourceLimits::for_vm(1, 512);
    assert_eq!(ok.memory_bytes, (512 << 20) + MEMORY_OVERHEAD);
    assert!(ok.check(512).is_ok());
    for (bad, says) in [
        (
            ResourceLimits {
                cpu_weight: 0,
                ..ok
            },
            "weight",
        ),
        (
            ResourceLimits {
                cpu_millicores: 5,
                ..ok
            },
            "too small",
        ),
        (ResourceLimits { pids: 3, ..ok }, "pids"),
        (
            ResourceLimits {
                memory_bytes: 1 << 20,
                ..ok
            },
            "too small for QEMU",
        ),
    ] {
        let err = bad.check(512).unwrap_err();
        assert!(err.contains(says), "{err}");
    }
    // Less than the guest's RAM is allowed: the guest may never touch it all.
    let tight = ResourceLimits {
        memory_bytes: 256 << 20,
        ..ok
    };
    assert!(tight.check(512).is_ok());
}

/// A fake v2 tree: the kernel makes a cgroup's control files when its directory is
/// made; here the test makes them.
fn fake_v2_cgroup(dir: &Path, files: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    for f in files {
        std::fs::write(dir.join(f), "").unwrap();
    }
}

#[test]
fn the_v2_writer_delegates_and_writes_each_limit() {
    let tree = tempfile::tempdir().unwrap();
    let own = tree.path().join("svc");
    fake_v2_cgroup(&own, &["cgroup.subtree_control"]);
    std::fs::write(
        own.join("cgroup.controllers"),
        "cpuset cpu io memory pids\n",
    )
    .unwrap();
    std::fs::write(own.join("cgroup.subtree_control"), "cpu\n").unwrap();
    let parent = own.join("forkd");
    fake_v2_cgroup(&parent, &["cgroup.subtree_control"]);
    let cgroups = Cgroups::at(CgroupVersion::V2, vec![parent.clone()]);
    cgroups.make_parents().unwrap();
    // Only what was not enabled yet is asked for.
    let read = |p: &Path| std::fs::read_to_string(p).unwrap();
    assert_eq!(read(&own.join("cgroup.subtree_control")), "+memory +pids");
    assert_eq!(
        read(&parent.join("cgroup.subtree_control")),
        "+memory +cpu +pids"
    );

    let vm = parent.join("sbx-1");
    fake_v2_cgroup(
        &vm,
        &[
            "memory.max",
            "cpu.max",
            "cpu.weight",
            "pids.max",
            "cgroup.procs",
        ],
    );
    let limits = ResourceLimits {
        memory_bytes: 768 << 20,
        cpu_millicores: 1500,
        cpu_weight: 50,
        pids: 64,
    };
    let made = cgroups.create("sbx-1", &limits).unwrap();
    assert_eq!(read(&vm.join("memory.max")), (768u64 << 20).to_string());
    assert_eq!(read(&vm.join("cpu.max")), "150000 100000");
    assert_eq!(read(&vm.join("cpu.weight")), "50");
    assert_eq!(read(&vm.join("pids.max")), "64");
    assert_eq!(made.procs_files().unwrap().len(), 1);
    std::fs::write(vm.join("memory.current"), "4096\n").unwrap();
    std::fs::write(vm.join("pids.current"), "7\n").unwrap();
    assert_eq!(
        cgroups.usage("sbx-1"),
        Some(CgroupUsage {
            memory_bytes: 4096,
            pids: 7
        })
    );
    let unlimited = ResourceLimits {
        cpu_millicores: 0,
        ..limits
    };
    cgroups.create("sbx-1", &unlimited).unwrap();
    assert_eq!(read(&vm.join("cpu.max")), "max 100000");
    assert_eq!(cgroups.usage("sbx-2"), None);
}

#[test]
fn the_v2_writer_names_what_the_tree_does_not_offer() {
    let tree = tempfile::tempdir().unwrap();
    let own = tree.path().join("svc");
    fake_v2_cgroup(&own, &["cgroup.subtree_control"]);
    std::fs::write(own.join("cgroup.controllers"), "cpu io\n").unwrap();
    let cgroups = Cgroups::at(CgroupVersion::V2, vec![own.join("forkd")]);
    let err = cgroups.make_parents().unwrap_err();
    assert!(err.contains("memory, pids controllers"), "{err}");
}

#[test]
fn the_v1_writer_writes_each_hierarchy_its_own_files() {
    let tree = tempfile::tempdir().unwrap();
    let parents: Vec<PathBuf> = ["memory", "cpu", "pids"]
        .iter()
        .map(|c| tree.path().join(c).join("forkd"))
        .collect();
    let files: [&[&str]; 3] = [
        &[
            "memory.limit_in_bytes",
            "memory.memsw.limit_in_bytes",
            "cgroup.procs",
        ],
        &[
            "cpu.cfs_period_us",
            "cpu.cfs_quota_us",
            "cpu.shares",
            "cgroup.procs",
        ],
        &["pids.max", "cgroup.procs"],
    ];
    for (parent, files) in parents.iter().zip(files) {
        fake_v2_cgroup(&parent.join("sbx-1"), files);
    }
    let cgroups = Cgroups::at(CgroupVersion::V1, parents.clone());
    let made = cgroups
        .create("sbx-1", &ResourceLimits::for_vm(2, 256))
        .unwrap();
    let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
    let limit = ((256u64 << 20) + MEMORY_OVERHEAD).to_string();
    let vm: Vec<PathBuf> = parents.iter().map(|p| p.join("sbx-1")).collect();
    assert_eq!(read(vm[0].join("memory.limit_in_bytes")), limit);
    assert_eq!(read(vm[0].join("memory.memsw.limit_in_bytes")), limit);
    assert_eq!(read(vm[1].join("cpu.cfs_quota_us")), "200000");
    assert_eq!(read(vm[1].join("cpu.cfs_period_us")), "100000");
    assert_eq!(read(vm[1].join("cpu.shares")), "1024");
    assert_eq!(read(vm[2].join("pids.max")), "256");
    assert_eq!(made.procs_files().unwrap().len(), 3);
    assert!(cgroups
        .create("../x", &ResourceLimits::for_vm(1, 64))
        .is_err());
}

/// On a host with a v1 memory hierarchy (this project's CI machines), a real process
/// joins a real cgroup between fork and exec, is bounded by it, and the cgroup goes
/// when it is removed after the process exits.
#[test]
fn a_process_joins_its_cgroup_before_exec() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let v1_memory = parse_mounts(&mountinfo)
        .iter()
        .any(|m| m.fstype == "cgroup" && m.options.split(',').any(|o| o == "memory"));
    if !v1_memory || !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: needs root and a cgroup v1 memory hierarchy");
        return;
    }
    let cgroups = Cgroups::detect().expect("cgroups on a v1 host as root");
    let id = format!("test-join-{}", std::process::id());
    let limits = ResourceLimits {
        memory_bytes: 64 << 20,
        cpu_millicores: 250,
        cpu_weight: 100,
        pids: 16,
    };
    let made = cgroups.create(&id, &limits).unwrap();
    let files = made.procs_files().unwrap();
    let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    let mut cmd = std::process::Command::new("sleep");
    cmd.arg("30");
    // SAFETY: `join` only calls write(2) on descriptors kept open by `files`.
    unsafe {
        cmd.pre_exec(move || join(&fds));
    }
    let mut child = cmd.spawn().unwrap();
    drop(files);
    let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", child.id())).unwrap();
    let own_lines = membership
        .lines()
        .filter(|l| l.ends_with(&format!("/forkd/{id}")));
    assert_eq!(own_lines.count(), 3, "{membership}");
    let memory_dir = &cgroups.dirs(&id)[0];
    assert_eq!(
        read_number(memory_dir, "memory.limit_in_bytes"),
        Some(64 << 20)
    );
    assert_eq!(
        read_number(&cgroups.dirs(&id)[1], "cpu.cfs_quota_us"),
        Some(25_000)
    );
    let usage = cgroups.usage(&id).unwrap();
    assert_eq!(usage.pids, 1);
    child.kill().unwrap();
    child.wait().unwrap();
    cgroups.remove(&id);
    assert!(cgroups.dirs(&id).iter().all(|d| !d.exists()));
}
