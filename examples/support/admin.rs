//! The operators' routes the quickstart and the login example share, behind
//! `Authorization: Bearer $ADMIN_TOKEN` (403 when `ADMIN_TOKEN` is not set, 401 without the
//! right token), and the Prometheus recorder behind their `/metrics`:
//!
//! - `GET /admin/limits/{limit}/{identity}`: the identity's state as JSON (`remaining`,
//!   `reset_ms`, `retry_after_ms`), consuming nothing;
//! - `DELETE /admin/limits/{limit}/{identity}`: a reset (204), which also lifts a block of
//!   the limit's penalty box;
//! - `PUT /admin/denies/{limit}/{identity}?secs=N`: a deny for N seconds (204), every
//!   request of the identity refused with 403 until it ends; N from 1 to 100 years
//!   (`MAX_DENY`), 400 otherwise;
//! - `DELETE /admin/denies/{limit}/{identity}`: lifts the deny (204);
//! - `GET /admin/top/{limit}?n=10`: the identities the limit refused most over the last one
//!   to two minutes, as JSON (`identity`, `count`, `error`, `first_seen_us`,
//!   `last_seen_us`), most refused first (`n` at most 100).
//!
//! 404 for an unknown limit, 400 for an identity the limit's keys cannot be.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tollgate::engine::MAX_DENY;
use tollgate::{AdminError, RateLimitLayer};

/// Installs the Prometheus recorder every tollgate metric goes to, and keeps its histograms
/// drained (so their memory stays bounded); `render` on the handle serves `/metrics`.
pub(crate) fn prometheus() -> Result<PrometheusHandle, String> {
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the Prometheus metrics recorder: {e}"))?;
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(prometheus)
}

/// The operators' routes over `limits`, with the token in `ADMIN_TOKEN`.
pub(crate) fn routes(limits: RateLimitLayer) -> Router {
    let token = std::env::var("ADMIN_TOKEN").ok().filter(|t| !t.is_empty());
    if token.is_none() {
        tracing::info!("ADMIN_TOKEN is not set: the /admin routes answer 403");
    }
    let admin = Arc::new(Admin { limits, token });
    Router::new()
        .route(
            "/admin/limits/{limit}/{identity}",
            get(peek).delete(reset).with_state(Arc::clone(&admin)),
        )
        .route(
            "/admin/denies/{limit}/{identity}",
            put(deny).delete(undeny).with_state(Arc::clone(&admin)),
        )
        .route("/admin/top/{limit}", get(top).with_state(admin))
}

/// The routes' state: the layer's handle, and the token they require.
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

fn done(answer: Result<(), AdminError>) -> Response {
    match answer {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => admin_error(e),
    }
}

fn admin_error(e: AdminError) -> Response {
    let status = match e {
        AdminError::UnknownLimit(_) | AdminError::UnknownPlan(_) => StatusCode::NOT_FOUND,
        AdminError::Identity(_) | AdminError::DenyTooLong(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, format!("{e}\n")).into_response()
}

type Target = Path<(String, String)>;

async fn peek(
    State(admin): State<Arc<Admin>>,
    Path((limit, id)): Target,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = admin.authorize(&headers) {
        return refused.into_response();
    }
    match admin.limits.peek(&limit, id.as_str()).await {
        Ok(state) => Json(serde_json::json!({
            "limit": limit,
            "identity": id,
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
    Path((limit, id)): Target,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = admin.authorize(&headers) {
        return refused.into_response();
    }
    done(admin.limits.reset(&limit, id.as_str()).await)
}

async fn deny(
    State(admin): State<Arc<Admin>>,
    Path((limit, id)): Target,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = admin.authorize(&headers) {
        return refused.into_response();
    }
    // 1 s to 100 years (`MAX_DENY`): 0 denies nothing, and a longer deny is refused.
    let max = MAX_DENY.as_secs();
    let Some(secs) = query
        .get("secs")
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|secs| (1..=max).contains(secs))
    else {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "a deny needs ?secs=N, a whole number of seconds from 1 to {max} (100 years)\n"
            ),
        )
            .into_response();
    };
    done(
        admin
            .limits
            .deny(&limit, id.as_str(), Duration::from_secs(secs))
            .await,
    )
}

async fn undeny(
    State(admin): State<Arc<Admin>>,
    Path((limit, id)): Target,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = admin.authorize(&headers) {
        return refused.into_response();
    }
    done(admin.limits.undeny(&limit, id.as_str()).await)
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
