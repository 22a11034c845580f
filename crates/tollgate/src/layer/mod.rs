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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;

use bytes::Bytes;
use http::{HeaderValue, Response};
use tollgate_core::{
    Algorithm, Backend, Clock, ConfigError, FailurePolicy, Limit, MemoryBackend, SystemClock,
    MAX_CHECKS,
};
use tower_layer::Layer;

use crate::allowlist::Allowlist;
use crate::cost::Metered;
use crate::decision::Decision;
use crate::key::{KeyExtractor, RequestView};
use crate::metrics::LimitMetrics;
use crate::plan::Plan as RequestPlan;
use crate::response::{self, HeaderConfig, Rejection};

mod admin;
mod body;
mod decide;
mod future;
mod reload;
mod service;
mod settle;
mod slots;

pub use admin::AdminError;
pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use reload::{ReloadError, Reloader};
pub use service::RateLimit;

type Responder = Box<dyn Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync>;
type PlanFn = Box<dyn Fn(&RequestView<'_>) -> Option<RequestPlan> + Send + Sync>;

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
            limits: Limits::new(),
            plan_fn: None,
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

    /// A handle that replaces this layer's limits at run time (see [`Reloader`]).
    pub fn reloader(&self) -> Reloader<B> {
        Reloader::new(Arc::clone(&self.shared))
    }
}

impl<B: Backend> RateLimitLayer<B> {
    /// Gives back what the backend holds of shared quotas ([`Backend::shutdown`]: the unused
    /// units of leased slices), for a graceful shutdown: call it once the server has stopped
    /// taking requests. Requests checked afterwards are checked without leases. Resolves once
    /// the backend has answered (or could not be reached: the units then come back when
    /// their slices expire, see [`tollgate_core::Lease`]).
    pub async fn shutdown(&self) {
        self.shared.backend.shutdown().await;
    }
}

/// Limits with the keys they are counted per: what a layer is built from
/// ([`RateLimitLayerBuilder::limits`]) and what a [`Reloader`] installs. A
/// [`LimitsFile`](crate::LimitsFile) reads them from TOML.
#[derive(Default)]
pub struct Limits {
    entries: Vec<(Limit, Box<dyn KeyExtractor>, Option<Metered>)>,
    allowlist: Allowlist,
}

impl Limits {
    /// No limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a limit, counted per key that `key` extracts.
    pub fn limit(mut self, limit: Limit, key: impl KeyExtractor) -> Self {
        self.entries.push((limit, Box::new(key), None));
        self
    }

    /// Adds a limit with a boxed extractor.
    pub fn push(&mut self, limit: Limit, key: Box<dyn KeyExtractor>) {
        self.entries.push((limit, key, None));
    }

    /// Adds a metered limit (see [`RateLimitLayerBuilder::metered`]).
    pub fn push_metered(&mut self, limit: Limit, key: Box<dyn KeyExtractor>, metered: Metered) {
        self.entries.push((limit, key, Some(metered)));
    }

    /// These limits with `allowlist`'s rules added to their allowlist (see [`Allowlist`]).
    pub fn with_allowlist(mut self, allowlist: Allowlist) -> Self {
        self.add_allowlist(allowlist);
        self
    }

    /// Adds `allowlist`'s rules to these limits' allowlist.
    pub fn add_allowlist(&mut self, allowlist: Allowlist) {
        let own = std::mem::take(&mut self.allowlist);
        self.allowlist = own.extend(allowlist);
    }

    /// The requests these limits admit without counting.
    pub fn allowlist(&self) -> &Allowlist {
        &self.allowlist
    }

    /// The limit named `name` and the extractor of its keys.
    pub fn get(&self, name: &str) -> Option<(&Limit, &dyn KeyExtractor)> {
        self.entries
            .iter()
            .find(|(l, _, _)| l.name() == name)
            .map(|(l, k, _)| (l, &**k))
    }

