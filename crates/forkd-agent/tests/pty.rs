//! Commands on a terminal against the real agent: input typed, size changed, exit
//! status, and a login shell when no command is given.

mod common;

use common::{channel_body, read_exec, read_until_stdout, Agent};
use forkd_proto::exec::{Command, ExecRequest, PtySize};
use forkd_proto::frame::{self, Decoder, Tag};
use hyper::StatusCode;

fn resize(cols: u16, rows: u16) -> bytes::Bytes {
    frame::encode_json(&PtySize { cols, rows })
        .map(|f| {
            // A JSON frame re-tagged: the payload of a resize is the size as JSON.
            let mut v = f.to_vec();
            v[0] = Tag::Resize as u8;
            bytes::Bytes::from(v)
        })
        .unwrap()
}

fn typed(s: &str) -> bytes::Bytes {
    frame::encode(Tag::Stdin, s.as_bytes()).unwrap()
}

#[tokio::test]
async fn a_shell_on_a_terminal_sees_its_size_change_and_exits_with_its_code() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = ExecRequest::new(Command::Argv(vec!["sh".into()]));
    req.pty = Some(PtySize { cols: 80, rows: 24 });
    req.env.insert("PS1".into(), "$ ".into());
    let (tx, body) = channel_body();
    tx.send(frame::encode_json(&req).unwrap()).await.unwrap();
    let resp = c.exec_start(body).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut dec = Decoder::new();
    let mut out = Vec::new();
    tx.send(typed("tty; stty size\n")).await.unwrap();
    read_until_stdout(&mut body, &mut dec, &mut out, |s| {
        String::from_utf8_lossy(s).contains("24 80")
    })
    .await;
    assert!(
        String::from_utf8_lossy(&out).contains("/dev/pts/"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    tx.send(resize(100, 30)).await.unwrap();
    tx.send(typed("stty size\n")).await.unwrap();
    read_until_stdout(&mut body, &mut dec, &mut out, |s| {
        String::from_utf8_lossy(s).contains("30 100")
    })
    .await;
    // The terminal echoes what is typed, and turns "\n" into "\r\n": a terminal's.
    assert!(String::from_utf8_lossy(&out).contains("stty size\r\n"));
    tx.send(typed("exit 3\n")).await.unwrap();
    let rest = read_exec(body).await;
    assert_eq!(rest.exit().code, Some(3));
}

#[tokio::test]
async fn ctrl_c_typed_interrupts_the_foreground_command_only() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = ExecRequest::new(Command::Argv(vec!["sh".into()]));
    req.pty = Some(PtySize { cols: 80, rows: 24 });
    let (tx, body) = channel_body();
    tx.send(frame::encode_json(&req).unwrap()).await.unwrap();
    let mut body = c.exec_start(body).await.into_body();
    let mut dec = Decoder::new();
    let mut out = Vec::new();
    tx.send(typed("sleep 100\n")).await.unwrap();
    // The interrupt reaches sleep (the terminal's foreground), and the shell goes on.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    tx.send(typed("\x03")).await.unwrap();
    tx.send(typed("echo \"status $?\"\n")).await.unwrap();
    read_until_stdout(&mut body, &mut dec, &mut out, |s| {
        String::from_utf8_lossy(s).contains("status 130")
    })
    .await;
    tx.send(typed("exit\n")).await.unwrap();
    assert_eq!(read_exec(body).await.exit().code, Some(0));
}

#[tokio::test]
async fn no_command_on_a_terminal_is_the_login_shell_and_a_zero_size_is_refused() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = ExecRequest::new(Command::Argv(Vec::new()));
    req.pty = Some(PtySize { cols: 80, rows: 24 });
    let (tx, body) = channel_body();
    tx.send(frame::encode_json(&req).unwrap()).await.unwrap();
    let mut body = c.exec_start(body).await.into_body();
    let mut dec = Decoder::new();
    let mut out = Vec::new();
    // $0 of a login shell starts with '-'.
    tx.send(typed("echo \"zero=$0\"; echo \"term=$TERM\"\n"))
        .await
        .unwrap();
    read_until_stdout(&mut body, &mut dec, &mut out, |s| {
        String::from_utf8_lossy(s).contains("term=xterm-256color")
    })
    .await;
    assert!(
        String::from_utf8_lossy(&out).contains("zero=-"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    tx.send(typed("exit 0\n")).await.unwrap();
    assert_eq!(read_exec(body).await.exit().code, Some(0));

    let mut req = ExecRequest::new(Command::Argv(vec!["sh".into()]));
    req.pty = Some(PtySize { cols: 0, rows: 24 });
    let out = c.exec(&req, b"").await;
    let Some(forkd_proto::exec::ExecEvent::Error(e)) = out.last else {
        panic!("a zero-column terminal ran: {:?}", out.last);
    };
    assert!(e.message.contains("column"), "{}", e.message);
}
