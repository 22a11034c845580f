//! The limits a layer applies: [`Limits`] as users give them, and the [`LimitSet`] a layer
//! compiles them into (checked whole, with what every request reads of it precomputed).

use std::fmt;
use std::sync::Arc;

use http::HeaderValue;
use tollgate_engine::{Algorithm, ConfigError, FailurePolicy, Limit, MAX_CHECKS};

use super::refused::Handle;
use crate::allowlist::Allowlist;
use crate::canary::CANARY_LIMIT;
use crate::cost::Metered;
use crate::decision::{DenyReason, LimitDecision, Outcome, Source};
use crate::denylist::Denylist;
use crate::fields;
use crate::key::KeyExtractor;
use crate::metrics::LimitMetrics;

/// Limits with the keys they are counted per: what a layer is built from
/// ([`RateLimitLayerBuilder::limits`](crate::RateLimitLayerBuilder::limits)) and what a
/// [`Reloader`](crate::Reloader) installs. A
/// [`LimitsFile`](crate::LimitsFile) reads them from TOML.
#[derive(Default)]
pub struct Limits {
    entries: Vec<(Limit, Box<dyn KeyExtractor>, Option<Metered>)>,
    allowlist: Allowlist,
    denylist: Denylist,
}

impl Limits {
    /// No limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a limit, counted per key that `key` extracts.
    pub fn limit(mut self, limit: Limit, key: impl KeyExtractor) -> Self {
        self.entries.push((limit, Box::new(key), None));
        self
    }

    /// Adds a limit with a boxed extractor.
    pub(crate) fn push(&mut self, limit: Limit, key: Box<dyn KeyExtractor>) {
        self.entries.push((limit, key, None));
    }

    /// Adds a metered limit (see [`RateLimitLayerBuilder::metered`](crate::RateLimitLayerBuilder::metered)).
    pub fn push_metered(&mut self, limit: Limit, key: Box<dyn KeyExtractor>, metered: Metered) {
        self.entries.push((limit, key, Some(metered)));
    }

    /// Adds every limit of `other`, and its allowlist and denylist.
    pub(crate) fn extend(&mut self, other: Limits) {
        self.entries.extend(other.entries);
        self.add_allowlist(other.allowlist);
        self.add_denylist(other.denylist);
    }

    /// These limits with `allowlist`'s rules added to their allowlist (see [`Allowlist`]).
    pub fn with_allowlist(mut self, allowlist: Allowlist) -> Self {
        self.add_allowlist(allowlist);
        self
    }

    /// Adds `allowlist`'s rules to these limits' allowlist.
    pub(crate) fn add_allowlist(&mut self, allowlist: Allowlist) {
        let own = std::mem::take(&mut self.allowlist);
        self.allowlist = own.extend(allowlist);
    }

    /// The requests these limits admit without counting.
    pub fn allowlist(&self) -> &Allowlist {
        &self.allowlist
    }

    /// These limits with `denylist`'s rules added to their denylist (see [`Denylist`]).
    pub fn with_denylist(mut self, denylist: Denylist) -> Self {
        self.add_denylist(denylist);
        self
    }

    /// Adds `denylist`'s rules to these limits' denylist.
    pub(crate) fn add_denylist(&mut self, denylist: Denylist) {
        let own = std::mem::take(&mut self.denylist);
        self.denylist = own.extend(denylist);
    }

    /// The requests these limits refuse outright.
    pub fn denylist(&self) -> &Denylist {
        &self.denylist
    }

    /// The limit named `name` and the extractor of its keys.
    pub fn get(&self, name: &str) -> Option<(&Limit, &dyn KeyExtractor)> {
        self.entries
            .iter()
            .find(|(l, _, _)| l.name() == name)
            .map(|(l, k, _)| (l, &**k))
    }

