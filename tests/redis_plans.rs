//! Quotas per plan and limits replaced at run time, on a real Redis and a real Redis Cluster.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use tollgate::key::Tenant;
use tollgate::{Limit, Limits, Plan, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::ServiceExt;

fn standalone(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .prefix("plans")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn cluster(cluster: &RedisCluster) -> RedisBackend {
    RedisBackend::builder()
        .cluster(cluster.urls())
        .prefix("plans")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn req(key: &str, plan: Option<&str>) -> Request<Body> {
    let mut req = Request::get("/")
        .header("x-key", key)
        .body(Body::empty())
        .unwrap();
    if let Some(plan) = plan {
        req.extensions_mut().insert(Plan::new(plan));
    }
    req
}

async fn admitted(app: &Router, key: &str, plan: Option<&str>, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let res = app.clone().oneshot(req(key, plan)).await.unwrap();
        if res.status() == StatusCode::OK {
            ok += 1;
        }
    }
    ok
}

/// Slow refills and long windows: nothing a test waits for turns while it runs (a day's
/// window turns at UTC midnight only).
fn limits() -> Limits {
    let gcra = Limit::gcra("p-gcra", Quota::per_hour(3).unwrap())
        .unwrap()
        .plan("pro", Quota::per_hour(6).unwrap())
        .unwrap();
    let window = Limit::fixed_window("p-window", Quota::per_day(4).unwrap())
        .unwrap()
        .plan("pro", Quota::per_day(7).unwrap())
        .unwrap();
    let log = Limit::sliding_log("p-log", Quota::per_hour(2).unwrap())
        .unwrap()
        .plan("pro", Quota::per_hour(5).unwrap())
        .unwrap();
    Limits::new()
        .limit(gcra, Tenant::header("x-key"))
        .limit(window, Tenant::header("x-key"))
        .limit(log, Tenant::header("x-key"))
}

/// Each limit alone, per plan: the (limit, quota) pairs are counted exactly.
async fn each_plan_is_exact(backend: impl Fn() -> RedisBackend) {
    for limit in limits().iter() {
        let app = Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::builder()
                .limit(limit.clone(), Tenant::header("x-key"))
                .backend(backend())
                .build()
                .unwrap(),
        );
        let (default, pro) = (
            limit.quota_of(None).1.limit() as usize,
            limit.quota_of(Some("pro")).1.limit() as usize,
        );
        assert_eq!(admitted(&app, "free-a", Some("free"), 10).await, default);
        assert_eq!(admitted(&app, "none-a", None, 10).await, default);
        assert_eq!(admitted(&app, "pro-a", Some("pro"), 10).await, pro);
    }
}

#[tokio::test]
async fn each_plan_gets_its_quota_on_redis() {
    let server = RedisServer::start();
    each_plan_is_exact(|| standalone(&server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_plan_gets_its_quota_on_a_cluster() {
    let nodes = RedisCluster::start(3);
    each_plan_is_exact(|| cluster(&nodes)).await;
}

fn daily(n: u32) -> Limits {
    Limits::new().limit(
        Limit::fixed_window("daily", Quota::per_day(n).unwrap()).unwrap(),
        Tenant::header("x-key"),
    )
}

/// A key that used 5 of 5 a day, raised to 10, gets exactly 5 more: at once, although this
/// replica's deny cache had just seen it refused.
async fn a_raised_quota_is_seen_at_once(backend: RedisBackend) {
    let layer = RateLimitLayer::builder()
        .limits(daily(5))
        .backend(backend)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer.clone());
    assert_eq!(admitted(&app, "a", None, 7).await, 5);
    assert!(layer.backend().deny_cache_len() > 0);
    layer.reloader().reload(daily(10)).unwrap();
    // The denial cached under the old quota answers no request under the new one.
    assert_eq!(admitted(&app, "a", None, 8).await, 5);
    // A reload that keeps the quotas keeps the cached denials.
    assert!(layer.backend().deny_cache_len() > 0);
    layer.reloader().reload(daily(10)).unwrap();
    assert!(layer.backend().deny_cache_len() > 0);
}

#[tokio::test]
async fn a_raised_quota_keeps_the_count_and_outlives_cached_denials_on_redis() {
    let server = RedisServer::start();
    a_raised_quota_is_seen_at_once(standalone(&server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_quota_keeps_the_count_and_outlives_cached_denials_on_a_cluster() {
    let nodes = RedisCluster::start(3);
    a_raised_quota_is_seen_at_once(cluster(&nodes)).await;
}

fn hourly_gcra(n: u32) -> Limits {
    Limits::new().limit(
        Limit::gcra("hourly", Quota::per_hour(n).unwrap()).unwrap(),
        Tenant::header("x-key"),
    )
}

/// GCRA carries the units a key used when its quota changes: by a reload, or by its plan.
async fn gcra_carries_what_was_used(backend: RedisBackend, other: RedisBackend) {
    let layer = RateLimitLayer::builder()
        .limits(hourly_gcra(5))
        .backend(backend)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer.clone());
    assert_eq!(admitted(&app, "g", None, 7).await, 5);
    layer.reloader().reload(hourly_gcra(10)).unwrap();
    assert_eq!(admitted(&app, "g", None, 8).await, 5);

    let plans = Limit::gcra("switch", Quota::per_hour(2).unwrap())
        .unwrap()
        .plan("pro", Quota::per_hour(6).unwrap())
        .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder()
            .limit(plans, Tenant::header("x-key"))
            .backend(other)
            .build()
            .unwrap(),
    );
    assert_eq!(admitted(&app, "u", None, 3).await, 2);
    assert_eq!(admitted(&app, "u", Some("pro"), 10).await, 4);
}

#[tokio::test]
async fn gcra_carries_what_a_key_used_across_quotas_on_redis() {
    let server = RedisServer::start();
    gcra_carries_what_was_used(standalone(&server.url()), standalone(&server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_carries_what_a_key_used_across_quotas_on_a_cluster() {
    let nodes = RedisCluster::start(3);
    gcra_carries_what_was_used(cluster(&nodes), cluster(&nodes)).await;
}
