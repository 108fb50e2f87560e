//! The shared snapshots of the built-in templates (common/fixture.rs), built through the
//! daemon's API before the tests that fork from them start: `cargo nextest` runs this
//! first (.config/nextest.toml), beside tests that build templates of their own, so that
//! no test holds one of the two test slots while it waits for another's build. A test
//! run by itself builds what it needs on first use as before.

mod common;

#[test]
fn the_shared_snapshots_of_the_built_in_templates_build() {
    for (template, tag) in [("minimal", "mini"), ("python", "python")] {
        let dir = common::fixture::snapshot(template, tag);
        assert!(dir.join("manifest.json").is_file(), "{}", dir.display());
    }
}
