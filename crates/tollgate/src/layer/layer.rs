//! [`RateLimitLayer`], the tower layer users add, and its builder.

use std::fmt;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::Response;
use tollgate_engine::topk::DEFAULT_TOP_K;
use tollgate_engine::{Backend, Clock, ConfigError, Limit, MemoryBackend, SystemClock};
use tower_layer::Layer;

use super::limits::Limits;
use super::refused::Refusals;
use super::reload::Reloader;
use super::respond::Responses;
use super::service::RateLimit;
use super::state::{PlanFn, Shared};
use crate::adaptive::{Adaptive, AdaptiveLimit, Guard};
use crate::allowlist::Allowlist;
use crate::cost::Metered;
use crate::denylist::Denylist;
use crate::key::{KeyExtractor, RequestView};
use crate::limits_file::error::LimitsFileError;
use crate::limits_file::LimitsFile;
use crate::plan::Plan;
use crate::rejection::Rejection;

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
/// # fn main() -> Result<(), tollgate::engine::ConfigError> {
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
    pub(super) shared: Arc<Shared<B>>,
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
            limits: Limits::new(),
            plan_fn: None,
            respond: Responses::default(),
            near_limit: 20,
            fallback_clock: Arc::new(SystemClock::new()),
            fallback_max_keys: 100_000,
            top_refused_k: DEFAULT_TOP_K,
            adaptive: None,
        }
    }
}

impl<B> RateLimitLayer<B> {
    /// The backend the limits are counted in.
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// The limits the layer applies now, in order.
    pub fn limits(&self) -> Vec<Limit> {
        self.shared
            .set
            .load()
            .limits
            .iter()
            .map(|e| e.limit.clone())
            .collect()
    }

    /// The running adaptive concurrency limit, if the layer has one (see [`crate::adaptive`]).
    pub fn adaptive(&self) -> Option<AdaptiveLimit> {
        self.shared
            .adaptive
            .as_ref()
            .map(|guard| AdaptiveLimit::new(Arc::clone(&guard.gate)))
    }

    /// A handle that replaces this layer's limits at run time (see [`Reloader`]).
    pub fn reloader(&self) -> Reloader<B> {
        Reloader::new(Arc::clone(&self.shared))
    }
}

impl<B: Backend> RateLimitLayer<B> {
    /// Gives back what the backend holds of shared quotas ([`Lifecycle::shutdown`](tollgate_engine::Lifecycle::shutdown): the unused
    /// units of leased slices), for a graceful shutdown: call it once the server has stopped
    /// taking requests. Requests checked afterwards are checked without leases. Resolves once
    /// the backend has answered (or could not be reached: the units then come back when
    /// their slices expire, see [`tollgate_engine::Lease`]).
    pub async fn shutdown(&self) {
        if let Some(lifecycle) = self.shared.backend.lifecycle() {
            lifecycle.shutdown().await;
        }
    }
}

impl RateLimitLayer {
    /// A layer counting in memory with the limits of a TOML text (no principal bound).
    ///
    /// # Errors
    ///
    /// As [`LimitsFile::parse`], and the [`ConfigError`] of limits that cannot build a layer.
    #[deprecated(
        note = "use `RateLimitLayer::builder().limits(LimitsFile::new().parse(text)?).build()`"
    )]
    pub fn from_toml_str(text: &str) -> Result<Self, LimitsFileError> {
        let limits = LimitsFile::new().parse(text)?;
        Ok(RateLimitLayer::builder().limits(limits).build()?)
    }

    /// As [`RateLimitLayer::from_toml_str`], reading the file at `path`.
    ///
    /// # Errors
    ///
    /// As [`LimitsFile::read`], and the [`ConfigError`] of limits that cannot build a layer.
    #[deprecated(
        note = "use `RateLimitLayer::builder().limits(LimitsFile::new().read(path)?).build()`"
    )]
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self, LimitsFileError> {
        let limits = LimitsFile::new().read(path)?;
        Ok(RateLimitLayer::builder().limits(limits).build()?)
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
    limits: Limits,
    plan_fn: Option<PlanFn>,
    respond: Responses,
    near_limit: u8,
    fallback_clock: Arc<dyn Clock>,
    fallback_max_keys: usize,
    top_refused_k: usize,
    adaptive: Option<(Adaptive, Box<dyn KeyExtractor>)>,
}

