//! Running operations as the daemon keeps them in memory: children ready so far, the
//! steps begun, and the cancellation of a fork.

use super::{Registry, MAX_STEPS};

impl Registry {
    /// Children ready so far in the running fork `op`, if it runs.
    pub fn progress(&self, op: &str) -> Option<u64> {
        self.slots().progress.get(op).copied()
    }

    /// Records a running operation's progress (kept in memory, like a fork's).
    pub fn set_progress(&self, op: &str, done: u64) {
        self.slots().progress.insert(op.to_owned(), done);
    }

    /// Forgets a finished operation's progress (its row has the final figures).
    pub fn clear_progress(&self, op: &str) {
        let mut slots = self.slots();
        slots.progress.remove(op);
        slots.steps.remove(op);
    }

    /// Records the step a running operation begins (the first [`MAX_STEPS`] are kept).
    pub fn add_step(&self, op: &str, step: &str) {
        let mut slots = self.slots();
        let steps = slots.steps.entry(op.to_owned()).or_default();
        if steps.len() < MAX_STEPS {
            steps.push(step.to_owned());
        }
    }

    /// The steps the running operation `op` has begun, oldest first.
    pub fn steps(&self, op: &str) -> Vec<String> {
        self.slots().steps.get(op).cloned().unwrap_or_default()
    }

    /// Cancels the running fork `op`: children not started yet are not, started ones
    /// are stopped and removed. False if no such fork runs.
    pub fn cancel(&self, op: &str) -> bool {
        match self.slots().cancels.get(op) {
            Some(c) => {
                c.cancel();
                true
            }
            None => false,
        }
    }
}
