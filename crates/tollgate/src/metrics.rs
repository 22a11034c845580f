//! Metric handles and rate-limited warnings, per limit.
//!
//! Names are part of the API (see `docs/operations.md`). Label values are limit names and fixed
//! words only: never a key.
//!
//! Handles are registered on the first request a layer sees rather than when it is built, so a
//! recorder installed after the router was built still receives everything. After that a
//! request pays for no registry lookup and no allocation: it increments a cached handle.
//!
//! Every series of a limit is registered at once, so the bypass and capacity counters exist
//! (at 0) before the first failure: an alert on `rate(...) > 0` or on an absent series then
//! works from the start.

use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use metrics::{Counter, Histogram};
use tollgate_engine::notice::{self, Throttle, STDERR_EVERY};

use crate::decision::{BypassReason, Decision, DenyReason, LimitDecision, Outcome, Source};

/// A value of the `outcome` label of `tollgate_decisions_total`.
///
/// It describes what happened to the request at one limit, which is not always the limit's own
/// verdict: on a request that another limit refused, this limit counted nothing, so it is
/// `Skipped` whatever it would have said (and a fail-open limit did not let anything through,
/// so it is no bypass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Label {
    Allowed,
    Delayed,
    Denied,
    Blocked,
    ShadowDenied,
    Bypassed,
    Fallback,
    Skipped,
    MissingKey,
    InvalidCost,
    Unavailable,
    Allowlisted,
    Denylisted,
    Queued,
}

