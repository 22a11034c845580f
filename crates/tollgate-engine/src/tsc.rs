//! The monotonic part of [`SystemClock`](crate::SystemClock): the CPU's time-stamp counter
//! (through `quanta`, which falls back to the kernel's monotonic clock where the counter is not
//! invariant), counted per thread from a recent reading of the kernel's monotonic clock.
//!
//! What reading the counter saves over asking the kernel: see `docs/benchmarks.md`, section
//! "Hand-written parts of the core, and what each saves", "The clock".

use std::sync::OnceLock;
use std::time::Instant;

/// How long a thread counts from the time-stamp counter before it re-reads the kernel's clock.
/// At the counter's worst plausible rate error (10⁻⁴) that is 0.1 µs.
const REANCHOR_NANOS: u64 = 1_000_000;

/// The origin of [`kernel_nanos`]: the first monotonic reading of the process.
static ORIGIN: OnceLock<Instant> = OnceLock::new();

static COUNTER: OnceLock<quanta::Clock> = OnceLock::new();

#[inline]
pub(crate) fn counter() -> &'static quanta::Clock {
    COUNTER.get_or_init(quanta::Clock::new)
}

/// The kernel's monotonic clock, in nanoseconds since the process's origin.
pub(crate) fn kernel_nanos() -> u64 {
    let elapsed = ORIGIN.get_or_init(Instant::now).elapsed();
    u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
}

/// Where a thread's readings are counted from: a raw counter value and the kernel's time at
/// that value, plus the thread's latest reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Anchor {
    raw: u64,
    nanos: u64,
    last: u64,
}

impl Anchor {
    /// Makes the first reading of each thread anchor.
    pub(crate) const UNSET: Self = Self {
        raw: u64::MAX,
        nanos: 0,
        last: 0,
    };

    /// The kernel's monotonic clock ([`kernel_nanos`]), extrapolated with the time-stamp
    /// counter for up to [`REANCHOR_NANOS`] from this anchor, which moves when it must.
    #[inline]
    pub(crate) fn monotonic_nanos(&mut self) -> u64 {
        let counter = counter();
        let raw = counter.raw();
        let since = counter.delta_as_nanos(self.raw, raw);
        self.read(raw, since, kernel_nanos)
    }

    /// The reading at counter value `raw`, which the counter puts `since` nanoseconds after the
    /// anchor; `kernel` reads the kernel's clock when the anchor has to move.
    #[inline]
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
}
