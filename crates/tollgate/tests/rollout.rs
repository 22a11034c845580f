//! A limit rolled out to a share of its keys (`Limit::enforce_percent`): a fixed hash of the
//! key decides its side, so the same clients are refused on every replica; the rest are
//! reported as shadow; a limits file sets and reloads the share.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use support::clients::{app, Svc};
use support::{Flaky, Recorder};
use tollgate::engine::rollout_share;
use tollgate::engine::BackendErrorKind;
use tollgate::key::Tenant;
use tollgate::{
    Decision, FakeClock, Limit, Limits, LimitsFile, MemoryBackend, Quota, RateLimitLayer,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tower::{Service, ServiceExt};

const KEYS: usize = 1_000;

/// Of the 1,000 keys `client-0` to `client-999`, those whose share is below 30: what the
/// hash gives, pinned (it never changes).
const IN_30: usize = 308;

/// Of the same keys, those whose share is below 60.
const IN_60: usize = 606;

fn key(i: usize) -> String {
    format!("client-{i}")
}

/// One request a minute per tenant, enforced on `percent` of the tenants.
fn per_tenant(percent: u32) -> Limits {
    let limit = Limit::gcra("per-tenant", Quota::per_minute(1).unwrap())
        .unwrap()
        .enforce_percent(percent)
        .unwrap();
    Limits::new().limit(limit, Tenant::header("x-tenant"))
}

fn memory() -> MemoryBackend<FakeClock> {
    MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build()
}

fn layer<B: tollgate::engine::Backend>(backend: B, limits: Limits) -> RateLimitLayer<B> {
    RateLimitLayer::builder()
        .backend(backend)
        .limits(limits)
        .build()
        .unwrap()
}

fn from(tenant: &str) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.headers_mut()
        .insert("x-tenant", tenant.parse().unwrap());
    req
}

/// Sends one request of every key through `svc`; the indices of the keys refused (429),
/// after asserting that every other key was admitted.
async fn refused(svc: &mut Svc) -> Vec<usize> {
    let mut refused = Vec::new();
    for i in 0..KEYS {
        let response = svc
            .ready()
            .await
            .unwrap()
            .call(from(&key(i)))
            .await
            .unwrap();
        match response.status() {
            StatusCode::TOO_MANY_REQUESTS => refused.push(i),
            status => assert_eq!(status, StatusCode::OK, "{}", key(i)),
        }
    }
    refused
}

/// The keys whose share is below `percent`.
fn in_share(percent: u8) -> Vec<usize> {
    (0..KEYS)
        .filter(|&i| rollout_share(key(i).as_bytes()) < percent)
        .collect()
}

/// The first request of every key is admitted (one a minute); a second, over the limit, is
/// refused only for the keys in the enforced share.
#[tokio::test]
async fn thirty_percent_refuses_the_same_keys_on_two_replicas() {
    let recorder = Recorder::install();
    let backend = memory();
    let (mut a, mut b) = (
        app(&layer(backend.clone(), per_tenant(30))),
        app(&layer(backend, per_tenant(30))),
    );
    assert_eq!(refused(&mut a).await, Vec::<usize>::new());
    let snap = recorder.snapshot();
    assert_eq!(snap.decisions("per-tenant", "allowed"), KEYS as u64);

    let on_a = refused(&mut a).await;
    assert_eq!(on_a.len(), IN_30);
    assert!((250..=350).contains(&on_a.len()));
    assert_eq!(on_a, in_share(30));
    // The rest were over the limit too: reported, not refused.
    let snap = recorder.snapshot();
    assert_eq!(snap.decisions("per-tenant", "denied"), IN_30 as u64);
    assert_eq!(
        snap.decisions("per-tenant", "shadow_denied"),
        (KEYS - IN_30) as u64
    );

    // The other replica, on the same counts, refuses exactly the same keys.
    assert_eq!(refused(&mut b).await, on_a);
}

