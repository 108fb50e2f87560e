//! A guest that stops answering, or a VM that dies, is detected and cleaned up.

mod common;

use common::{sh, Footprint};
use forkd_core::{SandboxError, SandboxOptions};
use forkd_image::RootfsImage;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresponsive_guest_is_detected_and_torn_down() {
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

    // A long command is running when the guest freezes (its vCPUs stopped): the call must
    // end with a clear error within about the agent timeout, not hang.
    let long = sb.exec(sh("sleep 600"), None);
    let freeze = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        sb.vm().pause().await.unwrap();
        Instant::now()
    };
    let (res, frozen_at) = tokio::join!(long, freeze);
    let detected_after = frozen_at.elapsed();
    let err = res.unwrap_err();
    assert!(matches!(err, SandboxError::Unresponsive { .. }), "{err}");
    assert!(err.to_string().contains("stopped answering"), "{err}");
    // Generous bound: the watchdog pings every second and waits two; it is the behaviour
    // (an error, well before the command's 600 s) that is asserted, not a latency.
    assert!(
        detected_after < Duration::from_secs(60),
        "took {detected_after:?}"
    );

    // The sandbox is torn down by the watchdog itself, and later calls fail at once.
    let again = sb.exec(sh("echo x"), None).await.unwrap_err();
    assert!(
        matches!(again, SandboxError::Unresponsive { .. }),
        "{again}"
    );
    fp.assert_gone();
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
