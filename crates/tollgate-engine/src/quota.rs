//! A quota: how many units a limit admits in how long.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::bounds::MAX_PERIOD;
use crate::clock::{micros, Micros};
use crate::error::ConfigError;

/// How many requests a limit admits in how long.
///
/// "100 per minute" is written `Quota::per_minute(100)` and means exactly that. A quota cannot be
/// zero, its period must leave at least one microsecond per request and last at most
/// [`MAX_PERIOD`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate_engine::Quota;
///
/// let q = Quota::per_minute(100)?;
/// assert_eq!(q.limit(), 100);
/// assert_eq!(q.period(), Duration::from_secs(60));
/// assert!(Quota::per_minute(0).is_err());
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    limit: NonZeroU32,
    period: Micros,
    burst: NonZeroU32,
    /// `period / limit`, kept so that a GCRA check does not divide for it.
    interval: Micros,
}

impl Quota {
    /// `limit` requests per `period`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroLimit`] for a limit of 0; [`ConfigError::PeriodTooShort`] when the
    /// period has fewer microseconds than the limit has requests;
    /// [`ConfigError::PeriodTooLong`] for a period longer than [`MAX_PERIOD`].
    pub fn new(limit: u32, period: Duration) -> Result<Self, ConfigError> {
        let limit = NonZeroU32::new(limit).ok_or(ConfigError::ZeroLimit)?;
        if period > MAX_PERIOD {
            return Err(ConfigError::PeriodTooLong);
        }
        let period = micros(period);
        if period < u64::from(limit.get()) {
            return Err(ConfigError::PeriodTooShort);
        }
        Ok(Self {
            limit,
            period,
            burst: limit,
            interval: period / u64::from(limit.get()),
        })
    }

    /// `limit` requests per second.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_second(limit: u32) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(1))
    }

    /// `limit` requests per minute.
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_minute(limit: u32) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(60))
    }

    /// `limit` requests per hour (a UTC hour for a fixed window).
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_hour(limit: u32) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(3600))
    }

    /// `limit` requests per day (a UTC day for a fixed window).
    ///
    /// # Errors
    ///
    /// As [`Quota::new`].
    pub fn per_day(limit: u32) -> Result<Self, ConfigError> {
        Self::new(limit, Duration::from_secs(86_400))
    }

    /// Lets GCRA admit up to `burst` requests at once while keeping the long-run rate.
    ///
    /// Without it the burst equals the limit. Only GCRA uses it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidBurst`] for a burst of 0; [`ConfigError::PeriodTooLong`] when
    /// refilling the whole burst would take longer than [`MAX_PERIOD`].
    pub fn with_burst(mut self, burst: u32) -> Result<Self, ConfigError> {
        self.burst = NonZeroU32::new(burst).ok_or(ConfigError::InvalidBurst)?;
        if self.interval.saturating_mul(u64::from(burst)) > micros(MAX_PERIOD) {
            return Err(ConfigError::PeriodTooLong);
        }
        Ok(self)
    }

    /// How far GCRA's whole-microsecond emission interval lets the long-run rate exceed
    /// `limit / period`, in parts per 10,000 (rounded up).
    pub(crate) fn rate_excess_bp(&self) -> u64 {
        let counted = u64::from(self.limit.get()) * self.interval;
        (self.period - counted)
            .saturating_mul(10_000)
            .div_ceil(counted)
    }

    /// Requests admitted per period.
    pub fn limit(&self) -> u32 {
        self.limit.get()
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period)
    }

    /// The period in microseconds.
    pub fn period_micros(&self) -> Micros {
        self.period
    }

    /// The most requests GCRA admits at once.
    pub fn burst(&self) -> u32 {
        self.burst.get()
    }

    /// GCRA's emission interval: the period divided by the limit, in whole microseconds.
    pub fn emission_interval(&self) -> Micros {
        self.interval
    }

    /// This quota with the limit divided by `parts` (rounded up, at least 1).
    pub(crate) fn divided(&self, parts: NonZeroU32) -> Self {
        let share = |n: NonZeroU32| {
            NonZeroU32::new(n.get().div_ceil(parts.get())).unwrap_or(NonZeroU32::MIN)
        };
        let limit = share(self.limit);
        Self {
            limit,
            period: self.period,
            burst: share(self.burst),
            interval: self.period / u64::from(limit.get()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_and_bursts_longer_than_a_century_are_refused() {
        assert!(Quota::new(1, MAX_PERIOD).is_ok());
        let longer = MAX_PERIOD + Duration::from_micros(1);
        assert_eq!(Quota::new(1, longer), Err(ConfigError::PeriodTooLong));
        assert_eq!(
            Quota::new(1, Duration::MAX),
            Err(ConfigError::PeriodTooLong)
        );
        // A burst that takes longer than that to refill: 3 a day, 200,000 at once (183 years).
        let day = Quota::per_day(3).unwrap();
        assert_eq!(day.with_burst(200_000), Err(ConfigError::PeriodTooLong));
        assert!(day.with_burst(100_000).is_ok());
    }
}
