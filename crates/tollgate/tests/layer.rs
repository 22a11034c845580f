//! The layer through the tower contract: refusals, headers, decisions, stacking.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response, StatusCode};
use tollgate::engine::{Backend, BackendError, BackendErrorKind, Check, Verdicts};
use tollgate::key::{key_fn, ClientIp, Global, Tenant};
use tollgate::{
    Decision, DenyReason, FakeClock, Limit, MemoryBackend, MissingKeyPolicy, Outcome, Quota,
    RateLimitLayer, Source,
};
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// A service that answers 200 with the remaining quota it read from the Decision.
fn app<B: Backend>(layer: RateLimitLayer<B>) -> Svc {
    let handler = service_fn(|req: Request<Body>| async move {
        let decision = req.extensions().get::<Decision>().cloned();
        let body = match decision {
            Some(d) => format!("remaining={:?}", d.remaining()),
            None => "no decision".to_owned(),
        };
        Ok::<_, Infallible>(Response::new(Body::from(body)))
    });
    // A refusal's body is the layer's own; axum's `Body` wraps either.
    tower::util::BoxCloneService::new(layer.layer(handler).map_response(|r| r.map(Body::new)))
}

fn memory() -> (MemoryBackend<FakeClock>, FakeClock) {
    let clock = FakeClock::new(1_700_000_000_000_000);
    (MemoryBackend::builder().clock(clock.clone()).build(), clock)
}

fn from(ip: [u8; 4]) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((ip, 4000))));
    req
}

async fn send(svc: &mut Svc, req: Request<Body>) -> Response<Body> {
    svc.ready().await.unwrap().call(req).await.unwrap()
}

fn header<'a>(res: &'a Response<Body>, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().unwrap())
}

async fn body(res: Response<Body>) -> String {
    let bytes = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn the_sixth_request_in_a_minute_is_refused_with_headers() {
    let (backend, clock) = memory();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(5).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    for i in 0..5 {
        let res = send(&mut svc, from([10, 0, 0, 1])).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            header(&res, "ratelimit-policy"),
            Some("\"per-ip\";q=5;w=60")
        );
        let expected = format!("\"per-ip\";r={};t={}", 4 - i, 12 * (i + 1));
        assert_eq!(header(&res, "ratelimit"), Some(expected.as_str()));
        assert!(res.extensions().get::<Decision>().is_some());
        assert_eq!(body(res).await, format!("remaining=Some({})", 4 - i));
    }
    let res = send(&mut svc, from([10, 0, 0, 1])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("12"));
    assert_eq!(header(&res, "ratelimit"), Some("\"per-ip\";r=0;t=12"));
    assert_eq!(
        header(&res, "content-type"),
        Some("application/problem+json")
    );
    let decision = res.extensions().get::<Decision>().cloned().unwrap();
    assert!(!decision.is_admitted());
    assert!(body(res).await.contains("\"status\":429"));

    // Another client is not affected; the first is admitted again after 12 s.
    assert_eq!(
        send(&mut svc, from([10, 0, 0, 2])).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_secs(12));
    assert_eq!(
        send(&mut svc, from([10, 0, 0, 1])).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&mut svc, from([10, 0, 0, 1])).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn retry_after_rounds_up_and_is_never_zero() {
    let (backend, clock) = memory();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("fast", Quota::per_second(2).unwrap()).unwrap(),
            Global,
        )
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    send(&mut svc, from([1, 1, 1, 1])).await;
    send(&mut svc, from([1, 1, 1, 1])).await;
    let res = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(header(&res, "retry-after"), Some("1")); // 0.5 s rounds up to 1
    clock.advance(Duration::from_micros(499_999));
    let res = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(header(&res, "retry-after"), Some("1")); // 1 µs left, still 1
}

