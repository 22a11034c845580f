//! Features that are exact alone, combined: a settle under a plan, fail open into a metered
//! handler, a sequential client on a concurrency limit, a reset seen by another replica. On
//! memory, a real Redis and a real 3-master Redis Cluster.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, Request, StatusCode};
use axum::{routing::get, Extension, Router};
use tollgate::cost::{Metered, Settle};
use tollgate::engine::Backend;
use tollgate::key::Tenant;
use tollgate::{Decision, FakeClock, Limit, MemoryBackend, Outcome, Plan, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::ServiceExt;

fn standalone(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .prefix("meet")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// `GET /` answering `ok`, behind `layer`.
fn ok_app<B: Backend>(layer: RateLimitLayer<B>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// A backend whose Redis was started and stopped: every call fails, fast.
fn down() -> RedisBackend {
    let mut server = RedisServer::start();
    server.stop();
    RedisBackend::builder()
        .url(server.url())
        .deadline(Duration::from_millis(200))
        .build()
        .unwrap()
}

fn cluster(cluster: &RedisCluster) -> RedisBackend {
    RedisBackend::builder()
        .cluster(cluster.urls())
        .prefix("meet")
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// Tokens per day: 10 by default, 1,000 on the pro plan; each request reserves `x-cost` and
/// the handler charges `x-charge` through its `Settle` handle.
fn tokens<B: Backend>(backend: B) -> (RateLimitLayer<B>, Router) {
    let limit = Limit::gcra("tokens", Quota::per_day(10).unwrap())
        .unwrap()
        .plan("pro", Quota::per_day(1000).unwrap())
        .unwrap();
    let layer = RateLimitLayer::builder()
        .metered(
            limit,
            Tenant::header("x-shop"),
            Metered::new()
                .header(HeaderName::from_static("x-cost"))
                .charged_by_handler(),
        )
        .backend(backend)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            get(
                |Extension(settle): Extension<Settle>, req: Request<Body>| async move {
                    let charge = req.headers().get("x-charge").unwrap().to_str().unwrap();
                    settle.charge(charge.parse().unwrap());
                    format!("counting={}", settle.is_counting())
                },
            ),
        )
        .layer(layer.clone());
    (layer, app)
}

fn pro(cost: u32, charge: u32) -> Request<Body> {
    let mut req = Request::get("/")
        .header("x-shop", "shop.example")
        .header("x-cost", cost.to_string())
        .header("x-charge", charge.to_string())
        .body(Body::empty())
        .unwrap();
    req.extensions_mut().insert(Plan::new("pro"));
    req
}

async fn body_of(res: axum::response::Response) -> String {
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The pro shop's remaining tokens, once they are no longer `before` (a settle on Redis is
/// sent without waiting: up to 500 looks 10 ms apart).
async fn remaining_after<B: Backend>(layer: &RateLimitLayer<B>, before: u64) -> u64 {
    let mut seen = before;
    for _ in 0..500 {
        seen = layer
            .peek_plan("tokens", Some("pro"), "shop.example")
            .await
            .unwrap()
            .remaining;
        if seen != before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen
}

/// A pro shop uses 900 of its 1,000 tokens, then a request reserves 10 and is charged 0: the
/// refund gives back those 10 under the pro quota, and 100 are left (not 990, as a settle
/// under the default quota of 10 would leave).
async fn a_refund_under_a_plan_keeps_the_plans_count<B: Backend>(backend: B) {
    let (layer, app) = tokens(backend);
    let res = app.clone().oneshot(pro(900, 900)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(body_of(res).await, "counting=true");
    let res = app.clone().oneshot(pro(10, 0)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    body_of(res).await;
    assert_eq!(remaining_after(&layer, 90).await, 100);
    // 100 more are admitted, and the 101st is refused.
    let res = app.clone().oneshot(pro(100, 100)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    body_of(res).await;
    let res = app.clone().oneshot(pro(1, 1)).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn a_refund_under_a_plan_keeps_the_plans_count_in_memory() {
    let clock = FakeClock::new(1_700_000_000_000_000);
    let memory = MemoryBackend::builder().clock(clock).build();
    a_refund_under_a_plan_keeps_the_plans_count(memory).await;
}

#[tokio::test]
async fn a_refund_under_a_plan_keeps_the_plans_count_on_redis() {
    let server = RedisServer::start();
    a_refund_under_a_plan_keeps_the_plans_count(standalone(&server.url())).await;
}

#[tokio::test]
async fn a_refund_under_a_plan_keeps_the_plans_count_on_a_cluster() {
    let nodes = RedisCluster::start(3);
    a_refund_under_a_plan_keeps_the_plans_count(cluster(&nodes)).await;
}

/// Redis is down and the limit fails open (the default): the handler that takes the `Settle`
/// handle is called, and the handle says its reports go nowhere.
#[tokio::test]
async fn fail_open_admits_into_a_metered_handler() {
    let (_, app) = tokens(down());
    for _ in 0..3 {
        let res = app.clone().oneshot(pro(5, 3)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let decision = res.extensions().get::<Decision>().unwrap().clone();
        assert!(matches!(
            decision.limits()[0].outcome(),
            Outcome::Bypassed { .. }
        ));
        assert_eq!(body_of(res).await, "counting=false");
    }
}

/// One client, one request at a time, each body read to its end, on a concurrency limit of 1:
/// every one of 40 is admitted, since each slot is given back before the next check counts.
#[tokio::test]
async fn a_sequential_client_is_never_refused_by_a_concurrency_limit_of_one() {
    let server = RedisServer::start();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::concurrency("one-at-a-time", 1).unwrap(),
            Tenant::header("x-shop"),
        )
        .backend(standalone(&server.url()))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "a body of a few bytes" }))
        .layer(layer);
    let mut admitted = 0;
    for _ in 0..40 {
        let req = Request::get("/")
            .header("x-shop", "shop.example")
            .body(Body::empty())
            .unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        if res.status() == StatusCode::OK {
            admitted += 1;
        }
        body_of(res).await;
    }
    assert_eq!(admitted, 40);
}

/// Moves Tokio's clock (which the deny cache reads) on by `by`, without sleeping.
async fn advance(by: Duration) {
    tokio::time::pause();
    tokio::time::advance(by).await;
    tokio::time::resume();
}

/// Replica B caches a denial for half a minute; replica A resets the key. B asks Redis again
/// within the deny cache's TTL (1 s by default) and admits.
#[tokio::test]
async fn a_reset_reaches_another_replicas_cached_denial_within_the_ttl() {
    let server = RedisServer::start();
    let replica = |backend: RedisBackend| {
        let layer = RateLimitLayer::builder()
            .limit(
                Limit::gcra("chat", Quota::per_minute(2).unwrap()).unwrap(),
                Tenant::header("x-shop"),
            )
            .backend(backend)
            .build()
            .unwrap();
        let app = ok_app(layer.clone());
        (layer, app)
    };
    let (a, _) = replica(standalone(&server.url()));
    let (_, b) = replica(standalone(&server.url()));
    let status = |app: &Router| {
        let req = Request::get("/")
            .header("x-shop", "shop.example")
            .body(Body::empty())
            .unwrap();
        let app = app.clone();
        async move { app.oneshot(req).await.unwrap().status() }
    };
    assert_eq!(status(&b).await, StatusCode::OK);
    assert_eq!(status(&b).await, StatusCode::OK);
    let calls = |server: &RedisServer| server.calls("evalsha");
    assert_eq!(status(&b).await, StatusCode::TOO_MANY_REQUESTS);
    let asked = calls(&server);
    // Refused from B's deny cache: no call.
    assert_eq!(status(&b).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(calls(&server), asked);
    // Past the TTL, B asks Redis once, which still refuses.
    advance(Duration::from_millis(1_001)).await;
    assert_eq!(status(&b).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(calls(&server), asked + 1);
    a.reset("chat", "shop.example").await.unwrap();
    // Within the TTL B may still refuse from its cache ...
    assert_eq!(status(&b).await, StatusCode::TOO_MANY_REQUESTS);
    // ... and past it, it asks Redis and admits.
    advance(Duration::from_millis(1_001)).await;
    assert_eq!(status(&b).await, StatusCode::OK);
}

/// A leased GCRA limit that settles after the response is refused when the layer is built: a
/// refund could let other replicas' slices run ahead of the quota. A fixed window may be both,
/// and a leased GCRA limit whose cost only comes from the request settles nothing.
#[test]
fn a_leased_gcra_limit_that_settles_is_refused_at_build_time() {
    use tollgate::engine::{ConfigError, Lease};
    let leased = |limit: Limit| limit.with_lease(Lease::new(10).unwrap()).unwrap();
    let gcra = leased(Limit::gcra("tokens", Quota::per_minute(100).unwrap()).unwrap());
    let refused = RateLimitLayer::builder()
        .metered(
            gcra.clone(),
            Tenant::header("x-shop"),
            Metered::new().count_if(|r| r.status().is_success()),
        )
        .build();
    assert_eq!(
        refused.err(),
        Some(ConfigError::LeaseWithSettle("tokens".into()))
    );
    let cost_only = RateLimitLayer::builder()
        .metered(
            gcra,
            Tenant::header("x-shop"),
            Metered::new().header(HeaderName::from_static("x-cost")),
        )
        .build();
    assert!(cost_only.is_ok());
    let window = leased(Limit::fixed_window("daily", Quota::per_day(100).unwrap()).unwrap());
    let both = RateLimitLayer::builder()
        .metered(
            window,
            Tenant::header("x-shop"),
            Metered::new().charged_by_handler(),
        )
        .build();
    assert!(both.is_ok());
}

fn ratelimit_of(res: &axum::response::Response) -> Option<String> {
    res.headers()
        .get("ratelimit")
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Three stacked limits: a refusal answered by Redis and one answered by a replica's deny
/// cache carry the same `RateLimit` items (the refusing limit's), and the same `Retry-After`.
#[tokio::test]
async fn refusals_from_redis_and_from_the_deny_cache_carry_the_same_fields() {
    let server = RedisServer::start();
    let replica = |cache: usize| {
        let backend = RedisBackend::builder()
            .url(server.url())
            .prefix("fields")
            .deadline(Duration::from_secs(5))
            .deny_cache_capacity(cache)
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder()
            .limit(
                Limit::gcra("per-ip", Quota::per_hour(1).unwrap()).unwrap(),
                Tenant::header("x-ip"),
            )
            .limit(
                Limit::gcra("per-shop", Quota::per_hour(100).unwrap()).unwrap(),
                Tenant::header("x-shop"),
            )
            .limit(
                Limit::fixed_window("global", Quota::per_day(1000).unwrap()).unwrap(),
                tollgate::key::Global,
            )
            .backend(backend)
            .build()
            .unwrap();
        ok_app(layer)
    };
    let (cached, uncached) = (replica(1000), replica(0));
    let req = || {
        Request::get("/")
            .header("x-ip", "ip.one")
            .header("x-shop", "shop.example")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        cached.clone().oneshot(req()).await.unwrap().status(),
        StatusCode::OK
    );
    // Redis refuses (no cache on this replica) ...
    let from_redis = uncached.clone().oneshot(req()).await.unwrap();
    // ... and the other replica refuses from the denial it foresaw when it admitted the last
    // unit.
    let calls = server.calls("evalsha");
    let from_cache = cached.clone().oneshot(req()).await.unwrap();
    assert_eq!(server.calls("evalsha"), calls, "answered by the deny cache");
    for res in [&from_redis, &from_cache] {
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    let items = ratelimit_of(&from_redis).unwrap();
    assert!(items.starts_with("\"per-ip\";r=0;t="), "{items}");
    assert!(
        !items.contains("per-shop") && !items.contains("global"),
        "{items}"
    );
    let seconds = |res: &axum::response::Response| {
        res.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    // The same item; the seconds may differ by the one that passed between the answers.
    let cached_items = ratelimit_of(&from_cache).unwrap();
    assert!(
        cached_items.starts_with("\"per-ip\";r=0;t="),
        "{cached_items}"
    );
    assert!(!cached_items.contains(','), "{cached_items}");
    assert!(seconds(&from_redis).abs_diff(seconds(&from_cache)) <= 1);
}

/// A fail-closed limit whose backend is down answers 503 without claiming `r=0`: what is left
/// of its quota is unknown.
#[tokio::test]
async fn a_fail_closed_refusal_claims_nothing_about_the_quota() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("ask-ai", Quota::per_minute(5).unwrap())
                .unwrap()
                .fail_closed(),
            tollgate::key::Global,
        )
        .backend(down())
        .build()
        .unwrap();
    let app = ok_app(layer);
    let res = app
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.headers().contains_key("retry-after"));
    assert_eq!(ratelimit_of(&res), None);
}

/// A request without a limit's key is told which key it lacks, and under which limit.
#[tokio::test]
async fn a_missing_key_names_its_source() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("chat-per-shop", Quota::per_minute(30).unwrap()).unwrap(),
            Tenant::header("x-shop-domain"),
        )
        .build()
        .unwrap();
    let app = ok_app(layer);
    let res = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = body_of(res).await;
    assert!(
        body.contains(r#"missing header \"x-shop-domain\" (rate limit \"chat-per-shop\")."#),
        "{body}"
    );
    let res = app
        .oneshot(
            Request::get("/")
                .header("x-shop-domain", "bad shop!")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let body = body_of(res).await;
    assert!(
        body.contains(r#"invalid header \"x-shop-domain\" (rate limit \"chat-per-shop\")."#),
        "{body}"
    );
}
