//! Run with: cargo run --example overload
//!
//! Serves `GET /work` on 127.0.0.1:3000 (`PORT` overrides) in front of a service that can do
//! 4 things at once: each request takes a worker of 4 for `WORK_MS` milliseconds (default 50)
//! of real time, and waits for one when all are busy. An adaptive concurrency limit learns
//! that capacity from the latency and sheds what it cannot serve; a per-IP rate limit (100 a
//! second) stacks with it. Logs go to stderr, filtered by `RUST_LOG` (default `info`).
//!
//! - `200` with `done (<class>, waited <n> ms in the queue)`: admitted.
//! - `503 Service Unavailable` with `Retry-After: 1` and a problem+json body: shed, the
//!   server is overloaded (it consumed nothing of the rate limit).
//! - `429 Too Many Requests` with `Retry-After`: the client is over its 100 a second.
//!
//! The class comes from the `x-priority` header (`critical`, `default`, `batch`, or a level
//! 0 to 99; absent or anything else: `default`): this example trusts it, as a service behind
//! a gateway that writes it would. Under load, `batch` is shed first and `critical` keeps
//! 20% of the limit. `GET /metrics` (not limited) serves the metrics in Prometheus' text
//! format: `tollgate_adaptive_limit`, `tollgate_adaptive_in_flight`,
//! `tollgate_adaptive_min_rtt_seconds`, `tollgate_adaptive_queue_depth`,
//! `tollgate_adaptive_shed_total{priority,reason}`.
//!
//! ```text
//! curl -si localhost:3000/work
//! # 40 at once, half of them batch: watch the batch ones get 503 first.
//! for i in $(seq 40); do curl -s -o /dev/null -w '%{http_code} ' -H "x-priority: $([ $((i % 2)) = 0 ] && echo batch || echo critical)" localhost:3000/work & done; wait; echo
//! curl -s localhost:3000/metrics | grep tollgate_adaptive
//! ```

mod support;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::{routing::get, Extension, Router};
use http::HeaderName;
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::sync::Semaphore;
use tollgate::key::ClientIp;
use tollgate::{Adaptive, Decision, Limit, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    support::init_logging()?;
    let port = support::port(3000)?;
    let work = match std::env::var("WORK_MS") {
        Ok(ms) => Duration::from_millis(
            ms.parse()
                .map_err(|e| format!("WORK_MS={ms:?} is not a number of milliseconds: {e}"))?,
        ),
        Err(_) => Duration::from_millis(50),
    };
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the Prometheus metrics recorder: {e}"))?;

    let limits = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_second(100)?)?,
            ClientIp::peer(),
        )
        .adaptive(
            Adaptive::gradient()
                .name("work")
                .min(2)
                .initial(8)
                .max(200)
                .timeout(Duration::from_secs(2))
                .queue(50, Duration::from_millis(100))
                .priority_header(HeaderName::from_static("x-priority")),
            ClientIp::peer(),
        )
        .build()?;
    // The service's own capacity: 4 workers.
    let workers = Arc::new(Semaphore::new(4));
    let app = Router::new()
        .route(
            "/work",
            get(handle)
                .route_layer(limits)
                .layer(Extension((workers, work))),
        )
        .route("/metrics", get(move || async move { prometheus.render() }));

    let listener = support::listen(port).await?;
    tracing::info!(
        "overload listening on http://{}: GET /work takes one of 4 workers for {} ms",
        listener.local_addr()?,
        work.as_millis()
    );
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service)
        .await
        .map_err(|e| format!("the server stopped: {e}"))?;
    Ok(())
}

async fn handle(
    Extension((workers, work)): Extension<(Arc<Semaphore>, Duration)>,
    decision: Decision,
) -> String {
    // The semaphore is never closed.
    let _worker = workers.acquire().await;
    tokio::time::sleep(work).await;
    let (class, waited) = match decision.adaptive() {
        Some(part) => (
            part.priority().label(),
            part.queued().unwrap_or_default().as_millis(),
        ),
        None => ("default".to_owned(), 0),
    };
    format!("done ({class}, waited {waited} ms in the queue)\n")
}