#[tokio::test]
async fn refusals_in_a_flood_each_say_their_own_limit_and_wait() {
    // Refusals reuse the last one's body, Retry-After and RateLimit value while they are the
    // same: each must still say its own limit and its own wait.
    let (backend, clock) = memory();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(1).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .limit(
            Limit::fixed_window("per-shop", Quota::per_hour(1).unwrap()).unwrap(),
            Tenant::header("x-shop"),
        )
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let shop = |ip: [u8; 4], shop: &str| {
        let mut req = from(ip);
        req.headers_mut().insert("x-shop", shop.parse().unwrap());
        req
    };
    assert_eq!(send(&mut svc, shop([10, 0, 0, 1], "a")).await.status(), 200);
    // The IP's limit refuses, for 60 s, three times over: the same answer each time.
    for _ in 0..3 {
        let res = send(&mut svc, shop([10, 0, 0, 1], "b")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&res, "retry-after"), Some("60"));
        // A refusal's items are its refusing limits: per-shop did not refuse.
        assert_eq!(header(&res, "ratelimit"), Some("\"per-ip\";r=0;t=60"));
        let length = header(&res, "content-length").map(str::to_owned);
        let text = body(res).await;
        assert!(text.contains("Rate limit \\\"per-ip\\\" exceeded; retry in 60 s."));
        assert_eq!(length, Some(text.len().to_string()));
    }
    // Then the shop's, until its hourly window ends (2,800 s on this clock): its own name,
    // wait and figures.
    let res = send(&mut svc, shop([10, 0, 0, 2], "a")).await;
    assert_eq!(header(&res, "retry-after"), Some("2800"));
    assert_eq!(header(&res, "ratelimit"), Some("\"per-shop\";r=0;t=2800"));
    let length = header(&res, "content-length").map(str::to_owned);
    let text = body(res).await;
    assert!(text.contains("Rate limit \\\"per-shop\\\" exceeded; retry in 2800 s."));
    assert_eq!(length, Some(text.len().to_string()));
    // The IP's again, a second later: one second less.
    clock.advance(Duration::from_secs(1));
    let res = send(&mut svc, shop([10, 0, 0, 1], "c")).await;
    assert_eq!(header(&res, "retry-after"), Some("59"));
    assert_eq!(header(&res, "ratelimit"), Some("\"per-ip\";r=0;t=59"));
    assert!(body(res).await.contains("retry in 59 s."));
}

/// Each layer reuses its own last refusal: layers refusing in turn on one thread each answer
/// with their own limit.
#[tokio::test]
async fn layers_refusing_in_turn_on_one_thread_each_say_their_own_limit() {
    let mut services: Vec<_> = (0..6)
        .map(|i| {
            let (backend, _) = memory();
            let name = format!("layer-{i}");
            let layer = RateLimitLayer::builder()
                .limit(
                    Limit::gcra(&name, Quota::per_minute(1).unwrap()).unwrap(),
                    ClientIp::peer(),
                )
                .backend(backend)
                .build()
                .unwrap();
            (name, app(layer))
        })
        .collect();
    for (_, svc) in &mut services {
        assert_eq!(send(svc, from([10, 0, 0, 9])).await.status(), 200);
    }
    for _ in 0..3 {
        for (name, svc) in &mut services {
            let res = send(svc, from([10, 0, 0, 9])).await;
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
            let value = format!("\"{name}\";r=0;t=60");
            assert_eq!(header(&res, "ratelimit"), Some(&*value));
            let text = body(res).await;
            assert!(
                text.contains(&format!("Rate limit \\\"{name}\\\" exceeded")),
                "{text}"
            );
        }
    }
}

