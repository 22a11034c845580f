//! Heap allocations per request of the layer, counted in-process: a count, not a timing, so it
//! can run in CI and fail when an allocation comes back.
//!
//! ```text
//! allocs [--requests N] [--check] [--only MODE] [--redis redis://127.0.0.1:6379/]
//! ```
//!
//! Each row is an axum router (a hello handler, the client's address in `ConnectInfo`) bare or
//! behind one in-memory layer ([`tollgate_bench::layers`], the same configurations as the bench
//! server's `tollgate-mem-allow+FEATURE` modes), called `N` times on a current-thread runtime
//! after a warm-up, the response's body read to its end. The layer's figure is its row's
//! allocations per request minus bare's (the request, the router and the body are the same in
//! every row). With `--check` it exits 1 when a row's figure is above its budget below: lower a
//! budget when an allocation is removed, so that it cannot come back unseen.
//!
//! With `--redis`, a row `tollgate-redis-allow` (one GCRA limit per IP that admits every request,
//! on that Redis) is printed and checked too: one request at a time, so every request is a
//! merged call of its own, the Redis path's most allocations per request. CI runs it on a
//! throwaway `redis-server`.
//!
//! The counter is the `stats_alloc` crate's wrapper of the system allocator: a global allocator
//! is an `unsafe impl`, which this workspace forbids in its own code.

// A measurement tool: a failed request should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::alloc::System;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::routing::get;
use axum::Router;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tollgate_bench::layers::governor;
use tollgate_bench::layers::{memory_layer, Counting, Feature, Path};
use tower::{Service, ServiceExt};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The most allocations per request each row's layer may make over bare axum's. A row missing
/// here has a budget of 0.
const BUDGETS: &[(&str, u64)] = &[
    ("tollgate-mem-allow", 9),
    ("tollgate-mem-deny", 4),
    ("tollgate-mem-allow+no-headers+no-decision", 6),
    ("tollgate-mem-allow+no-headers", 9),
    ("tollgate-mem-allow+no-decision", 6),
    ("tollgate-mem-allow+metrics", 9),
    ("tollgate-mem-allow+near-limit", 9),
    ("tollgate-mem-allow+no-top-refused", 9),
    ("tollgate-mem-allow+penalty", 9),
    ("tollgate-mem-allow+denylist", 9),
    ("tollgate-mem-allow+allowlist", 9),
    ("tollgate-mem-allow+plans", 9),
    ("tollgate-mem-allow+costs", 9),
    ("tollgate-mem-allow+delay", 13),
    ("tollgate-mem-allow+slots", 13),
    ("tollgate-mem-allow+queue", 13),
    ("tollgate-mem-deny+no-headers", 4),
    ("tollgate-mem-deny+no-decision", 4),
    ("tollgate-mem-deny+metrics", 4),
    ("tollgate-mem-deny+near-limit", 4),
    ("tollgate-mem-deny+no-top-refused", 4),
    ("tollgate-mem-deny+penalty", 4),
    ("tollgate-mem-deny+denylist", 4),
    ("tollgate-mem-deny+allowlist", 4),
    ("tollgate-mem-deny+plans", 4),
    ("tollgate-mem-deny+costs", 4),
    ("tollgate-mem-deny+delay", 8),
    ("tollgate-mem-deny+slots", 5),
    ("tollgate-mem-deny+queue", 5),
    // With `--redis`: the layer's own (as `tollgate-mem-allow`'s) and the call's. Of those
    // left: the request's wait for its call and the answer's slot are reused, not allocated.
    ("tollgate-redis-allow", 10),
];

async fn hello() -> &'static str {
    "hello\n"
}

/// A request from one client.
fn request() -> Request<Body> {
    let peer = SocketAddr::from(([10, 0, 0, 1], 40_000));
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut().insert(ConnectInfo(peer));
    req
}

/// Allocations per request (allocations and reallocations, as a heap profiler counts blocks)
/// of `router` over `n` requests after a warm-up, in hundredths.
fn per_request(router: Router, n: u64) -> u64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let mut service = router.into_service::<Body>();
        let mut run = async |count: u64| {
            for _ in 0..count {
                let response = service
                    .ready()
                    .await
                    .unwrap()
                    .call(request())
                    .await
                    .unwrap();
                axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .unwrap();
            }
        };
        run(1_000).await;
        let region = Region::new(GLOBAL);
        run(n).await;
        let stats = region.change();
        (stats.allocations + stats.reallocations) as u64 * 100 / n
    })
}

