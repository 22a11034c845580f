//! Metrics and tracing of the layer, with exact figures: every decision, every bypass with its
//! reason, every capacity refusal; and never a key in a label.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response, StatusCode};
use support::{Collector, Flaky, Recorder, KINDS};
use tollgate::engine::{Backend, BackendErrorKind};
use tollgate::key::{key_fn, ClientIp, Global, Tenant};
use tollgate::{Limit, MemoryBackend, MissingKeyPolicy, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

fn app<B: Backend>(layer: RateLimitLayer<B>) -> Svc {
    let ok = service_fn(|_req: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    });
    tower::util::BoxCloneService::new(layer.layer(ok).map_response(|r| r.map(Body::new)))
}

fn from(ip: [u8; 4]) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 4000))));
    req
}

fn shop(ip: [u8; 4], shop: &str) -> Request<Body> {
    let mut req = from(ip);
    req.headers_mut()
        .insert("x-shop-domain", shop.parse().unwrap());
    req
}

async fn send(svc: &mut Svc, req: Request<Body>) -> StatusCode {
    svc.ready().await.unwrap().call(req).await.unwrap().status()
}

fn limit(name: &str, per_minute: u32) -> Limit {
    Limit::gcra(name, Quota::per_minute(per_minute).unwrap()).unwrap()
}

