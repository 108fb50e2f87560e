//! The host's side of a file watch: the guest's events read as fast as they come into a
//! queue of at most [`QUEUE`] events, whoever reads them and however slowly. Events that
//! find it full are dropped and counted, and an `overflow` event with their number takes
//! their place in the order. Without it, a reader that stops would leave the events in
//! the agent connection's flow-control window (megabytes per stream) and the guest would
//! never learn that no one takes them; with it, a storm costs the host at most a queue.

use crate::error::SandboxError;
use forkd_proto::files::{WatchEvent, WatchKind};
use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Events the host keeps for a reader of one watch, as the guest does.
pub const QUEUE: usize = 1024;

/// What the pump left for the reader.
#[derive(Default)]
struct Queue {
    events: VecDeque<WatchEvent>,
    /// Dropped since the last event queued.
    dropped: u64,
    /// How the guest's stream ended, once it did.
    end: Option<Result<(), SandboxError>>,
    /// The end was handed out.
    finished: bool,
}

fn overflow(dropped: u64) -> WatchEvent {
    WatchEvent {
        kind: WatchKind::Overflow,
        path: String::new(),
        dir: false,
        dropped: Some(dropped),
    }
}

impl Queue {
    /// Queues `e`, or counts it dropped.
    fn push(&mut self, e: WatchEvent) {
        // The guest's own overflow stands for the events it lost.
        let weight = if e.kind == WatchKind::Overflow {
            e.dropped.unwrap_or(1)
        } else {
            1
        };
        if self.dropped > 0 && self.events.len() < QUEUE {
            let n = std::mem::take(&mut self.dropped);
            self.events.push_back(overflow(n));
        }
        if self.events.len() >= QUEUE {
            self.dropped += weight;
        } else if e.kind == WatchKind::Overflow
            && self
                .events
                .back()
                .is_some_and(|b| b.kind == WatchKind::Overflow)
        {
            if let Some(b) = self.events.back_mut() {
                b.dropped = Some(b.dropped.unwrap_or(0) + weight);
            }
        } else {
            self.events.push_back(e);
        }
    }
}

/// A watch's events, read by a task of its own (see the module's comment).
pub struct WatchQueue {
    shared: Arc<(Mutex<Queue>, Notify)>,
    pump: tokio::task::JoinHandle<()>,
}

fn lock(m: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl WatchQueue {
    /// Starts reading events with `next` (the guest's next event, `None` at its end)
    /// until it ends or fails, or this queue is dropped.
    pub fn start<N, F>(mut next: N) -> WatchQueue
    where
        N: FnMut() -> F + Send + 'static,
        F: Future<Output = Result<Option<WatchEvent>, SandboxError>> + Send,
    {
        let shared = Arc::new((Mutex::new(Queue::default()), Notify::new()));
        let pumped = shared.clone();
        let pump = tokio::spawn(async move {
            loop {
                let r = next().await;
                let (queue, notify) = &*pumped;
                let mut q = lock(queue);
                let more = match r {
                    Ok(Some(e)) => {
                        q.push(e);
                        true
                    }
                    Ok(None) => {
                        q.end = Some(Ok(()));
                        false
                    }
                    Err(e) => {
                        q.end = Some(Err(e));
                        false
                    }
                };
                drop(q);
                notify.notify_one();
                if !more {
                    return;
                }
            }
        });
        WatchQueue { shared, pump }
    }

    /// The next event, an overflow for those dropped, `None` once the guest's stream
    /// ended, or how it failed.
    pub async fn next(&mut self) -> Result<Option<WatchEvent>, SandboxError> {
        let (queue, notify) = &*self.shared;
        loop {
            let notified = notify.notified();
            {
                let mut q = lock(queue);
                if let Some(e) = q.events.pop_front() {
                    return Ok(Some(e));
                }
                if q.dropped > 0 {
                    return Ok(Some(overflow(std::mem::take(&mut q.dropped))));
                }
                if q.finished {
                    return Ok(None);
                }
                if let Some(end) = q.end.take() {
                    q.finished = true;
                    return end.map(|()| None);
                }
            }
            notified.await;
        }
    }
}

impl Drop for WatchQueue {
    fn drop(&mut self) {
        // Dropping the guest's stream ends the watch in the guest.
        self.pump.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn created(i: usize) -> WatchEvent {
        WatchEvent {
            kind: WatchKind::Create,
            path: format!("/w/{i}"),
            dir: false,
            dropped: None,
        }
    }

    #[tokio::test]
    async fn a_reader_that_waits_gets_the_queue_then_one_overflow_in_order() {
        let mut n = 0usize;
        let mut q = WatchQueue::start(move || {
            n += 1;
            let i = n;
            async move { Ok((i <= 5000).then(|| created(i))) }
        });
        // The pump runs ahead of the reader, which reads nothing until it is done.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let mut got = Vec::new();
        while let Some(e) = q.next().await.unwrap() {
            got.push(e);
        }
        assert_eq!(got.len(), QUEUE + 1);
        assert!(got[..QUEUE]
            .iter()
            .enumerate()
            .all(|(i, e)| e.path == format!("/w/{}", i + 1)));
        assert_eq!(got[QUEUE].kind, WatchKind::Overflow);
        assert_eq!(got[QUEUE].dropped, Some(5000 - QUEUE as u64));
        assert!(q.next().await.unwrap().is_none(), "the end stays the end");
    }

    #[test]
    fn an_overflow_takes_the_place_of_what_it_stands_for() {
        let mut q = Queue::default();
        for i in 0..QUEUE + 3 {
            q.push(created(i));
        }
        assert_eq!((q.events.len(), q.dropped), (QUEUE, 3));
        // Room for two: the overflow and the next event.
        q.events.pop_front();
        q.events.pop_front();
        q.push(created(9999));
        // The loss is reported where it happened: before what came after it.
        let tail: Vec<_> = q
            .events
            .iter()
            .rev()
            .take(2)
            .map(|e| (e.kind, e.dropped))
            .collect();
        assert_eq!(
            tail,
            [(WatchKind::Create, None), (WatchKind::Overflow, Some(3))]
        );
        // The guest's overflow counts as the events it lost, merged with one queued.
        let mut q = Queue::default();
        q.push(overflow(7));
        q.push(overflow(2));
        assert_eq!(q.events.len(), 1);
        assert_eq!(q.events[0].dropped, Some(9));
    }
}
