//! A guest that stops answering, or a VM that dies, is detected and cleaned up.

mod common;

use common::{sh, Footprint};
use forkd_core::{SandboxError, SandboxOptions};
use forkd_image::RootfsImage;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresponsive_guest_is_kept_and_recovers() {
    let opts = SandboxOptions {
        agent_timeout: Duration::from_secs(3),
        ..common::options()
    };
    let sb = common::boot_with(RootfsImage::Minimal, opts).await;
    let fp = Footprint::of(&sb);
    assert_eq!(
        sb.exec(sh("echo alive"), None).await.unwrap().stdout,
        b"alive\n"
    );

    // A command is running when the guest freezes (its vCPUs stopped). The watchdog
    // notices the silence and marks the sandbox unresponsive, but keeps it: a slow guest
    // is not a dead one.
    let in_flight = sb.exec(sh("sleep 2; echo finished"), None);
    let freeze_and_thaw = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        sb.vm().pause().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !sb.is_unresponsive() {
            assert!(Instant::now() < deadline, "never marked unresponsive");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let err = sb.exec(sh("echo x"), None).await.unwrap_err();
        assert!(matches!(err, SandboxError::Unresponsive { .. }), "{err}");
        assert!(err.to_string().contains("kept"), "{err}");
        assert!(
            sb.failure().is_none(),
            "an unresponsive sandbox has not failed"
        );
        assert!(sb.pid().is_some(), "its VM runs on");
        sb.vm().resume().await.unwrap();
    };
    let (res, ()) = tokio::join!(in_flight, freeze_and_thaw);
    // The call in flight was not cut: it finishes once the guest runs again.
    assert_eq!(res.unwrap().stdout, b"finished\n");
    let deadline = Instant::now() + Duration::from_secs(60);
    while sb.is_unresponsive() {
        assert!(Instant::now() < deadline, "never answered again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        sb.exec(sh("echo back"), None).await.unwrap().stdout,
        b"back\n"
    );
    sb.destroy().await.unwrap();
    fp.assert_gone();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_dies_is_reported_and_cleaned_up() {
    let sb = common::boot(RootfsImage::Minimal).await;
    let fp = Footprint::of(&sb);
    // Crash the guest kernel: with panic=-1 and -no-reboot, QEMU exits.
    let res = sb
        .exec(sh("echo c > /proc/sysrq-trigger; sleep 60"), None)
        .await;
    let err = res.unwrap_err();
    assert!(matches!(err, SandboxError::GuestExited { .. }), "{err}");
    assert!(err.to_string().contains("VM exited"), "{err}");
    fp.assert_gone();
    drop(sb);
    fp.assert_gone();
}
