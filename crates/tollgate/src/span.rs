//! A request's `tollgate.check` span, and its `rate_limit.*` attributes: what was decided,
//! why, what is left, how long the request waits or should wait, the backend's round trip
//! and whether a limit failed open.
//!
//! The span is a `DEBUG` span: [`CheckSpan::new`] asks `tracing`'s level filters (a static
//! maximum level and the current subscribers' most verbose level, one load and compare)
//! before it builds anything, and without a subscriber that wants it the span is
//! [`Span::none`], which records nothing and reads no clock. Every attribute is recorded
//! behind [`Span::is_disabled`], so no attribute is computed for a span nobody listens to.
//!
//! The attribute names follow OpenTelemetry's style; they are provisional until OpenTelemetry
//! has a convention for rate limiting.

use std::ops::Deref;
use std::time::{Duration, Instant};

use tracing::field::Empty;
use tracing::Span;

use crate::decision::{Decision, DenyReason, Outcome, Source};

/// The span of one request's check, and when it started (only when the span is enabled).
#[derive(Debug)]
pub(crate) struct CheckSpan {
    span: Span,
    started: Option<Instant>,
}

impl CheckSpan {
    /// The span of a request checked against the limits `names` (comma-separated): enabled
    /// only when a subscriber wants `DEBUG` spans.
    #[inline]
    pub(crate) fn new(names: &str) -> Self {
        if !tracing::level_enabled!(tracing::Level::DEBUG) {
            return Self::none();
        }
        let span = tracing::debug_span!(
            "tollgate.check",
            limits = names,
            outcome = Empty,
            decision = Empty,
            rate_limit.limits = names,
            rate_limit.outcome = Empty,
            rate_limit.reason = Empty,
            rate_limit.remaining = Empty,
            rate_limit.wait_ms = Empty,
            rate_limit.retry_after_ms = Empty,
            rate_limit.backend.rtt_ms = Empty,
            rate_limit.fail_open = Empty,
        );
        let started = (!span.is_disabled()).then(Instant::now);
        Self { span, started }
    }

    /// A span that records nothing.
    #[inline]
    pub(crate) fn none() -> Self {
        Self {
            span: Span::none(),
            started: None,
        }
    }

    /// Records the `rate_limit.*` attributes of `decision`, reached after the backend's
    /// answer (`asked`: the round trip is the time since the span started) or without asking.
    pub(crate) fn record(&self, decision: &Decision, asked: bool) {
        if self.span.is_disabled() {
            return;
        }
        let rtt = self.started.filter(|_| asked).map(|s| s.elapsed());
        record(&self.span, decision, rtt);
    }
}

impl Deref for CheckSpan {
    type Target = Span;

    fn deref(&self) -> &Span {
        &self.span
    }
}

/// Records `decision` on `span`: its `outcome` and `decision` labels (as the metrics name
/// them) and the `rate_limit.*` attributes, with the backend's round trip when the backend
/// was asked.
pub(crate) fn record(span: &Span, decision: &Decision, rtt: Option<Duration>) {
    if span.is_disabled() {
        return;
    }
    crate::metrics::record_span(span, decision);
    let (outcome, reason) = outcome(decision);
    span.record("rate_limit.outcome", outcome);
    if let Some(reason) = reason {
        span.record("rate_limit.reason", reason);
    }
    // A refused request has none left under the limit that refused it.
    let refused_with = || {
        decision
            .limits()
            .iter()
            .filter(|l| l.refuses())
            .filter_map(|l| match l.outcome() {
                Outcome::Denied { remaining, .. } => Some(*remaining),
                _ => None,
            })
            .min()
    };
    if let Some(remaining) = decision.remaining().or_else(refused_with) {
        span.record("rate_limit.remaining", remaining);
    }
    if let Some(wait) = decision.queued().max(decision.delayed()) {
        span.record("rate_limit.wait_ms", millis(wait));
    }
    if let Some(after) = decision.retry_after().filter(|_| !decision.is_admitted()) {
        span.record("rate_limit.retry_after_ms", millis(after));
    }
    if let Some(rtt) = rtt {
        span.record("rate_limit.backend.rtt_ms", millis(rtt));
    }
    span.record("rate_limit.fail_open", decision.is_bypassed());
}

/// Records a refusal before any check (a request without a key, or with a cost that is not
/// one): `refused`, with `reason`.
pub(crate) fn record_refused(span: &Span, reason: &'static str) {
    if span.is_disabled() {
        return;
    }
    span.record("rate_limit.outcome", "refused");
    span.record("rate_limit.reason", reason);
    span.record("rate_limit.fail_open", false);
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The request's outcome (`allowed`, `delayed`, `queued`, `refused`, `shadow`, `bypassed`,
/// `blocked`, `denied`) and why, when there is a why.
fn outcome(decision: &Decision) -> (&'static str, Option<&'static str>) {
    let limits = decision.limits();
    if !decision.is_admitted() {
        let refusing = limits.iter().filter(|l| l.refuses());
        // A deny (403) says most, then a block, then a refusal.
        if refusing
            .clone()
            .any(|l| matches!(l.outcome(), Outcome::Denylisted { .. }))
        {
            return ("denied", Some("denylisted"));
        }
        let reasons = refusing.filter_map(|l| match l.outcome() {
            Outcome::Denied { reason, .. } => Some(*reason),
            _ => None,
        });
        return match reasons.clone().find(|r| *r == DenyReason::Blocked) {
            Some(_) => ("blocked", Some(deny_reason(DenyReason::Blocked))),
            None => ("refused", reasons.map(deny_reason).next()),
        };
    }
    if let Some(reason) = limits.iter().find_map(|l| match l.outcome() {
        Outcome::Bypassed { reason } => Some(reason.as_str()),
        _ => None,
    }) {
        return ("bypassed", Some(reason));
    }
    if decision.queued().is_some() {
        return ("queued", None);
    }
    if decision.delayed().is_some() {
        return ("delayed", None);
    }
    if let Some(reason) = limits.iter().find_map(|l| match l.outcome() {
        Outcome::Denied { reason, .. } if l.is_shadow() => Some(deny_reason(*reason)),
        _ => None,
    }) {
        return ("shadow", Some(reason));
    }
    let reason = if decision.is_allowlisted() {
        Some("allowlisted")
    } else if limits.iter().any(|l| l.source() == Source::Fallback) {
        Some("fallback")
    } else {
        None
    };
    ("allowed", reason)
}

fn deny_reason(reason: DenyReason) -> &'static str {
    match reason {
        DenyReason::OverLimit => "over_limit",
        DenyReason::CostTooHigh => "cost_too_high",
        DenyReason::AtCapacity => "at_capacity",
        DenyReason::BackendUnavailable => "backend_unavailable",
        DenyReason::InFlight => "in_flight",
        DenyReason::Blocked => "blocked",
    }
}
