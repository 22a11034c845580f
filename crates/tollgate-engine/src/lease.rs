//! Quota leases: a replica takes a slice of a key's quota from a shared backend in one call and
//! admits from it locally.
//!
//! This module holds a lease's rules as pure functions and plain data: how large a slice is
//! ([`Lease::take_for`]), when it expires, how a replica sizes its next one and what it holds
//! of it. [`Leased`](crate::leased::Leased) runs them over any backend: the in-memory one, in
//! tests and in the accuracy simulation (`lease-sim`), and Redis, whose backend is a `Leased`
//! over its own.
//!
//! # What a lease keeps and what it gives up
//!
//! - **Counted before granted.** A slice of `n` units is a check of cost `n` in the backend:
//!   Redis consumes the units before any of them is admitted locally, with the algorithm's own
//!   arithmetic. So the backend never counts more than the quota admits, and every local
//!   admission is one of those units: over-admission is 0, across every replica.
//! - **When.** A unit is admitted locally at most the lease's lifetime after Redis counted it.
//!   A fixed window's slice expires with its window at the latest, so each unit is admitted in
//!   the window that counted it: at most the limit per window, exactly. A GCRA slice is
//!   *paced* by the TAT its take left, so that the admissions of every replica,
//!   at the times they happen, conform to the quota's GCRA; and its give-back applies only
//!   while the key's TAT is still that one (a later take's slice is paced by a TAT that counts
//!   these units: taking them back under it could let it run ahead of the rate).
//! - **Under-admission.** Units held in slices that nobody uses are counted but not admitted.
//!   At any moment the shortfall against an unleased limit is at most the units outstanding in
//!   slices, and each slice holds at most `min(max_slice, remaining / divisor)` of the units
//!   that remained when it was taken (see [`Lease::take_for`]). When every replica that holds
//!   a slice has demand for it, the slices are spent and exactly the quota is admitted.
//! - **The boundary stays exact.** Slices shrink as the remainder shrinks, and once
//!   `remaining / divisor` is no more than a request's cost every request is checked in the
//!   backend as without a lease.
//! - **Unused units go back** when a slice expires and when the backend shuts down: a refund
//!   with the algorithm's settle arithmetic ([`crate::algorithm::gcra_settle`],
//!   [`crate::algorithm::fixed_window_settle`]), for GCRA only while the TAT is unmoved (see
//!   above). A replica that dies without giving its units back holds nothing in Redis for
//!   long: a fixed window's units end with their window (the slice's expiry at the latest),
//!   and a GCRA slice's units are TAT that refills at the quota's rate like that of admitted
//!   requests (the bucket is whole `n` emission intervals after the take at most); the
//!   shortfall is those units, once.

use std::time::Duration;

use crate::algorithm;
use crate::clock::Micros;
use crate::error::ConfigError;
use crate::{counting::Algorithm, quota::Quota};

/// The largest slice a lease may take at once.
pub const MAX_SLICE: u32 = 100_000;

/// How a limit leases its quota (see the [module documentation](self)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate_engine::{Lease, Limit, Quota};
///
/// let lease = Lease::new(50)?.with_divisor(8)?.with_lifetime(Duration::from_secs(1))?;
/// let global = Limit::gcra("global", Quota::per_day(5_000)?)?.with_lease(lease)?;
/// assert_eq!(global.lease().map(|l| l.max_slice()), Some(50));
/// // Sliding logs keep every admission's time: they cannot be leased.
/// assert!(Limit::sliding_log("log", Quota::per_minute(10)?)?.with_lease(lease).is_err());
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    max_slice: u32,
    divisor: u32,
    lifetime: Micros,
}

impl Lease {
    /// The default divisor: a slice takes at most an eighth of what remains.
    pub const DEFAULT_DIVISOR: u32 = 8;
    /// The default lifetime of a slice.
    pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(1);

