//! BRANCH of a running `python` child: its children start with the source's state at the
//! branch instant (context variables, files, processes), with their own randomness, and
//! the source runs on without seeing them. Branches of branches form a chain whose head
//! forks like any snapshot.

mod common;

use common::{build_template, fork, fork_options, home, hv, sh, TestStore};
use forkd_core::branch::{self, Branched};
use forkd_core::compact::compact;
use forkd_core::template::Recipe;
use forkd_core::Sandbox;
use forkd_hypervisor::BranchMode;
use forkd_storage::snapshot::manifest::parts;
use forkd_storage::snapshot::{chain, Snapshot, Tag};

use common::run_code as run;

async fn shell(sb: &Sandbox, script: &str) -> String {
    let r = sb.exec(sh(script), None).await.unwrap();
    assert!(r.status.success(), "{script}: {r:?}");
    String::from_utf8_lossy(&r.stdout).trim().to_owned()
}

async fn branch_of(
    ts: &TestStore,
    source: &Sandbox,
    base: &Snapshot,
    tag: &str,
    mode: BranchMode,
) -> Branched {
    let tag = Tag::parse(tag).unwrap();
    branch::branch(
        hv().as_ref(),
        &home(),
        &ts.store,
        source,
        base,
        &tag,
        mode,
        &|m| eprintln!("[branch {tag}] {m}"),
    )
    .await
    .unwrap_or_else(|e| panic!("branching into {tag}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_of_a_branch_have_the_source_state_and_chains_fork() {
    let ts = TestStore::new();
    let recipe = Recipe::find("python", &[]).unwrap();
    let template = build_template(&ts.store, &recipe, "python-b").await;
    let source = fork(&home(), &template, &fork_options(1))
        .await
        .unwrap()
        .remove(0);
    run(&source, "x = 41").await;
    shell(&source, "echo written-before > /root/note && sync").await;
    let bg = source
        .call(|a| async move { a.spawn_process(&sh("while true; do sleep 1; done")).await })
        .await
        .unwrap();

    for (i, mode) in [BranchMode::Live, BranchMode::Pause]
        .into_iter()
        .enumerate()
    {
        let tag = format!("b-{mode}");
        // Its disk builds on its latest branch once it has one.
        let base = branch::base_of(source.dir(), "python-b");
        let base = ts.store.open(&Tag::parse(&base).unwrap()).unwrap();
        let b = branch_of(&ts, &source, &base, &tag, mode).await;
        eprintln!(
            "{mode}: pause {:?}, copy {:?}, {} pages differ, total {:?}",
            b.stats.pause, b.stats.copy, b.diff.pages, b.total
        );
        let m = &b.snapshot.manifest;
        // The first branch builds on the template; the second on the first.
        let want_parent = if i == 0 {
            "python-b".to_owned()
        } else {
            "b-live".to_owned()
        };
        assert_eq!(m.parent.as_deref(), Some(want_parent.as_str()));
        assert!(m.parts.contains_key(parts::MEMORY_DIFF));
        // The source goes on, and can write after the branch.
        assert_eq!(run(&source, "x").await.text(), Some("41"));
        shell(&source, &format!("echo after > /root/later-{mode}")).await;

        let count = if i == 0 { 3 } else { 1 };
        let children = fork(&home(), &b.snapshot, &fork_options(count))
            .await
            .unwrap();
        let mut draws = Vec::new();
        for c in &children {
            assert_eq!(run(c, "x + 1").await.text(), Some("42"), "{}", c.id());
            assert_eq!(shell(c, "cat /root/note").await, "written-before");
            // Written by the source after the branch: not in the branch.
            assert_eq!(
                shell(c, "test -e /root/later && echo yes || echo no").await,
                "no"
            );
            let procs = c
                .call(|a| async move { a.list_processes().await })
                .await
                .unwrap();
            let p = procs
                .iter()
                .find(|p| p.id == bg.id)
                .expect("the background process");
            assert!(p.exit.is_none(), "{p:?}");
            assert_eq!(
                shell(c, &format!("kill -0 {} && echo alive", p.pid)).await,
                "alive"
            );
            draws.push(
                run(c, "import os, random\n(os.urandom(16).hex(), random.random(), float(np.random.rand()))")
                    .await
                    .text()
                    .unwrap()
                    .to_owned(),
            );
            // A child's writes stay its own.
            shell(c, &format!("echo {} > /root/child", c.id())).await;
            run(c, "x = 0").await;
        }
        assert_eq!(
            shell(&source, "test -e /root/child && echo yes || echo no").await,
            "no"
        );
        assert_eq!(run(&source, "x").await.text(), Some("41"));
        let mut unique = draws.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(
            unique.len(),
            draws.len(),
            "children drew the same numbers: {draws:?}"
        );
        for c in children {
            c.destroy().await.unwrap();
        }
    }

    // A chain: a child of b-pause is branched, and a child of that one again.
    let head = ts.store.open(&Tag::parse("b-pause").unwrap()).unwrap();
    let mut snap = head;
    for depth in 2..=3 {
        let c = fork(&home(), &snap, &fork_options(1))
            .await
            .unwrap()
            .remove(0);
        run(&c, &format!("depth = {depth}")).await;
        let b = branch_of(&ts, &c, &snap, &format!("chain-{depth}"), BranchMode::Live).await;
        c.destroy().await.unwrap();
        assert_eq!(
            b.snapshot.manifest.parent.as_deref(),
            Some(snap.tag.as_str())
        );
        // Little changed: the link stores a fraction of the RAM.
        let own = std::fs::metadata(b.snapshot.part(parts::MEMORY_DIFF))
            .unwrap()
            .len();
        assert!(
            own < (u64::from(template.manifest.machine.memory_mib) << 20) / 10,
            "depth {depth}: the diff is {own} bytes"
        );
        snap = b.snapshot;
    }
    let c = fork(&home(), &snap, &fork_options(1))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(run(&c, "(x, depth)").await.text(), Some("(41, 3)"));
    assert_eq!(shell(&c, "cat /root/note").await, "written-before");
    c.destroy().await.unwrap();
    let info = chain::info(&ts.store, &snap).unwrap();
    assert_eq!(info.depth, 4, "{info:?}");
    assert_eq!(info.ancestors, ["chain-2", "b-pause", "b-live", "python-b"]);
    assert!(
        info.total_bytes > info.own_bytes + info.memory_image_bytes,
        "{info:?}"
    );
    assert_eq!(chain::verify(&ts.store, &snap.tag).unwrap().len(), 5);

    // Compacted, the head stands alone: it forks after its whole chain is gone.
    let flat_tag = Tag::parse("flat").unwrap();
    let flat = compact(hv().as_ref(), &ts.store, &snap, &flat_tag)
        .await
        .unwrap();
    assert_eq!(flat.manifest.parent, None);
    source.destroy().await.unwrap();
    let b_live = Tag::parse("b-live").unwrap();
    let doomed = chain::descendants(&ts.store, &b_live);
    assert_eq!(doomed, ["chain-3", "chain-2", "b-pause"]);
    let refused = ts.store.remove(&b_live, &[]).unwrap_err().to_string();
    assert!(refused.contains("b-pause"), "{refused}");
    for t in doomed.iter().chain([&"b-live".to_owned()]) {
        ts.store.remove(&Tag::parse(t).unwrap(), &[]).unwrap();
    }
    let c = fork(&home(), &flat, &fork_options(1))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(run(&c, "(x, depth)").await.text(), Some("(41, 3)"));
    assert_eq!(
        shell(&c, "cat /root/note /root/later-live").await,
        "written-before\nafter"
    );
    ts.store.verify(&flat_tag).unwrap();
}
