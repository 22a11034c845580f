//! Run with: cargo run --example quickstart
//!
//! Serves `GET /` on 127.0.0.1:3000 (`PORT` overrides), limited to 5 requests per minute per
//! client IP, counted in memory. The handler answers with the quota left, read from the
//! `Decision`; the sixth request within a minute gets `429` with `Retry-After`.
//! `GET /metrics` (not rate limited) serves tollgate's metrics in Prometheus' text format.
//!
//! ```text
//! for i in 1 2 3 4 5 6; do curl -si localhost:3000/ | grep -iE '^(HTTP|retry-after|ratelimit:)|left'; done
//! curl -s localhost:3000/metrics | grep tollgate_decisions_total
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::{routing::get, Router};
use metrics_exporter_prometheus::PrometheusBuilder;
use tollgate::key::ClientIp;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Every tollgate metric goes to this recorder; `/metrics` renders it.
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        // Drains histograms into their summaries, so their memory stays bounded.
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });

    let limits = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(5)?)?,
            ClientIp::peer(),
        )
        .build()?;
    // `route_layer` on the method router: a 404 or 405 never reaches the layer, so it consumes
    // nothing, and `/metrics` scrapes are never limited.
    let app = Router::new()
        .route("/", get(hello).route_layer(limits))
        .route("/metrics", get(move || async move { prometheus.render() }));

    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse()?,
        Err(_) => 3000,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("quickstart listening on http://{}", listener.local_addr()?);
    // Connect info gives `ClientIp` the socket peer.
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service).await?;
    Ok(())
}

async fn hello(decision: Decision) -> String {
    let left = decision.remaining().unwrap_or(0);
    format!("hello! {left} requests left in this minute\n")
}
