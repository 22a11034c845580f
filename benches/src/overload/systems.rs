//! The systems compared, each in front of the same handler: no limiter, a static concurrency
//! limit at the known capacity, tower-acc's Gradient2, and tollgate
//! ([`tollgate_adaptive`], the one place that builds it).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::routing::MethodRouter;
use axum::Router;
use tollgate::key::Global;
use tollgate::{Limit, RateLimitLayer};
use tower::ServiceBuilder;

use super::{Capacity, Class};

/// One system in front of the handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    /// No limiter: every request waits for a worker, however long the queue.
    None,
    /// tower's `ConcurrencyLimit` at the known capacity `W`, behind `LoadShed`: a request that
    /// finds `W` in flight is refused at once (503) instead of queued.
    Static,
    /// tower-acc's `Gradient2` adaptive limit behind `LoadShed`: refused (503) above the
    /// limit it has learnt.
    TowerAcc,
    /// tollgate, as [`tollgate_adaptive`] builds it.
    Tollgate,
}

impl System {
    /// Every system, in the order a run measures them (`None` first: it gives the unloaded
    /// latency).
    pub const ALL: [System; 4] = [
        System::None,
        System::Static,
        System::TowerAcc,
        System::Tollgate,
    ];

    /// Its name on the command line and in the table.
    pub fn name(self) -> &'static str {
        match self {
            System::None => "none",
            System::Static => "static",
            System::TowerAcc => "tower-acc",
            System::Tollgate => "tollgate",
        }
    }

    /// The system a name names.
    pub fn parse(name: &str) -> Option<System> {
        System::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The system in front of `handler`, at `/`, and the gauge of its limit when it has one
    /// that moves.
    ///
    /// # Errors
    ///
    /// When the limiter refuses its configuration.
    pub fn build(
        self,
        handler: MethodRouter,
        capacity: Capacity,
    ) -> Result<(Router, Option<LimitGauge>), String> {
        let router = Router::new();
        let gauge = LimitGauge::default();
        let with_gauge = matches!(self, System::TowerAcc);
        let router = match self {
            System::None => router.route_service("/", handler),
            System::Static => router.route_service(
                "/",
                ServiceBuilder::new()
                    .layer(HandleErrorLayer::new(shed))
                    .load_shed()
                    .concurrency_limit(capacity.workers as usize)
                    .service(handler),
            ),
            System::TowerAcc => router.route_service(
                "/",
                ServiceBuilder::new()
                    .layer(HandleErrorLayer::new(shed))
                    .load_shed()
                    .layer(tower_acc::ConcurrencyLimitLayer::new(Gauged {
                        inner: gradient2(),
                        gauge: gauge.clone(),
                    }))
                    .service(handler),
            ),
            System::Tollgate => tollgate_adaptive(handler, capacity).map_err(|e| e.to_string())?,
        };
        Ok((router, with_gauge.then_some(gauge)))
    }
}

/// An adaptive limit's current value, as its limiter last set it.
#[derive(Clone, Debug, Default)]
pub struct LimitGauge(Arc<AtomicUsize>);

impl LimitGauge {
    /// The limit now.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, limit: usize) {
        self.0.store(limit, Ordering::Relaxed);
    }
}

/// A tower-acc algorithm that also publishes its limit.
#[derive(Clone, Debug)]
struct Gauged<A> {
    inner: A,
    gauge: LimitGauge,
}

impl<A: tower_acc::Algorithm> tower_acc::Algorithm for Gauged<A> {
    fn max_concurrency(&self) -> usize {
        let limit = self.inner.max_concurrency();
        self.gauge.set(limit);
        limit
    }

    fn update(&mut self, rtt: Duration, num_inflight: usize, is_error: bool, is_canceled: bool) {
        self.inner.update(rtt, num_inflight, is_error, is_canceled);
        self.gauge.set(self.inner.max_concurrency());
    }
}

/// tower-acc's Gradient2 with its defaults (smoothing 0.2, RTT tolerance 1.5, a long window
/// of 600 samples), between the bounds tollgate's adaptive limit is given (4 to 512) and
/// starting at its default initial limit (20).
fn gradient2() -> tower_acc::Gradient2 {
    tower_acc::Gradient2::builder()
        .initial_limit(20)
        .min_limit(4)
        .max_limit(512)
        .build()
}

/// `LoadShed`'s refusal: 503 with `Retry-After`, as a shedding server answers.
async fn shed(_: tower::BoxError) -> (StatusCode, [(header::HeaderName, &'static str); 1]) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
    )
}

/// tollgate's system: the one place that builds it.
///
/// Today it is tollgate's static concurrency limit at the known capacity `W` (one key for
/// the whole server: [`Global`]), which refuses (429) what finds `W` in flight. The adaptive
/// limit with priority classes replaces the limit and inserts each request's class, as the
/// comments below say; nothing else in the benchmark changes.
///
/// # Errors
///
/// When tollgate refuses the configuration.
pub fn tollgate_adaptive(
    handler: MethodRouter,
    capacity: Capacity,
) -> Result<Router, tollgate::engine::ConfigError> {
    let layer = RateLimitLayer::builder()
        // Adaptive: `.adaptive(Adaptive::gradient().min(4).max(512), Global)` instead.
        .limit(Limit::concurrency("in-flight", capacity.workers)?, Global)
        .build()?;
    let service = ServiceBuilder::new()
        .map_request(|mut request: Request| {
            let class = Class::of(request.headers());
            // Adaptive: insert `tollgate::Priority::{Critical, Default, Batch}` for `class`.
            request.extensions_mut().insert(class);
            request
        })
        .layer(layer)
        .service(handler);
    Ok(Router::new().route_service("/", service))
}
