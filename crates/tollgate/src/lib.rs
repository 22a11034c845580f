//! Rate limiting for tower and axum.
//!
//! A [`RateLimitLayer`] holds one or more [`Limit`]s, each counted per key that its
//! [extractor](key) finds in the request: the client IP, a tenant, an authenticated principal,
//! or anything else. Limits are counted in a [`Backend`](engine::Backend): in memory by default
//! ([`MemoryBackend`]), or in Redis / Redis Cluster (the `tollgate-redis` crate) so that a limit
//! holds across every replica of a service.
//!
//! - Over a limit: `429 Too Many Requests` with `Retry-After` and the IETF `RateLimit` fields.
//! - Stacked limits are all-or-nothing: a request refused by one limit consumes from none.
//! - Backend down: each limit's [`FailurePolicy`]: fail open (the decision says `Bypassed` and
//!   `tollgate_bypass_total` counts it), fail closed (`503`), or a local fallback limit.
//! - Handlers read the [`Decision`] from the request (with the `axum` feature it is an axum
//!   extractor; a tonic handler finds it in `request.extensions()`), outer layers from the
//!   response's extensions.
//!
//! # Examples
//!
//! ```
//! use axum::{routing::get, Router};
//! use tollgate::key::{ClientIp, Tenant};
//! use tollgate::{Decision, Limit, Quota, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollgate::engine::ConfigError> {
//! let limits = RateLimitLayer::builder()
//!     // 20 a minute per client address (IPv6 grouped by /64)...
//!     .limit(Limit::gcra("burst", Quota::per_minute(20)?)?, ClientIp::peer())
//!     // ...and 500 a UTC day per shop; a request refused by either consumes from neither.
//!     .limit(Limit::fixed_window("shop-daily", Quota::per_day(500)?)?, Tenant::header("x-shop-domain"))
//!     .build()?;
//!
//! async fn chat(decision: Decision) -> String {
//!     // A limit whose backend failed and that fails open counted nothing: not "0 left".
//!     if decision.is_bypassed() {
//!         return "not counted: the rate limiter is unavailable".to_owned();
//!     }
//!     match decision.remaining() {
//!         Some(left) => format!("{left} requests left"),
//!         None => "not counted".to_owned(), // allowlisted, or skipped for want of a key
//!     }
//! }
//!
//! // `route_layer`: a 404 or 405 never reaches the layer, so it consumes nothing.
//! let app: Router = Router::new().route("/api/chat", get(chat).route_layer(limits));
//! # Ok(()) }
//! ```
//!
//! Serve with `app.into_make_service_with_connect_info::<SocketAddr>()` so that
//! [`ClientIp`](key::ClientIp) knows the socket peer.
//!
//! # Any tower service, and gRPC
//!
//! The layer wraps any service `http::Request<ReqBody> -> http::Response<ResBody>` whose body
//! carries [`Bytes`](bytes::Bytes); its responses have a [`ResponseBody`], the inner body or the
//! layer's own refusal. A call whose `content-type` starts with `application/grpc` is refused
//! with a gRPC status instead of an HTTP error: trailers-only, `grpc-status` 8
//! (`RESOURCE_EXHAUSTED`) with a `retry-after` entry, 14 (`UNAVAILABLE`) when a fail-closed
//! limit's backend failed, 3 (`INVALID_ARGUMENT`) for a missing key; the `RateLimit` fields are
//! metadata entries. In a tonic server: `Server::builder().layer(limits).add_service(svc)`.
//!
//! Features:
//! - `axum` (default): the [`Decision`] extractor, axum's `ConnectInfo` as the peer address.
//! - `tonic`: tonic's `TcpConnectInfo` as the peer address, and a `google.rpc.RetryInfo` in
//!   `grpc-status-details-bin` of gRPC refusals.
//! - `tonic-tls`: also tonic's `TlsConnectInfo<TcpConnectInfo>`.
//!
//! Without a framework, [`ClientIp`](key::ClientIp) reads a `SocketAddr` from the request's
//! extensions, or asks a function ([`ClientIp::peer_fn`](key::ClientIp::peer_fn)).
//!
//! # Costs from the request, settled after the response
//!
//! [`RateLimitLayerBuilder::metered`] adds a limit whose cost each request gives (a header,
//! `content-length`, an extension) and whose reservation is settled once the answer is known:
//! refunded by outcome (`count_if`), or charged at the cost the handler reports, through the
//! [`Settle`](cost::Settle) handle (usable until the response body ends) or a
//! [`Charge`](cost::Charge). See [`cost`].
//!
//! # Protecting the service itself
//!
//! [`RateLimitLayerBuilder::adaptive`] adds an [`Adaptive`] concurrency limit: how many
//! requests this process runs at once, learned from their latency, with [`Priority`] classes
//! (the lowest shed first, a reserve for critical ones), fairness between keys and a short
//! queue. A shed request is answered `503` with `Retry-After`, before any other limit is
//! asked, so it consumes nothing. See [`adaptive`].
//!
//! # Observability
//!
//! Through the [`metrics`](https://docs.rs/metrics) facade (install any exporter) and
//! [`tracing`](https://docs.rs/tracing):
//!
//! - `tollgate_decisions_total{limit, outcome}`, `tollgate_bypass_total{limit, reason}` and
//!   `tollgate_capacity_refusals_total{limit}`, counted by the layer for every limit of every
//!   request; networked backends add `tollgate_backend_duration_seconds{backend}`,
//!   `tollgate_backend_up{backend}` and `tollgate_deny_cache_hits_total{limit}`. Label values
//!   are limit names and fixed words, never a key.
//! - A `tollgate.check` debug span per request (fields `limits`, `outcome`, `decision`);
//!   bypasses and capacity refusals are `warn` events, at most one per limit every 10 s.
//! - The [`Canary`]: a synthetic key that must be denied, checked periodically through the real
//!   backend; `tollgate_canary_ok{backend}` is 1 only while it is, and
//!   `tollgate_canary_last_check_timestamp_seconds{backend}` says when it last checked.
//!
//! `docs/operations.md` says what each metric means and what to do when an alert fires; the
//! Prometheus alert rules and a Grafana dashboard are in the repository's `deploy/`.

