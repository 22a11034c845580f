//! The layer's refusals: a request without a key or a valid cost, a denylisted one, and a
//! refused decision, answered by the default problem+json or gRPC response or the user's
//! responder.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};

use super::limits::{LimitSet, SetLimit};
use super::respond::{policy_for, put_decision, Responses};
use super::state::Shared;
use crate::adaptive::{AdaptiveDecision, Guard};
use crate::decision::{Decision, Outcome, SkipReason, Source};
use crate::fields::{self, Fields};
use crate::key::MissingKey;
use crate::rejection::{refusal_of, Rejection, RejectionKind};
use crate::{grpc, problem, refusal_cache};

impl Responses {
    /// The refusal of a request without `entry`'s key, under a limit that rejects it.
    pub(crate) fn refuse_keyless<T>(
        &self,
        entry: &SetLimit,
        missing: MissingKey,
        req: &Request<T>,
        span: &tracing::Span,
    ) -> Response<Bytes> {
        entry.metrics.record_missing_key(span);
        crate::span::record_refused(span, "missing_key");
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
        entry: &SetLimit,
        req: &Request<T>,
        span: &tracing::Span,
    ) -> Response<Bytes> {
        entry.metrics.record_invalid_cost(span);
        crate::span::record_refused(span, "invalid_cost");
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
        let decision = refused_at_all(set, Outcome::Denylisted { retry_after });
        crate::span::record(span, &decision, None);
        self.refuse_decision(decision, req, set)
    }

    /// The refusal of a request that the adaptive limit `guard` shed (`part`): `503` with its
    /// `Retry-After` and no rate-limit fields (it says nothing of a quota). No other limit of
    /// `set` was asked: each says `Skipped` (`NotChecked`), and counts it so.
    pub(crate) fn refuse_shed<T>(
        &self,
        set: &LimitSet,
        guard: Option<&Guard>,
        part: AdaptiveDecision,
        req: &Request<T>,
    ) -> Response<Bytes> {
        let skipped = Outcome::Skipped {
            reason: SkipReason::NotChecked,
        };
        let decision = refused_at_all(set, skipped).with_adaptive(part);
        let (name, after) = match guard {
            Some(guard) => (guard.name(), guard.retry_after()),
            None => ("adaptive", Duration::from_secs(1)),
        };
        let rejection = Rejection::new(RejectionKind::Shed, name, Some(after), Some(&decision))
            .grpc(grpc::is_grpc(req.headers()));
        let mut response = self.refuse(&rejection);
        put_decision(&mut response, decision);
        response
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
        let (kind, limit) = refusal_of(&decision).unwrap_or_else(|| {
            let first = set.limits.first().map_or("", |e| e.limit.name());
            (RejectionKind::TooManyRequests, first)
        });
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

/// The refusal of a request that `shared`'s adaptive limit shed (`part`), under its limits now.
pub(crate) fn shed<B, T>(
    shared: &Shared<B>,
    part: AdaptiveDecision,
    req: &Request<T>,
) -> Response<Bytes> {
    let set = shared.set.load();
    shared
        .respond
        .refuse_shed(&set, shared.adaptive.as_ref(), part, req)
}

/// The decision of a request refused before any check: `outcome` at every limit of `set`,
/// counted as a refused request's.
fn refused_at_all(set: &LimitSet, outcome: Outcome) -> Decision {
    let decision: Decision = set
        .limits
        .iter()
        .map(|entry| entry.decision(outcome, Source::Backend, 0))
        .collect();
    for (entry, d) in set.limits.iter().zip(decision.limits()) {
        entry.metrics.record(d, false, 0);
    }
    decision
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use http::header::{CONTENT_TYPE, RETRY_AFTER};
    use http::StatusCode;
    use tollgate_engine::{Limit, Quota};

    use super::*;
    use crate::decision::DenyReason;
    use crate::key::{ClientIp, Global};
    use crate::RateLimitLayer;

    fn layer() -> RateLimitLayer {
        RateLimitLayer::builder()
            .limit(
                Limit::gcra("per-ip", Quota::per_minute(5).unwrap()).unwrap(),
                ClientIp::peer(),
            )
            .limit(
                Limit::gcra("everyone", Quota::per_minute(50).unwrap()).unwrap(),
                Global,
            )
            .build()
            .unwrap()
    }

    fn body(response: &Response<Bytes>) -> &str {
        std::str::from_utf8(response.body()).unwrap()
    }

    /// A deny that ends (a deny made at run time) sends `Retry-After`, rounded up; one
    /// without an end sends none.
    #[test]
    fn a_deny_sends_retry_after_only_when_it_ends() {
        let layer = layer();
        let set = layer.shared.set.load_full();
        let req = Request::new(());
        let span = tracing::Span::none();
        let after = Some(Duration::from_millis(89_100));
        let response = layer
            .shared
            .respond
            .refuse_denylisted(&set, &req, &span, after);
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        assert_eq!(response.headers()[RETRY_AFTER], "90");
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        assert!(body(&response)
            .ends_with(r#""detail":"The request is refused by a deny list; retry in 90 s."}"#));
        let decision = response.extensions().get::<Decision>().unwrap();
        assert_eq!(decision.retry_after(), after);
        assert_eq!(decision.limits().len(), 2);

        let response = layer
            .shared
            .respond
            .refuse_denylisted(&set, &req, &span, None);
        assert_eq!(response.status(), StatusCode::FORBIDDEN);
        assert!(!response.headers().contains_key(RETRY_AFTER));
        assert_eq!(response.headers().len(), 1, "{:?}", response.headers());
    }

    /// A decision that one limit refuses by a deny (as a backend's deny would) and another
    /// for its quota is refused as a deny: 403, the deny's end, no rate-limit fields.
    #[test]
    fn a_deny_in_a_decision_comes_before_a_used_up_quota() {
        let layer = layer();
        let set = layer.shared.set.load_full();
        let denied = Outcome::Denied {
            retry_after: Some(Duration::from_secs(5)),
            remaining: 0,
            reset: Duration::from_secs(60),
            reason: DenyReason::OverLimit,
        };
        let deny = |retry_after| Outcome::Denylisted { retry_after };
        let cases = [
            (deny(Some(Duration::from_secs(600))), Some("600")),
            // No end: waiting for the other limit would not help.
            (deny(None), None),
        ];
        for (outcome, retry_after) in cases {
            let decision: Decision = [
                set.limits[0].decision(denied, Source::Backend, 0),
                set.limits[1].decision(outcome, Source::Backend, 0),
            ]
            .into_iter()
            .collect();
            let response = layer
                .shared
                .respond
                .refuse_decision(decision, &Request::new(()), &set);
            assert_eq!(response.status(), StatusCode::FORBIDDEN, "{outcome:?}");
            assert_eq!(
                response
                    .headers()
                    .get(RETRY_AFTER)
                    .map(|v| v.to_str().unwrap()),
                retry_after
            );
            assert!(!response.headers().contains_key("ratelimit"));
            assert!(!response.headers().contains_key("ratelimit-policy"));
        }
    }
}