#[tokio::test]
async fn stacked_limits_are_all_or_nothing() {
    let (backend, _) = memory();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("burst", Quota::per_minute(2).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .limit(
            Limit::fixed_window("daily", Quota::per_day(100).unwrap()).unwrap(),
            Global,
        )
        .backend(backend)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let mut admitted = 0;
    let mut last = None;
    for _ in 0..50 {
        let res = send(&mut svc, from([192, 0, 2, 7])).await;
        admitted += usize::from(res.status() == StatusCode::OK);
        last = Some(res);
    }
    assert_eq!(admitted, 2);
    let last = last.unwrap();
    assert_eq!(last.status(), StatusCode::TOO_MANY_REQUESTS);
    let decision = last.extensions().get::<Decision>().unwrap();
    match decision.get("daily").unwrap().outcome() {
        Outcome::Allowed { remaining, .. } => assert_eq!(*remaining, 98),
        other => panic!("daily should admit, got {other:?}"),
    }
    // The refusal's fields name the limit that refused; the Decision has every limit.
    assert_eq!(header(&last, "ratelimit"), Some("\"burst\";r=0;t=30"));
}

#[tokio::test]
async fn two_stacked_layers_each_decide_and_report_together() {
    let (backend, _) = memory();
    let layer = |name, per_minute| {
        RateLimitLayer::builder()
            .limit(
                Limit::gcra(name, Quota::per_minute(per_minute).unwrap()).unwrap(),
                Global,
            )
            .backend(backend.clone())
            .build()
            .unwrap()
    };
    // The handler answers with the names of the limits in the request's decision.
    let handler = service_fn(|req: Request<Body>| async move {
        let names = req.extensions().get::<Decision>().map(|d| {
            d.limits()
                .iter()
                .map(|l| l.name().to_owned())
                .collect::<Vec<_>>()
                .join(",")
        });
        Ok::<_, Infallible>(Response::new(Body::from(names.unwrap_or_default())))
    });
    let mut svc = layer("outer", 3)
        .layer(layer("inner", 1).layer(handler))
        .map_response(|r| r.map(Body::new));
    let mut responses = Vec::new();
    for _ in 0..4 {
        responses.push(
            svc.ready()
                .await
                .unwrap()
                .call(from([1, 2, 3, 4]))
                .await
                .unwrap(),
        );
    }
    let codes: Vec<u16> = responses.iter().map(|r| r.status().as_u16()).collect();
    // Separate layers are not jointly atomic: the outer one counts requests the inner refuses.
    assert_eq!(codes, [200, 429, 429, 429]);

    let fields = |res: &Response<Body>, name: &str| -> Vec<String> {
        let values = res.headers().get_all(name).iter();
        values.map(|v| v.to_str().unwrap().to_owned()).collect()
    };
    // The inner layer's refusal keeps its own fields; the outer one adds its items.
    let refused = &responses[1];
    assert_eq!(header(refused, "retry-after"), Some("60"));
    assert_eq!(
        fields(refused, "ratelimit"),
        ["\"inner\";r=0;t=60", "\"outer\";r=1;t=40"]
    );
    assert_eq!(
        fields(refused, "ratelimit-policy"),
        ["\"inner\";q=1;w=60", "\"outer\";q=3;w=60"]
    );
    let decision = refused.extensions().get::<Decision>().unwrap();
    assert!(!decision.is_admitted());
    assert_eq!(decision.get("inner").unwrap().label(), "denied");
    assert_eq!(decision.get("outer").unwrap().label(), "allowed");
    assert_eq!(decision.limits()[0].name(), "outer");

    // Admitted: the handler saw both layers' limits, outer first; so does the response.
    let admitted = responses.swap_remove(0);
    let names: Vec<&str> = admitted
        .extensions()
        .get::<Decision>()
        .unwrap()
        .limits()
        .iter()
        .map(|l| l.name())
        .collect();
    assert_eq!(names, ["outer", "inner"]);
    assert_eq!(body(admitted).await, "outer,inner");
}

#[tokio::test]
async fn missing_keys_follow_each_limits_policy() {
    let shop = |policy| {
        Limit::fixed_window("shop", Quota::per_day(2).unwrap())
            .unwrap()
            .on_missing_key(policy)
    };
    // Reject: 400, and the backend is not asked.
    let layer = RateLimitLayer::builder()
        .limit(
            shop(MissingKeyPolicy::Reject),
            Tenant::header("x-shop-domain"),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    let res = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(body(res).await.contains("missing"));

    // Skip: admitted, and the decision says so.
    let layer = RateLimitLayer::builder()
        .limit(
            shop(MissingKeyPolicy::Skip),
            Tenant::header("x-shop-domain"),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..5 {
        let res = send(&mut svc, from([1, 1, 1, 1])).await;
        assert_eq!(res.status(), StatusCode::OK);
        let d = res.extensions().get::<Decision>().unwrap();
        assert_eq!(d.get("shop").unwrap().label(), "skipped");
    }

    // Shared bucket: every keyless request shares one quota of 2.
    let layer = RateLimitLayer::builder()
        .limit(
            shop(MissingKeyPolicy::SharedBucket),
            Tenant::header("x-shop-domain"),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(send(&mut svc, from([1, 1, 1, 1])).await.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 429]);
    let mut req = from([1, 1, 1, 1]);
    req.headers_mut()
        .insert("x-shop-domain", "a.example".parse().unwrap());
    assert_eq!(send(&mut svc, req).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn shadow_limits_report_without_refusing() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("new-limit", Quota::per_minute(1).unwrap())
                .unwrap()
                .shadow(),
            Global,
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    assert_eq!(
        send(&mut svc, from([1, 1, 1, 1])).await.status(),
        StatusCode::OK
    );
    let res = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let d = res.extensions().get::<Decision>().unwrap();
    assert!(d.is_admitted());
    assert_eq!(d.get("new-limit").unwrap().label(), "shadow_denied");

    // A shadow limit never refuses, not even a request without its key (whose policy is the
    // default, Reject): the limit is skipped.
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::fixed_window("shop-daily", Quota::per_day(500).unwrap())
                .unwrap()
                .shadow(),
            Tenant::header("x-shop-domain"),
        )
        .build()
        .unwrap();
    let res = send(&mut app(layer), from([1, 1, 1, 1])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let d = res.extensions().get::<Decision>().unwrap();
    assert_eq!(d.get("shop-daily").unwrap().label(), "skipped");
}

#[tokio::test]
async fn a_gcra_burst_is_advertised_as_the_same_rate_over_its_refill_time() {
    let (backend, _) = memory();
    let quota = Quota::per_minute(2).unwrap().with_burst(10).unwrap();
    let layer = RateLimitLayer::builder()
        .limit(Limit::gcra("b", quota).unwrap(), Global)
        .backend(backend)
        .legacy_headers(true)
        .build()
        .unwrap();
    let res = send(&mut app(layer), from([1, 1, 1, 1])).await;
    // 10 at once, refilled at 2 a minute: 10 per 300 s, never fewer than the 9 remaining.
    assert_eq!(header(&res, "ratelimit-policy"), Some("\"b\";q=10;w=300"));
    assert_eq!(header(&res, "ratelimit"), Some("\"b\";r=9;t=30"));
    assert_eq!(header(&res, "x-ratelimit-limit"), Some("10"));
}

#[tokio::test]
async fn custom_rejections_keep_the_headers() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("one", Quota::per_minute(1).unwrap()).unwrap(),
            Global,
        )
        .legacy_headers(true)
        .on_rejection(|r| {
            let mut res = Response::new(bytes::Bytes::from(format!("slow down ({})", r.limit())));
            *res.status_mut() = r.status();
            res
        })
        .build()
        .unwrap();
    let mut svc = app(layer);
    let ok = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(header(&ok, "x-ratelimit-remaining"), Some("0"));
    let res = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("60"));
    assert_eq!(header(&res, "x-ratelimit-limit"), Some("1"));
    assert_eq!(body(res).await, "slow down (one)");
}

#[tokio::test]
async fn headers_on_allowed_can_be_turned_off() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("one", Quota::per_minute(1).unwrap()).unwrap(),
            Global,
        )
        .headers_on_allowed(false)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let ok = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(header(&ok, "ratelimit"), None);
    let refused = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(header(&refused, "ratelimit"), Some("\"one\";r=0;t=60"));
}

