//! Code contexts against the real agent, with the host's python3 as the interpreter.

mod common;

use common::{full, Agent, Client};
use forkd_proto::context::{ContextEvent, ContextInfo, Execution};
use forkd_proto::ErrorBody;
use hyper::{Method, StatusCode};
use serde_json::json;

async fn run(c: &mut Client, id: &str, code: &str) -> Execution {
    run_with(c, id, json!({ "code": code })).await
}

async fn run_with(c: &mut Client, id: &str, body: serde_json::Value) -> Execution {
    let path = forkd_proto::routes::context_run(id);
    let (status, bytes) = c
        .call(
            Method::POST,
            &path,
            full(serde_json::to_vec(&body).unwrap()),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let mut x = Execution::default();
    let mut done = false;
    for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        assert!(!done, "events after done");
        let e: ContextEvent = serde_json::from_slice(line).expect("an event per line");
        done = x.push(e);
    }
    assert!(done, "the stream ends with done");
    x
}

async fn create(c: &mut Client) -> ContextInfo {
    let (status, info): (_, ContextInfo) = c
        .json(Method::POST, forkd_proto::routes::CONTEXTS, Some(json!({})))
        .await;
    assert_eq!(status, StatusCode::OK);
    info
}

#[tokio::test]
async fn state_persists_and_contexts_are_separate() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let a = create(&mut c).await;
    let b = create(&mut c).await;
    assert_ne!(a.id, b.id);
    assert!(run(&mut c, &a.id, "x = 41").await.error.is_none());
    assert_eq!(run(&mut c, &a.id, "x + 1").await.text(), Some("42"));
    let other = run(&mut c, &b.id, "x").await;
    assert_eq!(
        other.error.as_ref().map(|e| e.name.as_str()),
        Some("NameError")
    );

    let out = run(
        &mut c,
        &a.id,
        "print('hi')\nimport sys; print('oops', file=sys.stderr)\nx * 2",
    )
    .await;
    assert_eq!(out.stdout, "hi\n");
    assert_eq!(out.stderr, "oops\n");
    assert_eq!(out.text(), Some("82"));
    assert_eq!(out.execution_count, 3);

    let (_, list): (_, Vec<ContextInfo>) = c
        .json(Method::GET, forkd_proto::routes::CONTEXTS, None)
        .await;
    assert_eq!(list.len(), 2);
}

#[tokio::test]
async fn errors_carry_the_traceback_and_rich_values_their_html() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let a = create(&mut c).await;
    let x = run(&mut c, &a.id, "def f():\n    return 1 / 0\nf()").await;
    let err = x.error.expect("an error");
    assert_eq!(err.name, "ZeroDivisionError");
    assert!(err.traceback.contains("line 2, in f"), "{}", err.traceback);
    assert!(!err.traceback.contains("driver"), "{}", err.traceback);

    let x = run(
        &mut c,
        &a.id,
        "class T:\n    def _repr_html_(self):\n        return '<table></table>'\nT()",
    )
    .await;
    assert_eq!(x.results[0].html.as_deref(), Some("<table></table>"));

    // Output written straight to the descriptors (a subprocess) is captured too.
    let x = run(&mut c, &a.id, "import os\nos.system('echo from-a-child')").await;
    assert_eq!(x.stdout, "from-a-child\n");
}

#[tokio::test]
async fn a_timeout_interrupts_and_the_context_survives() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let a = create(&mut c).await;
    run(&mut c, &a.id, "y = 7").await;
    let x = run_with(
        &mut c,
        &a.id,
        json!({ "code": "import time\nwhile True: time.sleep(0.01)", "timeout_ms": 300 }),
    )
    .await;
    let names: Vec<_> = x.error.iter().map(|e| e.name.clone()).collect();
    assert_eq!(names, ["TimeoutError"], "{x:?}");
    assert_eq!(run(&mut c, &a.id, "y").await.text(), Some("7"));
}

