//! TEMPORARY scratch test against a booted VM (deleted before hand-off).
mod common;
use common::connect_socket;
use forkd_proto::exec::{Command, ExecRequest};
use forkd_proto::PingResponse;
use hyper::Method;
use std::time::Instant;

fn shell(s: &str) -> ExecRequest {
    ExecRequest::new(Command::Shell(s.into()))
}

#[tokio::test]
async fn vm() {
    let sock = std::path::PathBuf::from(std::env::var("FORKD_VM_SOCK").expect("FORKD_VM_SOCK"));
    let t = Instant::now();
    let mut c = connect_socket(&sock, b"").await;
    eprintln!("handshake {:?}", t.elapsed());
    let (st, p): (_, PingResponse) = c.json(Method::GET, "/v1/ping", None).await;
    eprintln!("ping {st} {p:?}");
    let out = c.exec(&shell("echo hello; id; mount; cat /proc/cmdline; hostname; ls -la /dev/fd; ip link 2>&1 | head -3; env"), b"").await;
    eprintln!(
        "{}\n{}\n{:?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        out.last
    );
    let mut r = shell("cat; exit 3");
    r.stdin = true;
    let out = c.exec(&r, b"round trip\n").await;
    eprintln!(
        "stdin: {:?} {:?}",
        String::from_utf8_lossy(&out.stdout),
        out.last
    );
    // orphan: a grandchild that outlives its parent
    let out = c.exec(&shell("(sleep 0.2 &) ; echo spawned"), b"").await;
    eprintln!("orphan: {:?}", String::from_utf8_lossy(&out.stdout));
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let out = c
        .exec(
            &shell("grep -l ') Z ' /proc/[0-9]*/stat 2>/dev/null; echo zombies-checked"),
            b"",
        )
        .await;
    eprintln!("zombies: {:?}", String::from_utf8_lossy(&out.stdout));
    let t = Instant::now();
    let out = c.exec(&shell("seq 1 1600000"), b"").await;
    let expected: String = (1..=1_600_000).map(|i| format!("{i}\n")).collect();
    eprintln!(
        "seq: {} bytes, equal {} in {:?}",
        out.stdout.len(),
        out.stdout == expected.as_bytes(),
        t.elapsed()
    );
    let data: Vec<u8> = (0..5u32 << 20).map(|i| (i % 253) as u8).collect();
    let t = Instant::now();
    let (st, _) = c
        .call(
            Method::PUT,
            "/v1/files?path=/root/blob",
            common::full(data.clone()),
        )
        .await;
    let (st2, got) = c
        .call(Method::GET, "/v1/files?path=/root/blob", common::full(""))
        .await;
    eprintln!(
        "files: {st} {st2} equal {} in {:?}",
        got == data,
        t.elapsed()
    );
    drop(c);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut c = connect_socket(&sock, b"garbage").await;
    let (st, _): (_, PingResponse) = c.json(Method::GET, "/v1/ping", None).await;
    eprintln!("second connection ping {st}");
    if std::env::var("FORKD_VM_SHUTDOWN").is_ok() {
        let (st, b) = c
            .call(
                Method::POST,
                "/v1/shutdown",
                common::full("{\"poweroff\":true}"),
            )
            .await;
        eprintln!("shutdown {st} {b:?}");
    }
}
