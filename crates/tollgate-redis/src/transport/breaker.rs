//! The circuit breaker: stops paying the deadline on every request while Redis is down.
//!
//! Closed, it lets every call through and counts consecutive failures. After `threshold` of
//! them it opens for `open_for`, failing calls at once. When that has passed, one call goes
//! through as a probe (the others keep failing fast): success closes the breaker, failure opens
//! it again for twice as long, up to `max_open_for`. A probe that never reports (its future was
//! dropped) frees the place after `probe_timeout`.
//!
//! Time is `tokio::time::Instant`, so tests can pause and advance it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tollgate_engine::notice::{self, Throttle, STDERR_EVERY};

/// Every opening of every breaker of the process, told on standard error when no tracing
/// subscriber is set (see [`notice`]).
static OPENED_NOTICE: LazyLock<Throttle> = LazyLock::new(|| Throttle::new(STDERR_EVERY));

/// Says on standard error, when nobody listens to tracing, that a breaker opened for `open_for`.
fn tell_opened(why: &str, open_for: Duration) {
    notice::to_stderr(&OPENED_NOTICE, |n| {
        format!(
            "tollgate-redis: WARNING circuit breaker opened: {why}; calls fail at once for \
             {}ms, and limits fail as their failure policy says; {n} opened since the last \
             such line. This line repeats at most every {}s; install a tracing subscriber to \
             see every one.",
            open_for.as_millis(),
            STDERR_EVERY.as_secs()
        )
    });
}

/// Where a circuit breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CircuitState {
    /// Calls go through.
    Closed,
    /// Calls fail at once, without reaching Redis.
    Open,
    /// The open interval has passed: the next call probes Redis.
    HalfOpen,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct BreakerConfig {
    /// Consecutive failures that open the breaker; 0 disables it.
    pub(crate) threshold: u32,
    pub(crate) open_for: Duration,
    pub(crate) max_open_for: Duration,
    pub(crate) probe_timeout: Duration,
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    state: Mutex<State>,
    /// Whether `open_until` is `None`, readable without the lock: a closed breaker (the usual
    /// case) admits every request without taking it or reading the clock.
    closed: AtomicBool,
}

#[derive(Debug)]
struct State {
    failures: u32,
    open_until: Option<Instant>,
    interval: Duration,
    probe_until: Option<Instant>,
}

/// A permission to call Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Permit {
    probe: bool,
}

impl Permit {
    /// The permit of one call that carries the requests of `permits`: a probe if any is.
    pub(crate) fn any(permits: impl IntoIterator<Item = Permit>) -> Self {
        Self {
            probe: permits.into_iter().any(|p| p.probe),
        }
    }
}

