//! The rate-limit middleware: [`RateLimitLayer`], its service [`RateLimit`] and future.
//!
//! One request's way through it:
//!
//! 1. Each limit's extractor finds the key (no I/O). A missing key applies the limit's
//!    [`MissingKeyPolicy`]: refuse with 400, skip the limit, or count in a shared bucket.
//! 2. The backend checks every limit in one call, all-or-nothing.
//! 3. All admitted: the [`Decision`] goes into the request's extensions, the inner service is
//!    called, and the response gets the decision and the `RateLimit` fields. Any refused: 429
//!    (or 503 when a fail-closed limit's backend failed) with `Retry-After`, and nothing was
//!    consumed. Backend failed: each limit's [`FailurePolicy`] decides.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};
use tollgate_core::{
    Backend, Clock, ConfigError, FailurePolicy, Limit, MemoryBackend, SystemClock, MAX_CHECKS,
};
use tower_layer::Layer;

use crate::decision::Decision;
use crate::key::KeyExtractor;
use crate::metrics::LimitMetrics;
use crate::response::{self, HeaderConfig, Rejection};

mod body;
mod decide;
mod future;
mod service;
mod slots;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use service::RateLimit;

type Responder = Box<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;

/// Applies one or more stacked limits to every request of the services it wraps.
///
/// Clones share one state: axum clones a layer for every route, and a limit stays one limit.
/// The limits of one layer are all-or-nothing: a request is admitted only if every limit admits
/// it, and then consumes from every one.
///
/// # Examples
///
/// ```
/// use axum::{routing::get, Extension, Router};
/// use tollgate::key::{ClientIp, Global};
/// use tollgate::{Decision, Limit, Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), tollgate::core::ConfigError> {
/// let layer = RateLimitLayer::builder()
///     .limit(Limit::gcra("per-ip", Quota::per_minute(60)?)?, ClientIp::peer())
///     .limit(Limit::fixed_window("everyone", Quota::per_day(100_000)?)?, Global)
///     .build()?;
///
/// let app: Router = Router::new()
///     .route("/", get(|d: Decision| async move { format!("{:?} left", d.remaining()) }))
///     .route_layer(layer);
/// # Ok(()) }
/// ```
pub struct RateLimitLayer<B = MemoryBackend> {
    shared: Arc<Shared<B>>,
}

impl<B> Clone for RateLimitLayer<B> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl RateLimitLayer<MemoryBackend> {
    /// Configures a layer; the backend is in memory unless [`RateLimitLayerBuilder::backend`]
    /// says otherwise.
    pub fn builder() -> RateLimitLayerBuilder<MemoryBackend> {
        RateLimitLayerBuilder {
            backend: MemoryBackend::new(),
            limits: Vec::new(),
            headers: HeaderConfig::default(),
            responder: None,
            grpc_responder: None,
            fallback_clock: Arc::new(SystemClock::new()),
            fallback_max_keys: 100_000,
            unavailable_retry_after: Duration::from_secs(1),
        }
    }
}

impl<B> RateLimitLayer<B> {
    /// The backend the limits are counted in.
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }
}

impl<S, B> Layer<S> for RateLimitLayer<B> {
    type Service = RateLimit<S, B>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.shared))
    }
}

impl<B: Backend> fmt::Debug for RateLimitLayer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt(f)
    }
}

/// Configures a [`RateLimitLayer`].
pub struct RateLimitLayerBuilder<B> {
    backend: B,
    limits: Vec<(Limit, Box<dyn KeyExtractor>)>,
    headers: HeaderConfig,
    responder: Option<Responder>,
    grpc_responder: Option<Responder>,
    fallback_clock: Arc<dyn Clock>,
    fallback_max_keys: usize,
    unavailable_retry_after: Duration,
}

impl<B: Backend> RateLimitLayerBuilder<B> {
    /// Adds a limit, counted per key that `key` extracts.
    pub fn limit(mut self, limit: Limit, key: impl KeyExtractor) -> Self {
        self.limits.push((limit, Box::new(key)));
        self
    }

    /// Counts the limits in `backend` (Redis, or a configured in-memory backend).
    pub fn backend<B2: Backend>(self, backend: B2) -> RateLimitLayerBuilder<B2> {
        RateLimitLayerBuilder {
            backend,
            limits: self.limits,
            headers: self.headers,
            responder: self.responder,
            grpc_responder: self.grpc_responder,
            fallback_clock: self.fallback_clock,
            fallback_max_keys: self.fallback_max_keys,
            unavailable_retry_after: self.unavailable_retry_after,
        }
    }

    /// Whether admitted responses carry `RateLimit-Policy` and `RateLimit` (default yes;
    /// refusals always do).
    pub fn headers_on_allowed(mut self, on: bool) -> Self {
        self.headers.on_allowed = on;
        self
    }

