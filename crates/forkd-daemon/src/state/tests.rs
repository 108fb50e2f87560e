use super::*;
use forkd_hypervisor::{Accel, MemoryBackend};

fn row(id: &str, timeout_at: Option<i64>) -> SandboxRow {
    SandboxRow {
        id: id.into(),
        snapshot: "python".into(),
        pid: 42,
        start_time: 7,
        config: VmConfig {
            id: id.into(),
            dir: "/run/x".into(),
            kernel: "/k".into(),
            initramfs: "/i".into(),
            cmdline: "console=ttyS0".into(),
            root_disk: "/d".into(),
            vcpus: 1,
            memory_mib: 512,
            memory: MemoryBackend::File {
                path: "/m".into(),
                shared: false,
            },
            accel: Accel::Tcg,
            cpu: "Westmere-v1".into(),
            clock: Default::default(),
            pit: true,
            limits: None,
            network: None,
            seccomp: true,
            detached: true,
        },
        labels: [("team".to_string(), "a".to_string())].into(),
        timeout_at,
        created_at: "2026-01-01T00:00:00Z".into(),
        state: SandboxState::Running,
        error: None,
        lifecycle: Default::default(),
    }
}

#[test]
fn rows_round_trip_and_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("forkd.db");
    let s = State::open(&path).unwrap();
    s.insert_sandbox(&row("sb-1", None)).unwrap();
    s.insert_sandbox(&row("sb-2", Some(100))).unwrap();
    assert!(
        s.insert_sandbox(&row("sb-1", None)).is_err(),
        "ids are unique"
    );
    drop(s);
    let s = State::open(&path).unwrap();
    assert_eq!(s.sandbox("sb-1").unwrap(), Some(row("sb-1", None)));
    assert_eq!(s.sandboxes().unwrap().len(), 2);
    assert_eq!(s.expired(99).unwrap(), Vec::<String>::new());
    assert_eq!(s.expired(100).unwrap(), vec!["sb-2".to_string()]);
    assert!(s.set_timeout("sb-2", None).unwrap());
    assert!(!s.set_timeout("sb-9", None).unwrap());
    assert!(s.expired(1000).unwrap().is_empty());
    // What its deadline and idleness do is kept with it.
    let lifecycle = Lifecycle {
        on_timeout: OnTimeout::Pause,
        auto_pause_after_s: Some(60),
        timeout_s: Some(100),
        pause_keeps: forkd_core::pause::PauseKeeps::Disk,
        manual_resume: true,
    };
    assert!(s.set_lifecycle("sb-2", &lifecycle).unwrap());
    assert_eq!(s.sandbox("sb-2").unwrap().unwrap().lifecycle, lifecycle);
    assert!(s.delete_sandbox("sb-1").unwrap());
    assert!(!s.delete_sandbox("sb-1").unwrap());
    assert_eq!(s.sandbox("sb-1").unwrap(), None);
}

#[test]
fn operations_left_running_are_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let s = State::open(&dir.path().join("forkd.db")).unwrap();
    let op = OperationRow {
        id: "op-1".into(),
        kind: "build_snapshot".into(),
        target: "python".into(),
        status: "running".into(),
        error: None,
        created_at: "t0".into(),
        finished_at: None,
        done: 0,
        total: 0,
        result: None,
        steps: Vec::new(),
    };
    s.insert_operation(&op).unwrap();
    let fork = OperationRow {
        id: "op-2".into(),
        kind: "fork".into(),
        ..op.clone()
    };
    s.insert_operation(&fork).unwrap();
    s.finish_with_result(
        "op-2",
        &OperationEnd {
            status: "succeeded",
            error: None,
            finished_at: "t0",
            done: 2,
            total: 5,
            result: &serde_json::json!({"sandboxes": ["sb-1"]}),
        },
    )
    .unwrap();
    assert_eq!(
        s.interrupt_running_operations("t1").unwrap(),
        vec![Interrupted {
            kind: "build_snapshot".into(),
            target: "python".into(),
            result: None
        }]
    );
    assert!(s.interrupt_running_operations("t2").unwrap().is_empty());
    // A branch is failed, not interrupted, and says which sandbox it branched.
    let branch = OperationRow {
        id: "op-3".into(),
        kind: "branch".into(),
        target: "b1".into(),
        result: Some(serde_json::json!({"source": "sb-9"})),
        steps: Vec::new(),
        ..op.clone()
    };
    s.insert_operation(&branch).unwrap();
    let cut = s.interrupt_running_operations("t3").unwrap();
    assert_eq!(cut.len(), 1);
    assert_eq!(cut[0].result.as_ref().unwrap()["source"], "sb-9");
    let got = s.operation("op-3").unwrap().unwrap();
    assert_eq!(
        (got.status.as_str(), got.kind.as_str()),
        ("failed", "branch")
    );
    let got = s.operation("op-1").unwrap().unwrap();
    assert_eq!(got.status, "interrupted");
    assert_eq!(got.finished_at.as_deref(), Some("t1"));
    let fork = s.operation("op-2").unwrap().unwrap();
    assert_eq!(
        fork.status, "succeeded",
        "a finished operation is not interrupted"
    );
    assert_eq!((fork.done, fork.total), (2, 5));
    assert_eq!(fork.result.unwrap()["sandboxes"][0], "sb-1");
}

#[test]
fn states_change_only_as_the_lifecycle_allows() {
    let dir = tempfile::tempdir().unwrap();
    let s = State::open(&dir.path().join("forkd.db")).unwrap();
    let mut r = row("sb-1", None);
    r.state = SandboxState::Starting;
    r.pid = 0;
    s.insert_sandbox(&r).unwrap();
    assert!(s
        .set_state("sb-1", SandboxState::Running, None, Some((77, 9)))
        .unwrap());
    let got = s.sandbox("sb-1").unwrap().unwrap();
    assert_eq!(
        (got.state, got.pid, got.start_time),
        (SandboxState::Running, 77, 9)
    );
    s.set_state("sb-1", SandboxState::Unresponsive, Some("no answer"), None)
        .unwrap();
    assert_eq!(
        s.sandbox("sb-1").unwrap().unwrap().error.as_deref(),
        Some("no answer")
    );
    s.set_state("sb-1", SandboxState::Stopping, None, None)
        .unwrap();
    let e = s
        .set_state("sb-1", SandboxState::Running, None, None)
        .unwrap_err();
    assert!(e.to_string().contains("from stopping to running"), "{e}");
    assert!(!s
        .set_state("sb-9", SandboxState::Running, None, None)
        .unwrap());
}

#[test]
fn a_version_1_database_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("forkd.db");
    let c = Connection::open(&path).unwrap();
    c.execute_batch(MIGRATIONS[0]).unwrap();
    c.execute(
        "INSERT INTO sandboxes VALUES ('sb-1', 'python', 42, 7, ?1, '{}', NULL, 't0')",
        params![serde_json::to_string(&row("sb-1", None).config).unwrap()],
    )
    .unwrap();
    c.pragma_update(None, "user_version", 1).unwrap();
    drop(c);
    let s = State::open(&path).unwrap();
    let got = s.sandbox("sb-1").unwrap().unwrap();
    assert_eq!(got.state, SandboxState::Running);
    assert_eq!(got.error, None);
}

#[test]
fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("forkd.db");
    let c = Connection::open(&path).unwrap();
    c.pragma_update(None, "user_version", 99).unwrap();
    drop(c);
    let e = State::open(&path).err().unwrap().to_string();
    assert!(e.contains("newer forkd (schema 99"), "{e}");
}
