//! A Redis Sentinel failover under the layer: while the master is gone every request is let
//! through as a counted bypass, and limiting resumes on the promoted replica by itself.
//! Real processes: a master, a replica and three sentinels on loopback.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use support::Recorder;
use tollgate::key::Tenant;
use tollgate::{Decision, Limit, Outcome, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{Sentinel, SENTINEL_MASTER};
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// What the limit did to a request of `shop`.
async fn outcome(svc: &mut Svc, shop: &str) -> Outcome {
    let req = Request::post("/api/chat")
        .header("x-shop-domain", shop)
        .body(Body::empty())
        .unwrap();
    let resp = svc.ready().await.unwrap().call(req).await.unwrap();
    let decision = resp.extensions().get::<Decision>().unwrap();
    *decision.get("chat-per-shop").unwrap().outcome()
}

#[tokio::test]
async fn during_a_sentinel_failover_every_bypass_is_counted_and_limiting_resumes() {
    let metrics = Recorder::install();
    let mut setup = Sentinel::start();
    let redis = RedisBackend::builder()
        .sentinel(SENTINEL_MASTER, setup.sentinel_urls())
        .deadline(Duration::from_millis(250))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("chat-per-shop", Quota::per_minute(30).unwrap())
                .unwrap()
                .fail_open(),
            Tenant::header("x-shop-domain"),
        )
        .backend(redis)
        .build()
        .unwrap();
    let ok = service_fn(|_req: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    });
    let mut svc: Svc =
        tower::util::BoxCloneService::new(layer.layer(ok).map_response(|r| r.map(Body::new)));

    assert!(matches!(
        outcome(&mut svc, "before.example").await,
        Outcome::Allowed { .. }
    ));
    metrics.snapshot();

    setup.master_mut().stop();
    let started = tokio::time::Instant::now();
    let mut bypassed = 0;
    let mut shop = 0;
    loop {
        shop += 1;
        match outcome(&mut svc, &format!("shop-{shop}.example")).await {
            Outcome::Allowed { .. } => break,
            Outcome::Bypassed { .. } => bypassed += 1,
            other => panic!("neither limited nor bypassed: {other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "limiting did not resume"
        );
        // Polls, as requests would keep coming.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        bypassed >= 1,
        "no request was bypassed while the master was down"
    );
    let s = metrics.snapshot();
    assert_eq!(s.total("tollgate_bypass_total"), bypassed);
    assert_eq!(s.decisions("chat-per-shop", "bypassed"), bypassed);
    assert_eq!(s.decisions("chat-per-shop", "allowed"), 1);
    assert_eq!(setup.master_port(), setup.replica().port());
}
