use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::{Algorithm, BackendErrorKind, Quota, Status, Verdict};

use crate::adaptive::AdaptiveDecision;

/// Why a limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DenyReason {
    /// The quota is used up.
    OverLimit,
    /// The request costs more than the quota can ever admit at once.
    CostTooHigh,
    /// The in-memory backend is full and this key is new.
    AtCapacity,
    /// The backend failed and the limit fails closed.
    BackendUnavailable,
    /// A concurrency limit: the key has as many requests in flight as the limit allows.
    InFlight,
    /// The key is in the limit's penalty box ([`Penalty`](tollgate_engine::Penalty)) until the
    /// refusal's `retry_after`, after refusals enough: every request is refused until then.
    Blocked,
}

/// Why a limit let a request through without counting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BypassReason {
    /// The backend did not answer within its deadline.
    Timeout,
    /// The backend could not be reached or answered with an error.
    Error,
    /// The circuit breaker is open after recent failures.
    CircuitOpen,
    /// The backend's answer could not be understood.
    Protocol,
    /// The check was not sent: this process had more checks waiting for the backend than it
    /// could send by their deadline. Local overload, not a backend failure.
    Overloaded,
}

impl BypassReason {
    /// A fixed label: `timeout`, `error`, `circuit_open`, `protocol` or `overloaded`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Error => "error",
            Self::CircuitOpen => "circuit_open",
            Self::Protocol => "protocol",
            Self::Overloaded => "overloaded",
        }
    }
}

impl From<BackendErrorKind> for BypassReason {
    fn from(kind: BackendErrorKind) -> Self {
        match kind {
            BackendErrorKind::Timeout => Self::Timeout,
            BackendErrorKind::CircuitOpen => Self::CircuitOpen,
            BackendErrorKind::Protocol => Self::Protocol,
            BackendErrorKind::Overloaded => Self::Overloaded,
            _ => Self::Error,
        }
    }
}

/// Why a limit was not applied to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// No key could be extracted and the limit skips keyless requests.
    MissingKey,
    /// The backend refused the request on another limit before evaluating this one.
    NotChecked,
}

/// What one limit decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Admitted and counted.
    Allowed {
        /// Units left in the quota.
        remaining: u64,
        /// Time until the quota is whole again.
        reset: Duration,
    },
    /// Refused (or, for a shadow limit, would have been).
    Denied {
        /// When the same request could be admitted; `None` when it never can.
        retry_after: Option<Duration>,
        /// Units left in the quota.
        remaining: u64,
        /// Time until the quota is whole again.
        reset: Duration,
        /// Why.
        reason: DenyReason,
    },
    /// Admitted without being counted: the backend failed and the limit fails open.
    Bypassed {
        /// How the backend failed.
        reason: BypassReason,
    },
    /// Not applied.
    Skipped {
        /// Why.
        reason: SkipReason,
    },
    /// Admitted without being counted: the request matched the layer's
    /// [`Allowlist`](crate::Allowlist).
    Allowlisted,
    /// Refused without being counted: the request matched the layer's
    /// [`Denylist`](crate::Denylist) (on every limit), or a deny list of the backend's for this
    /// limit's key. Refuses even under a shadow limit: a deny is an operator's, not a limit's.
    Denylisted {
        /// When the deny ends; `None` for one without an end (every static deny), which
        /// sends no `Retry-After`.
        retry_after: Option<Duration>,
    },
}

impl Outcome {
    /// The outcome a verdict stands for.
    pub(crate) fn from_verdict(verdict: &Verdict) -> Self {
        let reset = verdict.reset();
        let remaining = verdict.remaining;
        let reason = match verdict.status {
            Status::Allowed => return Self::Allowed { remaining, reset },
            Status::NotChecked => {
                return Self::Skipped {
                    reason: SkipReason::NotChecked,
                }
            }
            Status::Denied { .. } => DenyReason::OverLimit,
            Status::CostTooHigh => DenyReason::CostTooHigh,
            Status::AtCapacity { .. } => DenyReason::AtCapacity,
            Status::Blocked { .. } => DenyReason::Blocked,
            Status::Denylisted { retry_after } => {
                return Self::Denylisted {
                    retry_after: Some(Duration::from_micros(retry_after)),
                }
            }
            _ => DenyReason::OverLimit,
        };
        Self::Denied {
            retry_after: verdict.retry_after(),
            remaining,
            reset,
            reason,
        }
    }

    /// Whether this outcome lets the request through.
    pub fn admits(&self) -> bool {
        !matches!(self, Self::Denied { .. } | Self::Denylisted { .. })
    }
}

/// Where an outcome was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// The configured backend.
    Backend,
    /// The local fallback limiter, because the backend failed.
    Fallback,
}

