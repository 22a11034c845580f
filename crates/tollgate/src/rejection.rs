//! Why the layer refused a request, as a custom responder sees it.

use std::time::Duration;

use http::StatusCode;

use crate::decision::{Decision, DenyReason, Outcome};
use crate::key::MissingKey;

/// gRPC status codes the layer answers with.
const INVALID_ARGUMENT: u8 = 3;
const PERMISSION_DENIED: u8 = 7;
const RESOURCE_EXHAUSTED: u8 = 8;
const UNAVAILABLE: u8 = 14;

/// Why the layer refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectionKind {
    /// A limit is used up: `429 Too Many Requests`.
    TooManyRequests,
    /// The backend failed and a limit fails closed: `503 Service Unavailable`.
    Unavailable,
    /// A limit found no key and rejects keyless requests: `400 Bad Request`.
    MissingKey(MissingKey),
    /// A limit reads its cost from the request, and the request's is not a whole number of
    /// units (absent, not a number, negative, or above `u32::MAX`): `400 Bad Request`.
    InvalidCost,
    /// The request matched a deny list (the layer's [`Denylist`](crate::Denylist), or the
    /// backend's for a limit's key): `403 Forbidden`, with `Retry-After` only when the deny
    /// has an end.
    Denylisted,
    /// The adaptive concurrency limit shed the request: the server is overloaded (not the
    /// client over its quota): `503 Service Unavailable` with `Retry-After`, gRPC
    /// `UNAVAILABLE`. The [`limit`](Rejection::limit) is the adaptive limit's name.
    Shed,
}

/// A refused request, as handed to a custom responder.
#[derive(Debug, Clone, Copy)]
pub struct Rejection<'a> {
    kind: RejectionKind,
    limit: &'a str,
    retry_after: Option<Duration>,
    decision: Option<&'a Decision>,
    grpc: bool,
    source: Option<&'a str>,
}

impl<'a> Rejection<'a> {
    pub(crate) fn new(
        kind: RejectionKind,
        limit: &'a str,
        retry_after: Option<Duration>,
        decision: Option<&'a Decision>,
    ) -> Self {
        Self {
            kind,
            limit,
            retry_after,
            decision,
            grpc: false,
            source: None,
        }
    }

    pub(crate) fn with_source(mut self, source: &'a str) -> Self {
        self.source = Some(source);
        self
    }

    /// For a missing or invalid key, where the limit takes its key from, in words:
    /// `header "x-shop-domain"`, `query parameter "shop"`, `client address`, `principal
    /// UserId`.
    pub fn source(&self) -> Option<&'a str> {
        self.source
    }

    pub(crate) fn grpc(mut self, grpc: bool) -> Self {
        self.grpc = grpc;
        self
    }

    /// Whether the refused request is a gRPC call (`content-type: application/grpc*`), which
    /// is answered with a gRPC status instead of an HTTP error.
    pub fn is_grpc(&self) -> bool {
        self.grpc
    }

    /// The gRPC status code a gRPC refusal carries: 8 (`RESOURCE_EXHAUSTED`) for a used-up
    /// limit, 14 (`UNAVAILABLE`) for a fail-closed limit whose backend failed, 3
    /// (`INVALID_ARGUMENT`) for a missing key, 7 (`PERMISSION_DENIED`) for a deny list, 14
    /// for a request the adaptive limit shed.
    pub fn grpc_code(&self) -> u8 {
        match self.kind {
            RejectionKind::TooManyRequests => RESOURCE_EXHAUSTED,
            RejectionKind::Denylisted => PERMISSION_DENIED,
            RejectionKind::Unavailable | RejectionKind::Shed => UNAVAILABLE,
            RejectionKind::MissingKey(_) | RejectionKind::InvalidCost => INVALID_ARGUMENT,
        }
    }

    /// Why.
    pub fn kind(&self) -> RejectionKind {
        self.kind
    }

    /// The status the default response uses.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            RejectionKind::TooManyRequests => StatusCode::TOO_MANY_REQUESTS,
            RejectionKind::Denylisted => StatusCode::FORBIDDEN,
            RejectionKind::Unavailable | RejectionKind::Shed => StatusCode::SERVICE_UNAVAILABLE,
            RejectionKind::MissingKey(_) | RejectionKind::InvalidCost => StatusCode::BAD_REQUEST,
        }
    }

    /// The name of the (first) limit that refused.
    pub fn limit(&self) -> &'a str {
        self.limit
    }

    /// When to try again (the `Retry-After` the layer adds), if ever.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The whole decision, when the backend was asked (not for a missing key).
    pub fn decision(&self) -> Option<&'a Decision> {
        self.decision
    }
}

/// The kind of refusal a refused decision calls for, and the limit behind it. A deny comes
/// first: waiting does not lift it as it lifts a used-up quota or an outage.
pub(crate) fn refusal_of(decision: &Decision) -> Option<(RejectionKind, &str)> {
    let refusing = || decision.limits().iter().filter(|l| l.refuses());
    if let Some(limit) = refusing().find(|l| matches!(l.outcome(), Outcome::Denylisted { .. })) {
        return Some((RejectionKind::Denylisted, limit.name()));
    }
    let mut first = None;
    for limit in refusing() {
        if let Outcome::Denied {
            reason: DenyReason::BackendUnavailable,
            ..
        } = limit.outcome()
        {
            return Some((RejectionKind::Unavailable, limit.name()));
        }
        first.get_or_insert((RejectionKind::TooManyRequests, limit.name()));
    }
    first
}
