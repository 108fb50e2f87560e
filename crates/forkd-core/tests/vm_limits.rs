//! What a guest prints is bounded on the host: its serial console on disk, and the output
//! of a template's warm-up steps. This test binary runs with small limits.

mod common;

use common::{home, sh, Footprint, TestStore};
use forkd_core::template::{BuildOptions, Recipe};
use forkd_core::SandboxError;
use forkd_image::RootfsImage;
use std::path::Path;
use std::time::Duration;

const CONSOLE_CAP: u64 = 64 << 10;
const WARMUP_CAP: u64 = 4 << 10;

/// Fixes the small limits for this process before anything reads them.
fn small_limits() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::env::set_var("FORKD_CONSOLE_CAP", CONSOLE_CAP.to_string());
        std::env::set_var("FORKD_WARMUP_OUTPUT_CAP", WARMUP_CAP.to_string());
        let l = forkd_proto::limits::init().unwrap();
        assert_eq!(l.console_cap, CONSOLE_CAP);
    });
}

fn console_bytes(dir: &Path) -> u64 {
    ["console.log", "console.log.1"]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_flooding_its_console_stays_within_the_cap() {
    small_limits();
    let sb = common::boot(RootfsImage::Minimal).await;
    let fp = Footprint::of(&sb);
    // Ten times the cap (base64 makes it a third more), then a marker.
    let flood = format!(
        "head -c {} /dev/urandom | base64 > /dev/ttyS0; echo flood-ended > /dev/ttyS0",
        CONSOLE_CAP * 10
    );
    let out = sb.exec(sh(&flood), None).await.unwrap();
    assert!(out.status.success(), "{out:?}");
    // The host copies the console as it comes: wait for the marker to land.
    let mut seen = false;
    for _ in 0..600 {
        if sb.vm().console_tail(3).contains("flood-ended") {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(seen, "the marker never reached the console log");
    let on_disk = console_bytes(sb.dir());
    assert!(on_disk <= CONSOLE_CAP, "{on_disk} bytes of console on disk");
    assert!(
        sb.dir().join("console.log.1").exists(),
        "the flood filled the first file"
    );

    // A guest that dies still has its last console lines in the error.
    let err = sb
        .exec(sh("echo c > /proc/sysrq-trigger; sleep 60"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, SandboxError::GuestExited { .. }), "{err}");
    let msg = err.to_string();
    // The error quotes the last 30 console lines: some part of the crash's trace (which
    // part depends on how much of it the guest wrote before QEMU exited).
    assert!(
        [
            "sysrq",
            "Kernel panic",
            "Kernel Offset",
            "Call Trace",
            "RIP:",
            "do_syscall_64"
        ]
        .iter()
        .any(|s| msg.contains(s)),
        "{msg}"
    );
    fp.assert_gone();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_output_is_cut_to_its_cap() {
    small_limits();
    let ts = TestStore::new();
    let bytes = WARMUP_CAP * 10;
    let recipe = Recipe::parse(
        "loud",
        &format!(
            r#"
image = "minimal"
[[warmup]]
run = "head -c {bytes} /dev/zero | tr '\\0' a; echo first-done"
[[warmup]]
run = "head -c {bytes} /dev/zero | tr '\\0' b; echo; echo the-end-of-it; exit 3"
"#
        ),
    )
    .unwrap();
    let assets = common::assets(RootfsImage::Minimal).await;
    let tag = forkd_storage::snapshot::Tag::parse("loud").unwrap();
    let opts = BuildOptions {
        boot_timeout: Duration::from_secs(300),
        ..Default::default()
    };
    let notes = std::sync::Mutex::new(Vec::<String>::new());
    let err = forkd_core::template::build(
        common::hv().as_ref(),
        &home(),
        &ts.store,
        &recipe,
        &tag,
        &assets,
        &opts,
        &|m| notes.lock().unwrap().push(m.to_owned()),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    // The failing step's error ends with what it printed last, and says what was dropped.
    assert!(msg.contains("exit 3"), "{msg}");
    assert!(msg.contains("the-end-of-it"), "{msg}");
    let dropped = bytes + 1 + "the-end-of-it\n".len() as u64 - WARMUP_CAP;
    assert!(
        msg.contains(&format!(
            "[{dropped} earlier bytes dropped; the last {WARMUP_CAP} follow"
        )),
        "{msg}"
    );
    assert!(
        msg.len() < 2 * usize::try_from(WARMUP_CAP).unwrap(),
        "the error holds {} bytes",
        msg.len()
    );
    // The first step succeeded; its cut output is reported, not kept.
    let notes = notes.into_inner().unwrap();
    let first = bytes + "first-done\n".len() as u64 - WARMUP_CAP;
    assert!(
        notes
            .iter()
            .any(|n| n.contains(&format!("printed {first} bytes more than the {WARMUP_CAP}"))),
        "{notes:?}"
    );
}
