//! Snapshots of the built-in templates, built once per build of forkd and its guest
//! assets and shared by every test process that only needs one to fork from.
//!
//! A test that checks how a template is built still builds its own. The others take a
//! copy made of hard links ([`Daemon::link_snapshot`](super::Daemon::link_snapshot)):
//! a snapshot is read-only once sealed, its seal stamps (size, inode, mtime) hold for
//! a link, and removing the copy removes links only.
//!
//! The shared snapshots live in `<assets>/tmp/fx/<build>/<name>/`, where `<name>` hashes
//! the template and the tag and `<build>` the identity of the `forkd` binary and of the
//! guest assets: a new build of either starts new fixtures, and the first process to
//! need one builds it while holding its lock, so test processes running side by side
//! build each snapshot once. Fixtures of earlier builds are removed when the next one
//! is built.

use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The directory of the shared snapshot `tag` of the built-in `template`, built on first
/// use by any test process of this build.
pub fn snapshot(template: &str, tag: &str) -> PathBuf {
    // Short names: a sandbox's socket path under the fixture must fit in 107 bytes.
    let fixtures = forkd_image::Home::from_env().tmp_dir().join("fx");
    let build_id = build_id();
    let root = fixtures.join(&build_id);
    std::fs::create_dir_all(&root).unwrap();
    let name = &digest_hex(format!("{template}\0{tag}").as_bytes())[..12];
    let home = root.join(name);
    let built = home.join("snapshots").join(tag);
    let ready = home.join("ready");
    let _lock = lock(&root.join(format!("{name}.lock")), FlockArg::LockExclusive)
        .expect("the fixture lock");
    if ready.exists() {
        return built;
    }
    remove_stale(&fixtures, &build_id);
    if home.exists() {
        // A build that did not finish (its process died): start over.
        std::fs::remove_dir_all(&home).unwrap();
    }
    std::fs::create_dir_all(&home).unwrap();
    std::os::unix::fs::symlink(
        forkd_image::Home::from_env().images_dir(),
        home.join("images"),
    )
    .unwrap();
    build(&home, template, tag);
    File::create(&ready).unwrap();
    built
}

/// Copies the shared snapshot `tag` of `template` into the data directory `home` as
/// hard links, keeping the directory's mode.
pub fn link_into(home: &Path, template: &str, tag: &str) {
    let from = snapshot(template, tag);
    let (from_parent, to_parent) = (from.parent().unwrap(), home.join("snapshots"));
    if !to_parent.exists() {
        // As the daemon makes it (closed to others).
        std::fs::create_dir(&to_parent).unwrap();
        let mode = std::fs::metadata(from_parent).unwrap().permissions();
        std::fs::set_permissions(&to_parent, mode).unwrap();
    }
    link_dir(&from, &to_parent.join(tag));
}

/// Copies the snapshot directory `from` to `to` as hard links of its files.
pub fn link_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        assert!(e.file_type().unwrap().is_file(), "{:?}", e.path());
        std::fs::hard_link(e.path(), to.join(e.file_name())).unwrap();
    }
    std::fs::set_permissions(to, std::fs::metadata(from).unwrap().permissions()).unwrap();
}

/// Builds `template` as `tag` in the data directory `home` with a daemon of its own,
/// which is stopped (with every VM it started) before this returns.
fn build(home: &Path, template: &str, tag: &str) {
    let log = home.join("daemon.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .arg("daemon")
        .env("FORKD_HOME", home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    if let Err(why) = super::wait_until_serving(&home.join("forkd.sock"), &mut child, 60) {
        panic!("the fixture daemon: {why}: {}", log_text());
    }
    let client = forkd_daemon::client::Client::new(
        forkd_daemon::client::Endpoint::Unix(home.join("forkd.sock")),
        None,
    );
    // A thread of its own: the caller may be inside a runtime already.
    let (template, tag) = (template.to_owned(), tag.to_owned());
    std::thread::spawn(move || {
        super::runtime().block_on(super::build_snapshot(&client, &template, &tag));
    })
    .join()
    .unwrap_or_else(|_| panic!("building the fixture: {}", log_text()));
    super::signal(child.id(), nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "the fixture daemon: {}", log_text());
}

/// This build's identity: a hash of the size and time of the `forkd` binary and of every
/// guest asset.
fn build_id() -> String {
    let mut h = Sha256::new();
    stamp(&mut h, Path::new(env!("CARGO_BIN_EXE_forkd")));
    let images = forkd_image::Home::from_env().images_dir();
    let mut dirs = vec![images.clone()];
    let tmp = forkd_image::Home::from_env().tmp_dir();
    while let Some(dir) = dirs.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for path in entries {
            if path == tmp || path.file_name().is_some_and(|n| n == ".lock") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else {
                stamp(&mut h, &path);
            }
        }
    }
    h.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn stamp(h: &mut Sha256, path: &Path) {
    let m = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    h.update(format!(
        "{}\0{}\0{}.{}\0",
        path.display(),
        m.size(),
        m.mtime(),
        m.mtime_nsec()
    ));
}

fn lock(path: &Path, how: FlockArg) -> Option<Flock<File>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap();
    Flock::lock(file, how).ok()
}

/// Removes the fixtures of earlier builds, unless a process holds one of their locks.
fn remove_stale(fixtures: &Path, build_id: &str) {
    for e in std::fs::read_dir(fixtures).unwrap().flatten() {
        if e.file_name() == build_id {
            continue;
        }
        let locks: Option<Vec<Flock<File>>> = std::fs::read_dir(e.path())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|f| f.path().extension().is_some_and(|x| x == "lock"))
            .map(|f| lock(&f.path(), FlockArg::LockExclusiveNonblock))
            .collect();
        if locks.is_some() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn digest_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
