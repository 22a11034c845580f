//! What a backend is asked: one check of one key against one limit, and the later settle of
//! an admitted check's cost, found again through its receipt.

use crate::clock::Micros;
use crate::limit::Limit;
use crate::quota::Quota;

/// One limit to check for one request: which limit, which key, what it costs.
///
/// Built with [`Check::new`] and the `with_*` setters; its fields stay readable.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Check<'a> {
    /// The limit.
    pub limit: &'a Limit,
    /// The key's bytes, as extracted from the request (never stored as they are).
    pub key: &'a [u8],
    /// Units of the quota the request takes.
    pub cost: u32,
    /// The quota this check is counted against: the limit's default, or the quota of the
    /// request's plan ([`Check::with_quota`]). Backends read it, never `limit.quota()`.
    pub quota: Quota,
    /// Whether a denial by this limit refuses the batch. `false` for shadow limits, and for a
    /// key outside a limit's enforced share: they consume when they admit and report when
    /// they would deny, but never refuse.
    pub enforce: bool,
    /// The request's slot, for a concurrency limit: an id unique among the requests in flight
    /// on every replica (the layer draws 128 random bits per request), under which a backend
    /// whose slots expire (Redis) records, renews and releases it. 0 from [`Check::new`]; the
    /// in-memory backend only counts slots.
    pub slot: u128,
    /// The request's own cost when `cost` is a quota lease's slice (the request's cost and
    /// units for later requests, asked for by [`Leased`](crate::leased::Leased)), 0 otherwise.
    /// `cost` stays what the backend takes; a backend that remembers denials (Redis' deny
    /// cache) looks them up with this cost and learns none from the answer, which says
    /// nothing of the request's own cost. A backend that ignores it errs only toward
    /// limiting. 0 from [`Check::new`].
    pub slice_of: u32,
    /// How long, in microseconds, an admitted request of a GCRA limit may wait for its
    /// emission time ([`Limit::delay_up_to`]): the check admits a request that would conform
    /// within this delay and reserves its time at once
    /// ([`algorithm::gcra_delayed`](crate::algorithm::gcra_delayed)); its caller waits
    /// [`algorithm::gcra_wait`](crate::algorithm::gcra_wait) before serving it. Every backend
    /// reads it; other algorithms ignore it. 0 from [`Check::new`]: the layer sets it
    /// ([`Check::with_delay`]) only while the key has room for one more waiter.
    pub delay: Micros,
}

impl<'a> Check<'a> {
    /// A check of `key` against `limit`, with the limit's cost, enforced or not as the
    /// limit's shadow setting and enforced share say of `key` ([`Limit::enforces`]).
    pub fn new(limit: &'a Limit, key: &'a [u8]) -> Self {
        Self {
            limit,
            key,
            cost: limit.cost(),
            enforce: limit.enforces(key),
            quota: *limit.quota(),
            slot: 0,
            slice_of: 0,
            delay: 0,
        }
    }

    /// This check, admitted when it would conform within `delay` microseconds (see
    /// [`Check::delay`]).
    #[inline]
    #[must_use]
    pub fn with_delay(mut self, delay: Micros) -> Self {
        self.delay = delay;
        self
    }

    /// This check, holding slot `slot` of a concurrency limit.
    #[must_use]
    pub fn with_slot(mut self, slot: u128) -> Self {
        self.slot = slot;
        self
    }

    /// This check counted against `quota` instead of the limit's default (one of the limit's
    /// [plan quotas](Limit::plan)).
    #[inline]
    #[must_use]
    pub fn with_quota(mut self, quota: Quota) -> Self {
        self.quota = quota;
        self
    }
    /// This check with a cost of its own, for this request only (a cost read from the
    /// request, or the estimate a later [`Settlement`] corrects).
    #[must_use]
    pub fn with_cost(mut self, cost: u32) -> Self {
        self.cost = cost;
        self
    }

    /// This check, refusing the batch when it denies (`true`) or only reporting it
    /// (`false`; see [`Check::enforce`]).
    #[inline]
    #[must_use]
    pub fn with_enforce(mut self, enforce: bool) -> Self {
        self.enforce = enforce;
        self
    }

    /// This check as a quota lease's slice taken for a request of cost `slice_of` (see
    /// [`Check::slice_of`]).
    #[inline]
    #[must_use]
    pub fn with_slice_of(mut self, slice_of: u32) -> Self {
        self.slice_of = slice_of;
        self
    }
}

/// Where an admitted check's units went, as the backend that took them recorded it: what a
/// later [`Settlement`] of the same check needs to find them again.
///
/// [`at`](Self::at) is the backend's time of the check (for a sliding log, the time its
/// units were recorded at). Besides the time, each algorithm records one figure of its own,
/// made by its constructor and read by its accessor: a GCRA check's [`tat`](Self::tat) (the
/// TAT its reservation left, [`Receipt::gcra`]), a fixed window's
/// [`window_end`](Self::window_end) ([`Receipt::window`]), a sliding log's
/// [`last_seq`](Self::last_seq) on Redis (the last sequence number of its units,
/// [`Receipt::log`]); none otherwise ([`Receipt::new`]).
///
/// A GCRA settle's refund moves the TAT back only within the run of its check (`at`), only
/// when the TAT is still the receipt's `tat` (it frees the last reservation) or nobody waits,
/// and by the part of the reservation still ahead of now (see
/// [`algorithm::gcra_refund`](crate::algorithm::gcra_refund)); otherwise it is dropped, and the
/// key counts its units until its TAT reaches them. A receipt with a TAT and no time
/// ([`Receipt::guarded`]) is *guarded*: its settle applies only while the key's TAT is exactly
/// that TAT, and changes nothing otherwise. A quota lease's give-back is such a settle (see
/// [`Leased`](crate::leased::Leased)): a backend under `Leased` must honour the guard, as the
/// in-memory backend does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Receipt {
    /// The backend's time of the check, in microseconds since the Unix epoch.
    pub at: Micros,
    /// The algorithm's figure: a TAT, a window's end or a sequence number (see above).
    pub(crate) mark: u64,
}