impl<B: Backend> RateLimitLayerBuilder<B> {
    /// Adds an adaptive concurrency limit (see [`crate::adaptive`]): how many requests this
    /// process lets run at once, learned from their latency, with priority classes; `key`
    /// is what fairness within a class counts by (the heaviest keys are shed first).
    ///
    /// It is asked first, before the backend: a shed request (`503` with `Retry-After`)
    /// consumes nothing of the other limits, and a request they refuse gives its permit back
    /// at once. A layer has at most one; a second replaces the first. Its settings are
    /// checked by [`build`](Self::build).
    pub fn adaptive(mut self, adaptive: Adaptive, key: impl KeyExtractor) -> Self {
        self.adaptive = Some((adaptive, Box::new(key)));
        self
    }

    /// Adds a limit, counted per key that `key` extracts.
    pub fn limit(mut self, limit: Limit, key: impl KeyExtractor) -> Self {
        self.limits.push(limit, Box::new(key));
        self
    }

    /// Adds a limit, counted per key that `key` extracts, whose cost comes from each request
    /// and may be settled after the response (see [`crate::cost`]).
    ///
    /// ```
    /// use http::StatusCode;
    /// use tollgate::cost::Metered;
    /// use tollgate::key::ClientIp;
    /// use tollgate::{Limit, Quota, RateLimitLayer};
    ///
    /// # fn main() -> Result<(), tollgate::engine::ConfigError> {
    /// // Five failed logins a minute: only 401s count.
    /// let layer = RateLimitLayer::builder()
    ///     .metered(
    ///         Limit::gcra("login-failures", Quota::per_minute(5)?)?,
    ///         ClientIp::peer(),
    ///         Metered::new().count_if(|r| r.status() == StatusCode::UNAUTHORIZED),
    ///     )
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn metered(mut self, limit: Limit, key: impl KeyExtractor, metered: Metered) -> Self {
        self.limits.push_metered(limit, Box::new(key), metered);
        self
    }

    /// Chooses the plan of a request that has no [`Plan`] extension with `plan`,
    /// a function of the request (a header, the path, another extension). A request for
    /// which it answers `None` gets every limit's default quota.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::key::Global;
    /// use tollgate::{Limit, Plan, Quota, RateLimitLayer};
    ///
    /// # fn main() -> Result<(), tollgate::engine::ConfigError> {
    /// let limit = Limit::gcra("api", Quota::per_minute(10)?)?.plan("partner", Quota::per_minute(100)?)?;
    /// let layer = RateLimitLayer::builder()
    ///     .limit(limit, Global)
    ///     .plan_fn(|req| req.headers().contains_key("x-partner-key").then(|| Plan::new("partner")))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn plan_fn<F>(mut self, plan: F) -> Self
    where
        F: Fn(&RequestView<'_>) -> Option<Plan> + Send + Sync + 'static,
    {
        self.plan_fn = Some(Box::new(plan));
        self
    }

    /// Adds every limit of `limits` (for example from a [`LimitsFile`]),
    /// and its allowlist and denylist.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits.extend(limits);
        self
    }

    /// Admits the requests that `allowlist` matches without counting them (see
    /// [`Allowlist`]). Adds to the rules already given.
    pub fn allowlist(mut self, allowlist: Allowlist) -> Self {
        self.limits.add_allowlist(allowlist);
        self
    }

    /// Refuses the requests that `denylist` matches with `403 Forbidden`, without counting
    /// them (see [`Denylist`]); the allowlist wins over it. Adds to the rules already given.
    pub fn denylist(mut self, denylist: Denylist) -> Self {
        self.limits.add_denylist(denylist);
        self
    }

    /// Counts the limits in `backend` (Redis, or a configured in-memory backend).
    pub fn backend<B2: Backend>(self, backend: B2) -> RateLimitLayerBuilder<B2> {
        RateLimitLayerBuilder {
            backend,
            limits: self.limits,
            plan_fn: self.plan_fn,
            respond: self.respond,
            near_limit: self.near_limit,
            fallback_clock: self.fallback_clock,
            fallback_max_keys: self.fallback_max_keys,
            top_refused_k: self.top_refused_k,
            adaptive: self.adaptive,
        }
    }

