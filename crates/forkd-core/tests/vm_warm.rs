//! Children of the `python` template inherit its warm interpreter, and nothing that
//! must be their own: randomness and the wall clock diverge from the template's.

mod common;

use common::{build_template, fork, fork_options, home, TestStore};
use forkd_core::template::Recipe;

/// Runs `code` in the sandbox's first code context (the template's warm one).
use common::run_code as run;

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_inherit_warm_state_but_not_randomness_or_time() {
    let ts = TestStore::new();
    // The shipped python template, with one more line of warm state.
    let mut recipe = Recipe::find("python", &[]).unwrap();
    recipe.contexts[0].preload.push_str("\nx = 41\n");
    let snap = build_template(&ts.store, &recipe, "python-warm").await;
    assert_eq!(snap.manifest.contexts.len(), 1);

    let children = fork(&home(), &snap, &fork_options(2))
        .await
        .expect("fork 2");
    let mut draws = Vec::new();
    for c in &children {
        // Before any child code imports anything, pandas is already loaded.
        let x = run(
            c,
            "import sys\n'pandas' in sys.modules and 'numpy' in sys.modules",
        )
        .await;
        assert_eq!(x.text(), Some("True"), "{}", c.id());
        let x = run(c, "x + 1").await;
        assert_eq!(x.text(), Some("42"), "{}", c.id());

        let x = run(
            c,
            "import os, random\n(os.urandom(16).hex(), random.random(), float(np.random.rand()))",
        )
        .await;
        draws.push(x.text().unwrap().to_owned());

        let before = now_secs();
        let x = run(c, "import time\ntime.time()").await;
        let after = now_secs();
        let guest: f64 = x.text().unwrap().parse().unwrap();
        assert!(
            guest > before - 2.0 && guest < after + 2.0,
            "{}: guest clock {guest} is not within 2 s of the host's [{before}, {after}]",
            c.id()
        );
    }
    // Compare every component: the kernel RNG, Python's `random` and numpy's generator.
    let parse = |s: &str| -> Vec<String> {
        s.trim_matches(|c| c == '(' || c == ')')
            .split(", ")
            .map(str::to_owned)
            .collect()
    };
    let (a, b) = (parse(&draws[0]), parse(&draws[1]));
    assert_eq!(a.len(), 3, "{draws:?}");
    for (i, what) in ["os.urandom", "random.random", "numpy.random.rand"]
        .iter()
        .enumerate()
    {
        assert_ne!(a[i], b[i], "{what} is the same in two children: {draws:?}");
    }
    for c in children {
        c.destroy().await.unwrap();
    }
}
