//! In-flight limits across replicas: two app instances on one Redis (and on a cluster) hold at
//! most N requests of a key at once between them, and give every slot back.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::{routing::get, Router};
use tokio::sync::Semaphore;
use tollgate::key::Tenant;
use tollgate::{Limit, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{until, RedisCluster, RedisServer};
use tower::ServiceExt;

/// What the handlers of every instance see: how many run now, the most that ever ran at once.
struct Gauge {
    now: AtomicUsize,
    most: AtomicUsize,
    gate: Semaphore,
}

impl Gauge {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            now: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            gate: Semaphore::new(0),
        })
    }
}

fn instance(redis: RedisBackend, gauge: &Arc<Gauge>) -> Router {
    let limits = RateLimitLayer::builder()
        .limit(
            Limit::concurrency("in-flight", 3).unwrap(),
            Tenant::header("x-shop-domain"),
        )
        .backend(redis)
        .build()
        .unwrap();
    let gauge = Arc::clone(gauge);
    let handler = move || {
        let gauge = Arc::clone(&gauge);
        async move {
            let now = gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
            gauge.most.fetch_max(now, Ordering::SeqCst);
            gauge.gate.acquire().await.unwrap().forget();
            gauge.now.fetch_sub(1, Ordering::SeqCst);
            "ok"
        }
    };
    Router::new().route("/api/chat", get(handler).route_layer(limits))
}

fn backend(redis: tollgate_redis::RedisBackendBuilder) -> RedisBackend {
    // A deadline a loaded machine meets: a timed-out check fails open and spoils a count.
    redis.deadline(Duration::from_secs(5)).build().unwrap()
}

fn req() -> Request<Body> {
    Request::get("/api/chat")
        .header("x-shop-domain", "slow.example")
        .body(Body::empty())
        .unwrap()
}

/// Ten slow requests at once over two instances: exactly 3 run, 7 are refused; then the 3
/// finish and every slot is free again.
async fn ten_slow_requests_over_two_instances(a: Router, b: Router, gauge: Arc<Gauge>) {
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let app = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move { app.oneshot(req()).await.unwrap().status() })
        })
        .collect();
    // Wait (bounded) until every request is either answered or in its handler.
    for _ in 0..1000 {
        let finished = tasks.iter().filter(|t| t.is_finished()).count();
        if finished + gauge.now.load(Ordering::SeqCst) == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (done, waiting): (Vec<_>, Vec<_>) = tasks.into_iter().partition(|t| t.is_finished());
    let mut refused = 0;
    for task in done {
        assert_eq!(task.await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
        refused += 1;
    }
    assert_eq!(gauge.now.load(Ordering::SeqCst), 3);
    assert_eq!((waiting.len(), refused), (3, 7));
    gauge.gate.add_permits(3);
    for task in waiting {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(
        gauge.most.load(Ordering::SeqCst),
        3,
        "never more than 3 at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_n_in_flight_over_two_instances_on_one_redis() {
    let server = RedisServer::start();
    let gauge = Gauge::new();
    let redis = || backend(RedisBackend::builder().url(server.url().as_str()));
    let (a, b) = (redis(), redis());
    let key = a.key_for(
        &Limit::concurrency("in-flight", 3).unwrap(),
        b"slow.example",
    );
    ten_slow_requests_over_two_instances(instance(a, &gauge), instance(b, &gauge), gauge).await;
    let held = || -> u64 {
        redis::cmd("ZCARD")
            .arg(&key)
            .query(&mut server.client())
            .unwrap()
    };
    assert_eq!(until(0, held).await, 0, "every slot given back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_n_in_flight_over_two_instances_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let gauge = Gauge::new();
    let redis = || backend(RedisBackend::builder().cluster(cluster.urls()));
    let (a, b) = (redis(), redis());
    let key = a.key_for(
        &Limit::concurrency("in-flight", 3).unwrap(),
        b"slow.example",
    );
    let node = cluster.node_of_key(&key);
    ten_slow_requests_over_two_instances(instance(a, &gauge), instance(b, &gauge), gauge).await;
    let held = || -> u64 {
        redis::cmd("ZCARD")
            .arg(&key)
            .query(&mut cluster.nodes()[node].client())
            .unwrap()
    };
    assert_eq!(until(0, held).await, 0, "every slot given back");
}

/// Over real HTTP/1 connections: a client of one request at a time, alternating between two
/// servers that share a concurrency limit of 1 on Redis, whose handler answers an empty body
/// (which HTTP/1 would end without polling it). It reads each response to its end before it
/// sends the next: the end reaches it only once Redis has the release, so every request finds
/// the slot free. Exactly 40 of 40 admitted, on keep-alive connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_body_over_http_ends_only_once_its_slot_is_back() {
    use http_body_util::{BodyExt, Empty};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let server = RedisServer::start();
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let redis = backend(RedisBackend::builder().url(server.url().as_str()));
        let limits = RateLimitLayer::builder()
            .limit(
                Limit::concurrency("one", 1).unwrap(),
                Tenant::header("x-shop-domain"),
            )
            .backend(redis)
            .build()
            .unwrap();
        // `()`: an empty body, its size exactly 0.
        let app = Router::new().route("/empty", get(|| async {}).route_layer(limits));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    }
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<bytes::Bytes>>();
    let mut status = Vec::new();
    for i in 0..40 {
        let req = Request::get(format!("http://{}/empty", addrs[i % 2]))
            .header("x-shop-domain", "shop.example")
            .body(Empty::new())
            .unwrap();
        let res = client.request(req).await.unwrap();
        let code = res.status().as_u16();
        status.push(code);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert!(code != 200 || body.is_empty());
    }
    assert_eq!(status, [200; 40]);
}