    /// A lease whose slices hold at most `max_slice` units (2 to [`MAX_SLICE`]), with the
    /// default divisor and lifetime.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidLease`] for a `max_slice` outside `2..=MAX_SLICE` (a slice of one
    /// unit is a request's own check).
    pub fn new(max_slice: u32) -> Result<Self, ConfigError> {
        if !(2..=MAX_SLICE).contains(&max_slice) {
            return Err(ConfigError::InvalidLease("max_slice must be 2 to 100000"));
        }
        Ok(Self {
            max_slice,
            divisor: Self::DEFAULT_DIVISOR,
            lifetime: Self::DEFAULT_LIFETIME.as_micros() as Micros,
        })
    }

    /// Slices take at most `1 / divisor` of the units that remain (1 to 1,000). Set it at
    /// least to the number of replicas that share the limit, so that the slices outstanding
    /// never hold more than what remains.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidLease`] for 0 or above 1,000.
    pub fn with_divisor(mut self, divisor: u32) -> Result<Self, ConfigError> {
        if !(1..=1_000).contains(&divisor) {
            return Err(ConfigError::InvalidLease("divisor must be 1 to 1000"));
        }
        self.divisor = divisor;
        Ok(self)
    }

    /// How long a slice may be used (1 ms to 1 day); then its unused units go back.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidLease`] outside 1 ms to 1 day.
    pub fn with_lifetime(mut self, lifetime: Duration) -> Result<Self, ConfigError> {
        if lifetime < Duration::from_millis(1) || lifetime > Duration::from_secs(86_400) {
            return Err(ConfigError::InvalidLease("lifetime must be 1 ms to 1 day"));
        }
        self.lifetime = lifetime.as_micros() as Micros;
        Ok(self)
    }

    /// The most units one slice holds.
    pub fn max_slice(&self) -> u32 {
        self.max_slice
    }

    /// The divisor of the remainder (see [`with_divisor`](Self::with_divisor)).
    pub fn divisor(&self) -> u32 {
        self.divisor
    }

    /// How long a slice may be used.
    pub fn lifetime(&self) -> Duration {
        Duration::from_micros(self.lifetime)
    }

    /// The units to take from the backend for a request of `cost` when `remaining` units were
    /// last seen left: `min(max_slice, remaining / divisor)` if that is more than `cost` (the
    /// request takes `cost` of them, the rest is the slice), otherwise `cost` alone: near the
    /// limit every request is checked in the backend, without a slice.
    ///
    /// ```
    /// use tollgate_engine::Lease;
    ///
    /// let lease = Lease::new(50)?; // divisor 8
    /// assert_eq!(lease.take_for(1_000, 1), 50);
    /// assert_eq!(lease.take_for(80, 1), 10);
    /// assert_eq!(lease.take_for(15, 1), 1);
    /// # Ok::<(), tollgate_engine::ConfigError>(())
    /// ```
    pub fn take_for(&self, remaining: u64, cost: u32) -> u32 {
        let share = (remaining / u64::from(self.divisor)).min(u64::from(self.max_slice)) as u32;
        if share > cost {
            share
        } else {
            cost
        }
    }

    /// When a slice taken at `taken_at` (the backend's time) stops being used: its lifetime
    /// later, and for a fixed window never after its window's end.
    pub(crate) fn expiry(&self, algorithm: Algorithm, quota: &Quota, taken_at: Micros) -> Micros {
        let end = taken_at.saturating_add(self.lifetime);
        match algorithm {
            Algorithm::FixedWindow => end.min(algorithm::window_end(quota, taken_at)),
            _ => end,
        }
    }

    /// The slice of `units` that a take at `taken_at` (the backend's time) left this replica,
    /// when the backend answered with `reset` (microseconds until the quota is whole: for
    /// GCRA, the TAT after the take minus `taken_at`). It expires as
    /// [`expiry`](Self::expiry) says, and a GCRA slice is [paced](Slice::paced) by that TAT.
    pub(crate) fn slice(
        &self,
        algorithm: Algorithm,
        quota: &Quota,
        units: u32,
        taken_at: Micros,
        reset: Micros,
    ) -> Slice {
        let slice = Slice::new(units, self.expiry(algorithm, quota, taken_at));
        match algorithm {
            Algorithm::Gcra => {
                slice.paced(taken_at.saturating_add(reset), quota.emission_interval())
            }
            _ => slice,
        }
    }

