//! Run with: cargo run --example outbound -- provider | app
//!
//! Limits calls OUT to an upstream API: the same `RateLimitLayer` wraps an HTTP client (the
//! client of hyper-util) instead of a server's routes. One binary, two modes:
//!
//! - `outbound provider`: a fake model API on 127.0.0.1:`PROVIDER_PORT` (default 9000). It
//!   takes `PROVIDER_RPS` requests a second (default 10) as a token bucket of `PROVIDER_RPS`
//!   tokens refilled continuously from a monotonic clock, and answers `429` with
//!   `Retry-After` beyond that. `POST /v1/chat` answers `200` with a small JSON body;
//!   `GET /stats` answers `{"requests":N,"refused":M}`: every request it received (`/stats`
//!   excluded) and its `429`s.
//! - `outbound app`: a server on 127.0.0.1:`PORT` (default 3000) whose `POST /api/chat`
//!   calls the provider at `PROVIDER_URL` (default `http://127.0.0.1:9000`) with the body it
//!   got. The call goes through a GCRA limit of `PROVIDER_RPS` a second (its burst below),
//!   counted in Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`; a `rediss://` URL
//!   trusts the CA in `REDIS_CA_CERT` when it is set), keyed by the upstream's host: every
//!   replica pointed at that Redis shares the quota. A call beyond the quota waits for its
//!   turn (up to `MAX_DELAY_SECS`, default 30; at most `MAX_WAITING` calls at once per
//!   replica, default 1000) instead of being refused, so the provider never sees more than it
//!   takes. The app answers the provider's `200` and body as they are; a call the limit
//!   refuses is `503` with `Retry-After`; any other answer of the provider is `502` with its
//!   status in the body. Nothing is retried.
//!
//! The limit's burst is `PROVIDER_RPS − BURST_HEADROOM` (default 1; 0 to use the whole
//! burst). The limit reserves each call's time when it is checked, but the provider counts a
//! call when it arrives: with the same burst on both sides, a call sent exactly at its time
//! is refused whenever an earlier call took longer than it to get there (a new connection, a
//! busy machine), since the provider then counts that earlier call later than the limit did.
//! One unit of headroom gives every call one emission interval (100 ms at 10 a second) of
//! such slack, for the price of one call less at once; the rate is unchanged.
//!
//! If Redis fails, each replica keeps the quota in its memory at its share (`REPLICAS`
//! replicas, default 2), and a call beyond that share is refused at once (a failed backend
//! never makes a call wait).
//!
//! Logs go to stderr, filtered by `RUST_LOG` (default `info`). A variable that cannot be used
//! stops the start with a line saying which and why, and exit status 1.
//!
//! `examples/outbound.sh` runs two app replicas and a provider against a fresh
//! `redis-server`, sends 30 calls at once to each replica, and checks that all 60 get `200`,
//! that the provider refused none, and that it took 4.5 to 9 seconds:
//!
//! ```text
//! redis-server --port 6379 --save '' &
//! PROVIDER_PORT=9000 cargo run --example outbound -- provider &
//! PORT=3001 cargo run --example outbound -- app &
//! PORT=3002 cargo run --example outbound -- app &
//! for i in $(seq 1 30); do
//!   for p in 3001 3002; do curl -s -o /dev/null -w '%{http_code}\n' -X POST -d '{}' localhost:$p/api/chat & done
//! done; wait
//! curl -s localhost:9000/stats   # {"requests":60,"refused":0}
//! ```

mod support;

use std::error::Error;
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::cost::Metered;
use tollgate::key::{key_fn, RequestView};
use tollgate::{Decision, Limit, Quota, RateLimitLayer, ResponseBody};
use tollgate_redis::{redact_url, RedisBackend};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};

#[tokio::main]
async fn main() -> ExitCode {
    support::exit(run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    support::init_logging()?;
    match std::env::args().nth(1).as_deref() {
        Some("provider") => provider().await,
        Some("app") => app().await,
        Some(other) => Err(format!("unknown mode {other:?}: use `provider` or `app`").into()),
        None => Err("no mode: use `outbound provider` or `outbound app`".into()),
    }
}

/// The value of `name`, if it is set; an error if it is not UTF-8.
fn var(name: &str) -> Result<Option<String>, String> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name} is not valid UTF-8")),
    }
}

