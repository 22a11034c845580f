//! What the layer adds to a response: its [`Decision`] and the rate-limit fields.

use std::borrow::Cow;

use http::{HeaderValue, Response};
use tollgate_engine::Backend;

use super::limits::LimitSet;
use super::state::Shared;
use crate::decision::Decision;
use crate::fields::{self, Fields};

impl<B: Backend> Shared<B> {
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

    /// Adds the decision and (if configured) the rate-limit fields to an admitted response.
    pub(crate) fn finish<T>(&self, response: &mut Response<T>, decision: Decision) {
        if self.fields_on_allowed(&decision) {
            let set = self.set.load();
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
        && set
            .limits
            .iter()
            .zip(decision.limits())
            .all(|(e, d)| e.limit.name() == d.name() && e.limit.quota() == d.quota());
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