    /// The limits with the extractors of their keys, in order.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = (&Limit, &dyn KeyExtractor)> + '_ {
        self.entries.iter().map(|(l, k, _)| (l, &**k))
    }

    /// How many limits.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The limits, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Limit> + '_ {
        self.entries.iter().map(|(l, _, _)| l)
    }

    /// What a layer asks of its whole set of limits.
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        let limits = &self.entries;
        if limits.is_empty() {
            return Err(ConfigError::NoLimits);
        }
        if limits.len() > MAX_CHECKS {
            return Err(ConfigError::TooManyLimits);
        }
        if let Some((limit, _, _)) = limits
            .iter()
            .find(|(l, _, _)| l.name() == crate::CANARY_LIMIT)
        {
            return Err(ConfigError::ReservedName(limit.name().to_owned()));
        }
        for (i, (limit, _, metered)) in limits.iter().enumerate() {
            if limits[..i].iter().any(|(l, _, _)| l.name() == limit.name()) {
                return Err(ConfigError::DuplicateName(limit.name().to_owned()));
            }
            let settles = metered.as_ref().is_some_and(Metered::settles);
            if settles && limit.lease().is_some() && limit.algorithm() == Algorithm::Gcra {
                return Err(ConfigError::LeaseWithSettle(limit.name().to_owned()));
            }
        }
        Ok(())
    }

    /// Checks the whole set and prepares it for requests.
    pub(crate) fn compile(self) -> Result<LimitSet, ConfigError> {
        self.check()?;
        let allowlist = (!self.allowlist.is_empty()).then_some(self.allowlist);
        let limits = self.entries;
        let policy = response::policy_value(
            limits
                .iter()
                .map(|(l, _, _)| (l.name(), l.quota(), l.algorithm() == Algorithm::Concurrency)),
        );
        let has_slots = limits
            .iter()
            .any(|(l, _, _)| l.algorithm() == Algorithm::Concurrency);
        let names = limits
            .iter()
            .map(|(l, _, _)| l.name())
            .collect::<Vec<_>>()
            .join(",")
            .into();
        let plans = limits.iter().any(|(l, _, _)| l.plans().len() > 0);
        let settles = limits
            .iter()
            .any(|(_, _, m)| m.as_ref().is_some_and(Metered::settles));
        let charged_by_handler = limits
            .iter()
            .any(|(_, _, m)| m.as_ref().is_some_and(|m| m.by_handler));
        let limits = limits
            .into_iter()
            .map(|(limit, key, metered)| Entry {
                local: match limit.failure_policy() {
                    FailurePolicy::Fallback { replicas } => Some(limit.local_share(replicas)),
                    _ => None,
                },
                metrics: LimitMetrics::new(Arc::clone(limit.name_arc())),
                source: crate::key::source_for_people(&key.describe()).into(),
                limit,
                key,
                metered,
            })
            .collect();
        Ok(LimitSet {
            limits,
            allowlist,
            policy,
            names,
            plans,
            settles,
            charged_by_handler,
            has_slots,
        })
    }
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
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
    /// # fn main() -> Result<(), tollgate::core::ConfigError> {
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

    /// Chooses the plan of a request that has no [`Plan`](crate::Plan) extension with `plan`,
    /// a function of the request (a header, the path, another extension). A request for
    /// which it answers `None` gets every limit's default quota.
    ///
    /// # Examples
    ///
    /// ```
    /// use tollgate::key::Global;
    /// use tollgate::{Limit, Plan, Quota, RateLimitLayer};
    ///
    /// # fn main() -> Result<(), tollgate::core::ConfigError> {
    /// let limit = Limit::gcra("api", Quota::per_minute(10)?)?.plan("partner", Quota::per_minute(100)?)?;
    /// let layer = RateLimitLayer::builder()
    ///     .limit(limit, Global)
    ///     .plan_fn(|req| req.headers().contains_key("x-partner-key").then(|| Plan::new("partner")))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn plan_fn<F>(mut self, plan: F) -> Self
    where
        F: Fn(&RequestView<'_>) -> Option<RequestPlan> + Send + Sync + 'static,
    {
        self.plan_fn = Some(Box::new(plan));
        self
    }

    /// Adds every limit of `limits` (for example from a [`LimitsFile`](crate::LimitsFile)),
    /// and its allowlist.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits.entries.extend(limits.entries);
        self.limits.add_allowlist(limits.allowlist);
        self
    }

    /// Admits the requests that `allowlist` matches without counting them (see
    /// [`Allowlist`]). Adds to the rules already given.
    pub fn allowlist(mut self, allowlist: Allowlist) -> Self {
        self.limits.add_allowlist(allowlist);
        self
    }

    /// Counts the limits in `backend` (Redis, or a configured in-memory backend).
    pub fn backend<B2: Backend>(self, backend: B2) -> RateLimitLayerBuilder<B2> {
        RateLimitLayerBuilder {
            backend,
            limits: self.limits,
            plan_fn: self.plan_fn,
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

    /// Whether admitted responses carry the [`Decision`](crate::Decision) in their extensions
    /// (default yes; refusals always do). Every request carries it either way, for its handler.
    ///
    /// The response's copy is for what runs outside the layer: middleware that logs or counts
    /// decisions, and an outer `RateLimitLayer`, which adds this layer's limits to its own
    /// `Decision` on the response. Without it, an admitted response carries no `Decision` of
    /// this layer. Switching it off saves the response's extension map and the copy (three
    /// allocations; about 825 instructions per admitted request, see `docs/benchmarks.md`).
    pub fn decision_on_allowed(mut self, on: bool) -> Self {
        self.headers.decision_on_allowed = on;
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
        let set = self.limits.compile()?;
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                backend: self.backend,
                set: ArcSwap::from_pointee(set),
                reloads: Mutex::new(0),
                reload_tickets: std::sync::atomic::AtomicU64::new(1),
                plan_fn: self.plan_fn,
                fallback: MemoryBackend::builder()
                    .max_keys(self.fallback_max_keys)
                    .clock(self.fallback_clock)
                    .build(),
                headers: self.headers,
                responder: self.responder,
                grpc_responder: self.grpc_responder,
                unavailable_retry_after: self.unavailable_retry_after,
                last_refusal: response::Last::default(),
            }),
        })
    }
}

