//! Run with: cargo run --example llm_chat
//!
//! The per-shop LLM endpoint: `POST /api/chat` on 127.0.0.1:`PORT` (default 3000), limited to
//! 30 requests per minute per shop, the shop taken from the `x-shop-domain` header (validated:
//! missing or invalid is `400`). The limit lives in Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), so two copies of this server on two ports, pointed at one Redis,
//! enforce 30 per shop in total. If Redis fails the limit fails open, and says so: the reply's
//! `limited` is `false`, `tollgate_bypass_total` rises on `GET /metrics`, and a canary that
//! probes Redis every 10 s sets `tollgate_canary_ok`.
//!
//! ```text
//! redis-server --port 6379 --save '' &
//! cargo run --example llm_chat &
//! for i in $(seq 1 31); do
//!   curl -s -o /dev/null -w '%{http_code} ' -X POST -H 'x-shop-domain: demo.myshopify.com' localhost:3000/api/chat
//! done
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::header::CONTENT_TYPE;
use axum::{routing::get, routing::post, Router};
use metrics_exporter_prometheus::PrometheusBuilder;
use tollgate::key::Tenant;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
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

    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    // Starts without Redis if it is down: the limit's failure policy applies until it is back.
    // `REDIS_CLUSTER` (seed URLs, comma-separated) names a Redis Cluster instead.
    let backend = match std::env::var("REDIS_CLUSTER") {
        Ok(seeds) => RedisBackend::builder().cluster(seeds.split(',')).build()?,
        Err(_) => RedisBackend::builder().url(redis_url.as_str()).build()?,
    };

    let limits = RateLimitLayer::builder()
        .limit(
            Limit::gcra("chat-per-shop", Quota::per_minute(30)?)?.fail_open(),
            Tenant::header("x-shop-domain"),
        )
        .backend(backend.clone())
        .build()?;

    // A synthetic key that must always be denied: the gauge drops if Redis dies or forgets.
    let _canary = tollgate::Canary::new(backend, Duration::from_secs(10)).spawn();

    let app = Router::new()
        // `route_layer` on the method router: a 404 or 405 never reaches the layer, so it
        // consumes nothing, and `/metrics` scrapes are never limited.
        .route("/api/chat", post(chat).route_layer(limits))
        .route("/metrics", get(move || async move { prometheus.render() }));

    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse()?,
        Err(_) => 3000,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!(
        "llm_chat listening on http://{} (Redis at {redis_url})",
        listener.local_addr()?
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

/// Stands in for the expensive call; reports what the limiter decided.
async fn chat(decision: Decision) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    let body = match decision.get("chat-per-shop").map(|d| *d.outcome()) {
        Some(tollgate::Outcome::Allowed { remaining, .. }) => {
            format!("{{\"reply\":\"Your order is on its way.\",\"limited\":true,\"remaining\":{remaining}}}")
        }
        _ => "{\"reply\":\"Your order is on its way.\",\"limited\":false,\"remaining\":null}"
            .to_owned(),
    };
    ([(CONTENT_TYPE, "application/json")], body)
}
