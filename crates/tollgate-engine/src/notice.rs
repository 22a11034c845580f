//! Warnings that must reach a person even when the application listens to no tracing: a
//! backend that fails and a limit that lets requests through because of it.
//!
//! tollgate reports through `tracing` and `metrics`. An application that installed neither
//! would fail open in silence, so such a warning also goes to standard error, as one line,
//! when no tracing subscriber is set: at most once per [`STDERR_EVERY`] for each kind of
//! warning, with the count of events since the last line.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often, at most, one kind of warning is written to standard error.
pub const STDERR_EVERY: Duration = Duration::from_secs(60);

/// Counts events and lets one in each interval through.
#[derive(Debug)]
pub struct Throttle {
    every_ms: u64,
    started: Instant,
    /// Milliseconds since `started` before which events are only counted.
    next: AtomicU64,
    quiet: AtomicU64,
}

impl Throttle {
    /// A throttle that lets one event through at once, then at most one per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every_ms: u64::try_from(every.as_millis()).unwrap_or(u64::MAX),
            started: Instant::now(),
            next: AtomicU64::new(0),
            quiet: AtomicU64::new(0),
        }
    }

    /// Calls `log` with the number of events since its last call (this one included), unless
    /// it was called less than the interval ago.
    pub fn tick(&self, log: impl FnOnce(u64)) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        if let Some(n) = self.tick_at(now) {
            log(n);
        }
    }

    /// One event at `now` milliseconds since the throttle was made: the count to report, or
    /// `None` when it is only counted.
    fn tick_at(&self, now: u64) -> Option<u64> {
        let due = self.next.load(Ordering::Relaxed);
        let next = now.saturating_add(self.every_ms);
        if now >= due
            && self
                .next
                .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.quiet.swap(0, Ordering::Relaxed) + 1)
        } else {
            self.quiet.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Whether a tracing event emitted here would reach nobody: no subscriber is set, neither
/// for the whole process nor for this thread.
pub fn unheard() -> bool {
    tracing::dispatcher::get_default(|d| d.is::<tracing::subscriber::NoSubscriber>())
}

/// Counts one event of the kind `throttle` counts and, when nobody listens to tracing and
/// none was written in its interval, writes the line `line` makes of the count on standard
/// error. A failed write is ignored: there is nowhere else to say it.
pub fn to_stderr(throttle: &Throttle, line: impl FnOnce(u64) -> String) {
    if !unheard() {
        return;
    }
    throttle.tick(|n| {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "{}", line(n));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_goes_through_with_the_count_since_the_last() {
        let t = Throttle::new(Duration::from_secs(60));
        assert_eq!(t.tick_at(0), Some(1));
        assert_eq!(t.tick_at(1), None);
        assert_eq!(t.tick_at(59_999), None);
        assert_eq!(t.tick_at(60_000), Some(3));
        assert_eq!(t.tick_at(60_001), None);
        assert_eq!(t.tick_at(200_000), Some(2));
    }

    #[test]
    fn without_a_subscriber_nobody_hears() {
        assert!(unheard());
        let subscriber = tracing::subscriber::NoSubscriber::new();
        // Any other subscriber is someone listening.
        let listening = tracing::Dispatch::new(Listening);
        tracing::dispatcher::with_default(&listening, || assert!(!unheard()));
        tracing::subscriber::with_default(subscriber, || assert!(unheard()));
    }

    struct Listening;

    impl tracing::Subscriber for Listening {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, _: &tracing::Event<'_>) {}
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
}
