use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use crate::bounds::{DEFAULT_MAX_WAITING, MAX_LOG_UNITS, MAX_NAME_LEN, MAX_PLANS};
use crate::clock::Micros;
use crate::counting::Algorithm;
use crate::error::ConfigError;
use crate::lease::Lease;
use crate::penalty::Penalty;
use crate::quota::Quota;

/// The most a GCRA limit's rate may exceed its quota through the rounding of its emission
/// interval to whole microseconds: 1%, in parts per 10,000.
const MAX_RATE_EXCESS_BP: u64 = 100;

/// What a limit does when its backend fails or does not answer within its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit the request. The decision says `Bypassed` and the bypass is counted, so a dead
    /// limiter is visible. The default: a limiter should not take a site down.
    #[default]
    FailOpen,
    /// Refuse the request (`503 Service Unavailable` with `Retry-After`).
    FailClosed,
    /// Check a bounded in-memory limiter instead, with the quota divided by `replicas` (the
    /// number of processes expected to share the load).
    Fallback {
        /// The expected number of replicas; 1 keeps the quota as it is.
        replicas: NonZeroU32,
    },
}

/// What a limit does with a request it cannot find a key for (the header, parameter or address
/// is not there). A request that carries a key that cannot be one (too long, a character
/// outside the extractor's alphabet) is refused with 400 whatever the policy.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKeyPolicy {
    /// Refuse the request (`400 Bad Request`). The default: no key must never mean no limit.
    #[default]
    Reject,
    /// Do not apply this limit to the request; the decision says `Skipped`.
    Skip,
    /// Count the request against one bucket shared by every keyless request.
    SharedBucket,
}

/// One limit: a name, an algorithm, a quota and its policies.
///
/// The name is the limit's identity: in the in-memory backend, in Redis keys, in headers and in
/// metrics. Two layers that use limits of the same name on the same backend share their counts.
///
/// # Examples
///
/// ```
/// use tollgate_engine::{Limit, Quota};
///
/// let daily = Limit::fixed_window("daily", Quota::per_day(1_000)?)?
///     .fail_closed()
///     .with_cost(10)?;
/// assert_eq!(daily.name(), "daily");
/// assert!(Limit::gcra("has space", Quota::per_minute(1)?).is_err());
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Limit {
    name: Arc<str>,
    id: u64,
    algorithm: Algorithm,
    quota: Quota,
    /// Quotas by plan name; a request with no plan, or one not named here, gets `quota`.
    plans: Arc<[(Box<str>, Quota)]>,
    cost: u32,
    failure: FailurePolicy,
    missing_key: MissingKeyPolicy,
    /// The share of keys this limit refuses, in percent (see [`Limit::enforce_percent`]):
    /// 100 enforced, 0 shadow.
    enforce_percent: u8,
    /// The `Retry-After` of a concurrency refusal (nobody knows when a slot frees).
    busy_retry_after: Micros,
    /// Slices of the quota a replica may take from a shared backend (see [`Lease`]).
    lease: Option<Lease>,
    /// How long a request may wait for its emission time, in microseconds (0: never waits).
    delay: Micros,
    /// How long a request may wait in its key's queue for a free slot, in microseconds (a
    /// concurrency limit; 0: a full key refuses at once).
    queue: Micros,
    /// The most requests one key may have waiting at once (for a delay or in a queue).
    max_waiting: u32,
    /// A block after repeated refusals (see [`Penalty`]).
    penalty: Option<Penalty>,
}

/// How long a concurrency slot lives in a backend whose slots expire, unless renewed.
pub const DEFAULT_SLOT_TTL: Duration = Duration::from_secs(30);

