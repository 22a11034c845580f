//! Run with: cargo run --example llm_chat
//!
//! The per-shop LLM endpoint: `POST /api/chat` on 127.0.0.1:`PORT` (default 3000), limited to
//! 30 requests per minute per shop, the shop taken from the `x-shop-domain` header (validated:
//! missing or invalid is `400`). The limit lives in Redis at `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), so two copies of this server on two ports, pointed at one Redis,
//! enforce 30 per shop in total. If Redis fails the limit fails open, and says so: the reply's
//! `limited` is `false`, `tollgate_bypass_total` rises on `GET /metrics`, a warning
//! `rate limit bypassed` is logged, and a canary that probes Redis every 10 s sets
//! `tollgate_canary_ok`.
//!
//! Redis: `REDIS_URL` may carry an ACL user and password (`redis://app:secret@host:6379/`); a
//! `rediss://` URL is TLS, trusting the webpki roots, or only the CA certificate (PEM) in the
//! file `REDIS_CA_CERT` when it is set. `REDIS_CLUSTER` (seed URLs, comma-separated) names a
//! Redis Cluster instead of `REDIS_URL`. The start-up line shows the URLs without their
//! passwords. Logs go to stderr, filtered by `RUST_LOG` (default `info`).
//!
//! The body: a JSON object whose `message` is a string, and optionally `delay_ms`, 0 to 10000,
//! which makes the handler take that long, standing in for a slow model. A request without a
//! body is an empty message. A body that is not JSON, or a `delay_ms` that is not a whole
//! number from 0 to 10000, is `400`; JSON without a string `message` (`{"x":1}`, `[1]`, `"hi"`)
//! is `422`. Neither consumes anything, from any limit: both are refused by the handler, after
//! the layer admitted them, and give back what they reserved (`Metered::count_if`). The shop's
//! `remaining` (in a `200` reply and in the `RateLimit` header of the next one) is as before.
//!
//! Each shop also has a budget of `TOKENS_PER_HOUR` tokens (default 20,000), counted in Redis
//! too. A request's tokens are the UTF-8 bytes of its `message` (standing in for the model's
//! count, known once it has answered). The request reserves its `content-length` as an
//! estimate when it is admitted; the handler reports the actual count, and the difference is
//! given back (or taken). If Redis fails, the token budget is kept in each copy's memory, at
//! its share of the budget (`REPLICAS` copies, default 2): an outage cannot open it without
//! bound.
//!
//! At most `CONCURRENCY_PER_SHOP` (default 4) requests per shop are in flight at once, across
//! every replica (a slot per request in Redis; with Redis down, each copy keeps its share
//! locally, as for the token budget).
//!
//! A variable that cannot be used stops the start with a line saying which and why, and exit
//! status 1.
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
use std::process::ExitCode;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderName, StatusCode};
use axum::{routing::get, routing::post, Extension, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tollgate::cost::{parse_units, Metered, Settle};
use tollgate::key::Tenant;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};
use tollgate_redis::{redact_url, RedisBackend};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llm_chat: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the environment asks for.
pub(crate) struct Settings {
    /// A standalone server's URL, or a cluster's seeds.
    pub(crate) redis: Redis,
    /// The CA certificate (PEM) to trust for `rediss://`, and the file it came from.
    pub(crate) ca: Option<(String, Vec<u8>)>,
    pub(crate) tokens_per_hour: u32,
    pub(crate) replicas: NonZeroU32,
    pub(crate) in_flight: u32,
    pub(crate) port: u16,
}

/// Where the limits live.
pub(crate) enum Redis {
    Url(String),
    Cluster(Vec<String>),
}

impl Redis {
    /// For the start-up line and errors: without passwords.
    fn describe(&self) -> String {
        match self {
            Self::Url(url) => format!("Redis at {}", redact_url(url)),
            Self::Cluster(seeds) => {
                let seeds: Vec<String> = seeds.iter().map(|s| redact_url(s)).collect();
                format!("Redis Cluster at {}", seeds.join(","))
            }
        }
    }

