//! The layer around a client learns from its upstream: a `429` with `Retry-After` holds the
//! upstream's key back on every replica (the next calls wait in delay mode, or are refused at
//! once with a `Retry-After` that says so, without reaching the upstream), and a token budget
//! settled from the usage the upstream reports holds exactly. In memory, and across two
//! replicas on a real Redis server and a real 3-master cluster.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body_util::Full;
use tollgate::cost::{parse_units, Metered};
use tollgate::engine::Backend;
use tollgate::key::Global;
use tollgate::{Decision, FakeClock, Limit, MemoryBackend, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::{service_fn, Layer, ServiceExt};

/// An upstream that answers its first call `429` with `Retry-After: 5`, then `200`; it
/// counts the calls it got, and answers each with the delay its request was admitted with.
fn upstream(
    calls: Arc<AtomicU32>,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(move |req: Request<Full<Bytes>>| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        let waited = req
            .extensions()
            .get::<Decision>()
            .and_then(|d| d.limits()[0].delayed())
            .map_or(0, |d| d.as_millis());
        async move {
            let mut res = Response::new(Full::new(Bytes::from(waited.to_string())));
            if n == 0 {
                *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                res.headers_mut()
                    .insert("retry-after", "5".parse().unwrap());
            }
            Ok::<_, Infallible>(res)
        }
    })
}

/// Ten calls a second to the upstream, a burst of 1; waiting up to `delay`.
fn paced<B: Backend>(backend: B, delay: Duration) -> RateLimitLayer<B> {
    let mut limit = Limit::gcra("upstream", Quota::per_second(10).unwrap()).unwrap();
    if !delay.is_zero() {
        limit = limit.delay_up_to(delay).unwrap();
    }
    RateLimitLayer::builder()
        .metered(limit, Global, Metered::new().pause_from_upstream())
        .backend(backend)
        .build()
        .unwrap()
}

async fn paced_peek(layer: &RateLimitLayer<RedisBackend>) -> tollgate::engine::KeyState {
    layer.peek("upstream", "").await.unwrap()
}

fn call() -> Request<Full<Bytes>> {
    Request::post("https://api.example/v1/chat")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_429_holds_the_key_back_and_the_next_call_waits_for_it() {
    let calls = Arc::new(AtomicU32::new(0));
    let memory = MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build();
    let client = paced(memory, Duration::from_secs(10)).layer(upstream(Arc::clone(&calls)));
    let first = client.clone().oneshot(call()).await.unwrap();
    assert_eq!(first.status(), StatusCode::TOO_MANY_REQUESTS);
    // The backend's clock stands still: the next call's wait is exactly the pause.
    let second = client.clone().oneshot(call()).await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    let waited = http_body_util::BodyExt::collect(second.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(waited, "5000");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

fn standalone(url: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_429_on_one_replica_holds_every_replica_back() {
    let server = RedisServer::start();
    held_back_everywhere(|| standalone(&server.url())).await;
}

#[tokio::test]
async fn a_429_on_one_replica_holds_every_replica_of_a_cluster_back() {
    let cluster = RedisCluster::start(3);
    held_back_everywhere(|| {
        RedisBackend::builder()
            .cluster(cluster.urls())
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap()
    })
    .await;
}

/// Two replicas on backends `replica` makes: A's call gets the upstream's 429, and B's next
/// call is refused at once, never reaching the upstream.
async fn held_back_everywhere(replica: impl Fn() -> RedisBackend) {
    let calls = Arc::new(AtomicU32::new(0));
    // Without a delay: a held-back call is refused at once.
    let a_layer = paced(replica(), Duration::ZERO);
    let a = a_layer.clone().layer(upstream(Arc::clone(&calls)));
    let b = paced(replica(), Duration::ZERO).layer(upstream(Arc::clone(&calls)));
    assert_eq!(
        a.clone().oneshot(call()).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // The pause is written from a task: read the key until Redis holds it.
    let held = |layer| async move {
        let state = paced_peek(layer).await;
        state
            .retry_after
            .is_some_and(|r| r >= Duration::from_secs(4))
    };
    let mut landed = false;
    for _ in 0..1_000 {
        if held(&a_layer).await {
            landed = true;
            break;
        }
    }
    assert!(landed, "the pause reaches Redis");
    let refused = b.clone().oneshot(call()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((4..=5).contains(&retry), "Retry-After {retry}");
    // Refused by the layer: the upstream got A's call only.
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A token budget of 10,000 a day: each call reserves its `x-max-tokens`, and the
/// upstream's `x-usage-tokens` settles it. Ten calls over two replicas leave exactly the
/// budget less what the upstream reported.
#[tokio::test]
async fn a_token_budget_settled_from_the_upstream_s_usage_is_exact_across_replicas() {
    let server = RedisServer::start();
    let tokens = || {
        // A daily window: nothing refills while the test runs.
        let limit = Limit::fixed_window("tokens", Quota::per_day(10_000).unwrap()).unwrap();
        RateLimitLayer::builder()
            .metered(
                limit,
                Global,
                Metered::new()
                    .header(HeaderName::from_static("x-max-tokens"))
                    .charge_from(|r| {
                        parse_units(r.headers().get("x-usage-tokens").map(|v| v.as_bytes())).ok()
                    }),
            )
            .backend(standalone(&server.url()))
            .build()
            .unwrap()
    };
    let usage = |req: Request<Full<Bytes>>| async move {
        let used = req.headers()["x-used"].clone();
        let mut res = Response::new(Full::new(Bytes::new()));
        res.headers_mut().insert("x-usage-tokens", used);
        Ok::<_, Infallible>(res)
    };
    let (a, b) = (tokens(), tokens());
    let replicas = [
        a.clone().layer(service_fn(usage)),
        b.layer(service_fn(usage)),
    ];
    let mut used = 0u64;
    for i in 0..10u64 {
        let n = 37 * i + 11;
        used += n;
        let req = Request::post("https://api.example/v1/chat")
            .header("x-max-tokens", "800")
            .header("x-used", n.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = replicas[(i % 2) as usize]
            .clone()
            .oneshot(req)
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    // Settles are sent from tasks: read until they have all landed.
    let mut remaining = 0;
    for _ in 0..1_000 {
        remaining = a.peek("tokens", "").await.unwrap().remaining;
        if remaining == 10_000 - used {
            break;
        }
    }
    assert_eq!(remaining, 10_000 - used, "used {used}");
}