    /// The limits with the extractors of their keys, in order.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = (&Limit, &dyn KeyExtractor)> + '_ {
        self.entries.iter().map(|(l, k, _)| (l, &**k))
    }

    /// How many limits.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The limits, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Limit> + '_ {
        self.entries.iter().map(|(l, _, _)| l)
    }

    /// What a layer asks of its whole set of limits.
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        let limits = &self.entries;
        if limits.is_empty() {
            return Err(ConfigError::NoLimits);
        }
        if limits.len() > MAX_CHECKS {
            return Err(ConfigError::TooManyLimits);
        }
        if let Some((limit, _, _)) = limits.iter().find(|(l, _, _)| l.name() == CANARY_LIMIT) {
            return Err(ConfigError::ReservedName(limit.name().to_owned()));
        }
        for (i, (limit, _, metered)) in limits.iter().enumerate() {
            if limits[..i].iter().any(|(l, _, _)| l.name() == limit.name()) {
                return Err(ConfigError::DuplicateName(limit.name().to_owned()));
            }
            let settles = metered.as_ref().is_some_and(Metered::settles);
            if settles && limit.lease().is_some() && limit.algorithm() == Algorithm::Gcra {
                return Err(ConfigError::LeaseWithSettle(limit.name().to_owned()));
            }
            if metered.as_ref().is_some_and(|m| m.learns) && limit.algorithm() != Algorithm::Gcra {
                return Err(ConfigError::PauseUnsupported {
                    limit: limit.name().to_owned(),
                    algorithm: limit.algorithm(),
                });
            }
        }
        // A window counts a request when it is checked; a delayed one runs later, perhaps in
        // the next window, beside that window's own.
        let enforced = || limits.iter().map(|(l, _, _)| l).filter(|l| !l.is_shadow());
        if let Some(delayed) = enforced().find(|l| l.delay_micros() > 0) {
            if let Some(window) = enforced().find(|l| {
                matches!(
                    l.algorithm(),
                    Algorithm::FixedWindow | Algorithm::SlidingLog
                )
            }) {
                return Err(ConfigError::DelayWithWindow {
                    delayed: delayed.name().to_owned(),
                    window: window.name().to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Checks the whole set and prepares it for requests.
    ///
    /// With `reports`, every enforced limit keeps its key, to count the request's refusal.
    /// With `adaptive` (the layer has an adaptive limit), a set without limits is one.
    pub(crate) fn compile(self, reports: bool, adaptive: bool) -> Result<LimitSet, ConfigError> {
        match self.check() {
            Err(ConfigError::NoLimits) if adaptive => {}
            checked => checked?,
        }
        let allowlist = (!self.allowlist.is_empty()).then_some(self.allowlist);
        let denylist = (!self.denylist.is_empty()).then_some(self.denylist);
        let limits = self.entries;
        let policy = fields::policy_value(
            limits
                .iter()
                .map(|(l, _, _)| (l.name(), l.quota(), l.algorithm() == Algorithm::Concurrency)),
        );
        let has_slots = limits
            .iter()
            .any(|(l, _, _)| l.algorithm() == Algorithm::Concurrency);
        let names = limits
            .iter()
            .map(|(l, _, _)| l.name())
            .collect::<Vec<_>>()
            .join(",")
            .into();
        let plans = limits.iter().any(|(l, _, _)| l.plans().len() > 0);
        let settles = limits
            .iter()
            .any(|(_, _, m)| m.as_ref().is_some_and(Metered::settles));
        // A request that waits gives its units back if it is dropped: every limit keeps its
        // key for that refund.
        let delays = limits.iter().any(|(l, _, _)| l.delay_micros() > 0);
        // A request that waits in a line is checked again whole: every limit keeps its key.
        let queues = limits.iter().any(|(l, _, _)| l.queue_micros() > 0);
        let charged_by_handler = limits
            .iter()
            .any(|(_, _, m)| m.as_ref().is_some_and(|m| m.by_handler));
        let straight = limits.len() == 1
            && limits[0].2.is_none()
            && allowlist.is_none()
            && denylist.is_none()
            && !plans
            && !has_slots
            && !delays
            && !queues;
        let limits = limits
            .into_iter()
            .map(|(limit, key, metered)| SetLimit {
                refused: Handle::default(),
                keeps_key: delays
                    || queues
                    || (reports && !limit.is_shadow())
                    || keeps_key(&limit, metered.as_ref()),
                local: match limit.failure_policy() {
                    FailurePolicy::Fallback { replicas } => Some(limit.local_share(replicas)),
                    _ => None,
                },
                metrics: LimitMetrics::new(
                    Arc::clone(limit.name_arc()),
                    limit.algorithm() == Algorithm::Gcra,
                ),
                source: crate::key::source_for_people(&key.describe()).into(),
                limit,
                key,
                metered,
            })
            .collect();
        Ok(LimitSet {
            limits,
            allowlist,
            denylist,
            policy,
            names,
            plans,
            settles,
            charged_by_handler,
            has_slots,
            delays,
            queues,
            straight,
        })
    }
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One version of a layer's limits, checked whole.
pub(crate) struct LimitSet {
    pub(crate) limits: Box<[SetLimit]>,
    /// The requests admitted without counting; `None` when there is no rule.
    pub(crate) allowlist: Option<Allowlist>,
    /// The requests refused outright (unless allowlisted); `None` when there is no rule.
    pub(crate) denylist: Option<Denylist>,
    /// `RateLimit-Policy` of a request that gets every limit's default quota.
    pub(crate) policy: Option<HeaderValue>,
    /// The limits' names, comma-separated, for the check span.
    pub(crate) names: Box<str>,
    /// Whether any limit has plans (else the request's `Plan` is not looked up).
    pub(crate) plans: bool,
    /// Whether a limit settles after the response (see [`crate::cost`]).
    pub(crate) settles: bool,
    /// Whether a limit is charged by the handler: every admitted request then carries a
    /// [`Settle`](crate::cost::Settle) handle.
    pub(crate) charged_by_handler: bool,
    /// Whether any limit is a concurrency limit (its requests then draw a slot id).
    pub(crate) has_slots: bool,
    /// Whether any limit has a delay (its requests may then wait for their time).
    pub(crate) delays: bool,
    /// Whether any limit queues for its slots (a full key's requests may then wait).
    pub(crate) queues: bool,
    /// One limit, and nothing to look up, settle, hold, wait or queue for (most layers): a
    /// request's check, and its decision when the backend answers at once, take the straight
    /// line (`prepare.rs`, [`Shared::straight`](super::state::Shared)).
    pub(crate) straight: bool,
}

impl fmt::Debug for LimitSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.limits.iter().map(|e| &e.limit))
            .finish()
    }
}

/// One limit of a [`LimitSet`], with what the layer needs beside it.
pub(crate) struct SetLimit {
    pub(crate) limit: Limit,
    pub(crate) key: Box<dyn KeyExtractor>,
    /// Where the cost comes from and how it settles, for a metered limit.
    pub(crate) metered: Option<Metered>,
    /// The quota's local share, for [`FailurePolicy::Fallback`].
    pub(crate) local: Option<Limit>,
    pub(crate) metrics: LimitMetrics,
    /// Where the key comes from, in words (`header "x-shop-domain"`), for a missing key's
    /// refusal.
    pub(crate) source: Box<str>,
    /// Whether a request's key is needed after its check: to settle, to give a slot back, to
    /// ask the local fallback limiter, or to count its refusal (`layer/refused.rs`). Only then is it kept (owned) past the check.
    pub(crate) keeps_key: bool,
    /// Its handle on the summary of the keys it refused (`layer/refused.rs`).
    pub(crate) refused: Handle,
}

impl SetLimit {
    /// This limit's part of a decision.
    pub(crate) fn decision(
        &self,
        mut outcome: Outcome,
        source: Source,
        quota: u8,
    ) -> LimitDecision {
        let concurrent = self.limit.algorithm() == Algorithm::Concurrency;
        if let (
            true,
            Outcome::Denied {
                reason: reason @ DenyReason::OverLimit,
                ..
            },
        ) = (concurrent, &mut outcome)
        {
            *reason = DenyReason::InFlight;
        }
        let decision = LimitDecision::new(
            Arc::clone(self.limit.name_arc()),
            *self.limit.quota_at(usize::from(quota)),
            outcome,
            source,
            self.limit.is_shadow(),
        );
        if concurrent {
            decision.concurrent()
        } else {
            decision
        }
    }
}

/// Whether `limit`'s key is needed after the check (see [`SetLimit::keeps_key`]).
fn keeps_key(limit: &Limit, metered: Option<&Metered>) -> bool {
    limit.algorithm() == Algorithm::Concurrency
        || metered.is_some_and(Metered::settles)
        || matches!(limit.failure_policy(), FailurePolicy::Fallback { .. })
}