#[tokio::test]
async fn n_denied_requests_add_exactly_n_to_the_denied_counter() {
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .limit(limit("per-ip", 5), ClientIp::peer())
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..5 {
        assert_eq!(send(&mut svc, from([10, 0, 0, 1])).await, StatusCode::OK);
    }
    let before = metrics.snapshot();
    assert_eq!(before.decisions("per-ip", "allowed"), 5);
    assert_eq!(before.decisions("per-ip", "denied"), 0);

    const N: u64 = 17;
    for _ in 0..N {
        assert_eq!(
            send(&mut svc, from([10, 0, 0, 1])).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    let after = metrics.snapshot();
    assert_eq!(after.decisions("per-ip", "denied"), N);
    assert_eq!(after.total("tollgate_decisions_total"), N);
    assert_eq!(after.total("tollgate_bypass_total"), 0);
    assert_eq!(after.total("tollgate_capacity_refusals_total"), 0);
}

#[tokio::test]
async fn k_bypassed_requests_add_exactly_k_with_the_reason() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    let layer = RateLimitLayer::builder()
        .limit(limit("chat", 1), Global)
        .limit(limit("chat-per-shop", 1), Tenant::header("x-shop-domain"))
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer);
    // Working: one admitted, then denied.
    assert_eq!(
        send(&mut svc, shop([1, 1, 1, 1], "a.example")).await,
        StatusCode::OK
    );
    assert_eq!(
        send(&mut svc, shop([1, 1, 1, 1], "a.example")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    metrics.snapshot();

    // Down, K requests per way of failing: every one is let through and counted as a bypass,
    // per limit, with the reason.
    const K: u64 = 7;
    let reasons = ["timeout", "error", "circuit_open", "protocol", "overloaded"];
    for (kind, reason) in KINDS.into_iter().zip(reasons) {
        backend.fail(Some(kind));
        for _ in 0..K {
            assert_eq!(
                send(&mut svc, shop([1, 1, 1, 1], "a.example")).await,
                StatusCode::OK
            );
        }
        let s = metrics.snapshot();
        for name in ["chat", "chat-per-shop"] {
            assert_eq!(s.bypasses(name, reason), K, "{name} {reason}");
            assert_eq!(s.decisions(name, "bypassed"), K, "{name} {reason}");
        }
        assert_eq!(s.total("tollgate_bypass_total"), 2 * K);
        assert_eq!(s.total("tollgate_decisions_total"), 2 * K);
    }

    // Back: limiting again, and no more bypasses.
    backend.fail(None);
    assert_eq!(
        send(&mut svc, shop([1, 1, 1, 1], "a.example")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    let s = metrics.snapshot();
    assert_eq!(s.total("tollgate_bypass_total"), 0);
    assert_eq!(s.decisions("chat", "denied"), 1);
}

#[tokio::test]
async fn every_series_exists_from_the_first_request() {
    // An alert on `rate(tollgate_bypass_total[5m]) > 0` needs the series before the first
    // bypass; so does one on an absent series.
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .limit(limit("early", 5), Global)
        .build()
        .unwrap();
    send(&mut app(layer), from([1, 1, 1, 1])).await;
    let s = metrics.snapshot();
    for reason in ["timeout", "error", "circuit_open", "protocol", "overloaded"] {
        assert_eq!(
            s.counter(
                "tollgate_bypass_total",
                &[("limit", "early"), ("reason", reason)]
            ),
            Some(0)
        );
    }
    for outcome in [
        "denied",
        "shadow_denied",
        "bypassed",
        "fallback",
        "skipped",
        "missing_key",
        "invalid_cost",
        "unavailable",
    ] {
        assert_eq!(
            s.counter(
                "tollgate_decisions_total",
                &[("limit", "early"), ("outcome", outcome)]
            ),
            Some(0),
            "{outcome}"
        );
    }
    assert_eq!(s.decisions("early", "allowed"), 1);
    assert_eq!(
        s.counter("tollgate_capacity_refusals_total", &[("limit", "early")]),
        Some(0)
    );
    // The in-memory backend records no duration or health: a histogram per ~100 ns check
    // would cost more than the check.
    assert!(s.counters.keys().all(|(n, _)| n.starts_with("tollgate_")));
    assert!(s.gauges.is_empty());
}

#[tokio::test]
async fn a_request_refused_by_another_limit_counts_as_skipped_there() {
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .limit(limit("burst", 2), ClientIp::peer())
        .limit(
            Limit::fixed_window("daily", Quota::per_day(100).unwrap()).unwrap(),
            Global,
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    let mut admitted = 0;
    for _ in 0..50 {
        admitted += u64::from(send(&mut svc, from([192, 0, 2, 7])).await == StatusCode::OK);
    }
    assert_eq!(admitted, 2);
    let s = metrics.snapshot();
    assert_eq!(s.decisions("burst", "allowed"), 2);
    assert_eq!(s.decisions("burst", "denied"), 48);
    // "daily" admitted all 50 on its own, but consumed only for the 2 that passed.
    assert_eq!(s.decisions("daily", "allowed"), 2);
    assert_eq!(s.decisions("daily", "skipped"), 48);
}

#[tokio::test]
async fn a_fail_closed_refusal_is_unavailable_and_no_bypass() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    backend.fail(Some(BackendErrorKind::Unavailable));
    let layer = RateLimitLayer::builder()
        .limit(limit("open", 5), Global)
        .limit(limit("closed", 5).fail_closed(), Global)
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..3 {
        assert_eq!(
            send(&mut svc, from([1, 1, 1, 1])).await,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    let s = metrics.snapshot();
    assert_eq!(s.decisions("closed", "unavailable"), 3);
    assert_eq!(s.decisions("closed", "denied"), 0);
    // Nothing went through uncounted: the fail-open limit let nothing pass.
    assert_eq!(s.decisions("open", "skipped"), 3);
    assert_eq!(s.total("tollgate_bypass_total"), 0);
}

#[tokio::test]
async fn fallback_shadow_skip_and_missing_keys_have_their_outcomes() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    let layer = RateLimitLayer::builder()
        .limit(
            limit("local", 2).fallback(1.try_into().unwrap()),
            ClientIp::peer(),
        )
        .limit(limit("trial", 1).shadow(), Global)
        .limit(
            limit("per-shop", 100).on_missing_key(MissingKeyPolicy::Skip),
            Tenant::header("x-shop-domain"),
        )
        .limit(
            limit("per-user", 100),
            key_fn(|req| req.headers().get("x-user").map(|v| v.as_bytes().to_vec())),
        )
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer);
    let user = |ip| {
        let mut req = from(ip);
        req.headers_mut().insert("x-user", "u1".parse().unwrap());
        req
    };
    // No user: refused with 400 by "per-user", nothing else counted.
    assert_eq!(
        send(&mut svc, from([1, 1, 1, 1])).await,
        StatusCode::BAD_REQUEST
    );
    let s = metrics.snapshot();
    assert_eq!(s.decisions("per-user", "missing_key"), 1);
    assert_eq!(s.total("tollgate_decisions_total"), 1);

    // Twice through the backend: the shadow limit would deny the second.
    for _ in 0..2 {
        assert_eq!(send(&mut svc, user([1, 1, 1, 1])).await, StatusCode::OK);
    }
    let s = metrics.snapshot();
    assert_eq!(s.decisions("local", "allowed"), 2);
    assert_eq!(s.decisions("trial", "allowed"), 1);
    assert_eq!(s.decisions("trial", "shadow_denied"), 1);
    assert_eq!(s.decisions("per-shop", "skipped"), 2);
    assert_eq!(s.decisions("per-user", "allowed"), 2);

    // Backend down: "local" falls back (2 a minute locally), the others fail open.
    backend.fail(Some(BackendErrorKind::Timeout));
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(send(&mut svc, user([1, 1, 1, 1])).await.as_u16());
    }
    assert_eq!(codes, [200, 200, 429]);
    let s = metrics.snapshot();
    assert_eq!(s.decisions("local", "fallback"), 2);
    assert_eq!(s.decisions("local", "denied"), 1);
    assert_eq!(s.decisions("per-user", "bypassed"), 2);
    assert_eq!(s.bypasses("per-user", "timeout"), 2);
    assert_eq!(s.decisions("per-user", "skipped"), 1);
    assert_eq!(s.bypasses("trial", "timeout"), 2);
    // Not checked when the backend failed: a skipped limit stays skipped.
    assert_eq!(s.decisions("per-shop", "skipped"), 3);
    assert_eq!(s.total("tollgate_bypass_total"), 4);
}

#[tokio::test]
async fn capacity_refusals_are_counted() {
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .limit(limit("tiny", 5), ClientIp::peer())
        .backend(MemoryBackend::builder().max_keys(3).build())
        .build()
        .unwrap();
    let mut svc = app(layer);
    let mut codes = Vec::new();
    for last in 1..=5 {
        codes.push(send(&mut svc, from([10, 0, 0, last])).await.as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    let s = metrics.snapshot();
    assert_eq!(
        s.counter("tollgate_capacity_refusals_total", &[("limit", "tiny")]),
        Some(2)
    );
    assert_eq!(s.decisions("tiny", "denied"), 2);
    assert_eq!(s.decisions("tiny", "allowed"), 3);
}

#[tokio::test]
async fn no_label_ever_carries_a_key() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    let secrets = [
        "secret-shop-7f3a.example",
        "secret-user-alice@example.com",
        "198.51.100.77",
    ];
    let layer = RateLimitLayer::builder()
        .limit(limit("per-ip", 1), ClientIp::peer())
        .limit(limit("per-shop", 1), Tenant::header("x-shop-domain"))
        .limit(
            limit("per-user", 1),
            key_fn(|req| req.headers().get("x-user").map(|v| v.as_bytes().to_vec())),
        )
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer);
    let req = || {
        let mut req = shop([198, 51, 100, 77], secrets[0]);
        req.headers_mut()
            .insert("x-user", secrets[1].parse().unwrap());
        req
    };
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    // Allowed, denied, bypassed (every reason), and missing keys.
    for _ in 0..3 {
        send(&mut svc, req()).await;
    }
    for kind in KINDS {
        backend.fail(Some(kind));
        send(&mut svc, req()).await;
    }
    send(&mut svc, from([198, 51, 100, 77])).await;

    let s = metrics.snapshot();
    let values = s.label_values();
    assert!(!values.is_empty());
    for value in &values {
        assert!(
            ["per-ip", "per-shop", "per-user"].contains(&value.as_str())
                || value.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "unexpected label value {value:?}"
        );
        for secret in secrets {
            assert!(!value.contains(secret), "{value:?} carries a key");
        }
    }
    // Nor does any span field or event.
    let seen = collector.seen.lock().unwrap();
    let fields = seen
        .spans
        .iter()
        .flat_map(|(_, f)| f.values())
        .chain(seen.events.iter().flat_map(|(_, f)| f.values()));
    for field in fields {
        for secret in secrets {
            assert!(!field.contains(secret), "{field:?} carries a key");
        }
    }
}

#[tokio::test]
async fn one_span_per_request_with_its_limits_and_outcome() {
    let _metrics = Recorder::install();
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    let backend = Flaky::new();
    let layer = RateLimitLayer::builder()
        .limit(limit("burst", 1), ClientIp::peer())
        .limit(limit("shop", 100), Tenant::header("x-shop-domain"))
        .backend(backend.clone())
        .build()
        .unwrap();
    let mut svc = app(layer);
    send(&mut svc, shop([1, 1, 1, 1], "a.example")).await;
    send(&mut svc, shop([1, 1, 1, 1], "a.example")).await;
    send(&mut svc, from([1, 1, 1, 1])).await;
    backend.fail(Some(BackendErrorKind::CircuitOpen));
    send(&mut svc, shop([1, 1, 1, 1], "a.example")).await;

    let seen = collector.seen.lock().unwrap();
    let spans: Vec<_> = seen
        .spans
        .iter()
        .filter(|(name, _)| name == "tollgate.check")
        .map(|(_, f)| {
            (
                f["limits"].as_str(),
                f["outcome"].as_str(),
                f["decision"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        spans,
        [
            ("burst,shop", "allowed", "burst=allowed,shop=allowed"),
            ("burst,shop", "denied", "burst=denied,shop=skipped"),
            ("burst,shop", "missing_key", "shop=missing_key"),
            ("burst,shop", "bypassed", "burst=bypassed,shop=bypassed"),
        ]
    );
}

#[tokio::test]
async fn bypass_warnings_are_rate_limited_per_limit() {
    let metrics = Recorder::install();
    let collector = Collector::default();
    let _tracing = tracing::subscriber::set_default(collector.clone());
    let backend = Flaky::new();
    backend.fail(Some(BackendErrorKind::Timeout));
    let layer = RateLimitLayer::builder()
        .limit(limit("a", 1), Global)
        .limit(limit("b", 1), Global)
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..25 {
        assert_eq!(send(&mut svc, from([1, 1, 1, 1])).await, StatusCode::OK);
    }
    let seen = collector.seen.lock().unwrap();
    let warnings: Vec<_> = seen
        .events
        .iter()
        .filter(|(level, _)| *level == tracing::Level::WARN)
        .map(|(_, f)| (f["limit"].as_str(), f["reason"].as_str()))
        .collect();
    // One per limit within the interval, while every bypass is counted.
    assert_eq!(warnings, [("a", "timeout"), ("b", "timeout")]);
    let s = metrics.snapshot();
    assert_eq!(s.bypasses("a", "timeout"), 25);
    assert_eq!(s.bypasses("b", "timeout"), 25);
}

#[tokio::test]
async fn with_redis_stopped_k_requests_add_k_bypasses_with_their_reason() {
    let metrics = Recorder::install();
    let mut server = RedisServer::start();
    let redis = RedisBackend::builder()
        .url(server.url())
        // Generous: a loaded machine must not turn a refused connection into a timeout.
        .deadline(Duration::from_secs(2))
        .breaker_threshold(3)
        .breaker_open_for(Duration::from_secs(600))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(limit("chat-per-shop", 3), Tenant::header("x-shop-domain"))
        .backend(redis)
        .build()
        .unwrap();
    let mut svc = app(layer);

    // Up: 3 admitted, 2 denied, both from the local deny cache: the third admission used the
    // last unit and foretold the denial.
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(
            send(&mut svc, shop([1, 1, 1, 1], "secret-shop-a.example"))
                .await
                .as_u16(),
        );
    }
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    let s = metrics.snapshot();
    assert_eq!(s.decisions("chat-per-shop", "allowed"), 3);
    assert_eq!(s.decisions("chat-per-shop", "denied"), 2);
    assert_eq!(
        s.counter(
            "tollgate_deny_cache_hits_total",
            &[("limit", "chat-per-shop")]
        ),
        Some(2)
    );
    assert_eq!(
        s.gauge("tollgate_backend_up", &[("backend", "redis")]),
        Some(1.0)
    );
    assert_eq!(
        s.histograms
            .get(&(
                "tollgate_backend_duration_seconds".to_owned(),
                vec![("backend".to_owned(), "redis".to_owned())]
            ))
            .copied(),
        Some(3)
    );
    assert_eq!(s.total("tollgate_bypass_total"), 0);

    // Stopped: K requests, every one let through and counted. The first 3 failures reach
    // Redis (`error`), then the breaker opens and fails the rest at once (`circuit_open`).
    server.stop();
    const K: u64 = 10;
    for i in 0..K {
        let shop_name = format!("secret-shop-{i}.example");
        assert_eq!(
            send(&mut svc, shop([1, 1, 1, 1], &shop_name)).await,
            StatusCode::OK
        );
    }
    let s = metrics.snapshot();
    assert_eq!(s.bypasses("chat-per-shop", "error"), 3);
    assert_eq!(s.bypasses("chat-per-shop", "circuit_open"), K - 3);
    assert_eq!(s.bypasses("chat-per-shop", "timeout"), 0);
    assert_eq!(s.total("tollgate_bypass_total"), K);
    assert_eq!(s.decisions("chat-per-shop", "bypassed"), K);
    assert_eq!(s.total("tollgate_decisions_total"), K);
    assert_eq!(
        s.gauge("tollgate_backend_up", &[("backend", "redis")]),
        Some(0.0)
    );

    for value in s.label_values() {
        assert!(!value.contains("secret-shop"), "{value:?} carries a key");
    }
}

#[tokio::test]
async fn allowlisted_requests_are_counted_as_allowlisted_and_nothing_else() {
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .limit(limit("per-ip", 1), ClientIp::peer())
        .limit(limit("per-shop", 1), Tenant::header("x-shop-domain"))
        .allowlist(tollgate::Allowlist::new().networks(
            ClientIp::peer(),
            ["10.0.0.0/8".parse::<tollgate::key::Cidr>().unwrap()],
        ))
        .build()
        .unwrap();
    let mut svc = app(layer);
    const N: u64 = 9;
    for _ in 0..N {
        assert_eq!(
            send(&mut svc, shop([10, 1, 1, 1], "a.example")).await,
            StatusCode::OK
        );
    }
    let snap = metrics.snapshot();
    assert_eq!(snap.decisions("per-ip", "allowlisted"), N);
    assert_eq!(snap.decisions("per-shop", "allowlisted"), N);
    assert_eq!(snap.total("tollgate_decisions_total"), 2 * N);
}

/// A request whose cost is not a whole number of units is refused with 400 and counted as
/// `invalid_cost`, not as a missing key.
#[tokio::test]
async fn an_invalid_cost_is_counted_as_such() {
    let metrics = Recorder::install();
    let layer = RateLimitLayer::builder()
        .metered(
            limit("tokens", 100),
            Global,
            tollgate::cost::Metered::new().header(http::HeaderName::from_static("x-cost")),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    let mut req = from([1, 1, 1, 1]);
    req.headers_mut().insert("x-cost", "ten".parse().unwrap());
    assert_eq!(send(&mut svc, req).await, StatusCode::BAD_REQUEST);
    let s = metrics.snapshot();
    assert_eq!(s.decisions("tokens", "invalid_cost"), 1);
    assert_eq!(s.decisions("tokens", "missing_key"), 0);
}

#[tokio::test(start_paused = true)]
async fn delayed_admissions_are_counted_as_delayed_with_their_waits() {
    use tollgate::FakeClock;
    let metrics = Recorder::install();
    let backend = MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build();
    // One a second, burst 1, delay 2 s: at once, then waits of 1 and 2 s, then refused.
    let delayed = Limit::gcra("wait", Quota::per_second(1).unwrap())
        .unwrap()
        .delay_up_to(Duration::from_secs(2))
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(delayed, Global)
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let mut status = Vec::new();
    for _ in 0..4 {
        status.push(send(&mut svc, from([1, 1, 1, 1])).await.as_u16());
    }
    assert_eq!(status, [200, 200, 200, 429]);
    let s = metrics.snapshot();
    assert_eq!(s.decisions("wait", "allowed"), 1);
    assert_eq!(s.decisions("wait", "delayed"), 2);
    assert_eq!(s.decisions("wait", "denied"), 1);
    let waits = (
        "tollgate_delay_seconds".to_owned(),
        vec![("limit".to_owned(), "wait".to_owned())],
    );
    assert_eq!(s.histograms.get(&waits), Some(&2));
}

#[tokio::test]
async fn admissions_that_leave_at_most_the_near_share_are_counted_near_the_limit() {
    let metrics = Recorder::install();
    // The default share, 20 %: of a burst of 10, the admissions that leave 2, 1 and 0.
    let layer = RateLimitLayer::builder()
        .limit(limit("near-gcra", 10), Global)
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..12 {
        send(&mut svc, from([10, 0, 0, 1])).await;
    }
    // A GCRA quota's whole is its burst: 100 a minute with a burst of 10 is near at 2 left.
    let bursty = Limit::gcra(
        "near-burst",
        Quota::per_minute(100).unwrap().with_burst(10).unwrap(),
    )
    .unwrap();
    // At 50 %, of a fixed window of 10: the admissions that leave 5 to 0.
    let window = Limit::fixed_window("near-window", Quota::per_minute(10).unwrap()).unwrap();
    let layer = RateLimitLayer::builder()
        .limit(bursty, Tenant::header("x-a"))
        .limit(window, Tenant::header("x-b"))
        .near_limit_percent(50)
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..10 {
        let mut req = from([10, 0, 0, 2]);
        req.headers_mut().insert("x-a", "a".parse().unwrap());
        req.headers_mut().insert("x-b", "b".parse().unwrap());
        assert_eq!(send(&mut svc, req).await, StatusCode::OK);
    }
    let s = metrics.snapshot();
    let near = |limit| s.counter("tollgate_near_limit_total", &[("limit", limit)]);
    assert_eq!(s.decisions("near-gcra", "allowed"), 10);
    assert_eq!(s.decisions("near-gcra", "denied"), 2);
    assert_eq!(
        near("near-gcra"),
        Some(3),
        "refusals are not near the limit"
    );
    assert_eq!(near("near-burst"), Some(6));
    assert_eq!(near("near-window"), Some(6));
}