#[tokio::test]
async fn the_decision_on_admitted_responses_can_be_turned_off() {
    let limit = || Limit::gcra("two", Quota::per_minute(2).unwrap()).unwrap();
    let layer = RateLimitLayer::builder()
        .limit(limit(), Global)
        .decision_on_allowed(false)
        .build()
        .unwrap();
    let mut svc = app(layer);
    let ok = send(&mut svc, from([1, 1, 1, 1])).await;
    // Not on the response; the handler still read it from the request, and the fields stay.
    assert!(ok.extensions().get::<Decision>().is_none());
    assert_eq!(header(&ok, "ratelimit"), Some("\"two\";r=1;t=30"));
    assert_eq!(body(ok).await, "remaining=Some(1)");
    send(&mut svc, from([1, 1, 1, 1])).await;
    // A refusal still carries it.
    let refused = send(&mut svc, from([1, 1, 1, 1])).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let decision = refused.extensions().get::<Decision>().unwrap();
    assert!(!decision.is_admitted());
    assert_eq!(decision.limits().len(), 1);

    // By default an admitted response carries it too; with both switched off, neither the
    // fields nor the Decision.
    let ok = send(
        &mut app(RateLimitLayer::builder()
            .limit(limit(), Global)
            .build()
            .unwrap()),
        from([1, 1, 1, 1]),
    )
    .await;
    assert_eq!(
        ok.extensions().get::<Decision>().unwrap().remaining(),
        Some(1)
    );
    let layer = RateLimitLayer::builder()
        .limit(limit(), Global)
        .headers_on_allowed(false)
        .decision_on_allowed(false)
        .build()
        .unwrap();
    let ok = send(&mut app(layer), from([1, 1, 1, 1])).await;
    assert!(ok.extensions().get::<Decision>().is_none());
    assert_eq!(header(&ok, "ratelimit"), None);
    assert_eq!(body(ok).await, "remaining=Some(1)");
}

