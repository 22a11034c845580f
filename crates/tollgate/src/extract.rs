//! Reading the [`Decision`] in axum handlers.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;

use crate::decision::Decision;

/// The route has no rate-limit layer, so there is no [`Decision`] to extract.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct MissingDecision;

impl std::fmt::Display for MissingDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no rate-limit decision on this request: is the route behind a RateLimitLayer?")
    }
}

impl std::error::Error for MissingDecision {}

impl IntoResponse for MissingDecision {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}

/// `Decision` as an extractor: `async fn handler(decision: Decision)`. Rejects with 500 when
/// the route is not behind a [`RateLimitLayer`](crate::RateLimitLayer); use
/// `Option<Decision>` where that is expected.
impl<S: Send + Sync> FromRequestParts<S> for Decision {
    type Rejection = MissingDecision;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Decision>()
            .cloned()
            .ok_or(MissingDecision)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for Decision {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Decision>().cloned())
    }
}