impl Receipt {
    /// The receipt of a check made at `at` (the backend's time) that records nothing else: a
    /// concurrency limit's, or a sliding log's in memory.
    #[inline]
    pub const fn new(at: Micros) -> Self {
        Self { at, mark: 0 }
    }

    /// The receipt of a GCRA check made at `at` whose reservation left the key's TAT at `tat`.
    #[inline]
    pub const fn gcra(at: Micros, tat: Micros) -> Self {
        Self { at, mark: tat }
    }

    /// The receipt of a fixed-window check made at `at`, counted in the window that ends at
    /// `window_end`.
    #[inline]
    pub const fn window(at: Micros, window_end: Micros) -> Self {
        Self {
            at,
            mark: window_end,
        }
    }

    /// The receipt of a sliding-log check whose units were recorded at `at`, the last of them
    /// under the sequence number `last_seq`.
    #[inline]
    pub const fn log(at: Micros, last_seq: u64) -> Self {
        Self { at, mark: last_seq }
    }

    /// A *guarded* GCRA receipt: no time, and a settle that applies only while the key's TAT
    /// is exactly `tat` (a quota lease's give-back).
    #[inline]
    pub const fn guarded(tat: Micros) -> Self {
        Self { at: 0, mark: tat }
    }

    /// A GCRA receipt's TAT ([`Receipt::gcra`], [`Receipt::guarded`]).
    #[inline]
    pub const fn tat(&self) -> Micros {
        self.mark
    }

    /// A fixed-window receipt's end of its window ([`Receipt::window`]).
    #[inline]
    pub const fn window_end(&self) -> Micros {
        self.mark
    }

    /// A sliding-log receipt's last sequence number ([`Receipt::log`]).
    #[inline]
    pub const fn last_seq(&self) -> u64 {
        self.mark
    }
}

/// The settle of one check admitted earlier: it reserved `reserved` units, and should have
/// cost `actual`.
///
/// A settle gives back `reserved - actual` units, or consumes `actual - reserved` more, at
/// once and whether or not the quota has them (the key then goes into debt). Per algorithm:
///
/// - **GCRA** moves the key's theoretical arrival time (TAT) back by the refund's emission
///   intervals, never before now (a refund never makes a bucket fuller than full), or forward
///   by the charge's. A refund applies only within its check's run, and when it frees the last
///   reservation or nobody waits ([`Receipt`]): a dropped refund never lets a request that
///   waits be overtaken. A TAT written under another quota (a plan) is carried to the
///   settle's quota first, whole: a debt is kept across plans. A charge never puts the TAT more than twice the burst's refill time ahead
///   of now: the debt is at most one whole burst, paid back at the quota's rate, and the
///   key's next request waits until it is paid.
/// - **A fixed window** settles in the window of the check only: a refund decrements its count
///   (never below zero), a charge increments it past the limit if need be, by at most twice
///   the limit at a time. Once that window has
///   ended, a settle changes nothing: its debt, like its count, ends with the window.
/// - **A sliding log** removes the refunded units among those the check recorded, or records
///   the charge's units at the time of the settle. A log holds at most twice the quota's
///   limit: a charge past that is cut to it. The debt leaves with its entries, a period later.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Settlement<'a> {
    /// The limit, as in the check.
    pub limit: &'a Limit,
    /// The key's bytes, as in the check.
    pub key: &'a [u8],
    /// The units the check took.
    pub reserved: u32,
    /// The units the request should have cost.
    pub actual: u32,
    /// Where the check's units went, from its [`Verdicts`](crate::Verdicts).
    pub receipt: Receipt,
    /// The quota the check was counted against ([`Check::quota`]: the limit's default or the
    /// request's plan). The settle is applied under it, never under the limit's default.
    pub quota: Quota,
}

impl<'a> Settlement<'a> {
    /// The settle of a check of `key` against `limit` under `quota` that took `reserved`
    /// units with `receipt`, and should have cost `actual`.
    pub fn new(
        limit: &'a Limit,
        key: &'a [u8],
        reserved: u32,
        actual: u32,
        receipt: Receipt,
        quota: Quota,
    ) -> Self {
        Self {
            limit,
            key,
            reserved,
            actual,
            receipt,
            quota,
        }
    }

    /// The settle of `check`, admitted with `receipt`, which should have cost `actual` instead
    /// of the check's cost: under the check's limit, key and quota.
    pub fn of(check: &Check<'a>, receipt: Receipt, actual: u32) -> Self {
        Self {
            limit: check.limit,
            key: check.key,
            reserved: check.cost,
            actual,
            receipt,
            quota: check.quota,
        }
    }

    /// Whether this settle gives units back.
    pub fn refunds(&self) -> bool {
        self.actual < self.reserved
    }
}