/// A backend that always fails, to test the failure policies' mapping (not limiting itself).
#[derive(Clone)]
struct Down(BackendErrorKind);

impl Backend for Down {
    type Future = std::future::Ready<Result<Verdicts, BackendError>>;
    fn check(&self, _: &[Check<'_>]) -> Self::Future {
        std::future::ready(Err(BackendError::new(self.0, "down")))
    }
    fn kind(&self) -> &'static str {
        "down"
    }
}

#[tokio::test]
async fn a_failed_backend_applies_each_limits_policy() {
    let clock = FakeClock::new(0);
    let limit = |name| Limit::gcra(name, Quota::per_minute(4).unwrap()).unwrap();
    // Fail open: admitted, and the decision says Bypassed, never a plain allow.
    let layer = RateLimitLayer::builder()
        .limit(limit("open"), Global)
        .backend(Down(BackendErrorKind::Timeout))
        .build()
        .unwrap();
    let res = send(&mut app(layer), from([1, 1, 1, 1])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let d = res.extensions().get::<Decision>().unwrap();
    assert!(d.is_bypassed());
    assert_eq!(d.get("open").unwrap().label(), "bypassed");
    assert_eq!(header(&res, "ratelimit"), None);

    // Fail closed: 503 with Retry-After.
    let layer = RateLimitLayer::builder()
        .limit(limit("open"), Global)
        .limit(limit("closed").fail_closed(), Global)
        .backend(Down(BackendErrorKind::Unavailable))
        .unavailable_retry_after(Duration::from_secs(5))
        .build()
        .unwrap();
    let res = send(&mut app(layer), from([1, 1, 1, 1])).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&res, "retry-after"), Some("5"));
    let d = res.extensions().get::<Decision>().unwrap();
    match d.get("closed").unwrap().outcome() {
        Outcome::Denied { reason, .. } => assert_eq!(*reason, DenyReason::BackendUnavailable),
        other => panic!("{other:?}"),
    }
    // The fail-open limit beside it let nothing through: not a bypass.
    assert!(!d.is_bypassed());
    assert_eq!(d.get("open").unwrap().label(), "skipped");

    // Fallback: limited locally with the quota divided by the replicas (4 / 2 = 2).
    let layer = RateLimitLayer::builder()
        .limit(
            limit("local").fallback(2.try_into().unwrap()),
            ClientIp::peer(),
        )
        .backend(Down(BackendErrorKind::CircuitOpen))
        .fallback_clock(clock.clone())
        .build()
        .unwrap();
    let codes = through_fallback(&mut app(layer), "local").await;
    assert_eq!(codes, [200, 200, 429, 429]);

    // A shadow fail-closed limit refuses nothing, and leaves the fallback beside it on.
    let layer = RateLimitLayer::builder()
        .limit(limit("new-global").fail_closed().shadow(), Global)
        .limit(
            limit("per-ip").fallback(2.try_into().unwrap()),
            ClientIp::peer(),
        )
        .backend(Down(BackendErrorKind::Unavailable))
        .fallback_clock(clock)
        .build()
        .unwrap();
    let codes = through_fallback(&mut app(layer), "per-ip").await;
    assert_eq!(codes, [200, 200, 429, 429]);
}

/// The statuses of four requests from one address; each one admitted must have been limited
/// by the fallback limiter on `limit`.
async fn through_fallback(svc: &mut Svc, limit: &str) -> Vec<u16> {
    let mut codes = Vec::new();
    for _ in 0..4 {
        let res = send(svc, from([1, 1, 1, 1])).await;
        if res.status() == StatusCode::OK {
            let d = res.extensions().get::<Decision>().unwrap();
            assert_eq!(d.get(limit).unwrap().source(), Source::Fallback);
            assert_eq!(d.get(limit).unwrap().label(), "fallback");
        }
        codes.push(res.status().as_u16());
    }
    codes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_ten_of_sixty_four_concurrent_requests_are_admitted() {
    for round in 0..100 {
        let layer = RateLimitLayer::builder()
            .limit(
                Limit::gcra("ten", Quota::per_hour(10).unwrap()).unwrap(),
                Global,
            )
            .build()
            .unwrap();
        let svc = app(layer);
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let svc = svc.clone();
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    svc.oneshot(from([1, 1, 1, 1])).await.unwrap().status()
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += usize::from(t.await.unwrap() == StatusCode::OK);
        }
        assert_eq!(admitted, 10, "round {round}");
    }
}