/// `name` as a whole number from 1 up, or `default` when it is not set.
fn positive(name: &str, default: u32) -> Result<u32, String> {
    match var(name)? {
        None => Ok(default),
        Some(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{name}={v:?} is not a whole number from 1 to 4294967295")),
    }
}

// ---------------------------------------------------------------------------------------
// The provider: a fake model API with a token bucket of its own.

/// An exact token bucket of `burst` tokens refilled at `rate` a second, from a monotonic
/// clock. Times are nanoseconds multiplied by `rate`, so one token is exactly
/// 1,000,000,000 units whatever the rate: no rounding anywhere.
struct Bucket {
    origin: Instant,
    rate: u128,
    burst: u128,
    /// When the bucket is full again, in the scaled units since `origin` (the bucket's only
    /// state: its level at `now` is `burst − (full_at − now) / token`).
    full_at: u128,
}

const TOKEN: u128 = 1_000_000_000;

impl Bucket {
    fn new(rate: u32) -> Self {
        Self {
            origin: Instant::now(),
            rate: u128::from(rate),
            burst: u128::from(rate),
            full_at: 0,
        }
    }

    /// Takes a token at `now`; or, when the bucket holds less than one, how long until it does.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let now = now.saturating_duration_since(self.origin).as_nanos() * self.rate;
        let full_at = self.full_at.max(now);
        // At least one token: the bucket is short of full by at most `burst − 1` tokens.
        let short = full_at - now;
        let allowed = (self.burst - 1) * TOKEN;
        if short <= allowed {
            self.full_at = full_at + TOKEN;
            Ok(())
        } else {
            let nanos = (short - allowed).div_ceil(self.rate);
            Err(Duration::from_nanos(
                u64::try_from(nanos).unwrap_or(u64::MAX),
            ))
        }
    }
}

#[derive(Clone)]
struct Provider {
    bucket: Arc<Mutex<Bucket>>,
    requests: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
}

async fn provider() -> Result<(), Box<dyn Error>> {
    let rps = positive("PROVIDER_RPS", 10)?;
    let port = match var("PROVIDER_PORT")? {
        None => 9000,
        Some(v) => v
            .trim()
            .parse()
            .map_err(|_| format!("PROVIDER_PORT={v:?} is not a port number"))?,
    };
    let state = Provider {
        bucket: Arc::new(Mutex::new(Bucket::new(rps))),
        requests: Arc::default(),
        refused: Arc::default(),
    };
    let routes = Router::new()
        .route("/v1/chat", post(provider_chat))
        .fallback(provider_other)
        .with_state(state.clone());
    let app = Router::new()
        .route("/stats", get(stats))
        .with_state(state)
        .merge(routes);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| format!("PROVIDER_PORT={port}: cannot listen on 127.0.0.1:{port}: {e}"))?;
    tracing::info!("provider listening on http://127.0.0.1:{port} ({rps} requests a second)");
    axum::serve(listener, app)
        .await
        .map_err(|e| format!("the provider stopped: {e}"))?;
    Ok(())
}

const JSON: HeaderValue = HeaderValue::from_static("application/json");

async fn provider_chat(State(p): State<Provider>) -> Response {
    p.requests.fetch_add(1, Ordering::Relaxed);
    let taken = match p.bucket.lock() {
        Ok(mut bucket) => bucket.take(Instant::now()),
        // A handler panicked while it held the lock: the bucket's one number is still whole.
        Err(poisoned) => poisoned.into_inner().take(Instant::now()),
    };
    match taken {
        Ok(()) => {
            tracing::debug!("provider: call taken");
            (
                [(CONTENT_TYPE, JSON)],
                r#"{"reply":"Your order is on its way.","model":"fake-1"}"#,
            )
                .into_response()
        }
        Err(wait) => {
            p.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(?wait, "provider: over the rate, 429");
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            (
                StatusCode::TOO_MANY_REQUESTS,
                [(RETRY_AFTER, HeaderValue::from(secs))],
                "rate limited",
            )
                .into_response()
        }
    }
}

async fn provider_other(State(p): State<Provider>) -> StatusCode {
    p.requests.fetch_add(1, Ordering::Relaxed);
    StatusCode::NOT_FOUND
}

async fn stats(State(p): State<Provider>) -> Response {
    let body = format!(
        r#"{{"requests":{},"refused":{}}}"#,
        p.requests.load(Ordering::Relaxed),
        p.refused.load(Ordering::Relaxed)
    );
    ([(CONTENT_TYPE, JSON)], body).into_response()
}

// ---------------------------------------------------------------------------------------
// The app: calls the provider through the outbound limit.

/// The upstream client behind the limit: what the handler calls.
type Upstream = BoxCloneSyncService<
    Request<Full<Bytes>>,
    Response<ResponseBody<hyper::body::Incoming>>,
    hyper_util::client::legacy::Error,
>;

#[derive(Clone)]
struct App {
    upstream: Upstream,
    chat: Uri,
}