pub mod key;

pub mod cost;

pub mod adaptive;

mod allowlist;
mod canary;
mod decision;
mod denylist;
#[cfg(feature = "axum")]
mod extract;
mod fields;
mod grpc;
mod layer;
mod limits_file;
mod metrics;
mod plan;
mod problem;
mod refusal_cache;
mod rejection;
mod rules;
mod span;
mod upstream;

/// The parts that know nothing of HTTP: quotas, algorithms, clocks, backends.
pub use tollgate_engine as engine;

pub use adaptive::{Adaptive, AdaptiveDecision, AdaptiveLimit, Priority, ShedReason};
pub use allowlist::Allowlist;
pub use canary::{Canary, CanaryHandle, CanaryStatus, CANARY_LIMIT};
pub use decision::{
    BypassReason, Decision, DenyReason, LimitDecision, Outcome, SkipReason, Source,
};
pub use denylist::Denylist;
#[cfg(feature = "axum")]
pub use extract::MissingDecision;
pub use layer::admin::AdminError;
pub use layer::body::ResponseBody;
pub use layer::future::ResponseFuture;
pub use layer::layer::{RateLimitLayer, RateLimitLayerBuilder};
pub use layer::limits::Limits;
pub use layer::reload::{ReloadError, Reloader};
pub use layer::service::RateLimit;
pub use limits_file::error::LimitsFileError;
pub use limits_file::LimitsFile;
pub use plan::Plan;
pub use rejection::{Rejection, RejectionKind};
pub use tollgate_engine::Refused;
pub use tollgate_engine::{
    Algorithm, FailurePolicy, FakeClock, Limit, MemoryBackend, MissingKeyPolicy, Penalty, Quota,
    SystemClock,
};
pub use upstream::MAX_UPSTREAM_PAUSE;
