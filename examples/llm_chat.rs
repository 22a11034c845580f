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
//! Each shop also has a budget of `TOKENS_PER_HOUR` tokens (default 20,000), counted in Redis
//! too. A request's tokens are the UTF-8 bytes of its JSON body's `message` (standing in for
//! the model's count, known once it has answered). The request reserves its `content-length`
//! as an estimate when it is admitted; the handler reports the actual count, and the
//! difference is given back (or taken). A body that is not JSON is `400`, a JSON body that is not
//! an object or whose `message` is not a string is `422` (no `message` is no tokens): neither consumes anything, from either limit. A request without
//! a body is a message of no tokens. If Redis fails, the token budget is kept in each copy's
//! memory, at its share of the budget (`REPLICAS` copies, default 2): an outage cannot open it
//! without bound.
//!
//! At most `CONCURRENCY_PER_SHOP` (default 4) requests per shop are in flight at once, across
//! every replica (a slot per request in Redis; with Redis down, each copy keeps its share
//! locally, as for the token budget). The JSON body is optional; its `delay_ms` (0 to 10000) makes the handler
//! take that long, standing in for a slow model. Anything else in `delay_ms`, or a body that
//! is not a JSON object, gets `400`.
//!
//! ```text
//! redis-server --port 6379 --save '' &
//! TOKENS_PER_HOUR=1000 cargo run --example llm_chat &
//! msg=$(printf 'a%.0s' $(seq 1 300))
//! for i in $(seq 1 4); do
//!   curl -s -o /dev/null -w '%{http_code} ' -X POST -H 'x-shop-domain: demo.myshopify.com' \
//!     -d "{\"message\":\"$msg\"}" localhost:3000/api/chat
//! done   # 200 200 200 429
//! ```

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderName, StatusCode};
use axum::{routing::get, routing::post, Extension, Router};
use metrics_exporter_prometheus::PrometheusBuilder;
use tollgate::cost::{parse_units, Metered, Settle};
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
    let tokens_per_hour: u32 = match std::env::var("TOKENS_PER_HOUR") {
        Ok(n) => n.parse()?,
        Err(_) => 20_000,
    };
    let replicas = match std::env::var("REPLICAS") {
        Ok(n) => n.parse()?,
        Err(_) => NonZeroU32::MIN.saturating_add(1),
    };
    // Starts without Redis if it is down: the limits' failure policies apply until it is back.
    // `REDIS_CLUSTER` (seed URLs, comma-separated) names a Redis Cluster instead.
    let backend = match std::env::var("REDIS_CLUSTER") {
        Ok(seeds) => RedisBackend::builder().cluster(seeds.split(',')).build()?,
        Err(_) => RedisBackend::builder().url(redis_url.as_str()).build()?,
    };
    // Connect before the first request, so that it does not pay for the connection within
    // its deadline (and apply the failure policy for nothing). Redis may still be down.
    let _ = backend.ping().await;

    let in_flight: u32 = match std::env::var("CONCURRENCY_PER_SHOP") {
        Ok(n) => n.parse()?,
        Err(_) => 4,
    };
    let limits = RateLimitLayer::builder()
        .metered(
            Limit::gcra("chat-per-shop", Quota::per_minute(30)?)?.fail_open(),
            Tenant::header("x-shop-domain"),
            // A body that is not a message is refused by the handler and not counted.
            Metered::new().count_if(|r| !is_bad_message(r.status())),
        )
        .metered(
            Limit::gcra("tokens-per-shop", Quota::per_hour(tokens_per_hour)?)?.fallback(replicas),
            Tenant::header("x-shop-domain"),
            Metered::new()
                // The estimate: the body's size, at most the whole budget. No body, no tokens.
                .cost_from(move |req| {
                    match req.headers().get(CONTENT_LENGTH) {
                        None => Ok(0),
                        Some(v) => parse_units(Some(v.as_bytes())),
                    }
                    .map(|n| n.min(tokens_per_hour))
                })
                .charged_by_handler()
                .count_if(|r| r.status().is_success()),
        )
        // A slow model call holds a slot: one shop cannot take every worker.
        .limit(
            Limit::concurrency("chat-in-flight", in_flight)?.fallback(replicas),
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
        "llm_chat listening on http://{} (Redis at {redis_url}, {tokens_per_hour} tokens an hour per shop)",
        listener.local_addr()?
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}

fn is_bad_message(status: StatusCode) -> bool {
    status == StatusCode::BAD_REQUEST || status == StatusCode::UNPROCESSABLE_ENTITY
}

type Reply = (StatusCode, [(HeaderName, &'static str); 1], String);

/// Stands in for the expensive call; reports the tokens it used and what the limiter decided.
async fn chat(decision: Decision, settle: Option<Extension<Settle>>, body: Bytes) -> Reply {
    let json = [(CONTENT_TYPE, "application/json")];
    let tokens = if body.is_empty() {
        0
    } else {
        let value = match serde_json::from_slice::<serde_json::Value>(&body) {
            Err(_) => {
                let error = "{\"error\":\"the body is not JSON\"}".to_owned();
                return (StatusCode::BAD_REQUEST, json, error);
            }
            Ok(value) => value,
        };
        // A slow model: `delay_ms`, 0 to 10,000.
        if let Some(delay) = value.get("delay_ms") {
            let Some(ms) = delay.as_u64().filter(|ms| *ms <= 10_000) else {
                let error =
                    "{\"error\":\"delay_ms must be a whole number from 0 to 10000\"}".to_owned();
                return (StatusCode::BAD_REQUEST, json, error);
            };
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        // No `message` is a message of no tokens (a call that only waits); a `message` that is
        // not a string, or a body that is not an object, is unprocessable.
        let message = match (value.is_object(), value.get("message")) {
            (true, None) => Some(0),
            (_, Some(m)) => m.as_str().map(str::len),
            (false, None) => None,
        };
        let Some(tokens) = message else {
            let error = "{\"error\":\"the body has no string \\\"message\\\"\"}".to_owned();
            return (StatusCode::UNPROCESSABLE_ENTITY, json, error);
        };
        tokens
    };
    // The model has answered: its count is the request's actual cost.
    // (No handle: the token budget was not counted, its backend and fallback both failed.)
    if let Some(Extension(settle)) = settle {
        settle.charge(u32::try_from(tokens).unwrap_or(u32::MAX));
    }
    let body = match decision.get("chat-per-shop").map(|d| *d.outcome()) {
        Some(tollgate::Outcome::Allowed { remaining, .. }) => {
            format!("{{\"reply\":\"Your order is on its way.\",\"limited\":true,\"remaining\":{remaining},\"tokens\":{tokens}}}")
        }
        _ => format!(
            "{{\"reply\":\"Your order is on its way.\",\"limited\":false,\"remaining\":null,\"tokens\":{tokens}}}"
        ),
    };
    (StatusCode::OK, json, body)
}