    /// Also writes the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset` fields (default no).
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.headers.legacy = on;
        self
    }

    /// Builds refusals with `respond` instead of the default problem+json body. The layer still
    /// adds `Retry-After` (unless set) and the rate-limit fields.
    ///
    /// gRPC calls are refused by [`on_grpc_rejection`](Self::on_grpc_rejection)'s responder.
    pub fn on_rejection<F>(mut self, respond: F) -> Self
    where
        F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.responder = Some(Box::new(respond));
        self
    }

    /// Builds the refusals of gRPC calls (`content-type: application/grpc*`) with `respond`
    /// instead of the default trailers-only status (`grpc-status` 8, 14 or 3; see
    /// [`Rejection::grpc_code`]). The layer still adds the `retry-after` metadata (unless set)
    /// and the rate-limit fields. A trailers-only response has an empty body: the status goes in
    /// the headers.
    pub fn on_grpc_rejection<F>(mut self, respond: F) -> Self
    where
        F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.grpc_responder = Some(Box::new(respond));
        self
    }

    /// The clock of the local fallback limiter (default: the system clock).
    pub fn fallback_clock(mut self, clock: impl Clock) -> Self {
        self.fallback_clock = Arc::new(clock);
        self
    }

    /// The most keys the local fallback limiter tracks (default 100,000).
    pub fn fallback_max_keys(mut self, max_keys: usize) -> Self {
        self.fallback_max_keys = max_keys;
        self
    }

    /// The `Retry-After` of a 503 from a fail-closed limit (default 1 s).
    pub fn unavailable_retry_after(mut self, after: Duration) -> Self {
        self.unavailable_retry_after = after;
        self
    }

    /// Builds the layer.
    ///
    /// # Errors
    ///
    /// [`ConfigError::NoLimits`], [`ConfigError::TooManyLimits`] (more than
    /// [`MAX_CHECKS`]), [`ConfigError::DuplicateName`], or [`ConfigError::ReservedName`] for a
    /// limit named [`CANARY_LIMIT`](crate::CANARY_LIMIT), which only the canary may use.
    pub fn build(self) -> Result<RateLimitLayer<B>, ConfigError> {
        if self.limits.is_empty() {
            return Err(ConfigError::NoLimits);
        }
        if self.limits.len() > MAX_CHECKS {
            return Err(ConfigError::TooManyLimits);
        }
        if let Some((limit, _)) = self
            .limits
            .iter()
            .find(|(l, _)| l.name() == crate::CANARY_LIMIT)
        {
            return Err(ConfigError::ReservedName(limit.name().to_owned()));
        }
        for (i, (limit, _)) in self.limits.iter().enumerate() {
            if self.limits[..i]
                .iter()
                .any(|(l, _)| l.name() == limit.name())
            {
                return Err(ConfigError::DuplicateName(limit.name().to_owned()));
            }
        }
        let policy = response::policy_value(self.limits.iter().map(|(l, _)| l));
        let has_slots = self
            .limits
            .iter()
            .any(|(l, _)| l.algorithm() == tollgate_core::Algorithm::Concurrency);
        let names = self
            .limits
            .iter()
            .map(|(l, _)| l.name())
            .collect::<Vec<_>>()
            .join(",")
            .into();
        let limits = self
            .limits
            .into_iter()
            .map(|(limit, key)| Entry {
                local: match limit.failure_policy() {
                    FailurePolicy::Fallback { replicas } => Some(limit.local_share(replicas)),
                    _ => None,
                },
                metrics: LimitMetrics::new(Arc::clone(limit.name_arc())),
                limit,
                key,
            })
            .collect();
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                backend: self.backend,
                limits,
                fallback: MemoryBackend::builder()
                    .max_keys(self.fallback_max_keys)
                    .clock(self.fallback_clock)
                    .build(),
                policy,
                names,
                headers: self.headers,
                responder: self.responder,
                grpc_responder: self.grpc_responder,
                unavailable_retry_after: self.unavailable_retry_after,
                has_slots,
            }),
        })
    }
}

impl<B> fmt::Debug for RateLimitLayerBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field(
                "limits",
                &self.limits.iter().map(|(l, _)| l).collect::<Vec<_>>(),
            )
            .field("headers", &self.headers)
            .finish()
    }
}

/// The state every clone of a layer and its services shares.
pub(crate) struct Shared<B> {
    backend: B,
    limits: Box<[Entry]>,
    fallback: MemoryBackend<Arc<dyn Clock>>,
    policy: Option<HeaderValue>,
    /// The limits' names, comma-separated, for the check span.
    names: Box<str>,
    headers: HeaderConfig,
    responder: Option<Responder>,
    grpc_responder: Option<Responder>,
    unavailable_retry_after: Duration,
    /// Whether any limit is a concurrency limit (its requests then draw a slot id).
    has_slots: bool,
}

struct Entry {
    limit: Limit,
    key: Box<dyn KeyExtractor>,
    /// The quota's local share, for [`FailurePolicy::Fallback`].
    local: Option<Limit>,
    metrics: LimitMetrics,
}

/// Which limits a batch checked, in order, and which were skipped.
#[derive(Debug)]
pub(crate) struct Plan {
    n: usize,
    limit_of: [usize; MAX_CHECKS],
    skipped: [bool; MAX_CHECKS],
    /// The request's concurrency slot id (0 when the layer has no concurrency limit).
    slot: u64,
    /// The request's `tollgate.check` span, open from the keys to the decision.
    span: tracing::Span,
}

impl Plan {
    /// The request's concurrency slot id.
    pub(crate) fn slot(&self) -> u64 {
        self.slot
    }
}

pub(crate) enum Prepared<F> {
    Check(F, Plan),
    Refuse(Response<Bytes>),
}

pub(crate) enum Decided {
    Admit(Decision),
    Refuse(Response<Bytes>),
}

impl<B: Backend> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("backend", &self.backend.kind())
            .field(
                "limits",
                &self.limits.iter().map(|e| &e.limit).collect::<Vec<_>>(),
            )
            .field("headers", &self.headers)
            .finish()
    }
}
