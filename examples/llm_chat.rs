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
//! At most `CONCURRENCY_PER_SHOP` (default 4) requests per shop are in flight at once, across
//! every replica (a slot per request in Redis; with Redis down, each of two replicas keeps
//! half locally). The JSON body is optional; its `delay_ms` (0 to 10000) makes the handler
//! take that long, standing in for a slow model. Anything else in `delay_ms`, or a body that
//! is not a JSON object, gets `400`.
//!
//! ```text
//! redis-server --port 6379 --save '' &
//! cargo run --example llm_chat &
//! for i in $(seq 1 31); do
//!   curl -s -o /dev/null -w '%{http_code} ' -X POST -H 'x-shop-domain: demo.myshopify.com' localhost:3000/api/chat
//! done
//! ```

use std::net::SocketAddr;
use std::num::NonZeroU32;
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
    let backend = RedisBackend::builder().url(redis_url.as_str()).build()?;
    // Connect before the first request, so that it does not pay for the connection within
    // its deadline (and apply the failure policy for nothing). Redis may still be down.
    let _ = backend.ping().await;

    let in_flight: u32 = match std::env::var("CONCURRENCY_PER_SHOP") {
        Ok(n) => n.parse()?,
        Err(_) => 4,
    };
    let limits = RateLimitLayer::builder()
        .limit(
            Limit::gcra("chat-per-shop", Quota::per_minute(30)?)?.fail_open(),
            Tenant::header("x-shop-domain"),
        )
        // A slow model call holds a slot: one shop cannot take every worker.
        .limit(
            Limit::concurrency("chat-in-flight", in_flight)?
                .fallback(NonZeroU32::MIN.saturating_add(1)),
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
async fn chat(
    decision: Decision,
    body: axum::body::Bytes,
) -> Result<
    ([(axum::http::HeaderName, &'static str); 1], String),
    (axum::http::StatusCode, &'static str),
> {
    let bad = |why| (axum::http::StatusCode::BAD_REQUEST, why);
    if !body.is_empty() {
        let json: serde_json::Value =
            serde_json::from_slice(&body).map_err(|_| bad("the body is not JSON\n"))?;
        let object = json
            .as_object()
            .ok_or(bad("the body is not a JSON object\n"))?;
        if let Some(delay) = object.get("delay_ms") {
            let ms = delay
                .as_u64()
                .filter(|ms| *ms <= 10_000)
                .ok_or(bad("delay_ms must be a whole number from 0 to 10000\n"))?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
    let body = match decision.get("chat-per-shop").map(|d| *d.outcome()) {
        Some(tollgate::Outcome::Allowed { remaining, .. }) => {
            format!("{{\"reply\":\"Your order is on its way.\",\"limited\":true,\"remaining\":{remaining}}}")
        }
        _ => "{\"reply\":\"Your order is on its way.\",\"limited\":false,\"remaining\":null}"
            .to_owned(),
    };
    Ok(([(CONTENT_TYPE, "application/json")], body))
}