impl<B> fmt::Debug for RateLimitLayerBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("limits", &self.limits)
            .field("headers", &self.headers)
            .finish()
    }
}

/// The state every clone of a layer and its services shares.
pub(crate) struct Shared<B> {
    backend: B,
    /// The limits now. A request loads them once (no lock) and keeps them to its decision,
    /// so a reload never changes the limits of a request in flight.
    set: ArcSwap<LimitSet>,
    /// Serialises reloads (never taken by a request), and holds the ticket of the last one
    /// applied.
    reloads: Mutex<u64>,
    /// Numbers reloads in the order they start.
    reload_tickets: std::sync::atomic::AtomicU64,
    /// The plan of a request without a `Plan` extension.
    plan_fn: Option<PlanFn>,
    fallback: MemoryBackend<Arc<dyn Clock>>,
    headers: HeaderConfig,
    responder: Option<Responder>,
    grpc_responder: Option<Responder>,
    unavailable_retry_after: Duration,
    /// The last default `429`'s body and header fields, for the refusals of a flood.
    last_refusal: response::Last<response::Refusal>,
}

/// One version of a layer's limits, checked whole.
pub(crate) struct LimitSet {
    limits: Box<[Entry]>,
    /// The requests admitted without counting; `None` when there is no rule.
    allowlist: Option<Allowlist>,
    /// `RateLimit-Policy` of a request that gets every limit's default quota.
    policy: Option<HeaderValue>,
    /// The limits' names, comma-separated, for the check span.
    names: Box<str>,
    /// Whether any limit has plans (else the request's `Plan` is not looked up).
    plans: bool,
    /// Whether a limit settles after the response (see [`crate::cost`]).
    settles: bool,
    /// Whether a limit is charged by the handler: every admitted request then carries a
    /// [`Settle`](crate::cost::Settle) handle.
    charged_by_handler: bool,
    /// Whether any limit is a concurrency limit (its requests then draw a slot id).
    has_slots: bool,
}

impl fmt::Debug for LimitSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.limits.iter().map(|e| &e.limit))
            .finish()
    }
}

struct Entry {
    limit: Limit,
    key: Box<dyn KeyExtractor>,
    /// Where the cost comes from and how it settles, for a metered limit.
    metered: Option<Metered>,
    /// The quota's local share, for [`FailurePolicy::Fallback`].
    local: Option<Limit>,
    metrics: LimitMetrics,
    /// Where the key comes from, in words (`header "x-shop-domain"`), for a missing key's
    /// refusal.
    source: Box<str>,
}

/// Which limits a batch checked, in order, and which were skipped.
#[derive(Debug)]
pub(crate) struct Plan {
    /// The limits the request started with.
    set: Arc<LimitSet>,
    n: usize,
    limit_of: [usize; MAX_CHECKS],
    /// Per limit, the index of the quota the request got ([`Limit::quota_of`]).
    quota_of: [u8; MAX_CHECKS],
    /// Each checked limit's cost, in the layer's order.
    cost: [u32; MAX_CHECKS],
    /// The request's concurrency slot id (0 when the layer has no concurrency limit).
    slot: u128,
    /// The request's `tollgate.check` span, open from the keys to the decision.
    span: tracing::Span,
}

impl Plan {
    /// The request's concurrency slot id.
    pub(crate) fn slot(&self) -> u128 {
        self.slot
    }
}

pub(crate) enum Prepared<F> {
    Check(F, Plan),
    /// Admitted without asking the backend (allowlisted).
    Admit(Decision),
    Refuse(Response<Bytes>),
}

pub(crate) enum Decided {
    /// Admitted, with what the request owes its metered limits, and the limits it was checked
    /// under when some are concurrency limits (its slots are given back against them).
    Admit(
        Decision,
        Option<(Vec<settle::Item>, Arc<LimitSet>)>,
        Option<Arc<LimitSet>>,
    ),
    Refuse(Response<Bytes>),
}

impl<B: Backend> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("backend", &self.backend.kind())
            .field(
                "limits",
                &self
                    .set
                    .load()
                    .limits
                    .iter()
                    .map(|e| &e.limit)
                    .collect::<Vec<_>>(),
            )
            .field("headers", &self.headers)
            .finish()
    }
}
