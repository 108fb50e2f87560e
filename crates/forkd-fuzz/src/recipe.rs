//! Recipes: TOML a user writes, or a client sends in a build request, parsed into what a
//! template build does. What the parser accepts is what the build trusts.

use forkd_core::template::Recipe;
use std::path::{Component, Path};

/// The recipe parser, with what an accepted recipe must satisfy.
pub fn recipe(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return; // a recipe is read as text
    };
    if let Ok(r) = Recipe::parse("fuzz", text) {
        check(&r);
    }
}

/// What every accepted recipe must satisfy: its files are read from inside its
/// directory and written to absolute paths in the guest, and its numbers are in range.
pub fn check(r: &Recipe) {
    for f in &r.files {
        let src = Path::new(&f.src);
        assert!(
            !f.src.is_empty() && src.components().all(|c| matches!(c, Component::Normal(_))),
            "a file's src {:?} leaves the recipe's directory",
            f.src
        );
        let dest = Path::new(&f.dest);
        assert!(
            dest.is_absolute() && !dest.components().any(|c| c == Component::ParentDir),
            "a file's dest {:?} is not an absolute guest path",
            f.dest
        );
        assert!(f.mode() <= 0o7777, "file mode {:o}", f.mode());
    }
    assert!((1..=64).contains(&r.vcpus), "vcpus = {}", r.vcpus);
    assert!(
        (128..=262_144).contains(&r.memory_mib),
        "memory_mib = {}",
        r.memory_mib
    );
    assert!(
        r.image.is_some() != r.from.is_some(),
        "a recipe names one base"
    );
    if let Some(cpu) = &r.cpu {
        assert!(
            forkd_hypervisor::accel::is_cpu_model_name(cpu),
            "cpu = {cpu:?} reaches QEMU's command line"
        );
    }
    for p in &r.packages {
        assert!(
            forkd_image::packages::valid_package(p),
            "package {p:?} reaches apt"
        );
    }
}
