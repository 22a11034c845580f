//! Delayed limits through the layer on a real Redis and a real Redis Cluster: the server's
//! clock is real, so the quota's interval (500 ms) is large against the time the checks take,
//! and each figure is read to within the slack that leaves (250 ms).

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use tollgate::key::Tenant;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};
use tollgate_redis::{RedisBackend, RedisBackendBuilder};
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::ServiceExt;

/// Two a second, burst 1, delay 1.25 s: 1 + ⌊1.25 / 0.5⌋ = 3 of any number at once.
fn app(backend: RedisBackend) -> Router {
    let limit = Limit::gcra("wait", Quota::per_second(2).unwrap().with_burst(1).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_millis(1_250))
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(limit, Tenant::header("x-key"))
        .backend(backend)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// Ten requests at once: how many were admitted, and the waits of the admitted (in ms,
/// ascending) with how long each took to be answered.
async fn ten_at_once(app: &Router) -> (usize, Vec<(u128, u128)>) {
    // Connected and the scripts loaded first (another key), so that the ten are checked
    // within the slack, however slow the machine's first call.
    let warm = Request::get("/")
        .header("x-key", "warm")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(warm).await.unwrap().status(),
        StatusCode::OK
    );
    let start = Instant::now();
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let req = Request::get("/")
                .header("x-key", "k")
                .body(Body::empty())
                .unwrap();
            let app = app.clone();
            tokio::spawn(async move {
                let res = app.oneshot(req).await.unwrap();
                (res, start.elapsed())
            })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = 0;
    for task in tasks {
        let (res, took) = task.await.unwrap();
        if res.status() == StatusCode::OK {
            let waited = res.extensions().get::<Decision>().unwrap().delayed();
            admitted.push((waited.unwrap_or_default().as_millis(), took.as_millis()));
        } else {
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(res.headers()["retry-after"], "1");
            refused += 1;
        }
    }
    admitted.sort();
    assert_eq!(admitted.len() + refused, 10);
    (admitted.len(), admitted)
}

fn assert_model(admitted: usize, waits: &[(u128, u128)]) {
    assert_eq!(admitted, 3);
    // At once, then 500 ms and 1 s beyond the burst, less the time the checks took.
    for (&(waited, took), model) in waits.iter().zip([0, 500, 1_000]) {
        assert!(waited <= model && waited + 250 >= model, "{waits:?}");
        // Served no earlier than its time.
        assert!(took >= waited, "{waits:?}");
    }
}

/// The ten at once through a layer over `builder`'s backend, against the model.
async fn ten_against_the_model(builder: RedisBackendBuilder) {
    let backend = builder
        .prefix("delay")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let (admitted, waits) = ten_at_once(&app(backend)).await;
    assert_model(admitted, &waits);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_admits_the_burst_and_the_delay_s_intervals_each_at_its_time() {
    let server = RedisServer::start();
    ten_against_the_model(RedisBackend::builder().url(server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_admits_the_burst_and_the_delay_s_intervals_each_at_its_time() {
    let cluster = RedisCluster::start(3);
    ten_against_the_model(RedisBackend::builder().cluster(cluster.urls())).await;
}