#[tokio::test]
async fn closures_can_key_on_anything() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-path", Quota::per_minute(1).unwrap()).unwrap(),
            key_fn(|req| Some(req.uri().path().as_bytes().to_vec())),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    assert_eq!(send(&mut svc, get("/a")).await.status(), StatusCode::OK);
    assert_eq!(send(&mut svc, get("/b")).await.status(), StatusCode::OK);
    assert_eq!(
        send(&mut svc, get("/a")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn bad_configuration_is_an_error() {
    fn l(name: &str) -> Limit {
        Limit::gcra(name, Quota::per_minute(1).unwrap()).unwrap()
    }
    assert!(RateLimitLayer::builder().build().is_err());
    assert!(RateLimitLayer::builder()
        .limit(l("a"), Global)
        .limit(l("a"), Global)
        .build()
        .is_err());
    let mut b = RateLimitLayer::builder();
    for i in 0..9 {
        let name = format!("l{i}");
        b = b.limit(l(&name), Global);
    }
    assert!(b.build().is_err());
}

/// A backend that answers only on its second poll, as a networked one does: the layer must
/// wait for it, then decide exactly as it does for an answer that is ready at once.
#[derive(Clone)]
struct Late(MemoryBackend<FakeClock>);

struct LateAnswer(Option<Result<Verdicts, BackendError>>, bool);

impl std::future::Future for LateAnswer {
    type Output = Result<Verdicts, BackendError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        if !std::mem::replace(&mut self.1, true) {
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(self.0.take().unwrap())
    }
}

impl Backend for Late {
    type Future = LateAnswer;
    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        LateAnswer(Some(self.0.check_now(checks)), false)
    }
    fn kind(&self) -> &'static str {
        "late"
    }
}

#[tokio::test]
async fn an_answer_that_is_not_ready_at_once_decides_the_same() {
    let (backend, _clock) = memory();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-ip", Quota::per_minute(2).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .backend(Late(backend))
        .build()
        .unwrap();
    let mut svc = app(layer);
    for (remaining, t) in [(1, 30), (0, 60)] {
        let res = send(&mut svc, from([10, 0, 0, 1])).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            header(&res, "ratelimit-policy"),
            Some("\"per-ip\";q=2;w=60")
        );
        let expected = format!("\"per-ip\";r={remaining};t={t}");
        assert_eq!(header(&res, "ratelimit"), Some(expected.as_str()));
        assert_eq!(
            res.extensions().get::<Decision>().unwrap().remaining(),
            Some(remaining)
        );
        assert_eq!(body(res).await, format!("remaining=Some({remaining})"));
    }
    let res = send(&mut svc, from([10, 0, 0, 1])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("30"));
    assert_eq!(header(&res, "ratelimit"), Some("\"per-ip\";r=0;t=30"));
    assert!(!res.extensions().get::<Decision>().unwrap().is_admitted());
}

/// `Router::route_layer` limits the routes that exist: a request for a missing route never
/// reaches the layer, so a 404 consumes nothing (`Router::layer` would count it). A method
/// router's `route_layer` also keeps its 405s out.
#[tokio::test]
async fn route_layers_do_not_count_404s_or_405s() {
    use axum::routing::get;
    let layer = || {
        let (backend, _clock) = memory();
        RateLimitLayer::builder()
            .limit(
                Limit::gcra("per-ip", Quota::per_minute(2).unwrap()).unwrap(),
                ClientIp::peer(),
            )
            .backend(backend)
            .build()
            .unwrap()
    };
    let request = |method: &str, path: &str| {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([10, 0, 0, 1], 4000))));
        req
    };
    let codes = |app: axum::Router| async move {
        let mut codes = Vec::new();
        for (method, path) in [
            ("GET", "/nope"),
            ("GET", "/nope"),
            ("POST", "/"),
            ("GET", "/"),
            ("GET", "/"),
            ("GET", "/"),
        ] {
            let res = app.clone().oneshot(request(method, path)).await.unwrap();
            codes.push(res.status().as_u16());
        }
        codes
    };
    let per_method = axum::Router::new().route("/", get(|| async { "ok" }).route_layer(layer()));
    assert_eq!(codes(per_method).await, [404, 404, 405, 200, 200, 429]);
    let per_router = axum::Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(layer());
    assert_eq!(codes(per_router).await, [404, 404, 405, 200, 429, 429]);
    let everything = axum::Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer());
    assert_eq!(codes(everything).await, [404, 404, 429, 429, 429, 429]);
}