/// One limit's part of a [`Decision`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitDecision {
    name: Arc<str>,
    quota: Quota,
    outcome: Outcome,
    source: Source,
    shadow: bool,
    concurrent: bool,
    from_lease: bool,
    /// How long the request waits for this limit's reserved time (a delayed limit), in
    /// microseconds; 0 when it does not wait.
    delayed: u64,
    /// How long the request waited in this limit's queue for a slot, in microseconds; 0
    /// when it did not.
    queued: u64,
}

impl LimitDecision {
    /// A limit's decision.
    pub fn new(
        name: Arc<str>,
        quota: Quota,
        outcome: Outcome,
        source: Source,
        shadow: bool,
    ) -> Self {
        Self {
            name,
            quota,
            outcome,
            source,
            shadow,
            concurrent: false,
            from_lease: false,
            delayed: 0,
            queued: 0,
        }
    }

    /// Marks this as checked after `micros` in this limit's queue (none for 0).
    #[inline]
    pub(crate) fn queued_for(mut self, micros: u64) -> Self {
        self.queued = micros;
        self
    }

    /// How long the request waited in this concurrency limit's queue for a free slot
    /// ([`Limit::queue_up_to`](tollgate_engine::Limit::queue_up_to)) before this outcome: on
    /// an admission, how long it waited before the service was called; on a refusal, how
    /// long it waited in vain. `None` for a request that did not wait in this limit's queue.
    pub fn queued(&self) -> Option<Duration> {
        (self.queued > 0).then(|| Duration::from_micros(self.queued))
    }

    /// Marks this as admitted `micros` ahead of its time by a delayed limit (none for 0).
    #[inline]
    pub(crate) fn delayed_by(mut self, micros: u64) -> Self {
        self.delayed = micros;
        self
    }

    /// How long this limit's admission lies ahead of the time the quota reserved for it: a
    /// limit with a delay ([`Limit::delay_up_to`](tollgate_engine::Limit::delay_up_to)) admitted
    /// the request beyond its burst, and the layer waits this long before the service is
    /// called (a shadow limit only reports it). `None` for a request admitted at once, and for
    /// every other outcome. The outcome's `remaining` and `reset` show the quota after the
    /// reservation (`remaining` is then 0).
    pub fn delayed(&self) -> Option<Duration> {
        (self.delayed > 0).then(|| Duration::from_micros(self.delayed))
    }

    /// This part after a settle from `reserved` to `actual` units: what an admitted limit
    /// has left, and when it is whole again, as the backend's settle leaves them (a key in
    /// debt has 0 left).
    pub(crate) fn settled(mut self, algorithm: Algorithm, reserved: u32, actual: u32) -> Self {
        if let Outcome::Allowed { remaining, reset } = &mut self.outcome {
            let interval = Duration::from_micros(self.quota.emission_interval());
            if actual < reserved {
                let back = reserved - actual;
                let most = match algorithm {
                    Algorithm::Gcra => self.quota.burst(),
                    _ => self.quota.limit(),
                };
                *remaining = remaining
                    .saturating_add(u64::from(back))
                    .min(u64::from(most));
                if algorithm == Algorithm::Gcra {
                    *reset = reset.saturating_sub(interval.saturating_mul(back));
                }
            } else {
                let more = actual - reserved;
                *remaining = remaining.saturating_sub(u64::from(more));
                if algorithm == Algorithm::Gcra {
                    let cap = interval.saturating_mul(self.quota.burst().saturating_mul(2));
                    *reset = reset
                        .saturating_add(interval.saturating_mul(more))
                        .min(cap.max(*reset));
                }
            }
        }
        self
    }

    /// Marks this as answered from a leased slice (see [`Verdicts::from_lease`]).
    ///
    /// [`Verdicts::from_lease`]: tollgate_engine::Verdicts::from_lease
    pub(crate) fn leased(mut self, from_lease: bool) -> Self {
        self.from_lease = from_lease;
        self
    }

    /// Whether the backend admitted this from a slice of a leased quota that this process
    /// held (see [`tollgate_engine::Lease`]): counted in the shared backend before, answered
    /// without asking it. Counted by `tollgate_lease_admissions_total`.
    pub fn is_from_lease(&self) -> bool {
        self.from_lease
    }

    /// Marks this as a shadow decision when `shadowed`: the request's key lies outside the
    /// limit's enforced share ([`Limit::enforce_percent`]).
    ///
    /// [`Limit::enforce_percent`]: tollgate_engine::Limit::enforce_percent
    pub(crate) fn shadowed(mut self, shadowed: bool) -> Self {
        self.shadow |= shadowed;
        self
    }