#[tokio::test]
async fn reset_clears_state_and_delete_ends_the_context() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let a = create(&mut c).await;
    run(&mut c, &a.id, "z = 1").await;
    let (status, info): (_, ContextInfo) = c
        .json(
            Method::POST,
            &forkd_proto::routes::context_reset(&a.id),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_ne!(info.pid, a.pid);
    let x = run(&mut c, &a.id, "z").await;
    assert_eq!(x.error.map(|e| e.name), Some("NameError".into()));

    // A context whose interpreter dies says so and can be reset.
    let x = run(&mut c, &a.id, "import os\nos._exit(3)").await;
    assert_eq!(x.error.map(|e| e.name), Some("ContextDied".into()));
    c.json::<ContextInfo>(
        Method::POST,
        &forkd_proto::routes::context_reset(&a.id),
        None,
    )
    .await;
    assert_eq!(run(&mut c, &a.id, "1 + 1").await.text(), Some("2"));

    let (status, _): (_, ContextInfo) = c
        .json(Method::DELETE, &forkd_proto::routes::context(&a.id), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, err): (_, ErrorBody) = c
        .json(
            Method::POST,
            &forkd_proto::routes::context_run(&a.id),
            Some(json!({"code": "1"})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(err.error.message.contains(&a.id));
    let (status, _): (_, ErrorBody) = c
        .json(
            Method::POST,
            &forkd_proto::routes::context_run("ctx-9"),
            Some(json!({"nope": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// With `settle`, the resume hook answers once every context's reseed has run: a warm
/// pool's member is paused right after it.
#[tokio::test]
async fn a_settled_resume_answers_after_the_reseeds_ran() {
    use forkd_proto::context::{ResumeRequest, ResumeResponse};
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let ctx = create(&mut c).await;
    let dir = tempfile::tempdir().unwrap();
    let mark = dir.path().join("seeded");
    // random.seed, which the reseed calls, takes a second and then leaves a mark.
    let code = format!(
        "import random, time\n_seed = random.seed\ndef _slow(*a, **k):\n    time.sleep(1)\n    open({:?}, 'w').close()\n    return _seed(*a, **k)\nrandom.seed = _slow",
        mark.to_str().unwrap()
    );
    assert!(run(&mut c, &ctx.id, &code).await.error.is_none());
    let req = ResumeRequest {
        wall_clock_ns: 0,
        entropy_hex: "00".repeat(16),
        hostname: String::new(),
        env: [("SEEDED".to_owned(), "yes".to_owned())].into(),
        settle: true,
        continuing: false,
    };
    let (status, answer): (_, ResumeResponse) = c
        .json(
            Method::POST,
            forkd_proto::routes::RESUME,
            Some(serde_json::to_value(&req).unwrap()),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer.contexts_reseeded, 1);
    assert!(mark.exists(), "the hook answered before the reseed ran");
    let seen = run(&mut c, &ctx.id, "import os; os.environ['SEEDED']").await;
    assert_eq!(seen.text(), Some("'yes'"));
}

/// A machine continuing after a pause keeps its contexts' generators and variables: the
/// hook reseeds nothing and adds nothing.
#[tokio::test]
async fn a_continuing_resume_reseeds_nothing() {
    use forkd_proto::context::{ResumeRequest, ResumeResponse};
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let ctx = create(&mut c).await;
    let code = "import random\nrandom.seed(7)\n_first = random.random()\nrandom.seed(7)";
    assert!(run(&mut c, &ctx.id, code).await.error.is_none());
    let req = ResumeRequest {
        wall_clock_ns: 0,
        entropy_hex: String::new(),
        hostname: String::new(),
        env: [("SEEDED".to_owned(), "yes".to_owned())].into(),
        settle: true,
        continuing: true,
    };
    let (status, answer): (_, ResumeResponse) = c
        .json(
            Method::POST,
            forkd_proto::routes::RESUME,
            Some(serde_json::to_value(&req).unwrap()),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer.contexts_reseeded, 0);
    let same = run(&mut c, &ctx.id, "random.random() == _first").await;
    assert_eq!(same.text(), Some("True"), "the generator was reseeded");
    let env = run(&mut c, &ctx.id, "import os; 'SEEDED' in os.environ").await;
    assert_eq!(env.text(), Some("False"));
}