impl Label {
    const ALL: [Self; 14] = [
        Self::Allowed,
        Self::Delayed,
        Self::Denied,
        Self::Blocked,
        Self::ShadowDenied,
        Self::Bypassed,
        Self::Fallback,
        Self::Skipped,
        Self::MissingKey,
        Self::InvalidCost,
        Self::Unavailable,
        Self::Allowlisted,
        Self::Denylisted,
        Self::Queued,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Delayed => "delayed",
            Self::Queued => "queued",
            Self::Denied => "denied",
            Self::Blocked => "blocked",
            Self::ShadowDenied => "shadow_denied",
            Self::Bypassed => "bypassed",
            Self::Fallback => "fallback",
            Self::Skipped => "skipped",
            Self::MissingKey => "missing_key",
            Self::InvalidCost => "invalid_cost",
            Self::Unavailable => "unavailable",
            Self::Allowlisted => "allowlisted",
            Self::Denylisted => "denylisted",
        }
    }

    /// What happened at one limit to a request that was `admitted` (or refused) as a whole.
    pub(crate) fn of(decision: &LimitDecision, admitted: bool) -> Self {
        match decision.outcome() {
            Outcome::Denied { .. } if decision.is_shadow() => Self::ShadowDenied,
            Outcome::Denied {
                reason: DenyReason::BackendUnavailable,
                ..
            } => Self::Unavailable,
            Outcome::Denied {
                reason: DenyReason::Blocked,
                ..
            } => Self::Blocked,
            Outcome::Denied { .. } => Self::Denied,
            Outcome::Denylisted { .. } => Self::Denylisted,
            // Refused by another limit: nothing was consumed or let through here.
            _ if !admitted => Self::Skipped,
            Outcome::Allowed { .. } if decision.source() == Source::Fallback => Self::Fallback,
            // A shadow limit delays nobody: its admission is counted as one.
            Outcome::Allowed { .. } if decision.delayed().is_some() && !decision.is_shadow() => {
                Self::Delayed
            }
            Outcome::Allowed { .. } if decision.queued().is_some() => Self::Queued,
            Outcome::Allowed { .. } => Self::Allowed,
            Outcome::Bypassed { .. } => Self::Bypassed,
            Outcome::Skipped { .. } => Self::Skipped,
            Outcome::Allowlisted => Self::Allowlisted,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Every value of the `reason` label of `tollgate_bypass_total`.
const REASONS: [BypassReason; 5] = [
    BypassReason::Timeout,
    BypassReason::Error,
    BypassReason::CircuitOpen,
    BypassReason::Protocol,
    BypassReason::Overloaded,
];

fn reason_index(reason: BypassReason) -> usize {
    match reason {
        BypassReason::Timeout => 0,
        BypassReason::Error => 1,
        BypassReason::CircuitOpen => 2,
        BypassReason::Protocol => 3,
        BypassReason::Overloaded => 4,
    }
}

/// At most one warning of each kind per limit in this interval.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The bypasses of every limit of the process, told on standard error when no tracing
/// subscriber is set (see [`notice`]).
static BYPASS_NOTICE: LazyLock<Throttle> = LazyLock::new(|| Throttle::new(STDERR_EVERY));

pub(crate) struct LimitMetrics {
    name: Arc<str>,
    /// Whether the quota's whole is its burst (GCRA) rather than its limit.
    gcra: bool,
    handles: OnceLock<Handles>,
    // Separate budgets: a flood of capacity refusals must not hide the first bypass warning,
    // and each warning's count must be of its own kind.
    bypass_warn: Throttle,
    capacity_warn: Throttle,
}

struct Handles {
    decisions: [Counter; Label::ALL.len()],
    bypass: [Counter; REASONS.len()],
    capacity: Counter,
    /// Admissions answered from a leased slice held by this process.
    leased: Counter,
    /// How long delayed requests wait for this limit, or queued ones waited for its slots,
    /// in seconds.
    delay: Histogram,
    /// Admissions that left at most the layer's near-limit share of the quota.
    near: Counter,
}

impl LimitMetrics {
    /// The metrics of the limit `name`; `gcra` when its quota's whole is its burst.
    pub(crate) fn new(name: Arc<str>, gcra: bool) -> Self {
        Self {
            name,
            gcra,
            handles: OnceLock::new(),
            bypass_warn: Throttle::new(WARN_EVERY),
            capacity_warn: Throttle::new(WARN_EVERY),
        }
    }

    fn handles(&self) -> &Handles {
        self.handles.get_or_init(|| {
            let limit = || metrics::SharedString::from(Arc::clone(&self.name));
            Handles {
                decisions: Label::ALL.map(|outcome| {
                    metrics::counter!("tollgate_decisions_total", "limit" => limit(), "outcome" => outcome.as_str())
                }),
                bypass: REASONS.map(|reason| {
                    metrics::counter!("tollgate_bypass_total", "limit" => limit(), "reason" => reason.as_str())
                }),
                capacity: metrics::counter!("tollgate_capacity_refusals_total", "limit" => limit()),
                leased: metrics::counter!("tollgate_lease_admissions_total", "limit" => limit()),
                delay: metrics::histogram!("tollgate_delay_seconds", "limit" => limit()),
                near: metrics::counter!("tollgate_near_limit_total", "limit" => limit()),
            }
        })
    }

    /// Counts one limit's part of a request that was `admitted` (or refused) as a whole; an
    /// admission that left at most `near_percent` % of the quota (its burst under GCRA) also
    /// counts as near the limit.
    pub(crate) fn record(&self, decision: &LimitDecision, admitted: bool, near_percent: u8) {
        let handles = self.handles();
        let label = Label::of(decision, admitted);
        handles.decisions[label.index()].increment(1);
        if let (
            Label::Allowed | Label::Delayed | Label::Queued,
            Outcome::Allowed { remaining, .. },
        ) = (label, decision.outcome())
        {
            let quota = decision.quota();
            let whole = if self.gcra {
                quota.burst()
            } else {
                quota.limit()
            };
            if u128::from(*remaining) * 100 <= u128::from(whole) * u128::from(near_percent) {
                handles.near.increment(1);
            }
        }
        if label == Label::Allowed && decision.is_from_lease() {
            handles.leased.increment(1);
        }
        // One histogram for both ways of waiting: a limit delays (GCRA) or queues
        // (concurrency), never both.
        let waited = match label {
            Label::Delayed => decision.delayed(),
            Label::Queued => decision.queued(),
            _ => None,
        };
        if let Some(wait) = waited {
            handles.delay.record(wait.as_secs_f64());
        }
        match decision.outcome() {
            Outcome::Bypassed { reason } if label == Label::Bypassed => {
                handles.bypass[reason_index(*reason)].increment(1);
                notice::to_stderr(&BYPASS_NOTICE, |n| {
                    format!(
                        "tollgate: WARNING rate limit {:?} bypassed ({}): the backend failed \
                         and the limit fails open; {n} bypassed since the last such line. \
                         This line repeats at most every {}s; install a tracing subscriber or \
                         a metrics exporter (tollgate_bypass_total) to see every one.",
                        &*self.name,
                        reason.as_str(),
                        STDERR_EVERY.as_secs()
                    )
                });
                self.bypass_warn.tick(|n| {
                    tracing::warn!(
                        limit = &*self.name,
                        reason = reason.as_str(),
                        bypassed_since_last_warning = n,
                        "rate limit bypassed: the backend failed and the limit fails open"
                    )
                });
            }
            Outcome::Denied {
                reason: DenyReason::AtCapacity,
                ..
            } => {
                handles.capacity.increment(1);
                self.capacity_warn.tick(|n| {
                    tracing::warn!(
                        limit = &*self.name,
                        refused_since_last_warning = n,
                        "rate limiter at capacity: new keys are refused"
                    )
                });
            }
            _ => {}
        }
    }

    /// Counts a request refused because it had no key for this limit, and says so in its span.
    pub(crate) fn record_missing_key(&self, span: &tracing::Span) {
        self.record_refused_input(Label::MissingKey, span);
    }

    /// Counts a request refused because its cost for this limit is not a whole number of
    /// units, and says so in its span.
    pub(crate) fn record_invalid_cost(&self, span: &tracing::Span) {
        self.record_refused_input(Label::InvalidCost, span);
    }

    fn record_refused_input(&self, label: Label, span: &tracing::Span) {
        self.handles().decisions[label.index()].increment(1);
        if !span.is_disabled() {
            let label = label.as_str();
            span.record("outcome", label);
            span.record("decision", format_args!("{}={label}", self.name));
        }
    }
}

impl std::fmt::Debug for LimitMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitMetrics")
            .field("limit", &self.name)
            .finish()
    }
}

