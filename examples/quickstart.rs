//! Run with: cargo run --example quickstart
//!
//! Serves `GET /` on 127.0.0.1:3000 (`PORT` overrides), limited to 5 requests per minute per
//! client IP, counted in memory. Logs go to stderr, filtered by `RUST_LOG` (default `info`). The handler answers with the quota left, read from the
//! `Decision`; the sixth request within a minute gets `429` with `Retry-After`.
//! `GET /metrics` (not rate limited) serves tollgate's metrics in Prometheus' text format.
//!
//! Operators' routes, behind `Authorization: Bearer $ADMIN_TOKEN` (disabled, 403, when
//! `ADMIN_TOKEN` is not set; 401 without the right token):
//! `GET /admin/limits/{limit}/{identity}` answers the identity's state as JSON (`remaining`,
//! `reset_ms`, `retry_after_ms`), consuming nothing; `DELETE` on the same path resets it
//! (204). `PUT /admin/denies/{limit}/{identity}?secs=N` denies the identity for N seconds
//! (403 to its every request; 204), `DELETE` on that path lifts the deny (204). The identity
//! is what requests are counted as: here a client address (an IPv6 address stands for its
//! /64). 404 for an unknown limit, 400 for an identity that is not an address.
//! `GET /admin/top/{limit}?n=10` answers the identities the limit refused most over the last
//! one to two minutes as JSON (`identity`, `count`, `error`, `first_seen_us`,
//! `last_seen_us`), most refused first.
//!
//! ```text
//! for i in 1 2 3 4 5 6; do curl -si localhost:3000/ | grep -iE '^(HTTP|retry-after|ratelimit:)|left'; done
//! curl -s localhost:3000/metrics | grep tollgate_decisions_total
//! curl -s -H "authorization: Bearer $ADMIN_TOKEN" localhost:3000/admin/limits/per-ip/127.0.0.1
//! curl -s -X DELETE -H "authorization: Bearer $ADMIN_TOKEN" localhost:3000/admin/limits/per-ip/127.0.0.1
//! curl -s -H "authorization: Bearer $ADMIN_TOKEN" 'localhost:3000/admin/top/per-ip?n=10'
//! ```

#[path = "support/admin.rs"]
mod admin;
mod support;

use std::net::SocketAddr;
use std::process::ExitCode;

use axum::{routing::get, Router};
use tollgate::key::ClientIp;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    support::init_logging()?;
    let port = support::port(3000)?;
    // Every tollgate metric goes to this recorder; `/metrics` renders it.
    let prometheus = admin::prometheus()?;

    let limits = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(5)?)?,
            ClientIp::peer(),
        )
        .build()?;
    // `route_layer` on the method router: a 404 or 405 never reaches the layer, so it consumes
    // nothing, and `/metrics` scrapes are never limited.
    let app = Router::new()
        .route("/", get(hello).route_layer(limits.clone()))
        .route("/metrics", get(move || async move { prometheus.render() }))
        .merge(admin::routes(limits));

    let listener = support::listen(port).await?;
    tracing::info!(
        "quickstart listening on http://{}: GET / admits 5 a minute per client address",
        listener.local_addr()?
    );
    // Connect info gives `ClientIp` the socket peer; without it every request would be 400.
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service)
        .await
        .map_err(|e| format!("the server stopped: {e}"))?;
    Ok(())
}

async fn hello(decision: Decision) -> String {
    let left = decision.remaining().unwrap_or(0);
    format!("hello! {left} requests left in this minute\n")
}
