//! The server of the end-to-end benchmark: one axum "hello" handler, bare or behind a rate
//! limiter. `benches/run.sh` starts it once per run; see `docs/benchmarks.md`.
//!
//! ```text
//! bench-server --mode MODE [--port 8080] [--redis redis://127.0.0.1:6379/] [--flood-limit 300]
//!              [--threads 1] [--cluster redis://127.0.0.1:7000/,redis://127.0.0.1:7001/,...]
//! ```
//!
//! Modes (every limiter keys on the client IP, from the socket peer):
//!
//! | mode | what |
//! |---|---|
//! | `bare` | no limiter |
//! | `tollgate-mem-allow` | tollgate, in memory, a quota nothing reaches |
//! | `tollgate-mem-allow-lean` | the same without the `RateLimit` fields on admitted responses |
//! | `tollgate-mem-allow-minimal` | the same, and without the `Decision` on admitted responses |
//! | `tollgate-mem-deny` | tollgate, in memory, 1 a day: all but the first request refused |
//! | `tollgate-mem-delay` | as `tollgate-mem-allow`, the limit delayed up to 1 s: every request is checked with the delay and waits 0 |
//! | `tollgate-mem-delay-wait` | tollgate, in memory, 500 a second per IP, burst 1, delayed up to 1 s: every request past the first waits for its time (at most 64 at once) |
//! | `tollgate-mem-inflight` | as `tollgate-mem-allow`, plus a concurrency limit per IP nothing reaches |
//! | `tollgate-redis-inflight` | as `tollgate-redis-allow`, plus a concurrency limit per IP nothing reaches |
//! | `governor-allow` / `governor-deny` | tower_governor with the same two quotas |
//! | `tollgate-redis-allow` | tollgate on Redis, a quota nothing reaches |
//! | `tollgate-redis-allow3` | the same with 3 stacked limits (per IP GCRA, per IP daily window, global) |
//! | `tollgate-redis-spread` | as `tollgate-redis-allow`, but each request counts under the next of 100,000 keys in turn |
//! | `tollgate-redis-flood` | tollgate on Redis, GCRA `--flood-limit` per second per IP, flooded |
//! | `tollgate-redis-flood-window` | the same with a fixed window of `--flood-limit` per second |
//! | `tollgate-mem-settle` | as `tollgate-mem-allow`, metered: every answer (200) gives its unit back, a settle per request |
//! | `tollgate-redis-settle` | as `tollgate-redis-allow`, metered the same way: a `SETTLE` per request, merged |
//! | `tollgate-cluster-allow` | as `tollgate-redis-allow`, on the Redis Cluster of `--cluster`: one hot key |
//! | `tollgate-cluster-spread` | as `tollgate-redis-spread`, on the cluster: a key of its own per request |
//! | `tollgate-cluster-allow3` | as `tollgate-redis-allow3`, on the cluster: 3 stacked limits, in 3 slots |
//! | `tollgate-redis-lease-hot` | tollgate on Redis, one global GCRA limit (100,000,000 a day) leased in slices of up to 10,000: the hot key every request touches |
//! | `tollgate-mem-allow+F+...`, `tollgate-mem-deny+F+...` | the in-memory layer with features `F` (`tollgate_bench::layers`: `no-headers`, `no-decision`, `metrics`, `near-limit`, `no-top-refused`, `penalty`, `denylist`, `allowlist`, `plans`, `costs`, `delay`, `slots`, `queue`) |
//! | `naive-incr` | per-request `INCR` + `EXPIRE NX` on Redis, a limit nothing reaches |
//!
//! In `tollgate-redis-lease-hot` the server stops gracefully on SIGINT or SIGTERM and then
//! gives its slice back (`RateLimitLayer::shutdown`).

// A measurement tool: a bad flag or a failed bind should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use tollgate::cost::Metered;
use tollgate::key::{ClientIp, Global};
use tollgate::{Limit, Quota, RateLimitLayer};
use tollgate_bench::layers::governor;
use tollgate_bench::naive::NaiveIncr;
use tollgate_redis::RedisBackend;

struct Args {
    mode: String,
    port: u16,
    redis: String,
    flood_limit: u32,
    threads: usize,
    /// The seed nodes of a Redis Cluster, for the `tollgate-cluster-*` modes.
    cluster: Vec<String>,
}

fn args() -> Args {
    let mut args = Args {
        mode: String::new(),
        port: 8080,
        redis: "redis://127.0.0.1:6379/".into(),
        flood_limit: 300,
        threads: 1,
        cluster: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--mode" => args.mode = value,
            "--port" => args.port = value.parse().unwrap(),
            "--redis" => args.redis = value,
            "--flood-limit" => args.flood_limit = value.parse().unwrap(),
            "--threads" => args.threads = value.parse().unwrap(),
            "--cluster" => args.cluster = value.split(',').map(str::to_owned).collect(),
            other => panic!("unknown flag {other}"),
        }
    }
    args
}

