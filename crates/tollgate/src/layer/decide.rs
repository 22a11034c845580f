//! One request's way through the layer: keys, the backend's answer, the decision, the
//! refusal or the admitted response's fields.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::{
    Backend, BackendError, Check, FailurePolicy, MissingKeyPolicy, Verdicts, MAX_CHECKS,
};

use super::{Decided, Entry, Plan, Prepared, Shared};
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
        let span = if tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "tollgate.check",
                limits = &*self.names,
                outcome = tracing::field::Empty,
                decision = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let view = RequestView::new(req);
        let mut keys: [Option<Key<'_>>; MAX_CHECKS] = Default::default();
        let mut plan = Plan {
            n: 0,
            limit_of: [0; MAX_CHECKS],
            skipped: [false; MAX_CHECKS],
            slot: if self.has_slots {
                super::slots::next_id()
            } else {
                0
            },
            span,
        };
        for (i, entry) in self.limits.iter().enumerate() {
            match key_of(entry, &view) {
                Ok(Some(key)) => keys[i] = Some(key),
                Ok(None) => plan.skipped[i] = true,
                Err(missing) => {
                    entry.metrics.record_missing_key(&plan.span);
                    return Prepared::Refuse(
                        self.refuse(
                            &Rejection::new(
                                RejectionKind::MissingKey(missing),
                                entry.limit.name(),
                                None,
                                None,
                            )
                            .grpc(crate::grpc::is_grpc(req.headers())),
                        ),
                    );
                }
            }
        }
        let mut checks = [Check::new(&self.limits[0].limit, b""); MAX_CHECKS];
        for (i, (entry, key)) in self.limits.iter().zip(&keys).enumerate() {
            if let Some(key) = key {
                checks[plan.n] = Check::new(&entry.limit, key.as_bytes()).with_slot(plan.slot);
                plan.limit_of[plan.n] = i;
                plan.n += 1;
            }
        }
        let check = plan.span.in_scope(|| self.backend.check(&checks[..plan.n]));
        Prepared::Check(check, plan)
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
        let decision = match result {
            Ok(verdicts) if verdicts.len() == plan.n => {
                // Every verdict came back: each limit's outcome is its verdict, or a skip for
                // a limit that had no key, in the layer's order.
                let mut checked = plan.limit_of[..plan.n].iter().zip(verdicts.iter());
                let mut next = checked.next();
                self.limits
                    .iter()
                    .enumerate()
                    .map(|(i, entry)| {
                        let outcome = match next {
                            Some((&at, verdict)) if at == i => {
                                next = checked.next();
                                Outcome::from_verdict(verdict)
                            }
                            _ => Outcome::Skipped {
                                reason: SkipReason::MissingKey,
                            },
                        };
                        entry.decision(outcome, Source::Backend)
                    })
                    .collect()
            }
            Ok(verdicts) => {
                let error = BackendError::new(
                    tollgate_core::BackendErrorKind::Protocol,
                    format!("{} verdicts for {} checks", verdicts.len(), plan.n),
                );
                self.decide_failure(&error, req, plan)
            }
            Err(error) => self.decide_failure(error, req, plan),
        };
        let admitted = decision.is_admitted();
        for (entry, d) in self.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted);
        }
        obs::record_span(&plan.span, &decision);
        if admitted {
            return Decided::Admit(decision);
        }
        let (kind, limit) = response::refusal_of(&decision)
            .unwrap_or((RejectionKind::TooManyRequests, self.limits[0].limit.name()));
        let mut response = self.refuse(
            &Rejection::new(kind, limit, decision.retry_after(), Some(&decision))
                .grpc(crate::grpc::is_grpc(req.headers())),
        );
        // Refusals always carry the rate-limit fields: they say when to come back.
        self.stamp(&mut response, decision, true);
        Decided::Refuse(response)
    }

    /// The decision when the backend failed: each checked limit's failure policy.
    fn decide_failure<T>(&self, error: &BackendError, req: &Request<T>, plan: &Plan) -> Decision {
        let mut outcomes = [(
            Outcome::Skipped {
                reason: SkipReason::MissingKey,
            },
            Source::Backend,
        ); MAX_CHECKS];
        self.on_failure(error, req, plan, &mut outcomes);
        // A refused request went nowhere: a fail-open limit beside the one that refused it
        // bypassed nothing, and must not say it did.
        let refused = self
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
        self.limits
            .iter()
            .zip(outcomes)
            .map(|(entry, (outcome, source))| entry.decision(outcome, source))
            .collect()
    }

    /// Applies each checked limit's failure policy.
    fn on_failure<T>(
        &self,
        error: &BackendError,
        req: &Request<T>,
        plan: &Plan,
        outcomes: &mut [(Outcome, Source); MAX_CHECKS],
    ) {
        let mut closed = false;
        let mut fallback = [false; MAX_CHECKS];
        for &i in &plan.limit_of[..plan.n] {
            outcomes[i].0 = match self.limits[i].limit.failure_policy() {
                FailurePolicy::FailClosed => {
                    // A shadow limit refuses nothing, so it must not switch off the fallback
                    // of the enforced limits beside it either.
                    closed |= !self.limits[i].limit.is_shadow();
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
        for (i, entry) in self.limits.iter().enumerate() {
            if fallback[i] {
                keys[i] = key_of(entry, &view).ok().flatten();
            }
        }
        let mut checks = [Check::new(&self.limits[0].limit, b""); MAX_CHECKS];
        let mut index = [0usize; MAX_CHECKS];
        let mut n = 0;
        for (i, (entry, key)) in self.limits.iter().zip(&keys).enumerate() {
            if let (Some(local), Some(key)) = (&entry.local, key) {
                checks[n] = Check::new(local, key.as_bytes()).with_slot(plan.slot);
                index[n] = i;
                n += 1;
            }
        }
        if let Ok(verdicts) = self.fallback.check_now(&checks[..n]) {
            for (j, verdict) in verdicts.iter().enumerate() {
                outcomes[index[j]] = (Outcome::from_verdict(verdict), Source::Fallback);
            }
        }
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

    /// Adds the decision and (if configured) the rate-limit fields to an admitted response.
    pub(crate) fn finish<T>(&self, response: &mut Response<T>, decision: Decision) {
        self.stamp(response, decision, self.headers.on_allowed);
    }

    /// Puts the decision in the response's extensions, and the rate-limit fields if `fields`.
    fn stamp<T>(&self, response: &mut Response<T>, decision: Decision, fields: bool) {
        if fields {
            response::write_headers(
                response.headers_mut(),
                &decision,
                self.policy.as_ref(),
                self.headers,
            );
        }
        // Under this layer, another one decided too (it refused, or admitted): the response
        // carries both layers' limits, this one's first, as its fields do.
        if let Some(inner) = response.extensions_mut().insert(decision) {
            if let Some(mine) = response.extensions_mut().remove::<Decision>() {
                response.extensions_mut().insert(mine.then(&inner));
            }
        }
    }
}

impl Entry {
    /// This limit's part of a decision.
    fn decision(&self, mut outcome: Outcome, source: Source) -> LimitDecision {
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
            *self.limit.quota(),
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
