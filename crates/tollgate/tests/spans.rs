//! The `rate_limit.*` attributes of a request's `tollgate.check` span, read by a subscriber:
//! an allowed, a refused, a shadow and a bypassed request (a Redis backend at a closed port,
//! failing open).

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::net::TcpListener;
use std::time::Duration;

use axum::body::Body;
use http::{Request, StatusCode};
use support::clients::{app, Svc};
use support::Collector;
use tollgate::engine::Backend;
use tollgate::key::Tenant;
use tollgate::{FakeClock, Limit, MemoryBackend, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tower::{Service, ServiceExt};

fn from(tenant: &str) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.headers_mut()
        .insert("x-tenant", tenant.parse().unwrap());
    req
}

fn svc<B: Backend>(backend: B, limit: Limit) -> Svc {
    app(&RateLimitLayer::builder()
        .backend(backend)
        .limit(limit, Tenant::header("x-tenant"))
        .build()
        .unwrap())
}

fn two_a_minute() -> Limit {
    Limit::gcra("per-tenant", Quota::per_minute(2).unwrap()).unwrap()
}

fn memory() -> MemoryBackend<FakeClock> {
    MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build()
}

async fn status(svc: &mut Svc, tenant: &str) -> StatusCode {
    svc.ready()
        .await
        .unwrap()
        .call(from(tenant))
        .await
        .unwrap()
        .status()
}

/// The `rate_limit.*` attributes of every `tollgate.check` span, in order, without the
/// backend's round trip, which is returned beside them (parsed).
fn attributes(collector: &Collector) -> Vec<(HashMap<String, String>, Option<f64>)> {
    let seen = collector.seen.lock().unwrap();
    seen.spans
        .iter()
        .filter(|(name, _)| name == "tollgate.check")
        .map(|(_, fields)| {
            let mut attrs: HashMap<String, String> = fields
                .iter()
                .filter(|(k, _)| k.starts_with("rate_limit."))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let rtt = attrs
                .remove("rate_limit.backend.rtt_ms")
                .map(|v| v.parse::<f64>().unwrap());
            (attrs, rtt)
        })
        .collect()
}

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test]
async fn allowed_and_refused_requests_carry_their_attributes() {
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    let mut svc = svc(memory(), two_a_minute());
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    assert_eq!(status(&mut svc, "a").await, StatusCode::TOO_MANY_REQUESTS);

    let spans = attributes(&collector);
    let (attrs, rtts): (Vec<_>, Vec<_>) = spans.into_iter().unzip();
    assert_eq!(
        attrs,
        [
            map(&[
                ("rate_limit.limits", "per-tenant"),
                ("rate_limit.outcome", "allowed"),
                ("rate_limit.remaining", "1"),
                ("rate_limit.fail_open", "false"),
            ]),
            map(&[
                ("rate_limit.limits", "per-tenant"),
                ("rate_limit.outcome", "allowed"),
                ("rate_limit.remaining", "0"),
                ("rate_limit.fail_open", "false"),
            ]),
            map(&[
                ("rate_limit.limits", "per-tenant"),
                ("rate_limit.outcome", "refused"),
                ("rate_limit.reason", "over_limit"),
                ("rate_limit.remaining", "0"),
                ("rate_limit.retry_after_ms", "30000.0"),
                ("rate_limit.fail_open", "false"),
            ]),
        ]
    );
    // Every request asked the backend: each span has its round trip.
    assert_eq!(rtts.len(), 3);
    assert!(rtts
        .iter()
        .all(|r| r.is_some_and(|ms| ms >= 0.0 && ms.is_finite())));
}

#[tokio::test]
async fn a_shadow_limits_would_be_refusal_is_shadow() {
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    let mut svc = svc(memory(), two_a_minute().shadow());
    for _ in 0..3 {
        assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    }
    let last = attributes(&collector).pop().unwrap().0;
    assert_eq!(
        last,
        map(&[
            ("rate_limit.limits", "per-tenant"),
            ("rate_limit.outcome", "shadow"),
            ("rate_limit.reason", "over_limit"),
            ("rate_limit.fail_open", "false"),
        ])
    );
}

#[tokio::test]
async fn a_request_let_through_by_a_failing_backend_is_bypassed() {
    // A loopback port that nothing listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let backend = RedisBackend::builder()
        .url(format!("redis://127.0.0.1:{port}/"))
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    let mut svc = svc(backend, two_a_minute().fail_open());
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    let (attrs, rtt) = attributes(&collector).pop().unwrap();
    assert_eq!(
        attrs,
        map(&[
            ("rate_limit.limits", "per-tenant"),
            ("rate_limit.outcome", "bypassed"),
            ("rate_limit.reason", "error"),
            ("rate_limit.fail_open", "true"),
        ])
    );
    assert!(rtt.is_some());
}

#[tokio::test(start_paused = true)]
async fn a_delayed_request_carries_its_wait() {
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    let limit = Limit::gcra("per-tenant", Quota::per_minute(1).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_secs(60))
        .unwrap();
    let mut svc = svc(memory(), limit);
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    assert_eq!(status(&mut svc, "a").await, StatusCode::OK);
    let last = attributes(&collector).pop().unwrap().0;
    assert_eq!(
        last,
        map(&[
            ("rate_limit.limits", "per-tenant"),
            ("rate_limit.outcome", "delayed"),
            ("rate_limit.remaining", "0"),
            ("rate_limit.wait_ms", "60000.0"),
            ("rate_limit.fail_open", "false"),
        ])
    );
}
