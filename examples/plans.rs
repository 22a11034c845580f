//! Run with: cargo run --example plans
//!
//! Serves `GET /` on 127.0.0.1:3000 (`PORT` overrides) with the limits of the TOML file named
//! by `LIMITS_FILE` (default `examples/plans.toml`): per bearer token, 5 a minute for the
//! `free` plan and 50 for `pro`, in a fixed window. A tiny authentication middleware maps
//! `authorization: Bearer free-…` to the plan `free` and `Bearer pro-…` to `pro`; a request
//! without such a token gets `401`.
//!
//! The server reads the file again on SIGHUP. A file that does not parse or build is refused
//! with a logged error, and the limits it would have replaced keep working. Logs go to
//! stderr, filtered by `RUST_LOG` (default `info`).
//!
//! ```text
//! for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{http_code}\n' -H 'authorization: Bearer free-alice' localhost:3000/; done
//! sed -i '/free/s/\b5\b/10/' examples/plans.toml && kill -HUP $(pgrep -f 'target/.*/plans')
//! curl -si -H 'authorization: Bearer free-alice' localhost:3000/ | grep -i ratelimit
//! ```

mod support;

use std::process::ExitCode;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{routing::get, Router};
use tokio::signal::unix::{signal, SignalKind};
use tollgate::key::{Key, MissingKey, PrincipalId};
use tollgate::{Decision, LimitsFile, Plan, RateLimitLayer};

/// The caller's bearer token: the key of the per-token limit.
#[derive(Clone)]
struct Token(Arc<str>);

impl PrincipalId for Token {
    fn principal_id(&self) -> Result<Key<'_>, MissingKey> {
        Key::borrowed(self.0.as_bytes())
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    support::init_logging()?;
    let port = support::port(3000)?;
    let path = std::env::var("LIMITS_FILE").unwrap_or_else(|_| "examples/plans.toml".into());
    // `key = "principal"` in the file is the `Token` the middleware inserts.
    let file = LimitsFile::new().principal::<Token>();
    let limits = file
        .read(&path)
        .map_err(|e| format!("LIMITS_FILE={path}: {e}"))?;
    let limits = RateLimitLayer::builder()
        .limits(limits)
        .build()
        .map_err(|e| format!("LIMITS_FILE={path}: {e}"))?;
    let reloader = limits.reloader();
    let mut hangups = signal(SignalKind::hangup())
        .map_err(|e| format!("cannot listen for SIGHUP, which reloads the limits: {e}"))?;
    let watched = path.clone();
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let read = file.read(&watched).map_err(|e| e.to_string());
            match read.and_then(|limits| reloader.reload(limits).map_err(|e| e.to_string())) {
                Ok(()) => tracing::info!("reloaded the limits from {watched}"),
                Err(e) => {
                    tracing::error!("reload error: {watched}: {e}; the old limits stay")
                }
            }
        }
    });

    // The authentication runs first (`layer`), the limits on the route (`route_layer`).
    let app = Router::new()
        .route("/", get(hello).route_layer(limits))
        .layer(middleware::from_fn(auth));

    let listener = support::listen(port).await?;
    tracing::info!(
        "plans listening on http://{} with limits from {path}; SIGHUP reloads them",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .await
        .map_err(|e| format!("the server stopped: {e}"))?;
    Ok(())
}

/// `Bearer free-…` is the plan `free`, `Bearer pro-…` the plan `pro`; anything else is 401.
async fn auth(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let plan = match token {
        Some(t) if t.starts_with("free-") => "free",
        Some(t) if t.starts_with("pro-") => "pro",
        _ => return (StatusCode::UNAUTHORIZED, "a bearer token is needed\n").into_response(),
    };
    let token = Token(token.unwrap_or_default().into());
    req.extensions_mut().insert(token);
    req.extensions_mut().insert(Plan::new(plan));
    next.run(req).await
}

async fn hello(plan: axum::Extension<Plan>, decision: Decision) -> String {
    let left = decision.remaining().unwrap_or(0);
    format!("plan {}: {left} left\n", plan.as_str())
}