fn app() -> Router {
    Router::new().route("/", get(hello))
}

fn main() {
    let mut n = 20_000;
    let mut check = false;
    let mut only = None;
    let mut redis = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--requests" => n = args.next().unwrap().parse().unwrap(),
            "--check" => check = true,
            "--only" => only = args.next(),
            "--redis" => redis = args.next(),
            other => panic!("unknown argument {other}"),
        }
    }
    let mut rows: Vec<(String, Path, Vec<Feature>)> = vec![
        ("tollgate-mem-allow".into(), Path::Allow, vec![]),
        ("tollgate-mem-deny".into(), Path::Deny, vec![]),
        (
            "tollgate-mem-allow+no-headers+no-decision".into(),
            Path::Allow,
            vec![Feature::NoHeaders, Feature::NoDecision],
        ),
    ];
    for path in [Path::Allow, Path::Deny] {
        for feature in Feature::ALL {
            let base = match path {
                Path::Allow => "tollgate-mem-allow",
                Path::Deny => "tollgate-mem-deny",
            };
            rows.push((format!("{base}+{}", feature.name()), path, vec![feature]));
        }
    }
    let bare = per_request(app(), n);
    println!(
        "{:<44} {:>10} {:>8} {:>8}",
        "mode", "allocs/req", "layer", "budget"
    );
    println!("{:<44} {:>10}", "bare", hundredths(bare));
    // For comparison, not checked.
    for (name, period, burst) in [
        ("governor-allow", Duration::from_micros(1), u32::MAX),
        ("governor-deny", Duration::from_secs(86_400), 1),
    ] {
        let total = per_request(app().layer(governor(period, burst)), n);
        let own = total.saturating_sub(bare);
        println!(
            "{name:<44} {:>10} {:>8}",
            hundredths(total),
            hundredths(own)
        );
    }
    let mut over = Vec::new();
    if let Some(only) = &only {
        rows.retain(|(name, _, _)| name == only);
    }
    for (name, path, features) in &rows {
        let layer = memory_layer(*path, features);
        let router = app().layer(layer);
        let total = if features.contains(&Feature::Metrics) {
            metrics::with_local_recorder(&Counting, || per_request(router, n))
        } else {
            per_request(router, n)
        };
        let own = total.saturating_sub(bare);
        let budget = budget(name);
        println!(
            "{name:<44} {:>10} {:>8} {budget:>8}",
            hundredths(total),
            hundredths(own)
        );
        // Half an allocation of slack: a figure is an average, and a rare allocation (a map
        // that grows, a tick's hand-over) must not fail the check.
        if own > budget * 100 + 50 {
            over.push(name.clone());
        }
    }
    if let Some(url) = redis {
        let backend = tollgate_redis::RedisBackend::builder()
            .url(url.as_str())
            .build()
            .unwrap();
        let quota = tollgate::Quota::per_second(1_000_000)
            .unwrap()
            .with_burst(u32::MAX)
            .unwrap();
        let layer = tollgate::RateLimitLayer::builder()
            .limit(
                tollgate::Limit::gcra("per-ip", quota).unwrap(),
                tollgate::key::ClientIp::peer(),
            )
            .backend(backend)
            .build()
            .unwrap();
        let total = per_request(app().layer(layer), n);
        let own = total.saturating_sub(bare);
        let name = "tollgate-redis-allow";
        let budget = budget(name);
        println!(
            "{name:<44} {:>10} {:>8} {budget:>8}",
            hundredths(total),
            hundredths(own)
        );
        if own > budget * 100 + 50 {
            over.push(name.to_owned());
        }
    }
    if check && !over.is_empty() {
        eprintln!("allocations per request over budget: {}", over.join(", "));
        std::process::exit(1);
    }
}

/// The budget of the row `name`.
fn budget(name: &str) -> u64 {
    BUDGETS
        .iter()
        .find(|(mode, _)| *mode == name)
        .map_or(0, |(_, budget)| *budget)
}

/// `n` hundredths as a decimal.
fn hundredths(n: u64) -> String {
    format!("{}.{:02}", n / 100, n % 100)
}
