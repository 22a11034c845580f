//! Leased limits through the layer on a real Redis: four replicas (four layers, each with its
//! own backend) share one limit of 10 exactly; the `Decision` and a metric say which
//! admissions came from a slice; `shutdown` gives the unused units back.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use support::Recorder;
use tollgate::engine::Lease;
use tollgate::key::Global;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

fn leased(name: &str) -> Limit {
    let lease = Lease::new(4)
        .unwrap()
        .with_divisor(2)
        .unwrap()
        .with_lifetime(Duration::from_secs(3_600))
        .unwrap();
    Limit::fixed_window(name, Quota::per_day(10).unwrap())
        .unwrap()
        .with_lease(lease)
        .unwrap()
}

fn replica(server: &RedisServer, limit: &Limit) -> RateLimitLayer<RedisBackend> {
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap();
    RateLimitLayer::builder()
        .backend(backend)
        .limit(limit.clone(), Global)
        .build()
        .unwrap()
}

fn app(layer: &RateLimitLayer<RedisBackend>) -> Svc {
    let ok = service_fn(|req: Request<Body>| async move {
        let from_lease = req
            .extensions()
            .get::<Decision>()
            .is_some_and(|d| d.limits()[0].is_from_lease());
        let body = if from_lease { "lease" } else { "redis" };
        Ok::<_, Infallible>(Response::new(Body::from(body)))
    });
    tower::util::BoxCloneService::new(layer.layer(ok).map_response(|r| r.map(Body::new)))
}

/// Sends one request; `Some(true)` when admitted from a slice, `Some(false)` when admitted by
/// Redis, `None` when refused.
async fn send(svc: &mut Svc) -> Option<bool> {
    let req = Request::get("/").body(Body::empty()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    let status = res.status();
    let from_response = res
        .extensions()
        .get::<Decision>()
        .map(|d| d.limits()[0].is_from_lease());
    let body = axum::body::to_bytes(res.into_body(), 1024).await.unwrap();
    if status != StatusCode::OK {
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        return None;
    }
    let from_lease = &body[..] == b"lease";
    assert_eq!(
        from_response,
        Some(from_lease),
        "handler and response agree"
    );
    Some(from_lease)
}

#[tokio::test]
async fn four_replicas_admit_exactly_ten_and_say_which_came_from_a_slice() {
    let metrics = Recorder::install();
    let server = RedisServer::start();
    let limit = leased("shared");
    let layers: Vec<_> = (0..4).map(|_| replica(&server, &limit)).collect();
    let tasks: Vec<_> = layers
        .iter()
        .map(|layer| {
            let mut svc = app(layer);
            tokio::spawn(async move {
                let mut out = Vec::new();
                for _ in 0..25 {
                    out.push(send(&mut svc).await);
                }
                out
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.extend(t.await.unwrap());
    }
    let admitted = answers.iter().filter(|a| a.is_some()).count();
    let from_lease = answers.iter().filter(|a| **a == Some(true)).count();
    assert_eq!(admitted, 10);
    let snapshot = metrics.snapshot();
    assert_eq!(snapshot.decisions("shared", "allowed"), 10);
    assert_eq!(snapshot.decisions("shared", "denied"), 90);
    assert_eq!(
        snapshot.counter("tollgate_lease_admissions_total", &[("limit", "shared")]),
        Some(from_lease as u64)
    );
    // Every slice of 2 or more units admits one request through Redis and the rest locally.
    assert!(from_lease > 0, "{answers:?}");
}

#[tokio::test]
async fn a_layer_shut_down_gives_its_slice_back_to_the_others() {
    let metrics = Recorder::install();
    let server = RedisServer::start();
    let limit = leased("graceful");
    let first = replica(&server, &limit);
    let mut svc = app(&first);
    // 4 units taken: one admitted, 3 held.
    assert_eq!(send(&mut svc).await, Some(false));
    assert_eq!(send(&mut svc).await, Some(true));
    assert_eq!(first.backend().leased_units(), 2);
    first.shutdown().await;
    assert_eq!(first.backend().leased_units(), 0);
    let second = replica(&server, &limit);
    let mut other = app(&second);
    let mut admitted = 0;
    for _ in 0..12 {
        if send(&mut other).await.is_some() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 8);
    // The second replica: a slice of 4 (3 local), of 2 (1 local), then 2 checks in Redis.
    let snapshot = metrics.snapshot();
    assert_eq!(snapshot.decisions("graceful", "allowed"), 10);
    assert_eq!(
        snapshot.counter("tollgate_lease_admissions_total", &[("limit", "graceful")]),
        Some(1 + 4)
    );
}

#[tokio::test]
async fn while_redis_is_down_the_slice_admits_then_the_failure_policy_applies() {
    let mut server = RedisServer::start();
    let limit = leased("down").fail_closed();
    let layer = replica(&server, &limit);
    let mut svc = app(&layer);
    // A slice of 4: one admitted through Redis, 3 held.
    assert_eq!(send(&mut svc).await, Some(false));
    server.stop();
    for _ in 0..3 {
        assert_eq!(send(&mut svc).await, Some(true));
    }
    // Spent: the fail-closed limit refuses with 503.
    let req = Request::get("/").body(Body::empty()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
}
