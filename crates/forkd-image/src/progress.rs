//! How builds report what they are doing: spinners on a terminal, plain step lines
//! in CI logs, or nothing at all when used as a library.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Where build progress goes. All output is on stderr so stdout stays parseable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Progress {
    /// indicatif spinners (for a terminal).
    Spinner,
    /// `[forkd] ...` lines, one per step start and end (for logs).
    Plain,
    /// Nothing but `tracing` events.
    #[default]
    Silent,
}

/// In plain mode a relayed tool line is printed at most this often, so a
/// debootstrap run adds a few dozen lines to a CI log rather than thousands.
const PLAIN_RELAY_INTERVAL: Duration = Duration::from_secs(5);

impl Progress {
    /// Spinners when stderr is a terminal, plain lines otherwise.
    pub fn auto() -> Progress {
        if std::io::stderr().is_terminal() {
            Progress::Spinner
        } else {
            Progress::Plain
        }
    }

    /// Starts a step; it reports its elapsed time when [`Step::finish`]ed.
    pub(crate) fn step(&self, label: impl Into<String>) -> Step {
        let label = label.into();
        tracing::info!(step = %label, "started");
        let kind = match self {
            Progress::Spinner => {
                let bar = ProgressBar::new_spinner();
                if let Ok(style) = ProgressStyle::with_template(
                    "{spinner:.cyan} {prefix} {wide_msg:.dim} {elapsed}",
                ) {
                    bar.set_style(style);
                }
                bar.set_prefix(label.clone());
                bar.enable_steady_tick(Duration::from_millis(120));
                StepKind::Spinner(bar)
            }
            Progress::Plain => {
                eprintln!("[forkd] {label} ...");
                StepKind::Plain(Mutex::new(Instant::now()))
            }
            Progress::Silent => StepKind::Silent,
        };
        Step {
            label,
            started: Instant::now(),
            kind,
            done: false,
        }
    }

    /// A warning that is not an error (e.g. a module that is built in after all).
    pub(crate) fn warn(&self, msg: &str) {
        tracing::warn!("{msg}");
        match self {
            Progress::Spinner | Progress::Plain => eprintln!("[forkd] warning: {msg}"),
            Progress::Silent => {}
        }
    }
}

/// One running build step.
pub(crate) struct Step {
    label: String,
    started: Instant,
    kind: StepKind,
    done: bool,
}

enum StepKind {
    Spinner(ProgressBar),
    /// When the last relayed line was printed.
    Plain(Mutex<Instant>),
    Silent,
}

impl Step {
    /// What the step is doing right now, e.g. the last line a tool printed.
    /// Callable from a reader thread while the step runs.
    pub(crate) fn message(&self, msg: &str) {
        let msg = msg.trim();
        if msg.is_empty() {
            return;
        }
        match &self.kind {
            StepKind::Spinner(bar) => bar.set_message(msg.to_string()),
            StepKind::Plain(last) => {
                let mut last = match last.lock() {
                    Ok(g) => g,
                    Err(poisoned) => poisoned.into_inner(),
                };
                if last.elapsed() >= PLAIN_RELAY_INTERVAL {
                    *last = Instant::now();
                    eprintln!("[forkd] {}: {msg}", self.label);
                }
            }
            StepKind::Silent => {}
        }
    }

    /// Ends the step successfully, printing how long it took.
    pub(crate) fn finish(mut self) -> Duration {
        self.done = true;
        let took = self.started.elapsed();
        self.end(&format!("done in {:.1}s", took.as_secs_f64()));
        tracing::info!(step = %self.label, seconds = took.as_secs_f64(), "finished");
        took
    }

    fn end(&self, outcome: &str) {
        match &self.kind {
            StepKind::Spinner(bar) => {
                bar.finish_and_clear();
                eprintln!("  {} {outcome}", self.label);
            }
            StepKind::Plain(_) => {
                eprintln!("[forkd] {} {outcome}", self.label);
                // A flush failure on stderr has nowhere to be reported.
                let _ = std::io::stderr().flush();
            }
            StepKind::Silent => {}
        }
    }
}

impl Drop for Step {
    /// A step dropped without `finish` was cut short by an error (which the
    /// caller reports); say so, so a spinner is not left spinning.
    fn drop(&mut self) {
        if !self.done {
            let took = self.started.elapsed().as_secs_f64();
            self.end(&format!("failed after {took:.1}s"));
        }
    }
}
