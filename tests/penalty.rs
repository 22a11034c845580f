//! The login example's fail2ban through the layer: a GCRA limit of 5 a minute that counts
//! only 401s, and a penalty box that blocks a client refused 3 times within a minute for
//! 600 s. In memory, and across two replicas on a real Redis server and a real 3-master
//! cluster; a reset lifts the block, a deny answers 403 and an undeny lifts it.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::{routing::post, Router};
use tollgate::cost::Metered;
use tollgate::engine::Backend;
use tollgate::key::ClientIp;
use tollgate::{FakeClock, Limit, MemoryBackend, Penalty, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::ServiceExt;

fn login_layer<B: Backend>(backend: B) -> RateLimitLayer<B> {
    let failures = Limit::gcra("login-failures", Quota::per_minute(5).unwrap())
        .unwrap()
        .penalty(
            Penalty::after(3)
                .within(Duration::from_secs(60))
                .block_for(Duration::from_secs(600)),
        )
        .unwrap();
    RateLimitLayer::builder()
        .metered(
            failures,
            ClientIp::peer(),
            Metered::new().count_if(|r| r.status() == StatusCode::UNAUTHORIZED),
        )
        .backend(backend)
        .build()
        .unwrap()
}

fn app<B: Backend>(layer: &RateLimitLayer<B>) -> Router {
    Router::new().route(
        "/login",
        post(|headers: HeaderMap| async move {
            match headers.get("x-password") {
                Some(p) if p == "open-sesame" => StatusCode::OK,
                _ => StatusCode::UNAUTHORIZED,
            }
        })
        .route_layer(layer.clone()),
    )
}

/// A login attempt from 127.0.0.1: its status and Retry-After (whole seconds).
async fn attempt(app: &Router, password: &str) -> (StatusCode, Option<u64>) {
    let mut req = Request::post("/login")
        .header("x-password", password)
        .body(Body::empty())
        .unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 4000))));
    let res = app.clone().oneshot(req).await.unwrap();
    let retry = res
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (res.status(), retry)
}

/// The contract of examples/login.rs: five wrong passwords get 401, the next three 429 (the
/// third starts the block), the right one then 429 for the block's 600 s, on `a` and on `b`
/// (another replica, or the same); a reset on `a` lets the right password in on both.
async fn fail2ban<B: Backend>(a: (&RateLimitLayer<B>, &Router), b: &Router, settle: Duration) {
    let (layer, a) = a;
    for _ in 0..5 {
        assert_eq!(attempt(a, "guess").await.0, StatusCode::UNAUTHORIZED);
    }
    let mut refused = Vec::new();
    for _ in 0..3 {
        refused.push(attempt(a, "guess").await);
    }
    assert!(refused.iter().all(|r| r.0 == StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(
        refused[2].1,
        Some(600),
        "the third refusal starts the block"
    );
    for app in [a, b] {
        let (status, retry) = attempt(app, "open-sesame").await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let retry = retry.unwrap();
        assert!((590..=600).contains(&retry), "Retry-After {retry}");
    }
    layer.reset("login-failures", "127.0.0.1").await.unwrap();
    assert_eq!(attempt(a, "open-sesame").await.0, StatusCode::OK);
    tokio::time::pause();
    tokio::time::advance(settle).await;
    tokio::time::resume();
    assert_eq!(attempt(b, "open-sesame").await.0, StatusCode::OK);
    // A deny by hand: 403 with a Retry-After to its end, on both; lifted by an undeny.
    layer
        .deny("login-failures", "127.0.0.1", Duration::from_secs(3600))
        .await
        .unwrap();
    for app in [a, b] {
        let (status, retry) = attempt(app, "open-sesame").await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!((3590..=3600).contains(&retry.unwrap()));
    }
    layer.undeny("login-failures", "127.0.0.1").await.unwrap();
    assert_eq!(attempt(a, "open-sesame").await.0, StatusCode::OK);
}

#[tokio::test]
async fn fail2ban_in_memory() {
    let memory = MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build();
    let layer = login_layer(memory);
    let app = app(&layer);
    fail2ban((&layer, &app), &app, Duration::ZERO).await;
}

fn standalone(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

#[tokio::test]
async fn fail2ban_across_two_replicas_on_redis() {
    let server = RedisServer::start();
    let a = login_layer(standalone(&server.url()));
    let b = login_layer(standalone(&server.url()));
    // B's deny cache keeps the block for up to its TTL (1 s) after the reset.
    fail2ban((&a, &app(&a)), &app(&b), Duration::from_millis(1_100)).await;
}

#[tokio::test]
async fn fail2ban_across_two_replicas_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let replica = || {
        login_layer(
            RedisBackend::builder()
                .cluster(cluster.urls())
                .deadline(Duration::from_secs(5))
                .build()
                .unwrap(),
        )
    };
    let (a, b) = (replica(), replica());
    fail2ban((&a, &app(&a)), &app(&b), Duration::from_millis(1_100)).await;
}
