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
use tollgate::{Adaptive, Priority, RateLimitLayer};
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
        let published = Arc::new(AtomicUsize::new(0));
        let mut gauge = None;
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
                    .layer(tower_acc::ConcurrencyLimitLayer::new(Published {
                        inner: gradient2(),
                        limit: Arc::clone(&published),
                    }))
                    .service(handler),
            ),
            System::Tollgate => {
                let (router, limit) = tollgate_adaptive(handler).map_err(|e| e.to_string())?;
                gauge = limit;
                router
            }
        };
        if self == System::TowerAcc {
            gauge = Some(LimitGauge::new(move || published.load(Ordering::Relaxed)));
        }
        Ok((router, gauge))
    }
}

/// An adaptive limit's current value, read from its limiter.
#[derive(Clone)]
pub struct LimitGauge(Arc<dyn Fn() -> usize + Send + Sync>);

impl LimitGauge {
    /// A gauge that reads `read`.
    pub fn new(read: impl Fn() -> usize + Send + Sync + 'static) -> Self {
        LimitGauge(Arc::new(read))
    }

    /// The limit now.
    pub fn get(&self) -> usize {
        (self.0)()
    }
}

impl std::fmt::Debug for LimitGauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LimitGauge").field(&self.get()).finish()
    }
}

/// A tower-acc algorithm that also publishes its limit.
#[derive(Clone, Debug)]
struct Published<A> {
    inner: A,
    limit: Arc<AtomicUsize>,
}

impl<A: tower_acc::Algorithm> tower_acc::Algorithm for Published<A> {
    fn max_concurrency(&self) -> usize {
        let limit = self.inner.max_concurrency();
        self.limit.store(limit, Ordering::Relaxed);
        limit
    }

    fn update(&mut self, rtt: Duration, num_inflight: usize, is_error: bool, is_canceled: bool) {
        self.inner.update(rtt, num_inflight, is_error, is_canceled);
        self.limit
            .store(self.inner.max_concurrency(), Ordering::Relaxed);
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

/// tollgate's system: the one place that builds it, and the gauge of its limit.
///
/// tollgate's adaptive concurrency limit (a gradient, between 4 and 512, its defaults
/// otherwise), one key for the whole server ([`Global`]), each request's class from its
/// `x-priority` as a [`Priority`] extension. A shed request gets 503 with `Retry-After`.
///
/// # Errors
///
/// When tollgate refuses the configuration.
pub fn tollgate_adaptive(
    handler: MethodRouter,
) -> Result<(Router, Option<LimitGauge>), tollgate::engine::ConfigError> {
    let layer = RateLimitLayer::builder()
        .adaptive(Adaptive::gradient().min(4).max(512), Global)
        .build()?;
    let gauge = layer
        .adaptive()
        .map(|limit| LimitGauge::new(move || limit.limit() as usize));
    let service = ServiceBuilder::new()
        .map_request(|mut request: Request| {
            let priority = match Class::of(request.headers()) {
                Class::Critical => Priority::Critical,
                Class::Default => Priority::Default,
                Class::Batch => Priority::Batch,
            };
            request.extensions_mut().insert(priority);
            request
        })
        .layer(layer)
        .service(handler);
    Ok((Router::new().route_service("/", service), gauge))
}
