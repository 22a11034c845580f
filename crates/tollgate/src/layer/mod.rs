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
use http::{HeaderValue, Request, Response};
use tollgate_core::{
    Backend, BackendError, Check, Clock, ConfigError, FailurePolicy, Limit, MemoryBackend,
    MissingKeyPolicy, SystemClock, Verdicts, MAX_CHECKS,
};
use tower_layer::Layer;

use crate::decision::{Decision, DenyReason, LimitDecision, Outcome, SkipReason, Source};
use crate::key::{Key, KeyExtractor, MissingKey, RequestView};
use crate::metrics::{self as obs, LimitMetrics};
use crate::response::{self, HeaderConfig, Rejection, RejectionKind};

mod future;
mod service;

pub use future::ResponseFuture;
pub use service::RateLimit;

/// The key of the one bucket shared by keyless requests ([`MissingKeyPolicy::SharedBucket`]).
/// Extracted keys cannot take this value: IP keys start with a 4 or 6 byte, tenants are ASCII.
const SHARED_BUCKET: &[u8] = b"\xffshared-bucket";

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
///     .layer(layer);
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
    pub fn on_rejection<F>(mut self, respond: F) -> Self
    where
        F: Fn(&Rejection<'_>) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.responder = Some(Box::new(respond));
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
    /// [`MAX_CHECKS`]) or [`ConfigError::DuplicateName`].
    pub fn build(self) -> Result<RateLimitLayer<B>, ConfigError> {
        if self.limits.is_empty() {
            return Err(ConfigError::NoLimits);
        }
        if self.limits.len() > MAX_CHECKS {
            return Err(ConfigError::TooManyLimits);
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
                unavailable_retry_after: self.unavailable_retry_after,
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
    unavailable_retry_after: Duration,
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
    /// The request's `tollgate.check` span, open from the keys to the decision.
    span: tracing::Span,
}

pub(crate) enum Prepared<F> {
    Check(F, Plan),
    Refuse(Response<Bytes>),
}

pub(crate) enum Decided {
    Admit(Decision),
    Refuse(Response<Bytes>),
}

impl<B: Backend> Shared<B> {
    /// Extracts every key and starts the backend call; or refuses a request without a key.
    pub(crate) fn prepare<T>(&self, req: &Request<T>) -> Prepared<B::Future> {
        // Only a subscriber that wants debug spans gets one (`names` is built once, when the
        // layer is). Otherwise the span is `none`: a disabled span still costs, on every
        // request, what `tracing`'s `log` compatibility does when no subscriber is set (its
        // fields formatted, each enter and exit checked against the `log` level).
        let span = if tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "tollgate.check",
                limits = &*self.names,
                outcome = tracing::field::Empty,
                decision = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let view = RequestView::new(req);
        let mut keys: [Option<Key<'_>>; MAX_CHECKS] = Default::default();
        let mut plan = Plan {
            n: 0,
            limit_of: [0; MAX_CHECKS],
            skipped: [false; MAX_CHECKS],
            span,
        };
        for (i, entry) in self.limits.iter().enumerate() {
            match key_of(entry, &view) {
                Ok(Some(key)) => keys[i] = Some(key),
                Ok(None) => plan.skipped[i] = true,
                Err(missing) => {
                    entry.metrics.record_missing_key(&plan.span);
                    return Prepared::Refuse(self.refuse(&Rejection::new(
                        RejectionKind::MissingKey(missing),
                        entry.limit.name(),
                        None,
                        None,
                    )));
                }
            }
        }
        let mut checks = [Check::new(&self.limits[0].limit, b""); MAX_CHECKS];
        for (i, (entry, key)) in self.limits.iter().zip(&keys).enumerate() {
            if let Some(key) = key {
                checks[plan.n] = Check::new(&entry.limit, key.as_bytes());
                plan.limit_of[plan.n] = i;
                plan.n += 1;
            }
        }
        let check = plan.span.in_scope(|| self.backend.check(&checks[..plan.n]));
        Prepared::Check(check, plan)
    }

    /// Turns the backend's answer into a decision, or a refusal.
    ///
    /// The answer is borrowed: the verdicts of a batch are a few hundred bytes, and this runs
    /// on every request.
    pub(crate) fn decide<T>(
        &self,
        result: &Result<Verdicts, BackendError>,
        req: &Request<T>,
        plan: &Plan,
    ) -> Decided {
        // Warnings about bypasses and capacity are logged inside the request's span.
        let _entered = plan.span.enter();
        let decision = match result {
            Ok(verdicts) if verdicts.len() == plan.n => {
                // Every verdict came back: each limit's outcome is its verdict, or a skip for
                // a limit that had no key, in the layer's order.
                let mut checked = plan.limit_of[..plan.n].iter().zip(verdicts.iter());
                let mut next = checked.next();
                self.limits
                    .iter()
                    .enumerate()
                    .map(|(i, entry)| {
                        let outcome = match next {
                            Some((&at, verdict)) if at == i => {
                                next = checked.next();
                                Outcome::from_verdict(verdict)
                            }
                            _ => Outcome::Skipped {
                                reason: SkipReason::MissingKey,
                            },
                        };
                        entry.decision(outcome, Source::Backend)
                    })
                    .collect()
            }
            Ok(verdicts) => {
                let error = BackendError::new(
                    tollgate_core::BackendErrorKind::Protocol,
                    format!("{} verdicts for {} checks", verdicts.len(), plan.n),
                );
                self.decide_failure(&error, req, plan)
            }
            Err(error) => self.decide_failure(error, req, plan),
        };
        let admitted = decision.is_admitted();
        for (entry, d) in self.limits.iter().zip(decision.limits()) {
            entry.metrics.record(d, admitted);
        }
        obs::record_span(&plan.span, &decision);
        if admitted {
            return Decided::Admit(decision);
        }
        let (kind, limit) = response::refusal_of(&decision)
            .unwrap_or((RejectionKind::TooManyRequests, self.limits[0].limit.name()));
        let mut response = self.refuse(&Rejection::new(
            kind,
            limit,
            decision.retry_after(),
            Some(&decision),
        ));
        // Refusals always carry the rate-limit fields: they say when to come back.
        self.stamp(&mut response, decision, true);
        Decided::Refuse(response)
    }

    /// The decision when the backend failed: each checked limit's failure policy.
    fn decide_failure<T>(&self, error: &BackendError, req: &Request<T>, plan: &Plan) -> Decision {
        let mut outcomes = [(
            Outcome::Skipped {
                reason: SkipReason::MissingKey,
            },
            Source::Backend,
        ); MAX_CHECKS];
        self.on_failure(error, req, plan, &mut outcomes);
        // A refused request went nowhere: a fail-open limit beside the one that refused it
        // bypassed nothing, and must not say it did.
        let refused = self
            .limits
            .iter()
            .zip(&outcomes)
            .any(|(entry, (outcome, _))| !entry.limit.is_shadow() && !outcome.admits());
        if refused {
            for (outcome, _) in &mut outcomes {
                if let Outcome::Bypassed { .. } = outcome {
                    *outcome = Outcome::Skipped {
                        reason: SkipReason::NotChecked,
                    };
                }
            }
        }
        self.limits
            .iter()
            .zip(outcomes)
            .map(|(entry, (outcome, source))| entry.decision(outcome, source))
            .collect()
    }

    /// Applies each checked limit's failure policy.
    fn on_failure<T>(
        &self,
        error: &BackendError,
        req: &Request<T>,
        plan: &Plan,
        outcomes: &mut [(Outcome, Source); MAX_CHECKS],
    ) {
        let mut closed = false;
        let mut fallback = [false; MAX_CHECKS];
        for &i in &plan.limit_of[..plan.n] {
            outcomes[i].0 = match self.limits[i].limit.failure_policy() {
                FailurePolicy::FailClosed => {
                    // A shadow limit refuses nothing, so it must not switch off the fallback
                    // of the enforced limits beside it either.
                    closed |= !self.limits[i].limit.is_shadow();
                    Outcome::Denied {
                        retry_after: Some(self.unavailable_retry_after),
                        remaining: 0,
                        reset: Duration::ZERO,
                        reason: DenyReason::BackendUnavailable,
                    }
                }
                FailurePolicy::Fallback { .. } => {
                    fallback[i] = true;
                    Outcome::Skipped {
                        reason: SkipReason::NotChecked,
                    }
                }
                _ => Outcome::Bypassed {
                    reason: error.kind().into(),
                },
            };
        }
        if closed || !fallback.contains(&true) {
            return;
        }
        // The keys were borrowed from the request; extracting them again is cheaper than
        // copying them on every request for the rare failure.
        let view = RequestView::new(req);
        let mut keys: [Option<Key<'_>>; MAX_CHECKS] = Default::default();
        for (i, entry) in self.limits.iter().enumerate() {
            if fallback[i] {
                keys[i] = key_of(entry, &view).ok().flatten();
            }
        }
        let mut checks = [Check::new(&self.limits[0].limit, b""); MAX_CHECKS];
        let mut index = [0usize; MAX_CHECKS];
        let mut n = 0;
        for (i, (entry, key)) in self.limits.iter().zip(&keys).enumerate() {
            if let (Some(local), Some(key)) = (&entry.local, key) {
                checks[n] = Check::new(local, key.as_bytes());
                index[n] = i;
                n += 1;
            }
        }
        if let Ok(verdicts) = self.fallback.check_now(&checks[..n]) {
            for (j, verdict) in verdicts.iter().enumerate() {
                outcomes[index[j]] = (Outcome::from_verdict(verdict), Source::Fallback);
            }
        }
    }

    fn refuse(&self, rejection: &Rejection<'_>) -> Response<Bytes> {
        let mut response = match &self.responder {
            Some(respond) => respond(rejection),
            None => response::default_response(rejection),
        };
        response::write_retry_after(response.headers_mut(), rejection.retry_after());
        response
    }

    /// Adds the decision and (if configured) the rate-limit fields to an admitted response.
    pub(crate) fn finish<T>(&self, response: &mut Response<T>, decision: Decision) {
        self.stamp(response, decision, self.headers.on_allowed);
    }

    /// Puts the decision in the response's extensions, and the rate-limit fields if `fields`.
    fn stamp<T>(&self, response: &mut Response<T>, decision: Decision, fields: bool) {
        if fields {
            response::write_headers(
                response.headers_mut(),
                &decision,
                self.policy.as_ref(),
                self.headers,
            );
        }
        // Under this layer, another one decided too (it refused, or admitted): the response
        // carries both layers' limits, this one's first, as its fields do.
        if let Some(inner) = response.extensions_mut().insert(decision) {
            if let Some(mine) = response.extensions_mut().remove::<Decision>() {
                response.extensions_mut().insert(mine.then(&inner));
            }
        }
    }
}

impl Entry {
    /// This limit's part of a decision.
    fn decision(&self, outcome: Outcome, source: Source) -> LimitDecision {
        LimitDecision::new(
            Arc::clone(self.limit.name_arc()),
            *self.limit.quota(),
            outcome,
            source,
            self.limit.is_shadow(),
        )
    }
}

fn key_of<'r>(entry: &Entry, view: &RequestView<'r>) -> Result<Option<Key<'r>>, MissingKey> {
    match entry.key.extract(view) {
        Ok(key) => Ok(Some(key)),
        Err(missing) => match entry.limit.missing_key_policy() {
            // A shadow limit never refuses a request, not even one without its key.
            _ if entry.limit.is_shadow() => Ok(None),
            MissingKeyPolicy::Skip => Ok(None),
            MissingKeyPolicy::SharedBucket => Key::borrowed(SHARED_BUCKET).map(Some),
            _ => Err(missing),
        },
    }
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
