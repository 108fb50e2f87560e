//! The registry's rules on the fake backend (agent processes for VMs): capacity,
//! state transitions, reaping and adoption after a crash, in milliseconds.

use super::*;
use forkd_core::lifecycle::SandboxState;
use forkd_hypervisor::fake::AgentProcesses;
use forkd_hypervisor::Accel;
use forkd_proto::exec::{Command, ExecRequest};
use forkd_storage::snapshot::manifest::{parts, BuildTimes, Machine, Manifest, Versions};
use forkd_storage::snapshot::{Snapshot, Tag};

struct World {
    _dir: tempfile::TempDir,
    home: Home,
    state: Arc<State>,
    snap: Snapshot,
}

impl Drop for World {
    /// The fake backend's VMs run detached, as real ones do, and outlive the registries
    /// that made them: a test that keeps one on purpose would leave it running. Every
    /// process that names something in this world's directory is stopped with it.
    fn drop(&mut self) {
        for (pid, start_time) in forkd_host::process::find_inside(self._dir.path()) {
            forkd_host::process::kill(pid, start_time);
        }
    }
}

fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let home = Home::new(dir.path());
    let snap = fake_snapshot(&home, "fake");
    let state = Arc::new(State::open(&dir.path().join("forkd.db")).unwrap());
    World {
        _dir: dir,
        home,
        state,
        snap,
    }
}

/// A snapshot `tag` whose parts are placeholder files (the fake backend reads none).
fn fake_snapshot(home: &Home, tag: &str) -> Snapshot {
    let store = Store::of_home(home);
    let tag = Tag::parse(tag).unwrap();
    let staging = store.stage(&tag).unwrap();
    for p in parts::ALL {
        std::fs::write(staging.part(p), p.as_bytes()).unwrap();
    }
    let manifest = Manifest {
        format: forkd_storage::snapshot::manifest::FORMAT,
        tag: tag.to_string(),
        template: "fake".into(),
        created_at: "2026-01-01T00:00:00Z".into(),
        parent: None,
        parent_digest: None,
        branch: None,
        machine: Machine {
            vcpus: 1,
            memory_mib: 128,
            accel: Accel::Tcg,
            cpu: "max".into(),
            cmdline: String::new(),
            clock: Default::default(),
            pit: true,
            nic: false,
        },
        versions: Versions {
            kernel: "none".into(),
            rootfs: "none".into(),
            initramfs_sha256: String::new(),
            forkd: "test".into(),
            agent_protocol: forkd_proto::PROTOCOL_VERSION,
            hypervisor: "fake".into(),
            hypervisor_version: "fake".into(),
        },
        parts: Default::default(),
        contexts: Vec::new(),
        build: BuildTimes::default(),
        pool: 0,
        egress: None,
        lifecycle: Default::default(),
    };
    staging.publish(manifest, &|_| {}).unwrap()
}