    /// Marks this as a concurrency limit's decision.
    pub(crate) fn concurrent(mut self) -> Self {
        self.concurrent = true;
        self
    }

    /// Whether this is a concurrency limit's decision: its quota counts requests in flight,
    /// and its `remaining` is the free slots.
    pub fn is_concurrency(&self) -> bool {
        self.concurrent
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The limit's quota (for a fallback outcome, still the configured one).
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The outcome.
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// Whether the outcome came from the backend or from the local fallback.
    pub fn source(&self) -> Source {
        self.source
    }

    /// Whether the limit is in shadow mode for this request (its denials are reported, not
    /// enforced): a shadow limit, or one enforced on a share of keys that the request's key
    /// lies outside.
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// Whether this limit refuses the request (a shadow limit never does, except for a
    /// deny: [`Outcome::Denylisted`]).
    pub fn refuses(&self) -> bool {
        !self.outcome.admits()
            && (!self.shadow || matches!(self.outcome, Outcome::Denylisted { .. }))
    }

    /// A fixed label for this limit's own outcome: `allowed`, `delayed` (admitted to wait
    /// for its time: [`delayed`](Self::delayed)), `queued` (admitted after waiting in its
    /// queue: [`queued`](Self::queued)), `denied`, `shadow_denied`,
    /// `bypassed`, `fallback` (admitted by the fallback limiter), `skipped`, `allowlisted` or
    /// `denylisted`. The `outcome`
    /// label of `tollgate_decisions_total` can differ: `unavailable` for a fail-closed
    /// refusal, and `skipped` at the limits that did not refuse a refused request.
    pub fn label(&self) -> &'static str {
        match (&self.outcome, self.source, self.shadow) {
            (Outcome::Denied { .. }, _, true) => "shadow_denied",
            (Outcome::Denied { .. }, _, false) => "denied",
            (Outcome::Allowed { .. }, Source::Fallback, _) => "fallback",
            (Outcome::Allowed { .. }, Source::Backend, _) if self.delayed > 0 => "delayed",
            (Outcome::Allowed { .. }, Source::Backend, _) if self.queued > 0 => "queued",
            (Outcome::Allowed { .. }, Source::Backend, _) => "allowed",
            (Outcome::Bypassed { .. }, _, _) => "bypassed",
            (Outcome::Skipped { .. }, _, _) => "skipped",
            (Outcome::Allowlisted, _, _) => "allowlisted",
            (Outcome::Denylisted { .. }, _, _) => "denylisted",
        }
    }
}

/// What the limiter decided for one request, per limit, in the layer's order.
///
/// Every request that passes a rate-limit layer carries one in its extensions, and so does its
/// response (an admitted one unless the layer was built with
/// [`decision_on_allowed(false)`](crate::RateLimitLayerBuilder::decision_on_allowed)). A
/// bypass is never reported as a plain allow.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Decision, LimitDecision, Outcome, Source};
/// use tollgate::engine::Quota;
///
/// let d = Decision::new(vec![LimitDecision::new(
///     "burst".into(),
///     Quota::per_minute(5)?,
///     Outcome::Allowed { remaining: 4, reset: Duration::from_secs(12) },
///     Source::Backend,
///     false,
/// )]);
/// assert!(d.is_admitted());
/// assert_eq!(d.remaining(), Some(4));
/// assert_eq!(d.get("burst").map(|l| l.label()), Some("allowed"));
/// # Ok::<(), tollgate::engine::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Decision {
    limits: Limits,
    /// The adaptive concurrency limit's part, in a layer that has one.
    adaptive: Option<AdaptiveDecision>,
}

/// A decision's parts. Most layers have one limit: its part is kept inline, so that making a
/// decision and copying it to the response allocate nothing.
#[derive(Clone)]
enum Limits {
    One(LimitDecision),
    Many(Arc<[LimitDecision]>),
}

impl FromIterator<LimitDecision> for Decision {
    fn from_iter<I: IntoIterator<Item = LimitDecision>>(iter: I) -> Self {
        let mut iter = iter.into_iter();
        let limits = match (iter.next(), iter.next()) {
            (Some(one), None) => Limits::One(one),
            (first, second) => Limits::Many(first.into_iter().chain(second).chain(iter).collect()),
        };
        Self {
            limits,
            adaptive: None,
        }
    }
}

impl PartialEq for Decision {
    fn eq(&self, other: &Self) -> bool {
        self.limits() == other.limits() && self.adaptive == other.adaptive
    }
}

impl Eq for Decision {}

impl std::fmt::Debug for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Decision");
        d.field("limits", &self.limits());
        if let Some(adaptive) = &self.adaptive {
            d.field("adaptive", adaptive);
        }
        d.finish()
    }
}