    /// Whether admitted responses carry `RateLimit-Policy` and `RateLimit` (default yes;
    /// refusals always do).
    pub fn headers_on_allowed(mut self, on: bool) -> Self {
        self.respond.fields.on_allowed = on;
        self
    }

    /// Whether admitted responses carry the [`Decision`](crate::Decision) in their extensions
    /// (default yes; refusals always do). Every request carries it either way, for its handler.
    ///
    /// The response's copy is for what runs outside the layer: middleware that logs or counts
    /// decisions, and an outer `RateLimitLayer`, which adds this layer's limits to its own
    /// `Decision` on the response. Without it, an admitted response carries no `Decision` of
    /// this layer. Switching it off saves the response's extension map and the copy (three
    /// allocations per admitted request; `docs/benchmarks.md` has the figures).
    pub fn decision_on_allowed(mut self, on: bool) -> Self {
        self.respond.decision_on_allowed = on;
        self
    }

    /// The share of a quota, in percent, at or below which an admitted request's remaining
    /// units count it in `tollgate_near_limit_total{limit}` (default 20: an admission that left
    /// at most a fifth of the quota, of its burst under GCRA). A warning before the hard
    /// limit; 0 counts the admissions that left nothing, 100 every admission (larger values
    /// count as 100).
    pub fn near_limit_percent(mut self, percent: u8) -> Self {
        self.near_limit = percent.min(100);
        self
    }

    /// How many refused identities each limit's summary holds (default
    /// [`DEFAULT_TOP_K`], 100), for [`RateLimitLayer::top_refused`]; 0 counts no refusal.
    /// Memory stays bounded whatever the number of refused clients: an identity refused more
    /// than `N / k` times among `N` refusals is always held (`docs/operations.md`).
    pub fn top_refused_k(mut self, k: usize) -> Self {
        self.top_refused_k = k;
        self
    }

    /// Also writes the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset` fields (default no).
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.respond.fields.legacy = on;
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
        self.respond.responder = Some(Box::new(respond));
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
        self.respond.grpc_responder = Some(Box::new(respond));
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
        self.respond.unavailable_retry_after = after;
        self
    }

    /// Builds the layer.
    ///
    /// # Errors
    ///
    /// [`ConfigError::NoLimits`] (a layer with an adaptive limit may have no other),
    /// [`ConfigError::TooManyLimits`] (more than
    /// [`MAX_CHECKS`](tollgate_engine::MAX_CHECKS)), [`ConfigError::DuplicateName`],
    /// [`ConfigError::ReservedName`] for a limit named [`CANARY_LIMIT`](crate::CANARY_LIMIT),
    /// which only the canary may use, [`ConfigError::PauseUnsupported`] for
    /// [`pause_from_upstream`](crate::cost::Metered::pause_from_upstream) on a limit that is
    /// not GCRA, or [`ConfigError::DelayWithWindow`] for a delayed limit stacked with a fixed
    /// window or a sliding log (shadow limits aside): the window counts a request when it is
    /// checked, and a delayed one may run in the next window. A window on a layer of its own
    /// inside the delayed one counts requests when they run.
    /// [`ConfigError::InvalidAdaptive`] for an adaptive limit whose settings cannot work
    /// (see [`Adaptive`]).
    pub fn build(self) -> Result<RateLimitLayer<B>, ConfigError> {
        let set = self
            .limits
            .compile(self.top_refused_k > 0, self.adaptive.is_some())?;
        let adaptive = match self.adaptive {
            Some((adaptive, key)) => Some(Guard::new(adaptive.build()?, key)),
            None => None,
        };
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                backend: self.backend,
                set: ArcSwap::from_pointee(set),
                reloads: Mutex::new(0),
                reload_tickets: AtomicU64::new(1),
                plan_fn: self.plan_fn,
                fallback: MemoryBackend::builder()
                    .max_keys(self.fallback_max_keys)
                    .clock(Arc::clone(&self.fallback_clock))
                    .build(),
                refused: Refusals::new(self.top_refused_k, self.fallback_clock),
                respond: self.respond,
                waiters: Arc::default(),
                lines: Arc::default(),
                near_limit: self.near_limit,
                adaptive,
            }),
        })
    }
}

impl<B> fmt::Debug for RateLimitLayerBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("limits", &self.limits)
            .field("fields", &self.respond.fields)
            .field("decision_on_allowed", &self.respond.decision_on_allowed)
            .finish()
    }
}
