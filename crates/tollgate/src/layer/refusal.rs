//! The layer's refusals: a request without a key or a valid cost, a denylisted one, and a
//! refused decision, answered by the default problem+json or gRPC response or the user's
//! responder.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use tollgate_core::Backend;

use super::limits::{Entry, LimitSet};
use super::respond::{policy_for, put_decision};
use super::state::Shared;
use crate::decision::{Decision, Outcome, Source};
use crate::fields::{self, Fields};
use crate::key::MissingKey;
use crate::metrics as obs;
use crate::rejection::{refusal_of, Rejection, RejectionKind};
use crate::{grpc, problem, refusal_cache};

impl<B: Backend> Shared<B> {
    /// The refusal of a request without `entry`'s key, under a limit that rejects it.
    pub(crate) fn refuse_keyless<T>(
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
            .grpc(grpc::is_grpc(req.headers())),
        )
    }

    /// The refusal of a request whose cost for `entry` is not a whole number of units.
    pub(crate) fn refuse_invalid_cost<T>(
        &self,
        entry: &Entry,
        req: &Request<T>,
        span: &tracing::Span,
    ) -> Response<Bytes> {
        entry.metrics.record_invalid_cost(span);
        self.refuse(
            &Rejection::new(RejectionKind::InvalidCost, entry.limit.name(), None, None)
                .grpc(grpc::is_grpc(req.headers())),
        )
    }

    /// The refusal of a request that a deny list matched before any check: every limit of
    /// `set` says `Denylisted` (and counts it), `403` with `Retry-After` only when the deny
    /// ends (`retry_after`; a static deny has no end).
    pub(crate) fn refuse_denylisted<T>(
        &self,
        set: &LimitSet,
        req: &Request<T>,
        span: &tracing::Span,
        retry_after: Option<Duration>,
    ) -> Response<Bytes> {
        let outcome = Outcome::Denylisted { retry_after };
        let decision: Decision = set
            .limits
            .iter()
            .map(|entry| entry.decision(outcome, Source::Backend, 0))
            .collect();
        for (entry, d) in set.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, false, 0);
        }
        obs::record_span(span, &decision);
        self.refuse_decision(decision, req, set)
    }

    /// The refusal of a request that `decision` refused under `set`'s limits: it carries the
    /// decision and the rate-limit fields, which say when to come back (a deny has none: it
    /// says nothing of a quota).
    pub(crate) fn refuse_decision<T>(
        &self,
        decision: Decision,
        req: &Request<T>,
        set: &LimitSet,
    ) -> Response<Bytes> {
        let (kind, limit) = refusal_of(&decision)
            .unwrap_or((RejectionKind::TooManyRequests, set.limits[0].limit.name()));
        let rejection = Rejection::new(kind, limit, decision.retry_after(), Some(&decision))
            .grpc(grpc::is_grpc(req.headers()));
        let mut response = match kind {
            RejectionKind::Denylisted => self.refuse(&rejection),
            _ => self.refuse_with_fields(&rejection, &decision, set),
        };
        put_decision(&mut response, decision);
        response
    }

    fn refuse(&self, rejection: &Rejection<'_>) -> Response<Bytes> {
        let mut response = match (rejection.is_grpc(), &self.responder, &self.grpc_responder) {
            (false, Some(respond), _) | (true, _, Some(respond)) => respond(rejection),
            (false, None, _) => problem::default_response(rejection),
            (true, _, None) => grpc::default_response(rejection),
        };
        fields::write_retry_after(response.headers_mut(), rejection.retry_after());
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
        let fields = Fields::of_refusal(decision);
        let policy = policy_for(set, decision);
        let policy = policy.as_deref();
        if self.responder.is_none() {
            let reused = refusal_cache::reused_or_written(
                &self.last_refusal,
                rejection,
                &fields,
                policy,
                self.fields,
            );
            if let Some(response) = reused {
                return response;
            }
        }
        let mut response = self.refuse(rejection);
        fields::write_headers(response.headers_mut(), &fields, policy, self.fields);
        response
    }
}
