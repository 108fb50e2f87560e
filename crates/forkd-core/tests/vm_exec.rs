//! Commands in a real `minimal` guest under QEMU.

mod common;

use common::{argv, boot, sh, Footprint};
use forkd_image::RootfsImage;
use sha2::{Digest, Sha256};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_round_trips_output_status_env_cwd_and_stdin() {
    let sb = boot(RootfsImage::Minimal).await;
    let fp = Footprint::of(&sb);

    let r = sb.exec(argv(&["echo", "hello"]), None).await.unwrap();
    assert_eq!(r.stdout, b"hello\n");
    assert!(r.stderr.is_empty());
    assert_eq!(r.status.code, Some(0));
    assert!(r.status.success());

    let r = sb
        .exec(sh("echo out; echo err >&2; exit 7"), None)
        .await
        .unwrap();
    assert_eq!(r.stdout, b"out\n");
    assert_eq!(r.stderr, b"err\n");
    assert_eq!(r.status.code, Some(7));
    assert!(!r.status.timed_out);

    let mut req = sh("printf '%s|%s|' \"$GREETING\" \"$(pwd)\"; cat");
    req.env.insert("GREETING".into(), "hi there = ok".into());
    req.cwd = Some("/tmp".into());
    let stdin: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let r = sb.exec(req, Some(stdin.clone())).await.unwrap();
    let mut want = b"hi there = ok|/tmp|".to_vec();
    want.extend_from_slice(&stdin);
    assert_eq!(r.stdout.len(), want.len());
    assert!(r.stdout == want, "stdout differs from env|cwd|stdin");
    assert_eq!(r.status.code, Some(0));

    // A missing program and a missing cwd are errors, not hangs.
    let err = sb
        .exec(argv(&["/no/such/program"]), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("/no/such/program"), "{err}");
    let mut req = argv(&["true"]);
    req.cwd = Some("/no/such/dir".into());
    let err = sb.exec(req, None).await.unwrap_err();
    assert!(err.to_string().contains("/no/such/dir"), "{err}");

    // A signal is reported as a signal.
    let r = sb.exec(sh("kill -TERM $$"), None).await.unwrap();
    assert_eq!(r.status.signal, Some(15));
    assert_eq!(r.status.code, None);

    sb.destroy().await.unwrap();
    fp.assert_gone();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_output_arrives_complete_and_in_order_and_timeouts_kill() {
    let sb = boot(RootfsImage::Minimal).await;
    let fp = Footprint::of(&sb);

    // 10 MiB of numbered lines: order and completeness are checked line by line.
    let r = sb
        .exec(sh("seq 1 2000000 | head -c 10485760"), None)
        .await
        .unwrap();
    assert_eq!(r.status.code, Some(0));
    assert_eq!(r.stdout.len(), 10 << 20);
    let mut expected = Vec::with_capacity(11 << 20);
    for i in 1..=2_000_000u32 {
        expected.extend_from_slice(format!("{i}\n").as_bytes());
        if expected.len() >= 10 << 20 {
            break;
        }
    }
    expected.truncate(10 << 20);
    assert_eq!(
        hex::encode(Sha256::digest(&r.stdout)),
        hex::encode(Sha256::digest(&expected)),
        "10 MiB of output differs from what was printed"
    );

    let mut req = sh("echo started; sleep 30; echo never");
    req.timeout_ms = Some(1500);
    let r = sb.exec(req, None).await.unwrap();
    assert!(r.status.timed_out, "{:?}", r.status);
    assert_eq!(r.status.signal, Some(9));
    assert_eq!(r.stdout, b"started\n");
    assert!(r.status.duration_ms < 30_000);

    sb.destroy().await.unwrap();
    fp.assert_gone();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_execs_and_background_processes() {
    let sb = boot(RootfsImage::Minimal).await;
    let fp = Footprint::of(&sb);

    let runs = (0..5).map(|i| {
        let sb = &sb;
        async move {
            let r = sb
                .exec(
                    sh(&format!("sleep 1; echo job-{i}; echo e{i} >&2; exit {i}")),
                    None,
                )
                .await
                .unwrap();
            (i, r)
        }
    });
    for (i, r) in futures::future::join_all(runs).await {
        assert_eq!(r.stdout, format!("job-{i}\n").as_bytes());
        assert_eq!(r.stderr, format!("e{i}\n").as_bytes());
        assert_eq!(r.status.code, Some(i));
    }

    let agent = sb.agent();
    let p = agent
        .spawn_process(&sh("echo bg-started; exec sleep 600"))
        .await
        .unwrap();
    assert!(p.exit.is_none());
    let listed = agent.list_processes().await.unwrap();
    assert!(
        listed.iter().any(|q| q.id == p.id && q.exit.is_none()),
        "{listed:?}"
    );
    let still = agent.wait_process(p.id, Some(200)).await.unwrap();
    assert!(still.exit.is_none(), "sleep 600 ended early: {still:?}");
    let killed = agent.kill_process(p.id).await.unwrap();
    let exit = killed.exit.expect("killed process has an exit status");
    assert_eq!(exit.signal, Some(9));
    assert!(
        String::from_utf8_lossy(&killed.stdout).contains("bg-started"),
        "{killed:?}"
    );
    assert!(agent
        .list_processes()
        .await
        .unwrap()
        .iter()
        .all(|q| q.id != p.id));
    // The sleep is really gone from the guest.
    let r = sb
        .exec(
            sh("cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$' || true"),
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, b"0\n", "a sleep survived the kill");
    let err = agent.kill_process(p.id).await.unwrap_err();
    assert_eq!(err.code(), Some(forkd_proto::ErrorCode::NotFound), "{err}");

    // A background process that ends by itself can be waited for.
    let q = agent.spawn_process(&sh("echo done; exit 4")).await.unwrap();
    let q = agent.wait_process(q.id, Some(60_000)).await.unwrap();
    assert_eq!(q.exit.map(|e| e.code), Some(Some(4)));
    assert_eq!(q.stdout, b"done\n");

    sb.destroy().await.unwrap();
    fp.assert_gone();
}