impl Decision {
    /// A decision from its limits' parts.
    pub fn new(limits: Vec<LimitDecision>) -> Self {
        limits.into_iter().collect()
    }

    /// Every limit's part, in the layer's order.
    ///
    /// (Collecting an iterator of parts into a `Decision` allocates at most once, and not at
    /// all for a single part.)
    pub fn limits(&self) -> &[LimitDecision] {
        match &self.limits {
            Limits::One(one) => std::slice::from_ref(one),
            Limits::Many(many) => many,
        }
    }

    /// The decision of a layer with one limit.
    pub(crate) fn one(limit: LimitDecision) -> Self {
        Self {
            limits: Limits::One(limit),
            adaptive: None,
        }
    }

    /// This decision with the adaptive concurrency limit's part.
    pub(crate) fn with_adaptive(mut self, part: AdaptiveDecision) -> Self {
        self.adaptive = Some(part);
        self
    }

    /// The adaptive concurrency limit's part ([`crate::adaptive`]): the request's class, and
    /// whether it was shed (or, monitor-only, would have been). `None` in a layer without
    /// one.
    pub fn adaptive(&self) -> Option<&AdaptiveDecision> {
        self.adaptive.as_ref()
    }

    /// Whether the adaptive concurrency limit shed the request (`503`).
    pub fn is_shed(&self) -> bool {
        self.adaptive.is_some_and(|a| a.is_shed())
    }

    /// This decision's limits followed by `inner`'s: what two stacked layers decided (the
    /// inner layer's adaptive part, else the outer's).
    pub(crate) fn then(&self, inner: &Decision) -> Decision {
        let both: Decision = self
            .limits()
            .iter()
            .chain(inner.limits())
            .cloned()
            .collect();
        Decision {
            adaptive: inner.adaptive.or(self.adaptive),
            ..both
        }
    }

    /// One limit's part, by name.
    pub fn get(&self, name: &str) -> Option<&LimitDecision> {
        self.limits().iter().find(|l| l.name() == name)
    }

    /// Whether every limit admits the request (and the adaptive limit did not shed it).
    pub fn is_admitted(&self) -> bool {
        !self.limits().iter().any(LimitDecision::refuses) && !self.is_shed()
    }

    /// Whether the request matched the layer's [`Allowlist`](crate::Allowlist): admitted,
    /// and counted by no limit.
    pub fn is_allowlisted(&self) -> bool {
        let limits = self.limits();
        !limits.is_empty()
            && limits
                .iter()
                .all(|l| matches!(l.outcome, Outcome::Allowlisted))
    }

    /// Whether a deny list refused the request: the layer's [`Denylist`](crate::Denylist)
    /// (then every limit says [`Outcome::Denylisted`]) or the backend's for a limit's key.
    pub fn is_denylisted(&self) -> bool {
        self.limits()
            .iter()
            .any(|l| matches!(l.outcome, Outcome::Denylisted { .. }))
    }

    /// How long the request waits before the service is called: the longest
    /// [`LimitDecision::delayed`] of its enforced limits (stacked delayed limits wait for the
    /// latest of their times). `None` when it was served at once.
    pub fn delayed(&self) -> Option<Duration> {
        self.limits()
            .iter()
            .filter(|l| !l.shadow)
            .filter_map(LimitDecision::delayed)
            .max()
    }

    /// How long the request waited in a concurrency limit's queue for a free slot before it
    /// was checked for the last time (see [`LimitDecision::queued`]); `None` when it did not
    /// wait in one.
    pub fn queued(&self) -> Option<Duration> {
        self.limits().iter().filter_map(LimitDecision::queued).max()
    }

    /// Whether any limit let the request through uncounted because its backend failed.
    pub fn is_bypassed(&self) -> bool {
        self.limits()
            .iter()
            .any(|l| matches!(l.outcome, Outcome::Bypassed { .. }))
    }

    /// The fewest units left across the limits that counted the request.
    pub fn remaining(&self) -> Option<u64> {
        self.limits()
            .iter()
            .filter_map(|l| match l.outcome {
                Outcome::Allowed { remaining, .. } => Some(remaining),
                _ => None,
            })
            .min()
    }

    /// The longest wait among the limits that refuse the request; `None` when a deny
    /// without an end refuses it ([`Outcome::Denylisted`]).
    pub fn retry_after(&self) -> Option<Duration> {
        let mut longest = None;
        for limit in self.limits().iter().filter(|l| l.refuses()) {
            match limit.outcome {
                Outcome::Denylisted { retry_after: None } => return None,
                Outcome::Denied { retry_after, .. } | Outcome::Denylisted { retry_after } => {
                    longest = longest.max(retry_after);
                }
                _ => {}
            }
        }
        longest
    }
}

#[cfg(test)]
mod tests;
