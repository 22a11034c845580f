//! The server of known capacity: `W` workers, each request holding one for `S` (a tokio sleep:
//! the time a dependency takes), and an unbounded first-come-first-served queue before them,
//! so that without a limiter the latency grows with the load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post, MethodRouter};
use axum::serve::ListenerExt;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::systems::{LimitGauge, System};
use super::Capacity;

/// The path the control route sets the service time at: `POST /_ctl/service-us/{µs}`.
pub const SERVICE_TIME_PATH: &str = "/_ctl/service-us";
/// The path that answers an adaptive limit's current value (`GET`; 404 for a system without
/// one).
pub const LIMIT_PATH: &str = "/_ctl/limit";

/// The workers and the time a request takes now, shared by every request.
#[derive(Debug)]
pub struct Workers {
    free: Semaphore,
    service_us: AtomicU64,
}

impl Workers {
    /// `capacity.workers` workers taking `capacity.service` per request.
    pub fn new(capacity: Capacity) -> Arc<Self> {
        Arc::new(Workers {
            free: Semaphore::new(capacity.workers as usize),
            service_us: AtomicU64::new(micros(capacity.service)),
        })
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// One request: wait for a worker (in arrival order, however long), hold it for the service
/// time. A request whose client goes away leaves the queue.
async fn work(State(workers): State<Arc<Workers>>) -> StatusCode {
    let Ok(_worker) = workers.free.acquire().await else {
        return StatusCode::INTERNAL_SERVER_ERROR;
    };
    let us = workers.service_us.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_micros(us)).await;
    StatusCode::OK
}

async fn set_service(State(workers): State<Arc<Workers>>, Path(us): Path<u64>) -> StatusCode {
    workers.service_us.store(us, Ordering::Relaxed);
    StatusCode::NO_CONTENT
}

async fn limit(State(gauge): State<Option<LimitGauge>>) -> Result<String, StatusCode> {
    gauge
        .map(|g| g.get().to_string())
        .ok_or(StatusCode::NOT_FOUND)
}

/// The handler every system protects, as a service of its own.
pub fn handler(workers: Arc<Workers>) -> MethodRouter {
    get(work).with_state(workers)
}

/// The whole application: `system` in front of the handler at `/`, and the control route
/// (never limited) that the load generator uses to slow the dependency down.
///
/// # Errors
///
/// When the system cannot be built (a limiter's configuration it refuses).
pub fn app(system: System, capacity: Capacity) -> Result<Router, String> {
    let workers = Workers::new(capacity);
    let (limited, gauge) = system.build(handler(Arc::clone(&workers)), capacity)?;
    let control = Router::new()
        .route(&format!("{SERVICE_TIME_PATH}/{{us}}"), post(set_service))
        .with_state(workers);
    let limit = Router::new()
        .route(LIMIT_PATH, get(limit))
        .with_state(gauge);
    Ok(limited.merge(control).merge(limit))
}

/// Serves `app` on `listener` until the process ends, with `TCP_NODELAY` on every connection.
///
/// # Errors
///
/// When serving fails.
pub async fn serve(listener: TcpListener, app: Router) -> std::io::Result<()> {
    let listener = listener.tap_io(|tcp| {
        // Without it, small answers wait for the peer's delayed ACK; failure costs only speed.
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await
}
