//! File operations in a real `minimal` guest under QEMU.

mod common;

use common::{sh, Footprint};
use forkd_core::agent::WriteOptions;
use forkd_image::RootfsImage;
use forkd_proto::files::FileKind;
use forkd_proto::ErrorCode;
use rand::RngCore;
use sha2::{Digest, Sha256};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_stream_and_behave_as_documented() {
    let sb = common::boot(RootfsImage::Minimal).await;
    let fp = Footprint::of(&sb);
    let agent = sb.agent().clone();

    // 50 MiB of random bytes, written and read back, byte-identical.
    let mut data = vec![0u8; 50 << 20];
    rand::thread_rng().fill_bytes(&mut data);
    let digest = hex::encode(Sha256::digest(&data));
    let st = agent
        .write_file_bytes("/root/big.bin", data, WriteOptions::default())
        .await
        .unwrap();
    assert_eq!(st.size, 50 << 20);
    assert_eq!(st.kind, FileKind::File);
    let back = agent.read_file_bytes("/root/big.bin").await.unwrap();
    assert_eq!(back.len(), 50 << 20);
    assert_eq!(hex::encode(Sha256::digest(&back)), digest);
    // The guest sees the same bytes.
    let r = sb.exec(sh("sha256sum /root/big.bin"), None).await.unwrap();
    assert!(String::from_utf8_lossy(&r.stdout).starts_with(&digest));

    // mkdir -p, write with mode, stat, list (sorted), rename, remove.
    let d = agent.mkdir("/srv/data/a/b/c").await.unwrap();
    assert_eq!(d.kind, FileKind::Dir);
    agent
        .mkdir("/srv/data/a/b/c")
        .await
        .expect("mkdir -p of an existing dir is fine");
    agent
        .write_file_bytes(
            "/srv/data/a/z.txt",
            b"zed".to_vec(),
            WriteOptions {
                mode: Some(0o600),
                parents: false,
                owner: None,
            },
        )
        .await
        .unwrap();
    agent
        .write_file_bytes(
            "/srv/data/new/dir/y.txt",
            b"why".to_vec(),
            WriteOptions {
                mode: None,
                parents: true,
                owner: None,
            },
        )
        .await
        .unwrap();
    let st = agent.stat("/srv/data/a/z.txt").await.unwrap();
    assert_eq!((st.size, st.mode, st.name.as_str()), (3, 0o600, "z.txt"));
    let names: Vec<String> = agent
        .list_dir("/srv/data/a")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["b", "z.txt"]);
    let st = agent
        .rename("/srv/data/a/z.txt", "/srv/data/a/b/moved.txt")
        .await
        .unwrap();
    assert_eq!(st.path, "/srv/data/a/b/moved.txt");
    assert_eq!(
        agent
            .read_file_bytes("/srv/data/a/b/moved.txt")
            .await
            .unwrap(),
        b"zed"
    );
    assert_eq!(
        agent
            .read_file_bytes("/srv/data/new/dir/y.txt")
            .await
            .unwrap(),
        b"why"
    );

    let err = agent.remove("/srv/data/a", false).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::DirectoryNotEmpty), "{err}");
    agent.remove("/srv/data/a", true).await.unwrap();
    agent.remove("/root/big.bin", false).await.unwrap();

    // Missing paths are clear not-found errors, not hangs.
    for err in [
        agent.stat("/srv/data/a").await.unwrap_err(),
        agent.read_file_bytes("/nope/x").await.unwrap_err(),
        agent.list_dir("/nope").await.unwrap_err(),
        agent.remove("/nope", true).await.unwrap_err(),
        agent.rename("/nope", "/nope2").await.unwrap_err(),
    ] {
        assert_eq!(err.code(), Some(ErrorCode::NotFound), "{err}");
        assert!(
            err.to_string().contains("/nope") || err.to_string().contains("/srv/data/a"),
            "{err}"
        );
    }
    let err = agent
        .write_file_bytes("/nope/dir/f", b"x".to_vec(), WriteOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotFound), "{err}");
    let err = agent.stat("relative/path").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::InvalidArgument), "{err}");
    let err = agent.read_file_bytes("/srv/data").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::IsADirectory), "{err}");

    sb.destroy().await.unwrap();
    fp.assert_gone();
}
