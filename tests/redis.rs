//! The layer on a real Redis (and Redis Cluster): one limit across instances, failure policies.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use tollgate::key::{Global, Tenant};
use tollgate::{Decision, Limit, Outcome, Quota, RateLimitLayer, Source};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::ServiceExt;

/// One app instance: its own router, its own Redis connection.
fn instance(redis: RedisBackend, limits: Vec<Limit>) -> Router {
    let mut builder = RateLimitLayer::builder().backend(redis);
    for limit in limits {
        builder = builder.limit(limit, Tenant::header("x-shop-domain"));
    }
    Router::new()
        .route("/api/chat", get(|| async { "ok" }))
        .layer(builder.build().unwrap())
}

/// A deadline that a loaded machine meets: a timed-out check fails open (the default) and
/// would spoil an exact count.
fn standalone(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .prefix("test")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn req(shop: &str) -> Request<Body> {
    Request::get("/api/chat")
        .header("x-shop-domain", shop)
        .body(Body::empty())
        .unwrap()
}

async fn status(app: &Router, shop: &str) -> StatusCode {
    app.clone().oneshot(req(shop)).await.unwrap().status()
}

fn per_minute(name: &str, n: u32) -> Limit {
    Limit::gcra(name, Quota::per_minute(n).unwrap()).unwrap()
}

#[tokio::test]
async fn two_instances_on_one_redis_enforce_the_limit_once() {
    let server = RedisServer::start();
    let a = instance(standalone(&server.url()), vec![per_minute("chat", 2)]);
    let b = instance(standalone(&server.url()), vec![per_minute("chat", 2)]);
    let mut admitted = 0;
    for i in 0..10 {
        let app = if i % 2 == 0 { &a } else { &b };
        admitted += usize::from(status(app, "shop-1.example").await == StatusCode::OK);
    }
    assert_eq!(admitted, 2);
    // Another shop has its own quota.
    assert_eq!(status(&b, "shop-2.example").await, StatusCode::OK);
}

async fn hundred_concurrent(a: Router, b: Router) -> usize {
    let barrier = Arc::new(tokio::sync::Barrier::new(100));
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let app = if i % 2 == 0 { a.clone() } else { b.clone() };
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                app.oneshot(req("busy.example")).await.unwrap().status()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap() == StatusCode::OK);
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_requests_on_two_instances_admit_exactly_ten() {
    let server = RedisServer::start();
    let a = instance(standalone(&server.url()), vec![per_minute("chat", 10)]);
    let b = instance(standalone(&server.url()), vec![per_minute("chat", 10)]);
    // Warm both connections so that no request pays the connect inside the deadline.
    assert_eq!(status(&a, "warm-a.example").await, StatusCode::OK);
    assert_eq!(status(&b, "warm-b.example").await, StatusCode::OK);
    assert_eq!(hundred_concurrent(a, b).await, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_requests_on_a_cluster_admit_exactly_ten() {
    let cluster = RedisCluster::start(3);
    let backend = || {
        RedisBackend::builder()
            .cluster(cluster.urls())
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let limits = || vec![per_minute("chat", 10), per_minute("chat-hour", 1_000)];
    let a = instance(backend(), limits());
    let b = instance(backend(), limits());
    assert_eq!(status(&a, "warm-a.example").await, StatusCode::OK);
    assert_eq!(status(&b, "warm-b.example").await, StatusCode::OK);
    assert_eq!(hundred_concurrent(a, b).await, 10);
}

#[tokio::test]
async fn one_script_call_per_request_whatever_the_number_of_limits() {
    let server = RedisServer::start();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder()
            .limit(per_minute("burst", 1_000), Tenant::header("x-shop-domain"))
            .limit(
                Limit::fixed_window("daily", Quota::per_day(10_000).unwrap()).unwrap(),
                Tenant::header("x-shop-domain"),
            )
            .limit(
                Limit::sliding_log("hourly", Quota::per_hour(500).unwrap()).unwrap(),
                Global,
            )
            .backend(standalone(&server.url()))
            .build()
            .unwrap(),
    );
    let send = || async {
        let req = Request::get("/")
            .header("x-shop-domain", "a.example")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(req).await.unwrap().status()
    };
    assert_eq!(send().await, StatusCode::OK); // loads the script
    server.reset_stats();
    for _ in 0..25 {
        assert_eq!(send().await, StatusCode::OK);
    }
    let stats = server.command_stats();
    // One round trip per request: 25 script calls, no EVAL fallback, no other call from outside
    // a script (the commands the script runs inside Redis are counted too, and all are its own).
    assert_eq!(stats.get("evalsha").copied(), Some(25), "{stats:?}");
    assert_eq!(stats.get("eval"), None, "{stats:?}");
    assert_eq!(
        stats.get("time").copied(),
        Some(25),
        "one TIME per script: {stats:?}"
    );
}

#[tokio::test]
async fn when_redis_dies_each_limit_applies_its_policy_and_resumes_after() {
    let mut server = RedisServer::start();
    let open_for = Duration::from_secs(30);
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(Duration::from_millis(200))
        .breaker_threshold(3)
        .breaker_open_for(open_for)
        .build()
        .unwrap();
    let app = |limit: Limit| instance(backend.clone(), vec![limit]);
    let open = app(per_minute("open", 100));
    let closed = app(per_minute("closed", 100).fail_closed());
    let local = app(per_minute("local", 4).fallback(2.try_into().unwrap()));
    for a in [&open, &closed, &local] {
        assert_eq!(status(a, "s.example").await, StatusCode::OK);
    }

    server.stop();
    // Fail open: admitted, and the decision says Bypassed.
    for _ in 0..5 {
        let res = open.clone().oneshot(req("s.example")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let d = res.extensions().get::<Decision>().unwrap();
        assert!(matches!(
            d.get("open").unwrap().outcome(),
            Outcome::Bypassed { .. }
        ));
    }
    // Fail closed: 503 with Retry-After.
    let res = closed.clone().oneshot(req("s.example")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    // Fallback: the local limiter admits the quota's share (4 / 2 replicas = 2), then refuses.
    let mut codes = Vec::new();
    for _ in 0..3 {
        let res = local.clone().oneshot(req("s.example")).await.unwrap();
        if res.status() == StatusCode::OK {
            let d = res.extensions().get::<Decision>().unwrap();
            assert_eq!(d.get("local").unwrap().source(), Source::Fallback);
        }
        codes.push(res.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 429]);

    server.start_again();
    // The breaker is open: requests stay on the failure policy until its interval has passed,
    // on tokio's clock.
    tokio::time::pause();
    tokio::time::advance(open_for).await;
    tokio::time::resume();
    let res = open.clone().oneshot(req("s.example")).await.unwrap();
    let d = res.extensions().get::<Decision>().unwrap();
    match d.get("open").unwrap().outcome() {
        Outcome::Allowed { remaining, .. } => assert_eq!(*remaining, 99), // the restart lost the data
        other => panic!("limiting should have resumed, got {other:?}"),
    }
}

#[tokio::test]
async fn a_frozen_redis_costs_each_request_at_most_the_deadline() {
    let mut server = RedisServer::start();
    let deadline = Duration::from_millis(100);
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(deadline)
        .breaker_threshold(0) // off: every request pays the deadline, the worst case
        .build()
        .unwrap();
    let app = instance(backend, vec![per_minute("open", 100)]);
    assert_eq!(status(&app, "s.example").await, StatusCode::OK);
    server.pause();
    for _ in 0..3 {
        let started = Instant::now();
        assert_eq!(status(&app, "s.example").await, StatusCode::OK);
        // A bound, not a benchmark: the deadline plus a generous margin for a loaded machine.
        assert!(
            started.elapsed() < deadline + Duration::from_millis(400),
            "{:?}",
            started.elapsed()
        );
    }
    server.resume();
}

/// `Retry-After` of a response, in seconds.
fn retry_after(res: &axum::response::Response) -> u64 {
    res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// The same request refused by `cached`, a replica with a deny cache, then by `truth`, one
/// without: the first response, and the wait Redis gave. The cached `Retry-After` must be
/// that wait (whole seconds rounded up, read a moment earlier: possibly one more).
async fn refused_by_cache_and_redis(
    cached: &Router,
    truth: &Router,
) -> (axum::response::Response, u64) {
    let refused = cached.clone().oneshot(req("s.example")).await.unwrap();
    let real = truth.clone().oneshot(req("s.example")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(real.status(), StatusCode::TOO_MANY_REQUESTS);
    let (cached_wait, real_wait) = (retry_after(&refused), retry_after(&real));
    assert!(
        (real_wait..=real_wait + 1).contains(&cached_wait),
        "{cached_wait} s from the deny cache, {real_wait} s from Redis"
    );
    (refused, real_wait)
}

/// A replica whose every check reaches Redis: the truth a deny cache must not contradict.
fn uncached(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .prefix("test")
        .deadline(Duration::from_secs(5))
        .deny_cache_capacity(0)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_refusal_from_the_deny_cache_says_when_every_refusing_limit_admits_again() {
    let server = RedisServer::start();
    let stacked = || {
        vec![
            per_minute("burst", 2),
            Limit::fixed_window("daily", Quota::per_day(2).unwrap()).unwrap(),
        ]
    };
    let cached = instance(standalone(&server.url()), stacked());
    let truth = instance(uncached(&server.url()), stacked());
    for _ in 0..2 {
        assert_eq!(status(&cached, "s.example").await, StatusCode::OK);
    }
    // Both limits are used up: the burst for 30 s, the day until midnight (UTC).
    let (refused, real_wait) = refused_by_cache_and_redis(&cached, &truth).await;
    // The day's refusal outlasts the burst's (unless the day ends within the burst's 30 s).
    let to_midnight = 86_400
        - std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            % 86_400;
    if to_midnight > 32 {
        assert!(real_wait > 30, "{real_wait}");
    }
    let decision = refused.extensions().get::<Decision>().unwrap();
    for limit in ["burst", "daily"] {
        assert_eq!(
            decision.get(limit).unwrap().label(),
            "denied",
            "{decision:?}"
        );
    }
}

#[tokio::test]
async fn a_cached_denial_of_a_cheaper_request_does_not_shorten_a_costlier_ones_wait() {
    let server = RedisServer::start();
    // One budget shared by two routes: a chat costs 1 unit, a summary 5.
    let budget = || per_minute("llm-budget", 10);
    let redis = standalone(&server.url());
    let chat = instance(redis.clone(), vec![budget()]);
    let summary = instance(redis, vec![budget().with_cost(5).unwrap()]);
    let truth = instance(
        uncached(&server.url()),
        vec![budget().with_cost(5).unwrap()],
    );
    for _ in 0..10 {
        assert_eq!(status(&chat, "s.example").await, StatusCode::OK);
    }
    // The chats used the budget, and the last one left a cost-1 denial in the cache.
    let (_, real_wait) = refused_by_cache_and_redis(&summary, &truth).await;
    // 5 units at one every 6 s, counted from the first chat (a slow machine may have spent a
    // second or more on the chats); a cached cost-1 denial would say 6.
    assert!((25..=30).contains(&real_wait), "{real_wait}");
}
