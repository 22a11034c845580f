//! Where `now` comes from: the [`Clock`] trait, the unit of time, and a clock for tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Whole microseconds since the Unix epoch (UTC, no leap seconds).
///
/// Microseconds, not nanoseconds, so that the same figures fit exactly in the doubles that
/// Redis' Lua uses for numbers.
pub type Micros = u64;

/// Where algorithms get `now` from.
///
/// Algorithm code never reads the wall clock; backends take `now` from a `Clock` so that tests
/// can move time by hand ([`FakeClock`]).
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now(&self) -> Micros;
}

/// A clock that moves only when told to. Clones share the same time.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate_engine::{Clock, FakeClock};
///
/// let clock = FakeClock::new(1_000);
/// clock.advance(Duration::from_millis(2));
/// assert_eq!(clock.now(), 3_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    now: Arc<AtomicU64>,
}

impl FakeClock {
    /// A clock standing at `now` microseconds since the Unix epoch.
    pub fn new(now: Micros) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(now)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(micros(by), Ordering::SeqCst);
    }

    /// Sets the clock to `now` microseconds since the Unix epoch.
    pub fn set(&self, now: Micros) {
        self.now.store(now, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Micros {
        self.now.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Micros {
        (**self).now()
    }
}

pub(crate) fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
