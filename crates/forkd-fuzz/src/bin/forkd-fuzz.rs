//! The libFuzzer driver of every target (`./dev fuzz`): one binary, the target named by
//! `FORKD_FUZZ_TARGET`, so that one instrumented build serves them all. Built with the
//! `libfuzzer` feature and coverage instrumentation (see `docs/fuzzing.md`).

#![no_main]

use std::sync::OnceLock;

fn target() -> &'static forkd_fuzz::Target {
    static TARGET: OnceLock<&'static forkd_fuzz::Target> = OnceLock::new();
    TARGET.get_or_init(|| {
        let name = std::env::var("FORKD_FUZZ_TARGET").unwrap_or_default();
        forkd_fuzz::target(&name).unwrap_or_else(|| {
            let names: Vec<&str> = forkd_fuzz::TARGETS.iter().map(|t| t.name).collect();
            eprintln!(
                "FORKD_FUZZ_TARGET={name:?} names no target; one of: {}",
                names.join(" ")
            );
            std::process::exit(2)
        })
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    (target().run)(data);
});