fn fake() -> AgentProcesses {
    AgentProcesses::from_build(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

impl World {
    fn registry(&self, max: usize) -> Registry {
        self.registry_on(fake(), max)
    }

    fn registry_on(&self, hv: AgentProcesses, max: usize) -> Registry {
        Registry::new(
            Arc::new(hv),
            self.home.clone(),
            Store::of_home(&self.home),
            self.state.clone(),
            max,
        )
        .with_agent_timeout(Duration::from_millis(600))
    }
}

use std::path::Path;

fn spec(count: usize) -> CreateSpec {
    CreateSpec::new(count)
}

fn signal(row: &SandboxRow, sig: nix::sys::signal::Signal) {
    assert!(forkd_host::process::signal(row.pid, row.start_time, sig));
}

async fn echo(e: &Entry) -> Result<forkd_core::agent::ExecResult, SandboxError> {
    e.sandbox
        .exec(
            ExecRequest::new(Command::Argv(vec!["echo".into(), "hi".into()])),
            None,
        )
        .await
}

/// Runs the reaper until `done` holds (the watchdog works on its own clock).
async fn reap_until(r: &Registry, done: impl Fn(&Registry) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(r) {
        assert!(Instant::now() < deadline, "condition not reached");
        r.reap(crate::unix_now()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn db_state(w: &World, id: &str) -> Option<SandboxState> {
    w.state.sandbox(id).unwrap().map(|r| r.state)
}

#[tokio::test]
async fn children_get_the_env_they_were_created_with() {
    let w = world();
    let r = w.registry(2);
    let spec = CreateSpec {
        env: [("FORKD_T".to_owned(), "a b=c".to_owned())].into(),
        ..spec(1)
    };
    let e = r.create(&w.snap, spec).await.unwrap().entries.remove(0);
    let mut req = ExecRequest::new(Command::Shell("echo \"$FORKD_T|$HOME\"".into()));
    let out = e.sandbox.exec(req.clone(), None).await.unwrap();
    assert_eq!(out.stdout, b"a b=c|/root\n");
    // A request's own env still wins.
    req.env.insert("FORKD_T".into(), "mine".into());
    let out = e.sandbox.exec(req, None).await.unwrap();
    assert_eq!(out.stdout, b"mine|/root\n");
}

#[tokio::test]
async fn capacity_counts_every_recorded_sandbox_and_rows_say_running() {
    let w = world();
    let r = w.registry(3);
    let two = r.create(&w.snap, spec(2)).await.unwrap().entries;
    assert_eq!(r.running(), 2);
    for e in &two {
        assert_eq!(db_state(&w, &e.row.id), Some(SandboxState::Running));
        let row = w.state.sandbox(&e.row.id).unwrap().unwrap();
        assert_eq!(row.pid, e.sandbox.pid().unwrap());
        assert_ne!(row.start_time, 0);
        assert_eq!(echo(e).await.unwrap().stdout, b"hi\n");
    }
    let Err(e) = r.create(&w.snap, spec(2)).await else {
        panic!("a fork over capacity was accepted");
    };
    assert!(
        matches!(
            e,
            RegistryError::AtCapacity {
                live: 2,
                asked: 2,
                max: 3
            }
        ),
        "{e}"
    );
    let op_rows = w.state.sandboxes().unwrap();
    assert_eq!(op_rows.len(), 2, "a refused fork records nothing");
    for e in &two {
        r.delete(&e.row.id).await.unwrap();
        assert!(!e.row.config.dir.exists());
        assert_eq!(db_state(&w, &e.row.id), None);
    }
    assert_eq!(r.running(), 0);
}

#[tokio::test]
async fn a_silent_agent_makes_a_sandbox_unresponsive_until_it_answers() {
    let w = world();
    let r = w.registry(4);
    let e = r.create(&w.snap, spec(1)).await.unwrap().entries.remove(0);
    let id = e.row.id.clone();
    signal(&e.row, nix::sys::signal::Signal::SIGSTOP);
    reap_until(&r, |r| {
        r.describe(&id).unwrap().row.state == SandboxState::Unresponsive
    })
    .await;
    assert_eq!(db_state(&w, &id), Some(SandboxState::Unresponsive));
    let err = echo(&e).await.unwrap_err();
    assert!(matches!(err, SandboxError::Unresponsive { .. }), "{err}");
    assert!(err.to_string().contains("kept"), "{err}");
    assert!(e.sandbox.failure().is_none());
    assert!(forkd_host::process::is_alive(e.row.pid), "the VM is kept");
    signal(&e.row, nix::sys::signal::Signal::SIGCONT);
    reap_until(&r, |r| {
        r.describe(&id).unwrap().row.state == SandboxState::Running
    })
    .await;
    assert_eq!(db_state(&w, &id), Some(SandboxState::Running));
    assert_eq!(echo(&e).await.unwrap().stdout, b"hi\n");
    r.delete(&id).await.unwrap();
}

#[tokio::test]
async fn a_vm_that_dies_is_kept_failed_and_a_deadline_ends_a_sandbox() {
    let w = world();
    let r = w.registry(4);
    let mut two = r.create(&w.snap, spec(2)).await.unwrap().entries;
    let (a, b) = (two.remove(0), two.remove(0));
    forkd_host::process::kill(a.row.pid, a.row.start_time);
    reap_until(&r, |r| r.get(&a.row.id).is_err()).await;
    // Failed, saying why, its files kept until it is deleted; it holds no slot.
    assert_eq!(db_state(&w, &a.row.id), Some(SandboxState::Failed));
    let failed = r.describe(&a.row.id).unwrap();
    assert!(failed.row.error.is_some() && failed.sandbox.is_none());
    assert!(a.row.config.dir.exists());
    assert_eq!(r.running(), 1);
    r.delete(&a.row.id).await.unwrap();
    assert_eq!(db_state(&w, &a.row.id), None);
    assert!(!a.row.config.dir.exists());
    r.set_timeout(&b.row.id, Some(crate::unix_now() - 1))
        .unwrap();
    let removed = r.reap(crate::unix_now()).await;
    assert_eq!(removed, vec![b.row.id.clone()]);
    assert!(!forkd_host::process::is_alive(b.row.pid));
    assert_eq!(r.running(), 0);
}

#[tokio::test]
async fn a_restart_adopts_live_children_keeps_dead_ones_and_removes_what_a_crash_left() {
    let w = world();
    let first = w.registry(8);
    let mut kids = first.create(&w.snap, spec(3)).await.unwrap().entries;
    // The daemon "dies": its handles go, its detached VMs run on.
    drop(first);
    let (live, dead, stopping) = (kids.remove(0), kids.remove(0), kids.remove(0));
    forkd_host::process::kill(dead.row.pid, dead.row.start_time);
    // A delete was interrupted after it marked the row.
    w.state
        .set_state(&stopping.row.id, SandboxState::Stopping, None, None)
        .unwrap();
    // A fork was interrupted after the row of a child and its VM's start, before its
    // pid was recorded: found by its directory on a command line.
    let orphan_dir = forkd_core::sandbox::sandboxes_dir(&w.home).join("sb-0badc0ffee");
    std::fs::create_dir_all(&orphan_dir).unwrap();
    let mut orphan_cfg = live.row.config.clone();
    orphan_cfg.id = "sb-0badc0ffee".into();
    orphan_cfg.dir = orphan_dir.clone();
    w.state
        .insert_sandbox(&SandboxRow {
            id: "sb-0badc0ffee".into(),
            pid: 0,
            start_time: 0,
            config: orphan_cfg,
            state: SandboxState::Starting,
            ..live.row.clone()
        })
        .unwrap();
    let mut orphan = std::process::Command::new("sh")
        .args(["-c", "sleep 60; true"])
        .arg(orphan_dir.join("qmp.sock"))
        .spawn()
        .unwrap();
    // A directory nobody owns, left by a fork killed before its row.
    let stray = forkd_core::sandbox::sandboxes_dir(&w.home).join("sb-5ca7");
    std::fs::create_dir_all(&stray).unwrap();

    let second = w.registry(8);
    let (adopted, gone) = second.adopt_all().await.unwrap();
    assert_eq!(adopted, vec![live.row.id.clone()]);
    let mut gone = gone;
    gone.sort();
    let mut expected = vec![
        dead.row.id.clone(),
        stopping.row.id.clone(),
        "sb-0badc0ffee".to_string(),
    ];
    expected.sort();
    assert_eq!(gone, expected);
    assert!(!forkd_host::process::is_alive(stopping.row.pid));
    assert!(!forkd_host::process::is_alive(orphan.id()));
    assert!(!orphan.wait().unwrap().success(), "killed, not ended");
    assert!(!orphan_dir.exists());
    // The one whose VM died while the daemon was away is failed, its files kept.
    assert!(dead.row.config.dir.exists());
    assert_eq!(db_state(&w, &dead.row.id), Some(SandboxState::Failed));
    assert_eq!(second.prune_unowned(), vec!["sb-5ca7".to_string()]);
    assert!(live.row.config.dir.exists());
    assert_eq!(second.running(), 1);
    let e = second.get(&live.row.id).unwrap();
    assert_eq!(echo(&e).await.unwrap().stdout, b"hi\n");
    assert_eq!(
        w.state.sandboxes().unwrap().len(),
        2,
        "nothing double-counted"
    );
    second.delete(&live.row.id).await.unwrap();
    second.delete(&dead.row.id).await.unwrap();
    assert!(!dead.row.config.dir.exists());
}

#[tokio::test]
async fn a_live_vm_that_cannot_be_reached_is_kept_not_killed() {
    let w = world();
    let first = w.registry(8);
    let e = first
        .create(&w.snap, spec(1))
        .await
        .unwrap()
        .entries
        .remove(0);
    drop(first);
    // Its agent does not answer the restarted daemon (stopped), yet it runs.
    signal(&e.row, nix::sys::signal::Signal::SIGSTOP);
    let second = w.registry(8);
    let (adopted, gone) = second.adopt_all().await.unwrap();
    assert!(
        adopted.is_empty() && gone.is_empty(),
        "{adopted:?} {gone:?}"
    );
    let listed = second.describe(&e.row.id).unwrap();
    assert_eq!(listed.row.state, SandboxState::Unresponsive);
    assert!(listed.sandbox.is_none());
    assert!(matches!(
        second.get(&e.row.id),
        Err(SandboxError::NotReady { .. })
    ));
    assert!(forkd_host::process::is_alive(e.row.pid));
    assert_eq!(second.running(), 1);
    // Once it answers, the reaper takes it over.
    signal(&e.row, nix::sys::signal::Signal::SIGCONT);
    if let Some(u) = second.slots().unattached.get_mut(&e.row.id) {
        u.next_try = Instant::now();
    }
    reap_until(&second, |r| r.get(&e.row.id).is_ok()).await;
    assert_eq!(db_state(&w, &e.row.id), Some(SandboxState::Running));
    second.delete(&e.row.id).await.unwrap();
    assert!(!forkd_host::process::is_alive(e.row.pid));
}

/// Every process whose command line names a sandbox directory of this world.
fn vms_of(w: &World) -> Vec<(u32, u64)> {
    let dir = forkd_core::sandbox::sandboxes_dir(&w.home);
    forkd_host::process::find_inside(&dir)
}

#[tokio::test]
async fn a_fork_of_twelve_with_k_3_never_restores_more_than_3_at_once() {
    let w = world();
    let hv = fake().with_restore_delay(Duration::from_millis(50));
    let r = w.registry_on(hv.clone(), 16).with_fork_parallelism(3);
    let out = r.create(&w.snap, spec(12)).await.unwrap();
    assert_eq!(out.entries.len(), 12);
    // The restores overlap (3 at a time), and never more: without pacing all 12
    // would be in flight together.
    assert_eq!(hv.most_restores_in_flight(), 3);
    let op = w.state.operation(&out_op(&w)).unwrap().unwrap();
    assert_eq!(
        (op.status.as_str(), op.done, op.total),
        ("succeeded", 12, 12)
    );
    for e in out.entries {
        r.delete(&e.row.id).await.unwrap();
    }
    assert!(vms_of(&w).is_empty());
}

/// The id of the one fork operation of a world.
fn out_op(w: &World) -> String {
    let conn = rusqlite::Connection::open(w._dir.path().join("forkd.db")).unwrap();
    conn.query_row("SELECT id FROM operations WHERE kind = 'fork'", [], |r| {
        r.get(0)
    })
    .unwrap()
}

#[tokio::test]
async fn a_partial_fork_keeps_the_started_children_and_lists_the_errors() {
    let w = world();
    let r = w
        .registry_on(fake().with_failing_restores(3), 16)
        .with_fork_parallelism(2);
    let out = r
        .create(
            &w.snap,
            CreateSpec {
                partial: true,
                ..spec(6)
            },
        )
        .await
        .unwrap();
    assert_eq!((out.entries.len(), out.failures.len()), (4, 2));
    for f in &out.failures {
        assert!(f.to_string().contains("fake backend fails"), "{f}");
    }
    assert_eq!(
        w.state.sandboxes().unwrap().len(),
        4,
        "failed children leave no row"
    );
    assert_eq!(vms_of(&w).len(), 4);
    let op = w.state.operation(&out_op(&w)).unwrap().unwrap();
    let result = op.result.unwrap();
    assert_eq!(result["sandboxes"].as_array().unwrap().len(), 4);
    assert_eq!(result["errors"].as_array().unwrap().len(), 2);
    for e in out.entries {
        r.delete(&e.row.id).await.unwrap();
    }

    // All or nothing (the default): one failure and nothing is kept.
    let r = w
        .registry_on(fake().with_failing_restores(3), 16)
        .with_fork_parallelism(2);
    let Err(e) = r.create(&w.snap, spec(6)).await else {
        panic!("an all-or-nothing fork with a failed child succeeded");
    };
    assert!(e.to_string().contains("fake backend fails"), "{e}");
    assert!(w.state.sandboxes().unwrap().is_empty());
    assert!(vms_of(&w).is_empty());
    assert_eq!(r.running(), 0);
}

#[tokio::test]
async fn a_cancelled_fork_leaves_nothing() {
    let w = world();
    let r = w
        .registry_on(fake().with_restore_delay(Duration::from_millis(100)), 16)
        .with_fork_parallelism(1);
    let s = CreateSpec {
        partial: true,
        ..spec(12)
    };
    let op = s.op_id.clone();
    let fork = r.create(&w.snap, s);
    let cancel = async {
        // Cancel once a few children are up.
        loop {
            if r.progress(&op).unwrap_or(0) >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(r.cancel(&op));
    };
    let (res, ()) = tokio::join!(fork, cancel);
    let Err(e) = res else {
        panic!("a cancelled fork succeeded");
    };
    assert!(
        matches!(e, RegistryError::Sandbox(SandboxError::Cancelled)),
        "{e}"
    );
    assert!(w.state.sandboxes().unwrap().is_empty());
    assert!(vms_of(&w).is_empty(), "{:?}", vms_of(&w));
    assert_eq!(r.running(), 0);
    let row = w.state.operation(&op).unwrap().unwrap();
    assert_eq!(row.status, "cancelled");
    assert!(!r.cancel(&op), "a finished fork cannot be cancelled");
    let left = std::fs::read_dir(forkd_core::sandbox::sandboxes_dir(&w.home))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(left, 0, "no sandbox directory is left");
}

#[tokio::test]
async fn a_fork_that_would_not_fit_in_memory_is_refused_before_anything_starts() {
    let w = world();
    let r = w.registry(16).with_memory_overcommit(1e-12);
    let Err(e) = r.create(&w.snap, spec(2)).await else {
        panic!("a fork past the memory budget was admitted");
    };
    assert!(matches!(e, RegistryError::Memory(_)), "{e}");
    assert!(e.to_string().contains("the default"), "{e}");
    assert!(w.state.sandboxes().unwrap().is_empty());
    assert!(vms_of(&w).is_empty());
    // With a child alive, the estimate is measured on it.
    let r = w.registry(16);
    let one = r.create(&w.snap, spec(1)).await.unwrap().entries;
    let r2 = w.registry(16).with_memory_overcommit(1e-12);
    r2.adopt_all().await.unwrap();
    let Err(e) = r2.create(&w.snap, spec(1)).await else {
        panic!("a fork past the memory budget was admitted");
    };
    assert!(e.to_string().contains("measured on 1 live"), "{e}");
    drop(r);
    r2.delete(&one[0].row.id).await.unwrap();
}

/// Ids of the pool members recorded in the database.
fn member_rows(w: &World) -> Vec<String> {
    w.state
        .pool_members()
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect()
}

#[tokio::test]
async fn a_pool_of_3_serves_3_forks_and_refills() {
    let w = world();
    let r = w.registry(8);
    let status = r.set_pool_size(&w.snap, Some(3)).await.unwrap();
    assert_eq!((status.size, status.source.as_str()), (3, "api"));
    assert_eq!(r.fill_pools().await, 3);
    assert_eq!(r.fill_pools().await, 0, "a full pool makes no more");
    let members = member_rows(&w);
    assert_eq!(members.len(), 3);
    assert_eq!(vms_of(&w).len(), 3, "each member's VM runs");
    assert!(r.list().is_empty(), "members are not sandboxes");
    for (i, _) in members.iter().enumerate() {
        let child = r.create(&w.snap, spec(1)).await.unwrap().entries.remove(0);
        assert!(
            members.contains(&child.row.id),
            "fork {i} made {} instead of taking a member",
            child.row.id
        );
        assert_eq!(db_state(&w, &child.row.id), Some(SandboxState::Running));
        assert_eq!(echo(&child).await.unwrap().stdout, b"hi\n");
        assert_eq!(r.pool_status(&w.snap).idle, 2 - i);
        assert!(!member_rows(&w).contains(&child.row.id));
    }
    assert_eq!(
        r.fill_pools().await,
        0,
        "the pool waits for the children's start"
    );
    tokio::time::sleep(crate::pool::REFILL_AFTER).await;
    assert_eq!(r.fill_pools().await, 3, "the pool refills");
    let refilled = member_rows(&w);
    assert!(refilled.iter().all(|id| !members.contains(id)));
    assert_eq!(vms_of(&w).len(), 6);

    // A daemon's members are its own: the next one removes them, VMs and files.
    let dirs: Vec<_> = w
        .state
        .pool_members()
        .unwrap()
        .into_iter()
        .map(|m| m.dir)
        .collect();
    drop(r);
    let r = w.registry(8);
    assert_eq!(r.open_pools().await.unwrap(), 3);
    assert!(member_rows(&w).is_empty());
    assert!(dirs.iter().all(|d| !d.exists()));
    r.adopt_all().await.unwrap();
    assert_eq!(vms_of(&w).len(), 3, "only the three children are left");
    assert_eq!(r.pool_status(&w.snap).size, 3, "the size set is kept");
    for l in r.list() {
        r.delete(&l.row.id).await.unwrap();
    }
    r.drain_pool("fake").await;
    assert!(vms_of(&w).is_empty());
}

#[tokio::test]
async fn idle_members_are_reclaimed_before_a_fork_is_refused() {
    let w = world();
    let other = fake_snapshot(&w.home, "other");
    let r = w.registry(4);
    r.set_pool_size(&other, Some(3)).await.unwrap();
    assert_eq!(r.fill_pools().await, 3);
    // 3 members of `other` + 2 children of `fake` exceed 4: the members go.
    let two = r.create(&w.snap, spec(2)).await.unwrap().entries;
    assert_eq!(two.len(), 2);
    assert_eq!(r.pool_status(&other).idle, 0);
    assert!(member_rows(&w).is_empty());
    assert_eq!(vms_of(&w).len(), 2);
    // A pool refills only where there is room.
    tokio::time::sleep(crate::pool::REFILL_AFTER).await;
    assert_eq!(r.fill_pools().await, 2);
    let Err(e) = r.create(&w.snap, spec(3)).await else {
        panic!("a fork over capacity was accepted");
    };
    assert!(matches!(e, RegistryError::AtCapacity { .. }), "{e}");
    for e in two {
        r.delete(&e.row.id).await.unwrap();
    }
    r.drain_pool("other").await;
    assert!(vms_of(&w).is_empty());
}

#[tokio::test]
async fn a_member_whose_vm_died_is_replaced_by_a_fresh_restore() {
    let w = world();
    let r = w.registry(8);
    r.set_pool_size(&w.snap, Some(2)).await.unwrap();
    assert_eq!(r.fill_pools().await, 2);
    let members = member_rows(&w);
    // One member's VM dies while it waits.
    let (pid, _) = vms_of(&w)[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    while vms_of(&w).len() > 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let two = r.create(&w.snap, spec(2)).await.unwrap().entries;
    assert_eq!(two.len(), 2, "the fork does not fail for a dead member");
    assert!(two.iter().any(|e| members.contains(&e.row.id)));
    for e in &two {
        assert_eq!(echo(e).await.unwrap().stdout, b"hi\n");
    }
    assert_eq!(vms_of(&w).len(), 2, "one VM per child");
    for e in two {
        r.delete(&e.row.id).await.unwrap();
    }
    r.set_pool_size(&w.snap, Some(0)).await.unwrap();
    assert!(vms_of(&w).is_empty());
}
