use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// The real clock: the system time read once at start, advanced by the monotonic clock.
///
/// It never goes backwards, even when the system time is stepped, and it stays aligned to UTC
/// closely enough for calendar windows (UTC hour, UTC day).
///
/// The monotonic part is read from the CPU's time-stamp counter where it is invariant (through
/// `quanta`, which falls back to the kernel's monotonic clock elsewhere): that costs about half
/// a `clock_gettime`. The counter's rate is only estimated, so each thread re-reads the kernel's
/// monotonic clock every millisecond and counts from there; an error in the rate then stays far
/// below a microsecond instead of growing with uptime. Readings on one thread never decrease;
/// two threads agree to a fraction of a microsecond (a check reads `now` before it takes its
/// shard's lock, so checks never relied on a closer agreement).
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    base_unix: Micros,
    base_nanos: u64,
}

impl SystemClock {
    /// Anchors a clock at the current system time.
    pub fn new() -> Self {
        // Calibrates the counter now rather than in the first request (about a millisecond,
        // at most 200 ms, once per process).
        let _ = counter();
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Self {
            base_unix: micros(since_epoch),
            base_nanos: kernel_nanos(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Micros {
        let elapsed = monotonic_nanos().saturating_sub(self.base_nanos) / 1_000;
        self.base_unix.saturating_add(elapsed)
    }
}

/// How long a thread counts from the time-stamp counter before it re-reads the kernel's clock.
/// At the counter's worst plausible rate error (10⁻⁴) that is 0.1 µs.
const REANCHOR_NANOS: u64 = 1_000_000;

/// The origin of [`kernel_nanos`]: the first monotonic reading of the process.
static ORIGIN: OnceLock<Instant> = OnceLock::new();

static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();

fn counter() -> &'static quanta::Clock {
    COUNTER.get_or_init(quanta::Clock::new)
}

/// The kernel's monotonic clock, in nanoseconds since the process's origin.
fn kernel_nanos() -> u64 {
    let elapsed = ORIGIN.get_or_init(Instant::now).elapsed();
    u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
}

/// Where a thread's readings are counted from: a raw counter value and the kernel's time at
/// that value, plus the thread's latest reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Anchor {
    raw: u64,
    nanos: u64,
    last: u64,
}

impl Anchor {
    /// Makes the first reading of each thread anchor.
    const UNSET: Self = Self {
        raw: u64::MAX,
        nanos: 0,
        last: 0,
    };

    /// The reading at counter value `raw`, which the counter puts `since` nanoseconds after the
    /// anchor; `kernel` reads the kernel's clock when the anchor has to move.
    fn read(&mut self, raw: u64, since: u64, kernel: impl FnOnce() -> u64) -> u64 {
        // A counter below the anchor (another core's, or no anchor yet) or past the
        // re-anchoring period: read the kernel's clock.
        let nanos = if raw >= self.raw && since < REANCHOR_NANOS {
            self.nanos.saturating_add(since)
        } else {
            let nanos = kernel();
            self.raw = raw;
            self.nanos = nanos;
            nanos
        };
        // Re-anchoring may land a fraction of a microsecond before the extrapolation.
        self.last = self.last.max(nanos);
        self.last
    }
}

thread_local! {
    static ANCHOR: Cell<Anchor> = const { Cell::new(Anchor::UNSET) };
}

/// [`kernel_nanos`], extrapolated with the time-stamp counter for up to [`REANCHOR_NANOS`].
#[inline]
fn monotonic_nanos() -> u64 {
    let counter = counter();
    let raw = counter.raw();
    ANCHOR
        .try_with(|cell| {
            let mut anchor = cell.get();
            let since = counter.delta_as_nanos(anchor.raw, raw);
            let nanos = anchor.read(raw, since, kernel_nanos);
            cell.set(anchor);
            nanos
        })
        .unwrap_or_else(|_| kernel_nanos())
}

/// A clock that moves only when told to. Clones share the same time.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{Clock, FakeClock};
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

#[cfg(test)]
mod tests {
    use super::*;

    fn no_kernel() -> u64 {
        panic!("the anchor should not move")
    }

    #[test]
    fn a_thread_counts_from_its_anchor_and_re_anchors_every_millisecond() {
        let mut a = Anchor::UNSET;
        assert_eq!(a.read(100, 0, || 5_000), 5_000);
        assert_eq!((a.raw, a.nanos), (100, 5_000));
        assert_eq!(a.read(150, 400, no_kernel), 5_400);
        assert_eq!(a.read(2_000, 999_999, no_kernel), 1_004_999);
        // One millisecond past the anchor: the kernel's clock, here 300 ns ahead.
        assert_eq!(a.read(2_100, 1_000_000, || 1_005_300), 1_005_300);
        assert_eq!((a.raw, a.nanos), (2_100, 1_005_300));
        // A counter behind the anchor (another core's): the kernel's clock again.
        assert_eq!(a.read(2_099, 0, || 1_005_310), 1_005_310);
        assert_eq!(a.raw, 2_099);
    }

    #[test]
    fn readings_never_decrease_when_the_kernel_is_behind_the_extrapolation() {
        let mut a = Anchor::UNSET;
        a.read(0, 0, || 0);
        assert_eq!(a.read(10, 999_900, no_kernel), 999_900);
        assert_eq!(a.read(20, 1_000_000, || 999_000), 999_900);
        assert_eq!(a.nanos, 999_000);
        assert_eq!(a.read(30, 500, no_kernel), 999_900);
        assert_eq!(a.read(40, 901, no_kernel), 999_901);
    }

    #[test]
    fn system_clock_never_decreases_on_a_thread() {
        let clock = SystemClock::new();
        let mut last = clock.now();
        for _ in 0..100_000 {
            let now = clock.now();
            assert!(now >= last, "{now} < {last}");
            last = now;
        }
    }
}
