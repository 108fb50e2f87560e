//! Where a VM's start-up time went: each step of a boot or restore, in order, as the
//! backend and the sandbox layer measured it. `forkd bench fork` reports them, so that a
//! slower restore points at its step.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One measured step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// What the step was, such as `"network"` or `"device state"`.
    pub name: &'static str,
    /// How long it took.
    pub took: Duration,
}

/// Steps recorded as they end, each timed from the end of the one before.
#[derive(Debug)]
pub struct StepClock {
    last: Mutex<Instant>,
    steps: Mutex<Vec<Step>>,
}

impl Default for StepClock {
    fn default() -> Self {
        StepClock::new()
    }
}

impl StepClock {
    /// A clock whose first step starts now.
    pub fn new() -> StepClock {
        StepClock {
            last: Mutex::new(Instant::now()),
            steps: Mutex::new(Vec::new()),
        }
    }

    /// Ends the step under way as `name`; the next one starts now.
    pub fn end(&self, name: &'static str) {
        let now = Instant::now();
        let took = {
            let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            let took = now - *last;
            *last = now;
            took
        };
        self.steps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Step { name, took });
    }

    /// The steps so far.
    pub fn steps(&self) -> Vec<Step> {
        self.steps.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_timed_from_the_one_before() {
        let clock = StepClock::new();
        std::thread::sleep(Duration::from_millis(20));
        clock.end("first");
        clock.end("second");
        clock.end("third");
        let steps = clock.steps();
        let names: Vec<_> = steps.iter().map(|s| s.name).collect();
        assert_eq!(names, ["first", "second", "third"]);
        assert!(steps[0].took >= Duration::from_millis(20));
    }
}
