//! How long a request may wait instead of being refused: a GCRA limit's delay, a concurrency
//! limit's queue, and the bound on waiters both share.

use std::time::Duration;

use crate::bounds::MAX_PERIOD;
use crate::clock::Micros;
use crate::counting::Algorithm;
use crate::error::ConfigError;
use crate::limit::Limit;

impl Limit {
    /// Requests that would conform within `delay` wait instead of being refused (GCRA only).
    ///
    /// A check admits a request whose emission time lies at most `delay` beyond the burst,
    /// and reserves that time at once: the key's TAT moves exactly as for any admission, in
    /// one check (one Redis call, as without a delay), so the count stays exact across
    /// replicas. The layer then waits until that time before it calls the service; a request
    /// dropped while it waits gives its units back when nobody waits behind it (see
    /// [`algorithm::gcra_refund`](crate::algorithm::gcra_refund): otherwise they stay counted
    /// until the key's time reaches them, and no later request starts beside one that still
    /// waits). A request beyond the delay is refused as
    /// without one. At most [`max_waiting`](Self::max_waiting) requests of one key wait at
    /// once ([`DEFAULT_MAX_WAITING`](crate::DEFAULT_MAX_WAITING)), and at most
    /// [`MAX_WAITERS_PER_LIMIT`](crate::MAX_WAITERS_PER_LIMIT) of one limit: a request beyond
    /// either is checked without the delay. `Duration::ZERO` turns the delay off.
    ///
    /// A shadow limit reports what its delay would do and never makes a request wait; a
    /// leased limit's delayed checks are not answered from a slice (they reach the shared
    /// backend, as a plan's do); a backend failure applies the failure policy without a wait.
    /// A layer refuses a delayed limit stacked with a fixed window or a sliding log
    /// ([`ConfigError::DelayWithWindow`]): those count a request when it is checked, and a
    /// delayed one could run in the next window, beyond that window's limit.
    ///
    /// # Errors
    ///
    /// [`ConfigError::DelayUnsupported`] for a fixed window, a sliding log or a concurrency
    /// limit: they have no exact delay (their units are counted when a request is admitted,
    /// and nothing says when a later one would fit; a concurrency limit can
    /// [queue](Self::queue_up_to) instead);
    /// [`ConfigError::InvalidDelay`] past [`MAX_PERIOD`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_engine::{Limit, Quota};
    ///
    /// let chat = Limit::gcra("chat", Quota::per_second(5)?)?
    ///     .delay_up_to(Duration::from_secs(2))?
    ///     .max_waiting(16)?;
    /// assert_eq!((chat.delay(), chat.waiting_bound()), (Duration::from_secs(2), 16));
    /// assert!(Limit::fixed_window("daily", Quota::per_day(10)?)?
    ///     .delay_up_to(Duration::from_secs(2))
    ///     .is_err());
    /// # Ok::<(), tollgate_engine::ConfigError>(())
    /// ```
    pub fn delay_up_to(mut self, delay: Duration) -> Result<Self, ConfigError> {
        if self.algorithm != Algorithm::Gcra {
            return Err(ConfigError::DelayUnsupported(self.algorithm));
        }
        if delay > MAX_PERIOD {
            return Err(ConfigError::InvalidDelay(
                "a delay must not exceed 100 years",
            ));
        }
        self.delay = delay.as_micros() as Micros;
        Ok(self)
    }

    /// At most `n` requests of one key wait at once ([`DEFAULT_MAX_WAITING`](crate::DEFAULT_MAX_WAITING) unless set); a
    /// request beyond them is checked without the delay (see
    /// [`delay_up_to`](Self::delay_up_to)), or refused at once by a full concurrency limit
    /// that queues (see [`queue_up_to`](Self::queue_up_to)).
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidDelay`] for 0 (a limit that lets nobody wait has no delay).
    pub fn max_waiting(mut self, n: u32) -> Result<Self, ConfigError> {
        if n == 0 {
            return Err(ConfigError::InvalidDelay("max_waiting must be at least 1"));
        }
        self.max_waiting = n;
        Ok(self)
    }

    /// How long a request may wait for its emission time (zero: it never waits).
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.delay)
    }

    /// [`delay`](Self::delay) in microseconds, as a [`Check`](crate::Check) carries it.
    #[inline]
    pub fn delay_micros(&self) -> Micros {
        self.delay
    }

    /// The most requests of one key that wait at once (see [`max_waiting`](Self::max_waiting)).
    pub fn waiting_bound(&self) -> u32 {
        self.max_waiting
    }

    /// Requests that find their key's slots all taken wait up to `wait` for one, first come
    /// first served per key, instead of being refused (a concurrency limit only).
    ///
    /// A waiting request holds nothing: not a slot, and no unit of the layer's other limits.
    /// When its turn comes (a slot of its key is given back in this process, or a poll of a
    /// shared backend finds one free) it is checked again whole, all-or-nothing with the
    /// other limits, like any request. At most `max_waiting` requests of one key wait at once
    /// (see [`max_waiting`](Self::max_waiting)), and at most
    /// [`MAX_WAITERS_PER_LIMIT`](crate::MAX_WAITERS_PER_LIMIT) of one limit in one layer: a
    /// request beyond either is refused at once, as one that waited `wait` without a turn is
    /// (`Retry-After` [`busy_retry_after`](Self::busy_retry_after)). A request dropped while
    /// it waits leaves the queue and takes nothing. `Duration::ZERO` turns the queue off.
    ///
    /// # Errors
    ///
    /// [`ConfigError::QueueUnsupported`] on a limit that is not a concurrency limit;
    /// [`ConfigError::InvalidDelay`] for 0 waiters or a wait past [`MAX_PERIOD`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_engine::{Limit, Quota};
    ///
    /// let export = Limit::concurrency("exports", 2)?.queue_up_to(Duration::from_secs(10), 8)?;
    /// assert_eq!((export.queue(), export.waiting_bound()), (Duration::from_secs(10), 8));
    /// assert!(Limit::gcra("chat", Quota::per_second(5)?)?
    ///     .queue_up_to(Duration::from_secs(10), 8)
    ///     .is_err());
    /// # Ok::<(), tollgate_engine::ConfigError>(())
    /// ```
    pub fn queue_up_to(mut self, wait: Duration, max_waiting: u32) -> Result<Self, ConfigError> {
        if self.algorithm != Algorithm::Concurrency {
            return Err(ConfigError::QueueUnsupported(self.algorithm));
        }
        if wait > MAX_PERIOD {
            return Err(ConfigError::InvalidDelay(
                "a queue's wait must not exceed 100 years",
            ));
        }
        self = self.max_waiting(max_waiting)?;
        self.queue = wait.as_micros() as Micros;
        Ok(self)
    }

    /// How long a request may wait for a free slot (zero: a full key refuses at once).
    pub fn queue(&self) -> Duration {
        Duration::from_micros(self.queue)
    }

    /// [`queue`](Self::queue) in microseconds.
    #[inline]
    pub fn queue_micros(&self) -> Micros {
        self.queue
    }
}
