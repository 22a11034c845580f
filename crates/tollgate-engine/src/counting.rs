//! Which algorithm a limit counts with.

/// How a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// Generic cell rate algorithm: a token bucket kept as one timestamp. Smooth; admits up to
    /// `burst` at once, then one request per `period / limit`. The default.
    #[default]
    Gcra,
    /// At most `limit` per window; windows are aligned to the Unix epoch, so a one-day window is
    /// a UTC day and a one-hour window a UTC hour, on every replica. A burst across a window
    /// boundary can admit up to twice the limit within one period.
    FixedWindow,
    /// At most `limit` in any sliding period, counted exactly from a log of admitted requests.
    /// Memory grows with the limit (one entry per admitted request in the period).
    SlidingLog,
    /// At most `limit` requests in flight at once: a request takes a slot when it is admitted
    /// and gives it back when its response body ends or is dropped. The quota's period is how
    /// long a slot lives in a backend whose slots expire (Redis) unless its holder renews it,
    /// so that a crashed replica cannot hold slots for longer. See
    /// [`Limit::concurrency`](crate::Limit::concurrency).
    Concurrency,
}

impl Algorithm {
    /// A short lowercase name: `gcra`, `fixed_window`, `sliding_log` or `concurrency`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Gcra => "gcra",
            Self::FixedWindow => "fixed_window",
            Self::SlidingLog => "sliding_log",
            Self::Concurrency => "concurrency",
        }
    }
}
