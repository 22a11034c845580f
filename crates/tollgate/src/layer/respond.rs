//! How the layer answers: what it adds to an admitted response (its [`Decision`] and the
//! rate-limit fields) and, in `refusal.rs`, how it writes a refusal. Neither depends on the
//! backend: [`Responses`] is the part of a layer's state that shapes responses.

use std::borrow::Cow;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderValue, Response};

use super::limits::LimitSet;
use crate::decision::Decision;
use crate::fields::{self, FieldOptions, Fields};
use crate::refusal_cache::{Last, WrittenRefusal};
use crate::rejection::Rejection;

/// A custom responder of refusals.
pub(crate) type Responder = Box<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;

/// How a layer's responses are shaped: admitted ones and refusals.
pub(crate) struct Responses {
    /// Which rate-limit header fields responses get.
    pub(crate) fields: FieldOptions,
    /// Whether admitted responses carry the [`Decision`] (refusals always do).
    pub(crate) decision_on_allowed: bool,
    pub(crate) responder: Option<Responder>,
    pub(crate) grpc_responder: Option<Responder>,
    /// The `Retry-After` of a fail-closed `503`.
    pub(crate) unavailable_retry_after: Duration,
    /// The last default `429`'s body and header fields, for the refusals of a flood.
    pub(crate) last_refusal: Last<WrittenRefusal>,
}

impl Default for Responses {
    fn default() -> Self {
        Self {
            fields: FieldOptions::default(),
            decision_on_allowed: true,
            responder: None,
            grpc_responder: None,
            unavailable_retry_after: Duration::from_secs(1),
            last_refusal: Last::default(),
        }
    }
}

impl Responses {
    /// Whether [`finish`](Self::finish) adds anything to the response of a request admitted
    /// with `decision`: the decision, or the rate-limit fields. An allowlisted request's
    /// response has no fields: nothing was counted.
    pub(crate) fn adds_to_response(&self, decision: &Decision) -> bool {
        self.decision_on_allowed || self.fields_on_allowed(decision)
    }

    fn fields_on_allowed(&self, decision: &Decision) -> bool {
        // A layer of an adaptive limit alone has no quota to tell.
        self.fields.on_allowed && !decision.is_allowlisted() && !decision.limits().is_empty()
    }

    /// Adds the decision and (if configured) the rate-limit fields, with the policy of the
    /// limits now in `set`, to an admitted response.
    pub(crate) fn finish<T>(
        &self,
        set: &ArcSwap<LimitSet>,
        response: &mut Response<T>,
        decision: Decision,
    ) {
        if self.fields_on_allowed(&decision) {
            let set = set.load();
            let policy = policy_for(&set, &decision);
            let fields = Fields::of(&decision);
            fields::write_headers(
                response.headers_mut(),
                &fields,
                policy.as_deref(),
                self.fields,
            );
        }
        if self.decision_on_allowed {
            put_decision(response, decision);
        }
    }
}

/// Puts `decision` in the response's extensions. Under this layer, another one decided too (it
/// refused, or admitted): the response carries both layers' limits, this one's first, as its
/// fields do.
pub(crate) fn put_decision<T>(response: &mut Response<T>, decision: Decision) {
    if let Some(inner) = response.extensions_mut().insert(decision) {
        if let Some(mine) = response.extensions_mut().remove::<Decision>() {
            response.extensions_mut().insert(mine.then(&inner));
        }
    }
}

/// The `RateLimit-Policy` value of the quotas `decision` got: the one built with `set`'s limits
/// when they are every limit's default (always, for limits without plans), else built for it.
pub(crate) fn policy_for<'s>(
    set: &'s LimitSet,
    decision: &Decision,
) -> Option<Cow<'s, HeaderValue>> {
    let defaults = set.limits.len() == decision.limits().len()
        && set.limits.iter().zip(decision.limits()).all(|(e, d)| {
            // The decision's name is the limit's own (shared) for a decision of `set`.
            e.limit.quota() == d.quota()
                && (std::ptr::eq(e.limit.name(), d.name()) || e.limit.name() == d.name())
        });
    if defaults {
        return set.policy.as_ref().map(Cow::Borrowed);
    }
    fields::policy_value(
        decision
            .limits()
            .iter()
            .map(|d| (d.name(), d.quota(), d.is_concurrency())),
    )
    .map(Cow::Owned)
}
