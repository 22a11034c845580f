//! Run with: cargo run --example login
//!
//! A login endpoint with fail2ban in front of it, counted in memory, on 127.0.0.1:3000
//! (`PORT` overrides). Logs go to stderr, filtered by `RUST_LOG` (default `info`).
//!
//! `POST /login` answers `200` when the header `x-password` is `open-sesame`, and `401`
//! otherwise. The limit `login-failures` is GCRA, 5 a minute per client IP, and only `401`s
//! count (a successful login gives its unit back). Its penalty box: a client refused 3 times
//! within a minute is blocked for 600 s, and every request it makes meanwhile, right password
//! or not, gets `429` with a `Retry-After` that counts to the block's end (counted as
//! `outcome="blocked"` in `tollgate_decisions_total`).
//!
//! `GET /metrics` serves tollgate's metrics in Prometheus' text format. Operators' routes,
//! behind `Authorization: Bearer $ADMIN_TOKEN`, as in the quickstart:
//! `DELETE /admin/limits/login-failures/{ip}` resets the client and lifts its block (204);
//! `PUT /admin/denies/login-failures/{ip}?secs=N` denies it for N seconds (403), `DELETE` on
//! that path lifts the deny.
//!
//! ```text
//! ADMIN_TOKEN=s3cret cargo run --example login &
//! until curl -s -o /dev/null localhost:3000/metrics; do sleep 0.2; done
//! for i in 1 2 3 4 5 6 7 8; do curl -s -o /dev/null -w '%{http_code}\n' -X POST -H 'x-password: guess' localhost:3000/login; done
//! curl -si -X POST -H 'x-password: open-sesame' localhost:3000/login | grep -iE '^(HTTP|retry-after)'
//! curl -s -o /dev/null -w '%{http_code}\n' -X DELETE -H 'authorization: Bearer s3cret' localhost:3000/admin/limits/login-failures/127.0.0.1
//! curl -s -o /dev/null -w '%{http_code}\n' -X POST -H 'x-password: open-sesame' localhost:3000/login
//! curl -s localhost:3000/metrics | grep 'outcome="blocked"'
//! ```

#[path = "support/admin.rs"]
mod admin;
mod support;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use tollgate::cost::Metered;
use tollgate::key::ClientIp;
use tollgate::{Limit, Penalty, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    support::init_logging()?;
    let port = support::port(3000)?;
    let prometheus = admin::prometheus()?;

    let failures = Limit::gcra("login-failures", Quota::per_minute(5)?)?.penalty(
        Penalty::after(3)
            .within(Duration::from_secs(60))
            .block_for(Duration::from_secs(600)),
    )?;
    let limits = RateLimitLayer::builder()
        .metered(
            failures,
            ClientIp::peer(),
            // Only failed logins use the quota.
            Metered::new().count_if(|response| response.status() == StatusCode::UNAUTHORIZED),
        )
        .build()?;
    let app = Router::new()
        .route("/login", post(login).route_layer(limits.clone()))
        .route("/metrics", get(move || async move { prometheus.render() }))
        .merge(admin::routes(limits));

    let listener = support::listen(port).await?;
    tracing::info!(
        "login listening on http://{}: POST /login, 3 refusals within a minute block for 600 s",
        listener.local_addr()?
    );
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service)
        .await
        .map_err(|e| format!("the server stopped: {e}"))?;
    Ok(())
}

async fn login(headers: HeaderMap) -> StatusCode {
    match headers.get("x-password") {
        Some(password) if password == "open-sesame" => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}
