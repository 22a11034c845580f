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

/// One a second, burst 1, delay 5 s, on a real server: requests due at 0, 1 and 2 s; the one
/// due at 1 s goes away before its time. The next is due at 3 s, after the one still waiting
/// for 2 s, never beside it (its unit stays counted until the key's time reaches it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiter_never_lets_a_later_request_start_beside_one_that_waits() {
    let server = RedisServer::start();
    let backend = RedisBackend::builder()
        .url(server.url())
        .prefix("dropped")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    let limit = Limit::gcra("wait", Quota::per_second(1).unwrap().with_burst(1).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_secs(5))
        .unwrap();
    let value_key = backend.key_for(&limit, b"k");
    let layer = RateLimitLayer::builder()
        .limit(limit, Tenant::header("x-key"))
        .backend(backend)
        .build()
        .unwrap();
    let start = Instant::now();
    let app = Router::new()
        .route(
            "/",
            get(move || async move { start.elapsed().as_millis().to_string() }),
        )
        .layer(layer);
    let send = |app: &Router| {
        let req = Request::get("/")
            .header("x-key", "k")
            .body(Body::empty())
            .unwrap();
        tokio::spawn(app.clone().oneshot(req))
    };
    // How far ahead of the server's clock the key's TAT lies, in whole seconds (rounded).
    let mut redis = server.client();
    let mut ahead = move || -> u64 {
        let value: Option<String> = tollgate_testsupport::redis::cmd("GET")
            .arg(&value_key)
            .query(&mut redis)
            .unwrap();
        let (secs, micros): (u64, u64) = tollgate_testsupport::redis::cmd("TIME")
            .query(&mut redis)
            .unwrap();
        let tat: u64 = value.map_or(0, |v| v.split(':').next().unwrap().parse().unwrap());
        (tat.saturating_sub(secs * 1_000_000 + micros) + 500_000) / 1_000_000
    };
    // Each request is sent once the one before it has its reservation in Redis.
    let mut tasks = Vec::new();
    for reservations in 1..=3 {
        tasks.push(send(&app));
        while ahead() < reservations {
            tokio::task::yield_now().await;
        }
    }
    // The second goes away; the next request is sent once the refund its drop sends has
    // reached Redis (a call of a script, the only one since).
    server.reset_stats();
    tasks.remove(1).abort();
    while server.calls("evalsha") == 0 {
        tokio::task::yield_now().await;
    }
    let fourth = send(&app);
    // When each reached the handler (ms after the first was sent), and how long it waited.
    let mut seen = Vec::new();
    for task in tasks.into_iter().chain([fourth]) {
        let res = task.await.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let waited = res.extensions().get::<Decision>().unwrap().delayed();
        let body = axum::body::to_bytes(res.into_body(), 64).await.unwrap();
        let at: u128 = String::from_utf8_lossy(&body).parse().unwrap();
        seen.push((at, waited.map_or(0, |w| w.as_millis())));
    }
    // The first at once, the third at 2 s, the fourth at 3 s: each within the slack of its
    // time, and the fourth a whole second after the third.
    for (&(at, _), model) in seen.iter().zip([0, 2_000, 3_000]) {
        assert!(at >= model && at <= model + 250, "{seen:?}");
    }
    assert!(seen[2].0 >= seen[1].0 + 750, "{seen:?}");
}