async fn app() -> Result<(), Box<dyn Error>> {
    let port = support::port(3000)?;
    let rps = positive("PROVIDER_RPS", 10)?;
    let max_delay = positive("MAX_DELAY_SECS", 30)?;
    let max_waiting = positive("MAX_WAITING", 1000)?;
    let replicas = NonZeroU32::new(positive("REPLICAS", 2)?).unwrap_or(NonZeroU32::MIN);
    let headroom = match var("BURST_HEADROOM")? {
        None => 1,
        Some(v) => v
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n < rps)
            .ok_or_else(|| format!("BURST_HEADROOM={v:?} is not a whole number below {rps}"))?,
    };
    let provider = var("PROVIDER_URL")?.unwrap_or_else(|| "http://127.0.0.1:9000".to_owned());
    let chat: Uri = format!("{}/v1/chat", provider.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("PROVIDER_URL={provider:?} is not a URL: {e}"))?;
    if chat.scheme_str() != Some("http") || chat.authority().is_none() {
        return Err(format!("PROVIDER_URL={provider:?} is not an http:// URL with a host").into());
    }

    let redis_url = var("REDIS_URL")?.unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    // A call waits for its turn anyway: a slow check (the first one loads the script and
    // opens its connection) is better waited for than answered by the fallback, which never
    // waits and admits each replica's share at once.
    let mut builder = RedisBackend::builder()
        .url(redis_url.as_str())
        .deadline(Duration::from_millis(500));
    if let Some(path) = var("REDIS_CA_CERT")? {
        let pem = std::fs::read(&path)
            .map_err(|e| format!("REDIS_CA_CERT={path}: cannot read the file: {e}"))?;
        builder = builder.tls_ca_pem(pem);
    }
    let backend = builder
        .build()
        .map_err(|e| format!("REDIS_URL={}: {e}", redact_url(&redis_url)))?;

    // The provider's rate, shared by every replica through Redis, one key per upstream host;
    // its burst less the headroom (see the module's docs).
    let quota = Quota::per_second(rps)
        .and_then(|q| q.with_burst(rps - headroom))
        .map_err(|e| format!("PROVIDER_RPS={rps}: {e}"))?;
    let limit = Limit::gcra("upstream", quota)
        .and_then(|l| l.delay_up_to(Duration::from_secs(u64::from(max_delay))))
        .map_err(|e| format!("MAX_DELAY_SECS={max_delay}: {e}"))?
        .max_waiting(max_waiting)
        .map_err(|e| format!("MAX_WAITING={max_waiting}: {e}"))?
        .fallback(replicas);
    // A 429 the provider sends anyway (another client of the same account, a lower limit than
    // configured) holds the host back on every replica until its Retry-After.
    let limits = RateLimitLayer::builder()
        .metered(
            limit,
            key_fn(upstream_host),
            Metered::new().pause_from_upstream(),
        )
        .backend(backend.clone())
        .build()
        .map_err(|e| format!("the outbound limit: {e}"))?;
    // Connect before the first call, so that it does not pay for the connection.
    if let Err(e) = backend.ping().await {
        tracing::warn!(error = %e, "Redis at {} does not answer yet", redact_url(&redis_url));
    }

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let send = tower::service_fn(move |req: Request<Full<Bytes>>| {
        if req
            .extensions()
            .get::<Decision>()
            .is_some_and(Decision::is_bypassed)
        {
            tracing::warn!("Redis failed: the call was counted in this replica's share");
        }
        tracing::debug!(
            waited = ?req.extensions().get::<Decision>().and_then(Decision::delayed),
            "app: call sent"
        );
        client.request(req)
    });
    let state = App {
        upstream: BoxCloneSyncService::new(limits.layer(send)),
        chat,
    };
    let app = Router::new()
        .route("/api/chat", post(app_chat))
        .with_state(state);
    let listener = support::listen(port).await?;
    tracing::info!(
        "app listening on http://127.0.0.1:{port}, calling {provider} at most {rps} a second \
         (counted in Redis at {})",
        redact_url(&redis_url)
    );
    axum::serve(listener, app)
        .await
        .map_err(|e| format!("the server stopped: {e}"))?;
    Ok(())
}

/// The key of an outgoing call: the upstream's host and port, from its URI.
fn upstream_host(req: &RequestView<'_>) -> Option<Vec<u8>> {
    req.uri()
        .authority()
        .map(|a| a.as_str().to_ascii_lowercase().into_bytes())
}

async fn app_chat(State(app): State<App>, body: Bytes) -> Response {
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = app.chat.clone();
    request.headers_mut().insert(CONTENT_TYPE, JSON);
    let mut upstream = app.upstream;
    let answer = match upstream.ready().await {
        Ok(ready) => ready.call(request).await,
        Err(e) => Err(e),
    };
    let response = match answer {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(error = %support::chain(&e), "the provider could not be reached");
            return (StatusCode::BAD_GATEWAY, "the provider could not be reached").into_response();
        }
    };
    let refused_here = response
        .extensions()
        .get::<Decision>()
        .is_some_and(|d| !d.is_admitted());
    let status = response.status();
    let retry_after = response.headers().get(RETRY_AFTER).cloned();
    if refused_here {
        // The outbound limit refused the call: it was never sent.
        let mut out = (
            StatusCode::SERVICE_UNAVAILABLE,
            "the provider's quota is used up",
        )
            .into_response();
        if let Some(v) = retry_after {
            out.headers_mut().insert(RETRY_AFTER, v);
        }
        return out;
    }
    if status != StatusCode::OK {
        tracing::warn!(%status, "the provider refused the call");
        return (
            StatusCode::BAD_GATEWAY,
            format!("the provider answered {}", status.as_u16()),
        )
            .into_response();
    }
    match response.into_body().collect().await {
        Ok(body) => ([(CONTENT_TYPE, JSON)], Body::from(body.to_bytes())).into_response(),
        Err(e) => {
            tracing::warn!(error = %support::chain(&e), "the provider's body broke off");
            (StatusCode::BAD_GATEWAY, "the provider's answer broke off").into_response()
        }
    }
}