    /// The variable that named it, and its value without passwords.
    fn variable(&self) -> String {
        match self {
            Self::Url(url) => format!("REDIS_URL={}", redact_url(url)),
            Self::Cluster(seeds) => {
                let seeds: Vec<String> = seeds.iter().map(|s| redact_url(s)).collect();
                format!("REDIS_CLUSTER={}", seeds.join(","))
            }
        }
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

/// `name` as a whole number of type `T`, or `default` when it is not set.
fn number<T: std::str::FromStr>(name: &str, default: T, what: &str) -> Result<T, String> {
    match var(name)? {
        None => Ok(default),
        Some(v) => v
            .trim()
            .parse()
            .map_err(|_| format!("{name}={v:?} is not {what}")),
    }
}

impl Settings {
    /// The settings from the environment, or which variable is wrong and why.
    pub(crate) fn from_env() -> Result<Self, String> {
        let redis = match var("REDIS_CLUSTER")? {
            Some(seeds) => Redis::Cluster(
                seeds
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect(),
            ),
            None => {
                Redis::Url(var("REDIS_URL")?.unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned()))
            }
        };
        let ca = match var("REDIS_CA_CERT")? {
            None => None,
            Some(path) => {
                let pem = std::fs::read(&path)
                    .map_err(|e| format!("REDIS_CA_CERT={path}: cannot read the file: {e}"))?;
                Some((path, pem))
            }
        };
        Ok(Self {
            redis,
            ca,
            tokens_per_hour: number(
                "TOKENS_PER_HOUR",
                20_000,
                "a whole number from 1 to 4294967295",
            )?,
            replicas: number(
                "REPLICAS",
                NonZeroU32::MIN.saturating_add(1),
                "a whole number from 1 to 4294967295",
            )?,
            in_flight: number(
                "CONCURRENCY_PER_SHOP",
                4,
                "a whole number from 1 to 4294967295",
            )?,
            port: number("PORT", 3000, "a port number (0 to 65535)")?,
        })
    }

    /// The backend (no connection made yet), or what is wrong with the Redis settings.
    pub(crate) fn backend(&self) -> Result<RedisBackend, String> {
        let builder = match &self.redis {
            Redis::Url(url) => RedisBackend::builder().url(url.as_str()),
            Redis::Cluster(seeds) => {
                RedisBackend::builder().cluster(seeds.iter().map(String::as_str))
            }
        };
        let builder = match &self.ca {
            Some((_, pem)) => builder.tls_ca_pem(pem.as_slice()),
            None => builder,
        };
        // The error names the variable and the URL, never its password (the builder's errors
        // do not quote it either).
        builder.build().map_err(|e| match (&self.ca, &e) {
            (Some((path, _)), tollgate_redis::BuildError::Tls { .. }) => {
                format!("REDIS_CA_CERT={path}: {e}")
            }
            _ => format!("{}: {e}", self.redis.variable()),
        })
    }
}

/// Starts the server; an error says which setting failed and why.
async fn run() -> Result<(), String> {
    let filter = match var("RUST_LOG")? {
        None => EnvFilter::new("info"),
        Some(v) => EnvFilter::try_new(&v).map_err(|e| format!("RUST_LOG={v:?}: {e}"))?,
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let settings = Settings::from_env()?;

    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        // Drains histograms into their summaries, so their memory stays bounded.
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });

    // Starts without Redis if it is down: the limits' failure policies apply until it is back.
    let backend = settings.backend()?;
    let limits = limits(backend.clone(), &settings)?;
    // Connect before the first request, so that it does not pay for the connection within
    // its deadline (and apply the failure policy for nothing). Redis may still be down.
    if let Err(e) = backend.ping().await {
        tracing::warn!(error = %e, "{} does not answer yet", settings.redis.describe());
    }
    let app = app(limits, prometheus);
    // A synthetic key that must always be denied: the gauge drops if Redis dies or forgets.
    let _canary = tollgate::Canary::new(backend, CANARY_INTERVAL).spawn();

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", settings.port))
        .await
        .map_err(|e| {
            format!(
                "PORT={}: cannot listen on 127.0.0.1:{}: {e}",
                settings.port, settings.port
            )
        })?;
    let address = listener
        .local_addr()
        .map_err(|e| format!("the listening socket has no address: {e}"))?;
    let ca = match &settings.ca {
        Some((path, _)) => format!(", trusting the CA in {path}"),
        None => String::new(),
    };
    println!(
        "llm_chat listening on http://{address} ({}{ca}, {} tokens an hour per shop)",
        settings.redis.describe(),
        settings.tokens_per_hour,
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .map_err(|e| format!("the server stopped: {e}"))
}

/// The endpoint's limits, counted in `backend`.
pub(crate) fn limits(
    backend: RedisBackend,
    settings: &Settings,
) -> Result<RateLimitLayer<RedisBackend>, String> {
    let tokens_per_hour = settings.tokens_per_hour;
    let per_shop = Limit::gcra(
        "chat-per-shop",
        Quota::per_minute(30).map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?
    .fail_open();
    let tokens = Limit::gcra(
        "tokens-per-shop",
        Quota::per_hour(tokens_per_hour)
            .map_err(|e| format!("TOKENS_PER_HOUR={tokens_per_hour}: {e}"))?,
    )
    .map_err(|e| format!("TOKENS_PER_HOUR={tokens_per_hour}: {e}"))?
    .fallback(settings.replicas);
    let in_flight = Limit::concurrency("chat-in-flight", settings.in_flight)
        .map_err(|e| format!("CONCURRENCY_PER_SHOP={}: {e}", settings.in_flight))?
        .fallback(settings.replicas);
    RateLimitLayer::builder()
        .metered(
            per_shop,
            Tenant::header("x-shop-domain"),
            // A body the handler refuses (400, 422) gives its unit back: it counts for nothing.
            Metered::new().count_if(|r| !is_bad_message(r.status())),
        )
        .metered(
            tokens,
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
                // Only an answer uses tokens: a refused body gives its whole estimate back.
                .count_if(|r| r.status().is_success()),
        )
        // A slow model call holds a slot: one shop cannot take every worker.
        .limit(in_flight, Tenant::header("x-shop-domain"))
        .backend(backend)
        .build()
        .map_err(|e| format!("the limits: {e}"))
}

/// How often the canary checks Redis.
pub(crate) const CANARY_INTERVAL: Duration = Duration::from_secs(10);

/// The server's routes: `POST /api/chat` behind `limits`, and `GET /metrics` as `prometheus`
/// renders them.
pub(crate) fn app(limits: RateLimitLayer<RedisBackend>, prometheus: PrometheusHandle) -> Router {
    chat_routes(limits).route("/metrics", get(move || async move { prometheus.render() }))
}

/// `POST /api/chat` behind `limits`.
pub(crate) fn chat_routes(limits: RateLimitLayer<RedisBackend>) -> Router {
    // `route_layer` on the method router: a 404 or 405 never reaches the layer, so it
    // consumes nothing, and `/metrics` scrapes are never limited.
    Router::new().route("/api/chat", post(chat).route_layer(limits))
}

fn is_bad_message(status: StatusCode) -> bool {
    status == StatusCode::BAD_REQUEST || status == StatusCode::UNPROCESSABLE_ENTITY
}

type Reply = (StatusCode, [(HeaderName, &'static str); 1], String);

/// Stands in for the expensive call; reports the tokens it used and what the limiter decided.
async fn chat(decision: Decision, settle: Option<Extension<Settle>>, body: Bytes) -> Reply {
    let json = [(CONTENT_TYPE, "application/json")];
    let (tokens, delay_ms) = match read_message(&body) {
        Ok(message) => message,
        Err((status, error)) => return (status, json, format!("{{\"error\":{error:?}}}")),
    };
    // A slow model.
    if delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    }
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

/// The message's tokens (its UTF-8 bytes) and the delay asked for; or the status and the
/// reason of a refusal.
fn read_message(body: &[u8]) -> Result<(usize, u64), (StatusCode, &'static str)> {
    if body.is_empty() {
        return Ok((0, 0));
    }
    let value = serde_json::from_slice::<serde_json::Value>(body)
        .map_err(|_| (StatusCode::BAD_REQUEST, "the body is not JSON"))?;
    let delay_ms = match value.get("delay_ms") {
        None => 0,
        Some(delay) => delay.as_u64().filter(|ms| *ms <= 10_000).ok_or((
            StatusCode::BAD_REQUEST,
            "delay_ms must be a whole number from 0 to 10000",
        ))?,
    };
    let message = value
        .get("message")
        .and_then(serde_json::Value::as_str)
        .ok_or((
            StatusCode::UNPROCESSABLE_ENTITY,
            "the body is not a JSON object with a string \"message\"",
        ))?;
    Ok((message.len(), delay_ms))
}