/// The default `Retry-After` of a refusal for lack of a free slot.
pub const DEFAULT_BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Limit {
    /// A limit with the given algorithm.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidName`] unless the name is 1 to [`MAX_NAME_LEN`] characters of
    /// `[A-Za-z0-9_.-]` (names appear in headers, metric labels and Redis keys);
    /// [`ConfigError::InvalidBurst`] for a burst on an algorithm other than GCRA;
    /// [`ConfigError::ImpreciseRate`] for a GCRA quota whose emission interval (the period
    /// divided by the limit) rounds down to whole microseconds by more than 1% of itself, as
    /// `Quota::per_second(600_000)` does (the period is then a multiple of the limit, or the
    /// limit lower); [`ConfigError::LogTooLong`] for a sliding log whose quota is above
    /// [`MAX_LOG_UNITS`].
    pub fn new(name: &str, algorithm: Algorithm, quota: Quota) -> Result<Self, ConfigError> {
        if !valid_name(name) {
            return Err(ConfigError::InvalidName(name.chars().take(80).collect()));
        }
        check_quota(algorithm, &quota)?;
        Ok(Self {
            name: name.into(),
            id: name_id(name),
            algorithm,
            quota,
            plans: Arc::new([]),
            cost: 1,
            failure: FailurePolicy::default(),
            missing_key: MissingKeyPolicy::default(),
            enforce_percent: 100,
            busy_retry_after: DEFAULT_BUSY_RETRY_AFTER.as_micros() as Micros,
            lease: None,
            delay: 0,
            queue: 0,
            max_waiting: DEFAULT_MAX_WAITING,
            penalty: None,
        })
    }

    /// At most `max_in_flight` requests per key at once.
    ///
    /// A request takes a slot when it is admitted (all-or-nothing with the layer's other
    /// limits: a request refused by a rate limit takes no slot, and one refused for lack of a
    /// slot consumes no rate) and gives it back exactly once, when its response body ends or is
    /// dropped. A full key is refused with `Retry-After` [`DEFAULT_BUSY_RETRY_AFTER`]
    /// (see [`busy_retry_after`](Self::busy_retry_after)): nobody knows when a slot frees. In
    /// Redis a slot expires after [`DEFAULT_SLOT_TTL`] unless its holder renews it (it does,
    /// every third of that while the response streams), so a crashed replica's slots come back
    /// (see [`with_slot_ttl`](Self::with_slot_ttl)).
    ///
    /// # Errors
    ///
    /// As [`Limit::new`]; [`ConfigError::ZeroLimit`] for 0.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate_engine::Limit;
    ///
    /// let in_flight = Limit::concurrency("in-flight", 4)?;
    /// assert_eq!(in_flight.quota().limit(), 4);
    /// # Ok::<(), tollgate_engine::ConfigError>(())
    /// ```
    pub fn concurrency(name: &str, max_in_flight: u32) -> Result<Self, ConfigError> {
        let quota = Quota::new(max_in_flight, DEFAULT_SLOT_TTL)?;
        Self::new(name, Algorithm::Concurrency, quota)
    }

    /// How long a slot of this concurrency limit lives unless renewed (default
    /// [`DEFAULT_SLOT_TTL`]): the longest a crashed replica can hold it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::PeriodTooShort`] under a second (slots are renewed every third of it),
    /// [`ConfigError::PeriodTooLong`] past [`MAX_PERIOD`](crate::MAX_PERIOD),
    /// [`ConfigError::InvalidBurst`] on a limit that is not a concurrency limit.
    pub fn with_slot_ttl(mut self, ttl: Duration) -> Result<Self, ConfigError> {
        if self.algorithm != Algorithm::Concurrency {
            return Err(ConfigError::InvalidBurst);
        }
        if ttl < Duration::from_secs(1) {
            return Err(ConfigError::PeriodTooShort);
        }
        self.quota = Quota::new(self.quota.limit(), ttl)?;
        Ok(self)
    }

    /// The `Retry-After` of a refusal for lack of a free slot (default
    /// [`DEFAULT_BUSY_RETRY_AFTER`], at least one microsecond).
    pub fn busy_retry_after(mut self, after: Duration) -> Self {
        self.busy_retry_after = (after.as_micros().min(u128::from(u64::MAX)) as Micros).max(1);
        self
    }

    /// The `Retry-After` of a concurrency refusal, in microseconds.
    pub fn busy_retry_after_micros(&self) -> Micros {
        self.busy_retry_after
    }

    /// A GCRA limit (the default algorithm).
    ///
    /// # Errors
    ///
    /// As [`Limit::new`].
    pub fn gcra(name: &str, quota: Quota) -> Result<Self, ConfigError> {
        Self::new(name, Algorithm::Gcra, quota)
    }

    /// A fixed-window limit, windows aligned to the Unix epoch (UTC).
    ///
    /// # Errors
    ///
    /// As [`Limit::new`].
    pub fn fixed_window(name: &str, quota: Quota) -> Result<Self, ConfigError> {
        Self::new(name, Algorithm::FixedWindow, quota)
    }

    /// An exact sliding-log limit.
    ///
    /// Exactness costs one log entry per admitted unit and key, kept for a period, in memory
    /// or in Redis (one sorted-set member per unit): the quota may be at most
    /// [`MAX_LOG_UNITS`] per period. For quotas of thousands per period, or large costs, GCRA
    /// or a fixed window keep one number per key instead.
    ///
    /// # Errors
    ///
    /// As [`Limit::new`]: [`ConfigError::LogTooLong`] for a quota above [`MAX_LOG_UNITS`].
    pub fn sliding_log(name: &str, quota: Quota) -> Result<Self, ConfigError> {
        Self::new(name, Algorithm::SlidingLog, quota)
    }

    /// Requests whose plan is `plan` get `quota` instead of the limit's default.
    ///
    /// The plan is the name an authentication layer gives the request (`tollgate::Plan` in
    /// the layer crate). A request without a plan, or with a plan no [`Limit::plan`] names,
    /// gets the quota the limit was made with. Each (limit, quota) is counted exactly, in every
    /// backend; a key keeps what it used when its quota changes (its plan, or a reload). A
    /// sliding log's plans may differ in period: they share one log, kept for the longest
    /// ([`Limit::log_keep_micros`]).
    /// A concurrency limit's plan sets how many slots a key has, and nothing else: its
    /// period is not read, and every slot lives the limit's own slot lifetime
    /// ([`with_slot_ttl`](Self::with_slot_ttl)), by which its renewals are paced.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPlan`] for a name that is not 1 to [`MAX_NAME_LEN`] characters of
    /// `[A-Za-z0-9_.-]`, that this limit already has, or past the [`MAX_PLANS`]th; the quota's
    /// errors of [`Limit::new`];
    /// [`ConfigError::PlanPeriod`] for a fixed window whose plan has another period than the
    /// default; [`ConfigError::InvalidCost`] when the limit's cost is above what the quota
    /// admits at once.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate_engine::{Limit, Quota};
    ///
    /// let per_token = Limit::fixed_window("per-token", Quota::per_minute(5)?)?
    ///     .plan("pro", Quota::per_minute(50)?)?;
    /// assert_eq!(per_token.quota_of(Some("pro")).1.limit(), 50);
    /// assert_eq!(per_token.quota_of(Some("other")).1.limit(), 5);
    /// assert_eq!(per_token.quota_of(None).1.limit(), 5);
    /// # Ok::<(), tollgate_engine::ConfigError>(())
    /// ```
    pub fn plan(mut self, plan: &str, quota: Quota) -> Result<Self, ConfigError> {
        if !valid_name(plan)
            || self.plans.iter().any(|(p, _)| &**p == plan)
            || self.plans.len() >= MAX_PLANS
        {
            return Err(ConfigError::InvalidPlan(plan.chars().take(80).collect()));
        }
        check_quota(self.algorithm, &quota)?;
        if self.algorithm == Algorithm::FixedWindow
            && quota.period_micros() != self.quota.period_micros()
        {
            return Err(ConfigError::PlanPeriod(plan.to_owned()));
        }
        let max = max_cost_of(self.algorithm, &quota);
        if self.cost > max {
            return Err(ConfigError::InvalidCost {
                cost: self.cost,
                max,
            });
        }
        let mut plans = self.plans.to_vec();
        plans.push((plan.into(), quota));
        self.plans = plans.into();
        Ok(self)
    }

    /// The plans this limit names, with their quotas, in the order they were added.
    pub fn plans(&self) -> impl ExactSizeIterator<Item = (&str, &Quota)> + '_ {
        self.plans.iter().map(|(p, q)| (&**p, q))
    }

    /// How long a sliding log of this limit keeps an entry, in microseconds: the longest
    /// period of its quotas (the default's, every plan's, and `quota`, the check's). A log is
    /// shared by the limit's plans and keeps its entries across a change of quota, so an
    /// admission under a plan of a short period must leave the units a longer one still counts.
    pub fn log_keep_micros(&self, quota: &Quota) -> Micros {
        let own = self.quota.period_micros().max(quota.period_micros());
        self.plans
            .iter()
            .map(|(_, q)| q.period_micros())
            .fold(own, Micros::max)
    }

    /// The quota of a request whose plan is `plan`, with its index: 0 for the default (no
    /// plan, or one this limit does not name), `i + 1` for the `i`-th [plan](Limit::plan).
    #[inline]
    pub fn quota_of(&self, plan: Option<&str>) -> (usize, &Quota) {
        if let Some(plan) = plan {
            if let Some(i) = self.plans.iter().position(|(p, _)| &**p == plan) {
                return (i + 1, &self.plans[i].1);
            }
        }
        (0, &self.quota)
    }

    /// The quota at `index`, as [`Limit::quota_of`] numbers them (the default if out of range).
    #[inline]
    pub fn quota_at(&self, index: usize) -> &Quota {
        match index.checked_sub(1).and_then(|i| self.plans.get(i)) {
            Some((_, q)) => q,
            None => &self.quota,
        }
    }

    /// Each request costs `cost` units of the quota instead of 1.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidCost`] for 0, or for more than the quota admits at once (for a
    /// sliding log, never more than [`MAX_LOG_UNITS`]); with [plans](Limit::plan), more than
    /// the smallest of their quotas admits.
    pub fn with_cost(mut self, cost: u32) -> Result<Self, ConfigError> {
        let max = self
            .plans
            .iter()
            .map(|(_, q)| max_cost_of(self.algorithm, q))
            .fold(self.max_cost(), u32::min);
        if cost == 0 || cost > max {
            return Err(ConfigError::InvalidCost { cost, max });
        }
        self.cost = cost;
        Ok(self)
    }

    /// Admit requests when the backend fails, and say so (the default).
    pub fn fail_open(mut self) -> Self {
        self.failure = FailurePolicy::FailOpen;
        self
    }

    /// Refuse requests with 503 when the backend fails.
    pub fn fail_closed(mut self) -> Self {
        self.failure = FailurePolicy::FailClosed;
        self
    }

    /// Limit locally when the backend fails, with the quota divided by `replicas`.
    pub fn fallback(mut self, replicas: NonZeroU32) -> Self {
        self.failure = FailurePolicy::Fallback { replicas };
        self
    }

    /// What to do with a request that has no key for this limit.
    pub fn on_missing_key(mut self, policy: MissingKeyPolicy) -> Self {
        self.missing_key = policy;
        self
    }

    /// Shadow (dry-run) mode: count and report would-be denials, but never deny. Nothing
    /// about a shadow limit refuses a request: a request without its key skips it (whatever
    /// the missing-key policy), and its backend failing never answers 503. The same as
    /// [`enforce_percent(0)`](Self::enforce_percent).
    pub fn shadow(mut self) -> Self {
        self.enforce_percent = 0;
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name, shared.
    pub fn name_arc(&self) -> &Arc<str> {
        &self.name
    }

    /// A stable 64-bit identity derived from the name.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The cost of one request.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The failure policy.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.failure
    }

    /// The missing-key policy.
    pub fn missing_key_policy(&self) -> &MissingKeyPolicy {
        &self.missing_key
    }

    /// Whether the limit only reports for every key (shadow mode, an enforced share of 0%).
    pub fn is_shadow(&self) -> bool {
        self.enforce_percent == 0
    }

    /// This limit with its quota leased to replicas in slices (see [`Lease`] for what it keeps
    /// and the bound on what it gives up). A shared backend (Redis) takes a slice of a key's
    /// quota in one call and admits from it locally; a backend in the process ignores it.
    /// Only checks under the default quota are leased: a plan's are checked as without.
    ///
    /// # Errors
    ///
    /// [`ConfigError::LeaseUnsupported`] for a sliding log or a concurrency limit.
    pub fn with_lease(mut self, lease: Lease) -> Result<Self, ConfigError> {
        if !Lease::supports(self.algorithm) {
            return Err(ConfigError::LeaseUnsupported(self.algorithm));
        }
        if self.penalty.is_some() {
            return Err(ConfigError::PenaltyUnsupported(
                "a leased limit answers from its slice, where no refusal is counted",
            ));
        }
        self.lease = Some(lease);
        Ok(self)
    }

    /// The limit's lease, if its quota is leased.
    #[inline]
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    /// The largest cost one request can have and still be admitted.
    pub(crate) fn max_cost(&self) -> u32 {
        max_cost_of(self.algorithm, &self.quota)
    }

    /// This limit with its quotas (the default and every plan's) divided by `replicas`: the
    /// local stand-in for fallback.
    pub fn local_share(&self, replicas: NonZeroU32) -> Self {
        let mut limit = self.clone();
        limit.quota = self.quota.divided(replicas);
        limit.plans = self
            .plans
            .iter()
            .map(|(p, q)| (p.clone(), q.divided(replicas)))
            .collect();
        limit.cost = self.cost.min(limit.max_cost());
        limit
    }
}