#[tokio::test]
async fn a_refused_keys_decision_is_enforced_and_the_others_shadow() {
    let mut svc = app(&layer(memory(), per_tenant(30)));
    let (inside, outside) = {
        let inside = in_share(30);
        let outside = (0..KEYS).find(|i| !inside.contains(i)).unwrap();
        (inside[0], outside)
    };
    for i in [inside, outside] {
        let first = svc
            .ready()
            .await
            .unwrap()
            .call(from(&key(i)))
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::OK);
    }
    let over = |i| {
        let mut svc = svc.clone();
        async move {
            let r = svc
                .ready()
                .await
                .unwrap()
                .call(from(&key(i)))
                .await
                .unwrap();
            let d = r.extensions().get::<Decision>().unwrap().limits()[0].clone();
            (r.status(), d)
        }
    };
    let (status, decision) = over(inside).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let d = &decision;
    assert_eq!(
        (d.is_shadow(), d.refuses(), d.label()),
        (false, true, "denied")
    );
    let (status, decision) = over(outside).await;
    assert_eq!(status, StatusCode::OK);
    let d = &decision;
    assert_eq!(
        (d.is_shadow(), d.refuses(), d.label()),
        (true, false, "shadow_denied")
    );
}

#[tokio::test]
async fn zero_refuses_none_and_a_hundred_all() {
    for (percent, want) in [(0, 0), (100, KEYS)] {
        let mut svc = app(&layer(memory(), per_tenant(percent)));
        assert_eq!(refused(&mut svc).await.len(), 0);
        assert_eq!(refused(&mut svc).await.len(), want, "{percent}%");
    }
}

/// A fail-closed limit whose backend is down answers 503 to the keys in its enforced share
/// only: the others are in shadow, which a failing backend never refuses.
#[tokio::test]
async fn a_failing_backend_refuses_only_the_enforced_share() {
    let backend = Flaky::new();
    backend.fail(Some(BackendErrorKind::Unavailable));
    let limit = Limit::gcra("per-tenant", Quota::per_minute(1).unwrap())
        .unwrap()
        .fail_closed()
        .enforce_percent(30)
        .unwrap();
    let mut svc = app(&layer(
        backend,
        Limits::new().limit(limit, Tenant::header("x-tenant")),
    ));
    let mut unavailable = Vec::new();
    for i in 0..KEYS {
        let response = svc
            .ready()
            .await
            .unwrap()
            .call(from(&key(i)))
            .await
            .unwrap();
        match response.status() {
            StatusCode::SERVICE_UNAVAILABLE => unavailable.push(i),
            status => assert_eq!(status, StatusCode::OK, "{}", key(i)),
        }
    }
    assert_eq!(unavailable, in_share(30));
}

const FILE: &str = r#"
[[limit]]
name = "per-tenant"
period = "1m"
quota = 1
key = { header = "x-tenant" }
enforce_percent = PERCENT
"#;

fn file(percent: &str) -> Result<Limits, String> {
    LimitsFile::new()
        .parse(&FILE.replace("PERCENT", percent))
        .map_err(|e| e.to_string())
}

/// A reload raises the share: the keys enforced at 30% stay enforced, others join them.
#[tokio::test]
async fn a_reload_from_a_limits_file_changes_the_share() {
    let layer = layer(memory(), file("30").unwrap());
    let mut svc = app(&layer);
    assert_eq!(refused(&mut svc).await.len(), 0);
    assert_eq!(refused(&mut svc).await, in_share(30));

    layer.reloader().reload(file("60").unwrap()).unwrap();
    let at_60 = refused(&mut svc).await;
    assert_eq!(at_60.len(), IN_60);
    assert_eq!(at_60, in_share(60));
    assert!(in_share(30).iter().all(|i| at_60.contains(i)));

    layer.reloader().reload(file("0").unwrap()).unwrap();
    assert_eq!(refused(&mut svc).await.len(), 0);
}

#[test]
fn a_limits_file_refuses_a_share_that_is_none() {
    let err = file("101").unwrap_err();
    assert!(
        err.contains("enforce_percent 101 is invalid: it must be between 0 (shadow) and 100"),
        "{err}"
    );
    let err = LimitsFile::new()
        .parse(&FILE.replace("PERCENT", "30\nshadow = true"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`shadow = true` is `enforce_percent = 0`"),
        "{err}"
    );
    assert!(file("-1").is_err());
}

/// Two replicas on one real redis-server refuse the same keys.
#[tokio::test]
async fn thirty_percent_refuses_the_same_keys_on_two_redis_replicas() {
    let server = RedisServer::start();
    let backend = || {
        RedisBackend::builder()
            .url(server.url())
            .prefix("rollout")
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let (mut a, mut b) = (
        app(&layer(backend(), per_tenant(30))),
        app(&layer(backend(), per_tenant(30))),
    );
    assert_eq!(refused(&mut a).await, Vec::<usize>::new());
    let on_a = refused(&mut a).await;
    assert_eq!(on_a.len(), IN_30);
    assert_eq!(on_a, in_share(30));
    assert_eq!(refused(&mut b).await, on_a);
}
