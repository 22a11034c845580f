//! One request's way through the layer: keys, the backend's answer, the decision, the
//! refusal or the admitted response's fields.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use tollgate_core::{
    Backend, BackendError, Check, FailurePolicy, MissingKeyPolicy, Receipt, Verdicts, MAX_CHECKS,
};

use super::settle::Item;
use super::{Decided, Entry, LimitSet, Plan, Prepared, Shared};
use crate::decision::{Decision, DenyReason, LimitDecision, Outcome, SkipReason, Source};
use crate::key::{Key, MissingKey, RequestView};
use crate::metrics as obs;
use crate::response::{self, Rejection, RejectionKind};

/// The key of the one bucket shared by keyless requests ([`MissingKeyPolicy::SharedBucket`]).
/// Extracted keys cannot take this value: IP keys start with a 4 or 6 byte, tenants are ASCII.
const SHARED_BUCKET: &[u8] = b"\xffshared-bucket";

impl<B: Backend> Shared<B> {
    /// Extracts every key and starts the backend call; or refuses a request without a key.
    pub(crate) fn prepare<T>(&self, req: &Request<T>) -> Prepared<B::Future> {
        // Only a subscriber that wants debug spans gets one (`names` is built once, when the
        // layer is). Otherwise the span is `none`: a disabled span still costs, on every
        // request, what `tracing`'s `log` compatibility does when no subscriber is set (its
        // fields formatted, each enter and exit checked against the `log` level).
        let set = self.set.load_full();
        let span = if tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "tollgate.check",
                limits = &*set.names,
                outcome = tracing::field::Empty,
                decision = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let view = RequestView::new(req);
        if let Some(allowlist) = &set.allowlist {
            if allowlist.matches(&view) {
                return Prepared::Admit(allowlisted(&set, &span));
            }
        }
        // The request's plan is looked up only when some limit has plans: its extension, or
        // what the layer's plan function makes of the request.
        let chosen;
        let plan_name = match (set.plans, req.extensions().get::<crate::Plan>()) {
            (false, _) => None,
            (true, Some(plan)) => Some(plan.as_str()),
            (true, None) => {
                chosen = self.plan_fn.as_ref().and_then(|f| f(&view));
                chosen.as_ref().map(crate::Plan::as_str)
            }
        };
        let slot = if set.has_slots {
            super::slots::next_id()
        } else {
            0
        };
        let mut n = 0;
        let mut limit_of = [0; MAX_CHECKS];
        let mut quota_of = [0u8; MAX_CHECKS];
        let mut cost = [0u32; MAX_CHECKS];
        // One limit (most layers): no arrays of keys and checks to fill and drop.
        let check = if let [entry] = &*set.limits {
            let key = match key_of(entry, &view) {
                Ok(key) => key,
                Err(missing) => {
                    return Prepared::Refuse(self.refuse_keyless(entry, missing, req, &span))
                }
            };
            match &key {
                Some(key) => {
                    let check =
                        match self.check_of(entry, key, plan_name, slot, (&view, req, &span)) {
                            Ok(check) => check,
                            Err(refusal) => return Prepared::Refuse(*refusal),
                        };
                    (quota_of[0], cost[0], n) = (check.1, check.0.cost, 1);
                    span.in_scope(|| self.backend.check(&[check.0]))
                }
                None => span.in_scope(|| self.backend.check(&[])),
            }
        } else {
            let mut keys: [Option<Key<'_>>; MAX_CHECKS] = Default::default();
            for (i, entry) in set.limits.iter().enumerate() {
                match key_of(entry, &view) {
                    Ok(key) => keys[i] = key,
                    Err(missing) => {
                        return Prepared::Refuse(self.refuse_keyless(entry, missing, req, &span))
                    }
                }
            }
            let mut checks = [Check::new(&set.limits[0].limit, b""); MAX_CHECKS];
            for (i, (entry, key)) in set.limits.iter().zip(&keys).enumerate() {
                if let Some(key) = key {
                    let check =
                        match self.check_of(entry, key, plan_name, slot, (&view, req, &span)) {
                            Ok(check) => check,
                            Err(refusal) => return Prepared::Refuse(*refusal),
                        };
                    (quota_of[i], cost[i]) = (check.1, check.0.cost);
                    checks[n] = check.0;
                    limit_of[n] = i;
                    n += 1;
                }
            }
            span.in_scope(|| self.backend.check(&checks[..n]))
        };
        let plan = Plan {
            set,
            n,
            limit_of,
            quota_of,
            cost,
            slot,
            span,
        };
        Prepared::Check(check, plan)
    }

    /// The refusal of a request without `entry`'s key, under a limit that rejects it.
    fn refuse_keyless<T>(
        &self,
        entry: &Entry,
        missing: MissingKey,
        req: &Request<T>,
        span: &tracing::Span,
    ) -> Response<Bytes> {
        entry.metrics.record_missing_key(span);
        self.refuse(
            &Rejection::new(
                RejectionKind::MissingKey(missing),
                entry.limit.name(),
                None,
                None,
            )
            .with_source(&entry.source)
            .grpc(crate::grpc::is_grpc(req.headers())),
        )
    }

    /// `entry`'s check of `key` under the request's plan (and the index of its quota), with
    /// the request's cost for a metered limit; or the refusal of a cost that is not one.
    fn check_of<'k, T>(
        &self,
        entry: &'k Entry,
        key: &'k Key<'_>,
        plan_name: Option<&str>,
        slot: u128,
        (view, req, span): (&RequestView<'_>, &Request<T>, &tracing::Span),
    ) -> Result<(Check<'k>, u8), Box<Response<Bytes>>> {
        let (index, quota) = entry.limit.quota_of(plan_name);
        let mut check = Check::new(&entry.limit, key.as_bytes())
            .with_quota(*quota)
            .with_slot(slot);
        if let Some(of) = entry.metered.as_ref().and_then(|m| m.cost.as_ref()) {
            match of(view) {
                Ok(units) => check = check.with_cost(units),
                Err(_) => {
                    entry.metrics.record_invalid_cost(span);
                    return Err(Box::new(
                        self.refuse(
                            &Rejection::new(
                                RejectionKind::InvalidCost,
                                entry.limit.name(),
                                None,
                                None,
                            )
                            .grpc(crate::grpc::is_grpc(req.headers())),
                        ),
                    ));
                }
            }
        }
        // A limit has at most `MAX_PLANS` plans.
        Ok((check, u8::try_from(index).unwrap_or(0)))
    }

    /// Turns the backend's answer into a decision, or a refusal.
    ///
    /// The answer is borrowed: the verdicts of a batch are a few hundred bytes, and this runs
    /// on every request.
    pub(crate) fn decide<T>(
        &self,
        result: &Result<Verdicts, BackendError>,
        req: &Request<T>,
        plan: &Plan,
    ) -> Decided {
        // Warnings about bypasses and capacity are logged inside the request's span.
        let _entered = plan.span.enter();
        // Where each limit's units went, in the layer's order, for a settle.
        let mut receipts = [Receipt::default(); MAX_CHECKS];
        let decision = match result {
            Ok(verdicts) if verdicts.len() == plan.n => {
                if plan.set.settles {
                    for (j, &i) in plan.limit_of[..plan.n].iter().enumerate() {
                        receipts[i] = verdicts.receipt(j);
                    }
                }
                // One limit, checked (most layers): its verdict is the decision.
                if let ([entry], [verdict]) = (&*plan.set.limits, &verdicts[..]) {
                    let outcome = Outcome::from_verdict(verdict);
                    Decision::one(
                        entry
                            .decision(outcome, Source::Backend, plan.quota_of[0])
                            .leased(verdicts.from_lease(0)),
                    )
                } else {
                    decision_of(verdicts, plan)
                }
            }
            Ok(verdicts) => {
                let error = BackendError::new(
                    tollgate_core::BackendErrorKind::Protocol,
                    format!("{} verdicts for {} checks", verdicts.len(), plan.n),
                );
                self.decide_failure(&error, req, plan, &mut receipts)
            }
            Err(error) => self.decide_failure(error, req, plan, &mut receipts),
        };
        let admitted = decision.is_admitted();
        for (entry, d) in plan.set.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted);
        }
        obs::record_span(&plan.span, &decision);
        if admitted {
            let owed = if plan.set.settles {
                self.owed(&decision, req, plan, &receipts)
            } else {
                None
            };
            let slots = plan.set.has_slots.then(|| Arc::clone(&plan.set));
            return Decided::Admit(decision, owed, slots);
        }
        let (kind, limit) = response::refusal_of(&decision).unwrap_or((
            RejectionKind::TooManyRequests,
            plan.set.limits[0].limit.name(),
        ));
        let rejection = Rejection::new(kind, limit, decision.retry_after(), Some(&decision))
            .grpc(crate::grpc::is_grpc(req.headers()));
        // Refusals always carry the rate-limit fields: they say when to come back.
        let mut response = self.refuse_with_fields(&rejection, &decision, &plan.set);
        put_decision(&mut response, decision);
        Decided::Refuse(response)
    }

    /// The decision when the backend failed: each checked limit's failure policy.
    fn decide_failure<T>(
        &self,
        error: &BackendError,
        req: &Request<T>,
        plan: &Plan,
        receipts: &mut [Receipt; MAX_CHECKS],
    ) -> Decision {
        let mut outcomes = [(
            Outcome::Skipped {
                reason: SkipReason::MissingKey,
            },
            Source::Backend,
        ); MAX_CHECKS];
        self.on_failure(error, req, plan, &mut outcomes, receipts);
        // A refused request went nowhere: a fail-open limit beside the one that refused it
        // bypassed nothing, and must not say it did.
        let refused = plan
            .set
            .limits
            .iter()
            .zip(&outcomes)
            .any(|(entry, (outcome, _))| !entry.limit.is_shadow() && !outcome.admits());
        if refused {
            for (outcome, _) in &mut outcomes {
                if let Outcome::Bypassed { .. } = outcome {
                    *outcome = Outcome::Skipped {
                        reason: SkipReason::NotChecked,
                    };
                }
            }
        }
        plan.set
            .limits
            .iter()
            .zip(outcomes)
            .enumerate()
            .map(|(i, (entry, (outcome, source)))| {
                entry.decision(outcome, source, plan.quota_of[i])
            })
            .collect()
    }

    /// Applies each checked limit's failure policy.
    fn on_failure<T>(
        &self,
        error: &BackendError,
        req: &Request<T>,
        plan: &Plan,
        outcomes: &mut [(Outcome, Source); MAX_CHECKS],
        receipts: &mut [Receipt; MAX_CHECKS],
    ) {
        let limits = &plan.set.limits;
        let mut closed = false;
        let mut fallback = [false; MAX_CHECKS];
        for &i in &plan.limit_of[..plan.n] {
            outcomes[i].0 = match limits[i].limit.failure_policy() {
                FailurePolicy::FailClosed => {
                    // A shadow limit refuses nothing, so it must not switch off the fallback
                    // of the enforced limits beside it either.
                    closed |= !limits[i].limit.is_shadow();
                    Outcome::Denied {
                        retry_after: Some(self.unavailable_retry_after),
                        remaining: 0,
                        reset: Duration::ZERO,
                        reason: DenyReason::BackendUnavailable,
                    }
                }
                FailurePolicy::Fallback { .. } => {
                    fallback[i] = true;
                    Outcome::Skipped {
                        reason: SkipReason::NotChecked,
                    }
                }
                _ => Outcome::Bypassed {
                    reason: error.kind().into(),
                },
            };
        }
        if closed || !fallback.contains(&true) {
            return;
        }
        // The keys were borrowed from the request; extracting them again is cheaper than
        // copying them on every request for the rare failure.
        let view = RequestView::new(req);
        let mut keys: [Option<Key<'_>>; MAX_CHECKS] = Default::default();
        for (i, entry) in limits.iter().enumerate() {
            if fallback[i] {
                keys[i] = key_of(entry, &view).ok().flatten();
            }
        }
        let mut checks = [Check::new(&limits[0].limit, b""); MAX_CHECKS];
        let mut index = [0usize; MAX_CHECKS];
        let mut n = 0;
        for (i, (entry, key)) in limits.iter().zip(&keys).enumerate() {
            if let (Some(local), Some(key)) = (&entry.local, key) {
                let quota = *local.quota_at(usize::from(plan.quota_of[i]));
                checks[n] = Check::new(local, key.as_bytes())
                    .with_quota(quota)
                    .with_slot(plan.slot);
                if entry.metered.as_ref().is_some_and(|m| m.cost.is_some()) {
                    checks[n] = checks[n].with_cost(plan.cost[i]);
                }
                index[n] = i;
                n += 1;
            }
        }
        if let Ok(verdicts) = self.fallback.check_now(&checks[..n]) {
            for (j, verdict) in verdicts.iter().enumerate() {
                outcomes[index[j]] = (Outcome::from_verdict(verdict), Source::Fallback);
                receipts[index[j]] = verdicts.receipt(j);
            }
        }
    }

    /// What an admitted request owes the metered limits that settle: the units each took,
    /// where, and under which key (extracted again: the request's keys were borrowed).
    fn owed<T>(
        &self,
        decision: &Decision,
        req: &Request<T>,
        plan: &Plan,
        receipts: &[Receipt; MAX_CHECKS],
    ) -> Option<(Vec<Item>, Arc<LimitSet>)> {
        let view = RequestView::new(req);
        let mut items = Vec::new();
        for (i, (entry, d)) in plan.set.limits.iter().zip(decision.limits()).enumerate() {
            let Some(metered) = entry.metered.as_ref().filter(|m| m.settles()) else {
                continue;
            };
            if !matches!(d.outcome(), Outcome::Allowed { .. }) {
                continue;
            }
            let Ok(Some(key)) = key_of(entry, &view) else {
                continue;
            };
            let fallback = d.source() == Source::Fallback;
            // The quota the check was made under: the request's plan's, in the limiter that
            // counted it.
            let counted_by = match (&entry.local, fallback) {
                (Some(local), true) => local,
                _ => &entry.limit,
            };
            items.push(Item {
                entry: i,
                key: key.as_bytes().into(),
                reserved: plan.cost[i],
                receipt: receipts[i],
                quota: *counted_by.quota_at(usize::from(plan.quota_of[i])),
                fallback,
                by_handler: metered.by_handler,
                on_drop: metered.on_drop,
                counted: true,
            });
        }
        // A limit charged by the handler gives every admitted request a `Settle` handle, even
        // one whose reservation nothing counts (a bypass, a missing key): the handler that
        // takes it must find it.
        (plan.set.charged_by_handler || !items.is_empty()).then(|| (items, Arc::clone(&plan.set)))
    }

    fn refuse(&self, rejection: &Rejection<'_>) -> Response<Bytes> {
        let mut response = match (rejection.is_grpc(), &self.responder, &self.grpc_responder) {
            (false, Some(respond), _) | (true, _, Some(respond)) => respond(rejection),
            (false, None, _) => response::default_response(rejection),
            (true, _, None) => crate::grpc::default_response(rejection),
        };
        response::write_retry_after(response.headers_mut(), rejection.retry_after());
        response
    }

    /// The refusal of a request that `decision` refused under `set`'s limits, with its
    /// rate-limit fields: the default `429` reuses the last one's body and fields when it
    /// would be written the same (the refusal path runs most in a flood).
    fn refuse_with_fields(
        &self,
        rejection: &Rejection<'_>,
        decision: &Decision,
        set: &LimitSet,
    ) -> Response<Bytes> {
        let fields = response::Fields::of_refusal(decision);
        let policy = policy_for(set, decision);
        let policy = policy.as_deref();
        if self.responder.is_none() {
            let reused =
                response::refusal(&self.last_refusal, rejection, &fields, policy, self.headers);
            if let Some(response) = reused {
                return response;
            }
        }
        let mut response = self.refuse(rejection);
        response::write_headers(response.headers_mut(), &fields, policy, self.headers);
        response
    }

    /// Whether [`finish`](Self::finish) adds anything to the response of a request admitted
    /// with `decision`: the decision, or the rate-limit fields. An allowlisted request's
    /// response has no fields: nothing was counted.
    pub(crate) fn adds_to_response(&self, decision: &Decision) -> bool {
        self.headers.decision_on_allowed || self.fields_on_allowed(decision)
    }

    fn fields_on_allowed(&self, decision: &Decision) -> bool {
        self.headers.on_allowed && !decision.is_allowlisted()
    }

    /// Adds the decision and (if configured) the rate-limit fields to an admitted response.
    pub(crate) fn finish<T>(&self, response: &mut Response<T>, decision: Decision) {
        if self.fields_on_allowed(&decision) {
            let set = self.set.load();
            let policy = policy_for(&set, &decision);
            let fields = response::Fields::of(&decision);
            response::write_headers(
                response.headers_mut(),
                &fields,
                policy.as_deref(),
                self.headers,
            );
        }
        if self.headers.decision_on_allowed {
            put_decision(response, decision);
        }
    }
}

