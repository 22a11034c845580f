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
//! (204). The identity is what requests are counted as: here a client address (an IPv6
//! address stands for its /64). 404 for an unknown limit, 400 for an identity that is not
//! an address. `GET /admin/top/{limit}?n=10` answers the identities the limit refused most
//! over the last one to two minutes as JSON (`identity`, `count`, `error`, `first_seen_us`,
//! `last_seen_us`), most refused first.
//!
//! ```text
//! for i in 1 2 3 4 5 6; do curl -si localhost:3000/ | grep -iE '^(HTTP|retry-after|ratelimit:)|left'; done
//! curl -s localhost:3000/metrics | grep tollgate_decisions_total
//! curl -s -H "authorization: Bearer $ADMIN_TOKEN" localhost:3000/admin/limits/per-ip/127.0.0.1
//! curl -s -X DELETE -H "authorization: Bearer $ADMIN_TOKEN" localhost:3000/admin/limits/per-ip/127.0.0.1
//! curl -s -H "authorization: Bearer $ADMIN_TOKEN" 'localhost:3000/admin/top/per-ip?n=10'
//! ```

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{routing::get, Json, Router};
use metrics_exporter_prometheus::PrometheusBuilder;
use tollgate::key::ClientIp;
use tollgate::{AdminError, Decision, Limit, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    support::init_logging()?;
    let port = support::port(3000)?;
    // Every tollgate metric goes to this recorder; `/metrics` renders it.
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the Prometheus metrics recorder: {e}"))?;
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
    let token = std::env::var("ADMIN_TOKEN").ok().filter(|t| !t.is_empty());
    if token.is_none() {
        tracing::info!("ADMIN_TOKEN is not set: the /admin routes answer 403");
    }
    let admin = Arc::new(Admin {
        limits: limits.clone(),
        token,
    });
    let app = Router::new()
        .route("/", get(hello).route_layer(limits))
        .route("/metrics", get(move || async move { prometheus.render() }))
        .route(
            "/admin/limits/{limit}/{identity}",
            get(peek).delete(reset).with_state(Arc::clone(&admin)),
        )
        .route("/admin/top/{limit}", get(top).with_state(admin));

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

/// The operators' routes' state: the layer's handle, and the token they require.
struct Admin {
    limits: RateLimitLayer,
    token: Option<String>,
}

impl Admin {
    /// `Err` with 403 when no token is configured, 401 when the request lacks it.
    fn authorize(&self, headers: &HeaderMap) -> Result<(), (StatusCode, &'static str)> {
        let Some(token) = &self.token else {
            return Err((
                StatusCode::FORBIDDEN,
                "admin routes are off: set ADMIN_TOKEN\n",
            ));
        };
        let given = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(token.as_str()) {
            return Err((StatusCode::UNAUTHORIZED, "wrong or missing bearer token\n"));
        }
        Ok(())
    }
}

fn admin_error(e: AdminError) -> Response {
    let status = match e {
        AdminError::UnknownLimit(_) | AdminError::UnknownPlan(_) => StatusCode::NOT_FOUND,
        AdminError::Identity(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, format!("{e}\n")).into_response()
}

async fn peek(
    State(admin): State<Arc<Admin>>,
    Path((limit, identity)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = admin.authorize(&headers) {
        return refused.into_response();
    }
    match admin.limits.peek(&limit, identity.as_str()).await {
        Ok(state) => Json(serde_json::json!({
            "limit": limit,
            "identity": identity,
            "remaining": state.remaining,
            "reset_ms": state.reset.as_millis() as u64,
            "retry_after_ms": state.retry_after.map(|d| d.as_millis() as u64),
        }))
        .into_response(),
        Err(e) => admin_error(e),
    }
}

async fn reset(
    State(admin): State<Arc<Admin>>,
    Path((limit, identity)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let answer = match admin.authorize(&headers) {
        Ok(()) => admin.limits.reset(&limit, identity.as_str()).await,
        Err(refused) => return refused.into_response(),
    };
    match answer {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => admin_error(e),
    }
}

async fn top(
    State(admin): State<Arc<Admin>>,
    Path(limit): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = admin.authorize(&headers) {
        return refused.into_response();
    }
    // `?n=`: how many identities (default 10, at most 100).
    let n = match query.get("n").map(|n| n.parse::<usize>()) {
        None => 10,
        Some(Ok(n)) => n.min(100),
        Some(Err(_)) => return (StatusCode::BAD_REQUEST, "n is not a number\n").into_response(),
    };
    match admin.limits.top_refused(&limit, n).await {
        Ok(top) => {
            let top: Vec<_> = top
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "identity": r.identity,
                        "count": r.count,
                        "error": r.error,
                        "first_seen_us": r.first_seen,
                        "last_seen_us": r.last_seen,
                    })
                })
                .collect();
            Json(serde_json::json!({ "limit": limit, "top": top })).into_response()
        }
        Err(e) => admin_error(e),
    }
}