/// A quota no benchmark reaches: a million a second, with a burst of four billion.
fn unreachable_quota() -> Quota {
    Quota::per_second(1_000_000)
        .unwrap()
        .with_burst(u32::MAX)
        .unwrap()
}

fn per_ip(quota: Quota) -> RateLimitLayer {
    per_ip_adding(quota, true, true)
}

/// As `per_ip`, with admitted responses getting the `RateLimit` fields and the `Decision`
/// only as asked.
fn per_ip_adding(quota: Quota, fields: bool, decision: bool) -> RateLimitLayer {
    RateLimitLayer::builder()
        .limit(Limit::gcra("per-ip", quota).unwrap(), ClientIp::peer())
        .headers_on_allowed(fields)
        .decision_on_allowed(decision)
        .build()
        .unwrap()
}

/// One GCRA limit per IP under `quota`, delayed up to a second.
fn delayed(quota: Quota) -> RateLimitLayer {
    let limit = Limit::gcra("per-ip", quota)
        .unwrap()
        .delay_up_to(Duration::from_secs(1))
        .unwrap();
    RateLimitLayer::builder()
        .limit(limit, ClientIp::peer())
        .build()
        .unwrap()
}

fn redis(url: &str) -> RedisBackend {
    RedisBackend::builder().url(url).build().unwrap()
}

fn cluster(urls: &[String]) -> RedisBackend {
    assert!(!urls.is_empty(), "the cluster modes need --cluster");
    RedisBackend::builder()
        .cluster(urls.to_vec())
        .build()
        .unwrap()
}

/// One limit, keyed by `key`, on the Redis at `url`.
fn on_redis(
    limit: Limit,
    key: impl tollgate::key::KeyExtractor,
    url: &str,
) -> RateLimitLayer<RedisBackend> {
    on_backend(limit, key, redis(url))
}

fn on_backend(
    limit: Limit,
    key: impl tollgate::key::KeyExtractor,
    backend: RedisBackend,
) -> RateLimitLayer<RedisBackend> {
    RateLimitLayer::builder()
        .limit(limit, key)
        .backend(backend)
        .build()
        .unwrap()
}

/// Three stacked limits: per IP GCRA, per IP daily window, and a global GCRA.
fn stacked3(backend: RedisBackend) -> RateLimitLayer<RedisBackend> {
    RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", unreachable_quota()).unwrap(),
            ClientIp::peer(),
        )
        .limit(
            Limit::fixed_window("per-ip-daily", Quota::per_day(u32::MAX).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .limit(Limit::gcra("global", unreachable_quota()).unwrap(), Global)
        .backend(backend)
        .build()
        .unwrap()
}

/// Every request under a key of its own among 100,000, taken in turn: the many-clients case,
/// where requests merged into one Redis call share no key (every request here comes from one
/// address).
fn spread_keys() -> impl tollgate::key::KeyExtractor {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    tollgate::key::key_fn(|_| {
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % 100_000;
        Some(n.to_be_bytes().to_vec())
    })
}

/// A limit whose every reservation is settled after the answer: the `count_if` says no to the
/// 200 every request gets, so each one gives its unit back.
fn settled<B: tollgate::engine::Backend>(backend: B) -> RateLimitLayer<B> {
    RateLimitLayer::builder()
        .metered(
            Limit::gcra("per-ip", unreachable_quota()).unwrap(),
            ClientIp::peer(),
            Metered::new().count_if(|r| r.status() != axum::http::StatusCode::OK),
        )
        .backend(backend)
        .build()
        .unwrap()
}

async fn hello() -> &'static str {
    "hello\n"
}

/// The leased hot key: one global GCRA limit every request touches, on Redis.
fn lease_hot(url: &str) -> RateLimitLayer<RedisBackend> {
    let lease = tollgate::engine::Lease::new(10_000)
        .unwrap()
        .with_lifetime(Duration::from_secs(1))
        .unwrap();
    let quota = Quota::per_day(100_000_000).unwrap();
    on_redis(
        Limit::gcra("global", quota)
            .unwrap()
            .with_lease(lease)
            .unwrap(),
        Global,
        url,
    )
}