/// Puts `decision` in the response's extensions. Under this layer, another one decided too (it
/// refused, or admitted): the response carries both layers' limits, this one's first, as its
/// fields do.
fn put_decision<T>(response: &mut Response<T>, decision: Decision) {
    if let Some(inner) = response.extensions_mut().insert(decision) {
        if let Some(mine) = response.extensions_mut().remove::<Decision>() {
            response.extensions_mut().insert(mine.then(&inner));
        }
    }
}

/// The `RateLimit-Policy` value of the quotas `decision` got: the one built with `set`'s limits
/// when they are every limit's default (always, for limits without plans), else built for it.
fn policy_for<'s>(set: &'s LimitSet, decision: &Decision) -> Option<Cow<'s, HeaderValue>> {
    let defaults = set.limits.len() == decision.limits().len()
        && set
            .limits
            .iter()
            .zip(decision.limits())
            .all(|(e, d)| e.limit.name() == d.name() && e.limit.quota() == d.quota());
    if defaults {
        return set.policy.as_ref().map(Cow::Borrowed);
    }
    response::policy_value(
        decision
            .limits()
            .iter()
            .map(|d| (d.name(), d.quota(), d.is_concurrency())),
    )
    .map(Cow::Owned)
}

impl Entry {
    /// This limit's part of a decision.
    fn decision(&self, mut outcome: Outcome, source: Source, quota: u8) -> LimitDecision {
        let concurrent = self.limit.algorithm() == tollgate_core::Algorithm::Concurrency;
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

/// The decision of every verdict: each limit's outcome is its verdict, or a skip for a
/// limit that had no key, in the layer's order.
fn decision_of(verdicts: &Verdicts, plan: &Plan) -> Decision {
    let mut checked = plan.limit_of[..plan.n].iter().zip(verdicts.iter());
    let mut next = checked.next();
    let mut j = 0;
    plan.set
        .limits
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let (outcome, leased) = match next {
                Some((&at, verdict)) if at == i => {
                    next = checked.next();
                    j += 1;
                    (Outcome::from_verdict(verdict), verdicts.from_lease(j - 1))
                }
                _ => {
                    let reason = SkipReason::MissingKey;
                    (Outcome::Skipped { reason }, false)
                }
            };
            entry
                .decision(outcome, Source::Backend, plan.quota_of[i])
                .leased(leased)
        })
        .collect()
}

/// The decision of a request that `set`'s allowlist matched: every limit `Allowlisted`.
fn allowlisted(set: &LimitSet, span: &tracing::Span) -> Decision {
    let decision: Decision = set
        .limits
        .iter()
        .map(|entry| entry.decision(Outcome::Allowlisted, Source::Backend, 0))
        .collect();
    for (entry, d) in set.limits.iter().zip(decision.limits()) {
        entry.metrics.record(d, true);
    }
    obs::record_span(span, &decision);
    decision
}

pub(super) fn key_of<'r>(
    entry: &Entry,
    view: &RequestView<'r>,
) -> Result<Option<Key<'r>>, MissingKey> {
    match entry.key.extract(view) {
        Ok(key) => Ok(Some(key)),
        Err(missing) => match entry.limit.missing_key_policy() {
            // A shadow limit never refuses a request, not even one without its key.
            _ if entry.limit.is_shadow() => Ok(None),
            MissingKeyPolicy::Skip => Ok(None),
            MissingKeyPolicy::SharedBucket => Key::borrowed(SHARED_BUCKET).map(Some),
            _ => Err(missing),
        },
    }
}