impl Breaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State {
                failures: 0,
                open_until: None,
                interval: config.open_for,
                probe_until: None,
            }),
            closed: AtomicBool::new(true),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens the breaker until `until`, or closes it (`None`): the one place that changes
    /// `open_until`, so that `closed` always says the same.
    fn set_open_until(&self, s: &mut State, until: Option<Instant>) {
        s.open_until = until;
        self.closed.store(until.is_none(), Ordering::Release);
    }

    /// A permit to call Redis now, or `None` to fail fast.
    pub(crate) fn admit(&self) -> Option<Permit> {
        if self.closed.load(Ordering::Acquire) {
            return Some(Permit { probe: false });
        }
        let now = Instant::now();
        let mut s = self.lock();
        match s.open_until {
            None => Some(Permit { probe: false }),
            Some(until) if now < until => None,
            Some(_) if s.probe_until.is_some_and(|p| now < p) => None,
            Some(_) => {
                s.probe_until = Some(now + self.config.probe_timeout);
                Some(Permit { probe: true })
            }
        }
    }

    /// Redis answered a call made with `permit`. Only a probe's answer closes an open breaker:
    /// a call sent before the breaker opened that answers late says nothing of Redis now.
    pub(crate) fn success(&self, permit: Permit) {
        let mut s = self.lock();
        if s.open_until.is_some() && !permit.probe {
            return;
        }
        if s.open_until.is_some() {
            tracing::info!(
                backend = "redis",
                "circuit breaker closed: Redis answers again"
            );
        }
        s.failures = 0;
        self.set_open_until(&mut s, None);
        s.probe_until = None;
        s.interval = self.config.open_for;
    }

    /// Redis did not answer (in time). Returns whether the connection should be replaced: when
    /// the breaker (re)opens, or on every failure when the breaker is off. A connection can die
    /// without an error (a NAT entry or a failover that drops it silently), and calls on it
    /// then only time out; without this, probes would keep timing out on the dead one.
    pub(crate) fn failure(&self, permit: Permit) -> bool {
        if self.config.threshold == 0 {
            return true;
        }
        let now = Instant::now();
        let mut s = self.lock();
        s.failures = s.failures.saturating_add(1);
        if permit.probe {
            s.interval = (s.interval * 2).min(self.config.max_open_for);
            let until = now + s.interval;
            self.set_open_until(&mut s, Some(until));
            s.probe_until = None;
            tracing::warn!(
                backend = "redis",
                open_for_ms = s.interval.as_millis() as u64,
                "circuit breaker probe failed: open again"
            );
            tell_opened("the probe failed, Redis still fails", s.interval);
            true
        } else if s.open_until.is_none() && s.failures >= self.config.threshold {
            s.interval = self.config.open_for;
            let until = now + s.interval;
            self.set_open_until(&mut s, Some(until));
            tracing::warn!(
                backend = "redis",
                failures = s.failures,
                open_for_ms = s.interval.as_millis() as u64,
                "circuit breaker opened: Redis is failing"
            );
            tell_opened(
                &format!("Redis failed {} times in a row", s.failures),
                s.interval,
            );
            true
        } else {
            false
        }
    }

    pub(crate) fn state(&self) -> CircuitState {
        let now = Instant::now();
        match self.lock().open_until {
            None => CircuitState::Closed,
            Some(until) if now < until => CircuitState::Open,
            Some(_) => CircuitState::HalfOpen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig {
            threshold: 3,
            open_for: Duration::from_millis(250),
            max_open_for: Duration::from_secs(1),
            probe_timeout: Duration::from_millis(100),
        })
    }

    fn fail(b: &Breaker) {
        let permit = b.admit().expect("a permit");
        b.failure(permit);
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_the_threshold_and_probes_once() {
        let b = breaker();
        fail(&b);
        fail(&b);
        assert_eq!(b.state(), CircuitState::Closed);
        fail(&b);
        assert_eq!(b.state(), CircuitState::Open);
        assert_eq!(b.admit(), None);

        tokio::time::advance(Duration::from_millis(249)).await;
        assert_eq!(b.admit(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(b.state(), CircuitState::HalfOpen);
        let probe = b.admit().expect("one probe");
        assert_eq!(b.admit(), None, "only one probe at a time");
        b.success(probe);
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.admit().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn failed_probes_double_the_interval_up_to_the_max() {
        let b = breaker();
        for _ in 0..3 {
            fail(&b);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        for expected in [500, 1_000, 1_000] {
            fail(&b); // the probe
            tokio::time::advance(Duration::from_millis(expected - 1)).await;
            assert_eq!(b.admit(), None);
            tokio::time::advance(Duration::from_millis(1)).await;
            assert_eq!(b.state(), CircuitState::HalfOpen);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_probe_frees_its_place() {
        let b = breaker();
        for _ in 0..3 {
            fail(&b);
        }
        tokio::time::advance(Duration::from_millis(250)).await;
        let _lost = b.admit().expect("a probe");
        assert_eq!(b.admit(), None);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(b.admit().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn successes_reset_the_count() {
        let b = breaker();
        fail(&b);
        fail(&b);
        b.success(Permit::default());
        fail(&b);
        fail(&b);
        assert_eq!(b.state(), CircuitState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_of_a_call_sent_before_the_breaker_opened_does_not_close_it() {
        let b = breaker();
        let late = b.admit().expect("a permit");
        for _ in 0..3 {
            fail(&b);
        }
        assert_eq!(b.state(), CircuitState::Open);
        b.success(late);
        assert_eq!(b.state(), CircuitState::Open);
        tokio::time::advance(Duration::from_millis(250)).await;
        let probe = b.admit().expect("a probe");
        b.success(probe);
        assert_eq!(b.state(), CircuitState::Closed);
    }
}
