//! Metric handles and rate-limited warnings, per limit.
//!
//! Names are part of the API (see `docs/operations.md`). Label values are limit names and fixed
//! words only: never a key.
//!
//! Handles are registered on the first request a layer sees rather than when it is built, so a
//! recorder installed after the router was built still receives everything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use metrics::Counter;

use crate::decision::{BypassReason, DenyReason, LimitDecision, Outcome};

/// Every value of the `outcome` label of `tollgate_decisions_total`.
pub(crate) const OUTCOMES: [&str; 7] = [
    "allowed",
    "denied",
    "shadow_denied",
    "bypassed",
    "fallback",
    "skipped",
    "missing_key",
];

const REASONS: [BypassReason; 4] = [
    BypassReason::Timeout,
    BypassReason::Error,
    BypassReason::CircuitOpen,
    BypassReason::Protocol,
];

const WARN_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct LimitMetrics {
    name: Arc<str>,
    handles: OnceLock<Handles>,
    started: Instant,
    next_warn: AtomicU64,
    quiet: AtomicU64,
}

struct Handles {
    decisions: [Counter; OUTCOMES.len()],
    bypass: [Counter; REASONS.len()],
    capacity: Counter,
}

impl LimitMetrics {
    pub(crate) fn new(name: Arc<str>) -> Self {
        Self {
            name,
            handles: OnceLock::new(),
            started: Instant::now(),
            next_warn: AtomicU64::new(0),
            quiet: AtomicU64::new(0),
        }
    }

    fn handles(&self) -> &Handles {
        self.handles.get_or_init(|| {
            let limit = || metrics::SharedString::from(Arc::clone(&self.name));
            Handles {
                decisions: OUTCOMES.map(|outcome| {
                    metrics::counter!("tollgate_decisions_total", "limit" => limit(), "outcome" => outcome)
                }),
                bypass: REASONS.map(|reason| {
                    metrics::counter!("tollgate_bypass_total", "limit" => limit(), "reason" => reason.as_str())
                }),
                capacity: metrics::counter!("tollgate_capacity_refusals_total", "limit" => limit()),
            }
        })
    }

    pub(crate) fn record(&self, decision: &LimitDecision) {
        let handles = self.handles();
        let label = decision.label();
        if let Some(i) = OUTCOMES.iter().position(|o| *o == label) {
            handles.decisions[i].increment(1);
        }
        match decision.outcome() {
            Outcome::Bypassed { reason } => {
                if let Some(i) = REASONS.iter().position(|r| r == reason) {
                    handles.bypass[i].increment(1);
                }
                self.warn(|n| {
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
                self.warn(|n| {
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

    pub(crate) fn record_missing_key(&self) {
        let i = OUTCOMES.len() - 1;
        self.handles().decisions[i].increment(1);
    }

    /// Logs at most once per [`WARN_EVERY`] per limit, with the count of events in between.
    fn warn(&self, log: impl FnOnce(u64)) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let due = self.next_warn.load(Ordering::Relaxed);
        let next = now.saturating_add(WARN_EVERY.as_millis() as u64);
        if now >= due
            && self
                .next_warn
                .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            log(self.quiet.swap(0, Ordering::Relaxed) + 1);
        } else {
            self.quiet.fetch_add(1, Ordering::Relaxed);
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
