//! Named crash points for the crash-consistency tests: with `FORKD_FAILPOINT=<name>` in
//! its environment, a process aborts (as `kill -9` would end it: no destructor, no
//! flush) the first time it reaches [`hit`]`(<name>)`. Unset, a failpoint costs one
//! comparison against a value read once.
//!
//! The names, in the order a fork passes them: `fork.after_row` (the child's row is
//! written, its VM not started), `fork.after_vm_start` (its VM runs, its row still says
//! `starting`), `fork.after_ready` (its row says `running`, the API has not answered);
//! `delete.after_mark` (the row says `stopping`, the VM still runs); `adopt.after_first`
//! (a restarted daemon has adopted one sandbox of several); `build.after_boot` (a
//! template's parent runs, its snapshot is not written); `branch.at_instant` (a branch's
//! source is stopped at the branch instant, its memory stream half sent).

use std::sync::OnceLock;

/// The environment variable that arms a failpoint.
pub const ENV: &str = "FORKD_FAILPOINT";

/// Aborts the process if the failpoint `name` is armed.
pub fn hit(name: &str) {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var(ENV).ok().filter(|s| !s.is_empty()));
    if armed.as_deref() == Some(name) {
        eprintln!("forkd: failpoint {name} reached: aborting");
        std::process::abort();
    }
}