async fn app(args: &Args) -> Router {
    let app = Router::new().route("/", get(hello));
    match args.mode.as_str() {
        "bare" => app,
        "tollgate-mem-allow" => app.layer(per_ip(unreachable_quota())),
        "tollgate-mem-allow-lean" => app.layer(per_ip_adding(unreachable_quota(), false, true)),
        "tollgate-mem-allow-minimal" => app.layer(per_ip_adding(unreachable_quota(), false, false)),
        "tollgate-mem-settle" => app.layer(settled(tollgate::MemoryBackend::new())),
        "tollgate-redis-settle" => app.layer(settled(redis(&args.redis))),
        "tollgate-mem-deny" => app.layer(per_ip(Quota::per_day(1).unwrap())),
        "tollgate-mem-delay" => app.layer(delayed(unreachable_quota())),
        "tollgate-mem-delay-wait" => app.layer(delayed(
            Quota::per_second(500).unwrap().with_burst(1).unwrap(),
        )),
        "tollgate-mem-inflight" => app.layer(
            RateLimitLayer::builder()
                .limit(
                    Limit::gcra("per-ip", unreachable_quota()).unwrap(),
                    ClientIp::peer(),
                )
                .limit(
                    Limit::concurrency("in-flight", 1_000).unwrap(),
                    ClientIp::peer(),
                )
                .build()
                .unwrap(),
        ),
        "tollgate-redis-inflight" => app.layer(
            RateLimitLayer::builder()
                .limit(
                    Limit::gcra("per-ip", unreachable_quota()).unwrap(),
                    ClientIp::peer(),
                )
                .limit(
                    Limit::concurrency("in-flight", 1_000).unwrap(),
                    ClientIp::peer(),
                )
                .backend(redis(&args.redis))
                .build()
                .unwrap(),
        ),
        "governor-allow" => app.layer(governor(Duration::from_micros(1), u32::MAX)),
        "governor-deny" => app.layer(governor(Duration::from_secs(86_400), 1)),
        "tollgate-redis-allow" => app.layer(on_redis(
            Limit::gcra("per-ip", unreachable_quota()).unwrap(),
            ClientIp::peer(),
            &args.redis,
        )),
        "tollgate-redis-spread" => app.layer(on_redis(
            Limit::gcra("per-client", unreachable_quota()).unwrap(),
            spread_keys(),
            &args.redis,
        )),
        "tollgate-redis-allow3" => app.layer(stacked3(redis(&args.redis))),
        "tollgate-cluster-allow" => app.layer(on_backend(
            Limit::gcra("per-ip", unreachable_quota()).unwrap(),
            ClientIp::peer(),
            cluster(&args.cluster),
        )),
        "tollgate-cluster-spread" => app.layer(on_backend(
            Limit::gcra("per-client", unreachable_quota()).unwrap(),
            spread_keys(),
            cluster(&args.cluster),
        )),
        "tollgate-cluster-allow3" => app.layer(stacked3(cluster(&args.cluster))),
        "tollgate-redis-flood" => app.layer(on_redis(
            Limit::gcra("per-ip", Quota::per_second(args.flood_limit).unwrap()).unwrap(),
            ClientIp::peer(),
            &args.redis,
        )),
        "tollgate-redis-flood-window" => app.layer(on_redis(
            Limit::fixed_window("per-ip", Quota::per_second(args.flood_limit).unwrap()).unwrap(),
            ClientIp::peer(),
            &args.redis,
        )),
        "tollgate-redis-lease-hot" => app.layer(lease_hot(&args.redis)),
        "naive-incr" => {
            let naive = NaiveIncr::connect(&args.redis, u64::MAX).await.unwrap();
            app.layer(axum::middleware::from_fn_with_state(
                naive,
                NaiveIncr::middleware,
            ))
        }
        other => match tollgate_bench::layers::parse_mode(other) {
            Some((path, features)) => {
                if features.contains(&tollgate_bench::layers::Feature::Metrics) {
                    metrics::set_global_recorder(tollgate_bench::layers::Counting).unwrap();
                }
                app.layer(tollgate_bench::layers::memory_layer(path, &features))
            }
            None => panic!("unknown mode {other:?}"),
        },
    }
}

/// SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).unwrap();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let app = app(&args).await;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
            .await
            .unwrap();
        eprintln!(
            "bench-server {} on http://{}",
            args.mode,
            listener.local_addr().unwrap()
        );
        if args.mode == "tollgate-redis-lease-hot" {
            // The layer is built again here to keep a handle on it for the shutdown.
            let layer = lease_hot(&args.redis);
            let app = Router::new()
                .route("/", get(hello))
                .layer(layer.clone())
                .into_make_service_with_connect_info::<SocketAddr>();
            axum::serve(listener, app)
                .with_graceful_shutdown(stop_signal())
                .await
                .unwrap();
            layer.shutdown().await;
            eprintln!("bench-server: slices given back");
            return;
        }
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, service).await.unwrap();
    });
}
