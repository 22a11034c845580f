//! The client's estimate of the server's clock.

use std::sync::atomic::{AtomicI64, Ordering};

use tollgate_engine::Micros;

/// The server's `TIME` minus the local monotonic clock, in microseconds, as last seen.
///
/// The estimate is a monotonic clock, corrected by the difference last seen between the
/// server's time in a reply and when its call was sent. The server read its time after the
/// call was sent, so the estimate is at or after the server's time (by up to a round trip,
/// while the clocks run at the same rate), and a step of the local wall clock does not move
/// it. It names the fixed windows a call declares, and times leased slices: a slice then ends
/// no later, by the server's clock, than its window or its pace allows.
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    skew: AtomicI64,
}

impl ServerClock {
    /// The estimate of the server's `TIME` now.
    pub(crate) fn now(&self) -> Micros {
        let skew = self.skew.load(Ordering::Relaxed);
        monotonic_time().saturating_add_signed(skew)
    }

    /// Keeps the difference between the server's time, `server_now`, and the monotonic clock
    /// when the call that read it was `sent`.
    pub(crate) fn saw(&self, server_now: Micros, sent: Micros) {
        let skew = i64::try_from(i128::from(server_now) - i128::from(sent));
        self.skew.store(skew.unwrap_or(0), Ordering::Relaxed);
    }

    /// Makes the estimate `skew` microseconds off the monotonic clock.
    #[cfg(test)]
    pub(crate) fn set_skew(&self, skew: i64) {
        self.skew.store(skew, Ordering::Relaxed);
    }
}

/// The local wall clock in microseconds since the Unix epoch (0 before it).
fn local_time() -> Micros {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A monotonic clock in microseconds, which read the wall clock's time when first asked: it
/// never steps back or forward with the wall clock.
pub(crate) fn monotonic_time() -> Micros {
    static START: std::sync::OnceLock<(std::time::Instant, Micros)> = std::sync::OnceLock::new();
    let (instant, wall) = START.get_or_init(|| (std::time::Instant::now(), local_time()));
    let elapsed = u64::try_from(instant.elapsed().as_micros()).unwrap_or(u64::MAX);
    wall.saturating_add(elapsed)
}