    /// Whether `algorithm` can be leased: GCRA and fixed windows.
    pub(crate) fn supports(algorithm: Algorithm) -> bool {
        matches!(algorithm, Algorithm::Gcra | Algorithm::FixedWindow)
    }
}

/// How a replica sizes its next slice from how its last ones ended: a slice that expired
/// with units left halves the next ones (down to a 65,536th), a slice spent to the last unit
/// doubles them back (up to [`Lease::take_for`]'s size). A replica whose share of the
/// traffic cannot spend a slice in its lifetime (or, under GCRA, at the pace of the quota's
/// rate: see [`Slice::paced`]) then takes small ones instead of taking and giving back
/// large ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Sizing {
    shift: u8,
}

impl Sizing {
    /// The units to take for a request of `cost` when `remaining` were last seen left:
    /// [`Lease::take_for`], scaled down by what earlier slices came to.
    pub(crate) fn units(&self, lease: &Lease, remaining: u64, cost: u32) -> u32 {
        let share = lease.take_for(remaining, cost) >> self.shift;
        if share > cost {
            share
        } else {
            cost
        }
    }

    /// A slice ended with units left.
    pub(crate) fn wasted(&mut self) {
        self.shift = (self.shift + 1).min(16);
    }

    /// A slice was spent to its last unit.
    pub(crate) fn spent(&mut self) {
        self.shift = self.shift.saturating_sub(1);
    }
}

/// The units of one slice that one replica still holds, and until when.
///
/// A GCRA slice is also *paced*: it is used only while its units still fit before the TAT
/// that its take left in the backend (`now + units × interval <= horizon`). A replica that
/// holds units past that point would admit them after the bucket, as Redis counts it, has
/// refilled past them: the admissions would then run ahead of the quota's rate. A slice
/// that falls behind its pace is dead, as if expired.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Slice {
    units: u32,
    expires: Micros,
    /// The backend's TAT after the take (GCRA), or 0: no pace.
    horizon: Micros,
    /// The emission interval of the pace (GCRA), or 0.
    interval: Micros,
}

impl Slice {
    /// A slice of `units` usable until `expires` (excluded).
    pub(crate) fn new(units: u32, expires: Micros) -> Self {
        Self {
            units,
            expires,
            horizon: 0,
            interval: 0,
        }
    }

    /// This slice, used only while `now + units × interval <= horizon`: a GCRA slice whose
    /// take left the key's TAT at `horizon`, for a quota of emission interval `interval`.
    pub(crate) fn paced(mut self, horizon: Micros, interval: Micros) -> Self {
        self.horizon = horizon;
        self.interval = interval;
        self
    }

    /// Units held.
    pub(crate) fn units(&self) -> u32 {
        self.units
    }

    /// Whether the slice can still be used at `now`: before its expiry, and for a paced
    /// slice while its units fit before its horizon.
    pub(crate) fn live(&self, now: Micros) -> bool {
        now < self.expires
            && (self.interval == 0
                || now.saturating_add(u64::from(self.units).saturating_mul(self.interval))
                    <= self.horizon)
    }

    /// Takes `cost` units at `now`, if the slice is live and holds them.
    #[inline]
    pub(crate) fn take(&mut self, cost: u32, now: Micros) -> bool {
        if self.live(now) && self.units >= cost {
            self.units -= cost;
            true
        } else {
            false
        }
    }

    /// Puts back `cost` units taken by [`take`](Self::take) for a request that another limit
    /// refused.
    pub(crate) fn put_back(&mut self, cost: u32) {
        self.units = self.units.saturating_add(cost);
    }

    /// Replaces the slice with `fresh`, a slice just taken in the backend.
    ///
    /// Returns the units of the earlier slice, which must go back (kept, they would live past
    /// their own expiry).
    pub(crate) fn refill(&mut self, fresh: Slice) -> u32 {
        std::mem::replace(self, fresh).units
    }