/// Fills the `outcome` and `decision` fields of a request's `tollgate.check` span.
///
/// `outcome` is the request's: `denylisted` (403), `denied` (429) or `unavailable` (503) when
/// refused, else the most
/// telling of its limits' labels (`bypassed`, `fallback`, `shadow_denied`, `allowed`, `skipped`).
/// `decision` lists `name=label` per limit. Called by [`crate::span::record`], once it knows
/// that a subscriber listens.
pub(crate) fn record_span(span: &tracing::Span, decision: &Decision) {
    let admitted = decision.is_admitted();
    let has = |want: Label| {
        decision
            .limits()
            .iter()
            .any(|d| Label::of(d, admitted) == want)
    };
    let outcome = if !admitted {
        if has(Label::Denylisted) {
            Label::Denylisted
        } else if has(Label::Blocked) {
            Label::Blocked
        } else if has(Label::Unavailable) {
            Label::Unavailable
        } else {
            Label::Denied
        }
    } else {
        [
            Label::Bypassed,
            Label::Fallback,
            Label::ShadowDenied,
            Label::Allowed,
            Label::Allowlisted,
        ]
        .into_iter()
        .find(|l| has(*l))
        .unwrap_or(Label::Skipped)
    };
    span.record("outcome", outcome.as_str());
    span.record("decision", tracing::field::display(Labels(decision)));
}

/// `name=label` for every limit of a decision, comma-separated, written without allocating.
struct Labels<'a>(&'a Decision);

impl std::fmt::Display for Labels<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let admitted = self.0.is_admitted();
        for (i, d) in self.0.limits().iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{}={}", d.name(), Label::of(d, admitted).as_str())?;
        }
        Ok(())
    }
}

/// Counts one attempt to replace a layer's limits.
pub(crate) fn record_reload(ok: bool) {
    let result = if ok { "ok" } else { "error" };
    metrics::counter!("tollgate_config_reloads_total", "result" => result).increment(1);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tollgate_engine::Quota;

    fn decision(outcome: Outcome, source: Source, shadow: bool) -> LimitDecision {
        LimitDecision::new(
            "l".into(),
            Quota::per_minute(1).unwrap(),
            outcome,
            source,
            shadow,
        )
    }

    #[test]
    fn labels_say_what_happened_to_the_request() {
        let allowed = Outcome::Allowed {
            remaining: 1,
            reset: Duration::ZERO,
        };
        let denied = |reason| Outcome::Denied {
            retry_after: None,
            remaining: 0,
            reset: Duration::ZERO,
            reason,
        };
        let bypassed = Outcome::Bypassed {
            reason: BypassReason::Timeout,
        };
        let denylisted = Outcome::Denylisted { retry_after: None };
        let b = Source::Backend;
        let cases = [
            (allowed, b, false, true, Label::Allowed),
            (allowed, Source::Fallback, false, true, Label::Fallback),
            (
                denied(DenyReason::OverLimit),
                b,
                false,
                false,
                Label::Denied,
            ),
            (
                denied(DenyReason::AtCapacity),
                b,
                false,
                false,
                Label::Denied,
            ),
            (
                denied(DenyReason::OverLimit),
                b,
                true,
                true,
                Label::ShadowDenied,
            ),
            (
                denied(DenyReason::BackendUnavailable),
                b,
                false,
                false,
                Label::Unavailable,
            ),
            (bypassed, b, false, true, Label::Bypassed),
            // Another limit refused the request: this one consumed nothing, let nothing through.
            (allowed, b, false, false, Label::Skipped),
            (bypassed, b, false, false, Label::Skipped),
            (
                denied(DenyReason::OverLimit),
                b,
                true,
                false,
                Label::ShadowDenied,
            ),
            // A deny refuses under a shadow limit too, with or without an end.
            (denylisted, b, false, false, Label::Denylisted),
            (denylisted, b, true, false, Label::Denylisted),
            (
                Outcome::Denylisted {
                    retry_after: Some(Duration::from_secs(60)),
                },
                b,
                false,
                false,
                Label::Denylisted,
            ),
        ];
        for (outcome, source, shadow, admitted, want) in cases {
            let d = decision(outcome, source, shadow);
            assert_eq!(
                Label::of(&d, admitted),
                want,
                "{outcome:?} admitted={admitted}"
            );
        }
        for (i, label) in Label::ALL.iter().enumerate() {
            assert_eq!(label.index(), i);
        }
        for (i, reason) in REASONS.iter().enumerate() {
            assert_eq!(reason_index(*reason), i);
        }
    }
}