fn max_cost_of(algorithm: Algorithm, quota: &Quota) -> u32 {
    match algorithm {
        Algorithm::Gcra => quota.burst(),
        Algorithm::FixedWindow | Algorithm::SlidingLog => quota.limit(),
        // One request, one slot.
        Algorithm::Concurrency => 1,
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// What an algorithm asks of a quota (the default's, and every plan's).
fn check_quota(algorithm: Algorithm, quota: &Quota) -> Result<(), ConfigError> {
    if algorithm != Algorithm::Gcra && quota.burst() != quota.limit() {
        return Err(ConfigError::InvalidBurst);
    }
    // GCRA spaces requests by a whole number of microseconds, rounded down: at high rates
    // (600,000 a second is one every 1.67 µs, counted as 1) that would admit far more
    // than the quota says.
    if algorithm == Algorithm::Gcra && quota.rate_excess_bp() > MAX_RATE_EXCESS_BP {
        return Err(ConfigError::ImpreciseRate);
    }
    if algorithm == Algorithm::SlidingLog && quota.limit() > MAX_LOG_UNITS {
        return Err(ConfigError::LogTooLong {
            limit: quota.limit(),
            max: MAX_LOG_UNITS,
        });
    }
    Ok(())
}

/// FNV-1a: deterministic, so a name means the same limit in every process.
fn name_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

mod rollout;
pub use rollout::rollout_share;
mod sanctions;
#[cfg(test)]
mod tests;
mod waiting;