    /// The TAT the slice's take left in the backend (GCRA), or 0.
    pub(crate) fn horizon(&self) -> Micros {
        self.horizon
    }

    /// Empties the slice: the units to give back.
    pub(crate) fn drain(&mut self) -> u32 {
        std::mem::take(&mut self.units)
    }

    /// The units to give back at `now`: all it holds once it has expired, none before.
    pub(crate) fn expire(&mut self, now: Micros) -> u32 {
        if self.live(now) {
            0
        } else {
            self.drain()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_shrink_with_the_remainder_and_stop_near_the_limit() {
        let lease = Lease::new(10).unwrap().with_divisor(4).unwrap();
        assert_eq!(lease.take_for(1_000, 1), 10);
        assert_eq!(lease.take_for(20, 1), 5);
        assert_eq!(lease.take_for(8, 1), 2);
        assert_eq!(lease.take_for(7, 1), 1);
        assert_eq!(lease.take_for(0, 1), 1);
        // A costly request takes its own cost, and a slice only beyond it.
        assert_eq!(lease.take_for(20, 5), 5);
        assert_eq!(lease.take_for(40, 5), 10);
    }

    #[test]
    fn a_fixed_windows_slice_ends_with_its_window() {
        let q = Quota::per_second(10).unwrap();
        let lease = Lease::new(5)
            .unwrap()
            .with_lifetime(Duration::from_millis(300))
            .unwrap();
        assert_eq!(
            lease.expiry(Algorithm::FixedWindow, &q, 1_100_000),
            1_400_000
        );
        assert_eq!(
            lease.expiry(Algorithm::FixedWindow, &q, 1_900_000),
            2_000_000
        );
        assert_eq!(lease.expiry(Algorithm::Gcra, &q, 1_900_000), 2_200_000);
    }

    #[test]
    fn a_slice_admits_what_it_holds_until_it_expires() {
        let mut s = Slice::new(2, 100);
        assert!(s.take(1, 10));
        assert!(!s.take(2, 10));
        s.put_back(1);
        assert!(s.take(2, 99));
        assert!(!s.take(1, 99));
        let mut s = Slice::new(3, 100);
        assert_eq!(s.expire(99), 0);
        assert!(!s.take(1, 100));
        assert_eq!(s.expire(100), 3);
        assert_eq!(s.units(), 0);
    }

    #[test]
    fn a_paced_slice_dies_once_its_units_no_longer_fit_before_its_horizon() {
        // 3 units at an interval of 10, the TAT at 100: usable at 70 (70 + 30 <= 100).
        let mut s = Slice::new(3, 1_000).paced(100, 10);
        assert!(s.live(70));
        assert!(!s.live(71));
        assert!(s.take(1, 70));
        // 2 units left: usable until 80.
        assert!(s.take(1, 80));
        assert!(!s.take(1, 91));
        assert_eq!(s.expire(91), 1);
    }

    #[test]
    fn slices_shrink_after_waste_and_grow_back_when_spent() {
        let lease = Lease::new(64).unwrap().with_divisor(1).unwrap();
        let mut sizing = Sizing::default();
        assert_eq!(sizing.units(&lease, 1_000, 1), 64);
        sizing.wasted();
        sizing.wasted();
        assert_eq!(sizing.units(&lease, 1_000, 1), 16);
        sizing.spent();
        assert_eq!(sizing.units(&lease, 1_000, 1), 32);
        for _ in 0..20 {
            sizing.wasted();
        }
        assert_eq!(sizing.units(&lease, 1_000, 1), 1);
    }

    #[test]
    fn bad_leases_are_refused() {
        assert!(Lease::new(1).is_err());
        assert!(Lease::new(MAX_SLICE + 1).is_err());
        assert!(Lease::new(2).unwrap().with_divisor(0).is_err());
        assert!(Lease::new(2)
            .unwrap()
            .with_lifetime(Duration::from_micros(999))
            .is_err());
    }
}
