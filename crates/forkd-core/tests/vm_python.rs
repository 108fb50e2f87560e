//! The `python` image has pandas and numpy.

mod common;

use common::{argv, Footprint};
use forkd_image::RootfsImage;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_image_imports_pandas() {
    let sb = common::boot(RootfsImage::Python).await;
    let fp = Footprint::of(&sb);
    let r = sb
        .exec(
            argv(&[
                "python3",
                "-c",
                "import pandas, numpy; print(pandas.__version__); print(numpy.__version__)",
            ]),
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        r.status.code,
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    let out = String::from_utf8_lossy(&r.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    for v in lines {
        assert!(
            v.split('.').count() >= 2 && v.split('.').all(|p| !p.is_empty()),
            "not a version: {v:?}"
        );
    }
    sb.destroy().await.unwrap();
    fp.assert_gone();
}
