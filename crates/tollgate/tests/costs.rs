//! Costs read from the request, and settled after the response, through the layer (in memory).

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body::Frame;
use tollgate::cost::{Charge, Metered, OnDrop, Settle};
use tollgate::key::Global;
use tollgate::{
    Decision, DenyReason, FakeClock, Limit, MemoryBackend, Outcome, Quota, RateLimitLayer,
};
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

fn memory() -> MemoryBackend<FakeClock> {
    let clock = FakeClock::new(1_700_000_000_000_000);
    MemoryBackend::builder().clock(clock).build()
}

/// A body of three chunks that reports `charge` through the request's `Settle` handle as its
/// last chunk is taken, as a streamed answer that counts its tokens does.
struct Streamed {
    left: u32,
    settle: Option<Settle>,
    charge: u32,
}

impl http_body::Body for Streamed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        if self.left == 0 {
            if let Some(settle) = &self.settle {
                settle.charge(self.charge);
            }
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"chunk")))))
    }
}

/// Answers with the status in `x-status` (default 200); puts a `Charge` of `x-charge` in the
/// response, or streams and reports `x-stream-charge` through the handle at the body's end;
/// the body says the remaining units the decision saw.
fn app<B: tollgate::engine::Backend>(layer: RateLimitLayer<B>) -> Svc {
    let handler = service_fn(|req: Request<Body>| async move {
        let get = |name: &str| {
            req.headers()
                .get(name)
                .map(|v| v.to_str().unwrap().parse::<u32>().unwrap())
        };
        let status = StatusCode::from_u16(get("x-status").unwrap_or(200) as u16).unwrap();
        let remaining = req.extensions().get::<Decision>().unwrap().remaining();
        let mut res = if let Some(charge) = get("x-stream-charge") {
            let settle = req.extensions().get::<Settle>().cloned();
            Response::new(Body::new(Streamed {
                left: 3,
                settle,
                charge,
            }))
        } else {
            Response::new(Body::from(format!("{remaining:?}")))
        };
        *res.status_mut() = status;
        if let Some(charge) = get("x-charge") {
            res.extensions_mut().insert(Charge(charge));
        }
        Ok::<_, Infallible>(res)
    });
    tower::util::BoxCloneService::new(layer.layer(handler).map_response(|r| r.map(Body::new)))
}

fn post(headers: &[(&str, &str)]) -> Request<Body> {
    let mut req = Request::post("/").body(Body::empty()).unwrap();
    for (k, v) in headers {
        req.headers_mut().insert(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    req
}

async fn send(svc: &mut Svc, req: Request<Body>) -> Response<Body> {
    svc.ready().await.unwrap().call(req).await.unwrap()
}

/// The units the decision of a request of `estimate` left, read by the handler.
async fn remaining_after(svc: &mut Svc, estimate: &str) -> Option<u64> {
    let res = send(svc, post(&[("x-estimate", estimate)])).await;
    assert_eq!(res.status(), StatusCode::OK);
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.trim_start_matches("Some(")
        .trim_end_matches(')')
        .parse()
        .ok()
}

async fn drain(res: Response<Body>) {
    http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap();
}

fn tokens(metered: Metered) -> Svc {
    let layer = RateLimitLayer::builder()
        .backend(memory())
        .metered(
            Limit::gcra("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
            Global,
            metered.header(HeaderName::from_static("x-estimate")),
        )
        .build()
        .unwrap();
    app(layer)
}

#[tokio::test]
async fn a_cost_from_a_header_takes_that_many_units() {
    let mut svc = tokens(Metered::new());
    assert_eq!(remaining_after(&mut svc, "300").await, Some(700));
    assert_eq!(remaining_after(&mut svc, "0").await, Some(700));
    assert_eq!(remaining_after(&mut svc, "700").await, Some(0));
}

#[tokio::test]
async fn reserve_100_charge_250_consumes_250() {
    let mut svc = tokens(Metered::new().charged_by_handler());
    let res = send(
        &mut svc,
        post(&[("x-estimate", "100"), ("x-charge", "250")]),
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    drain(res).await;
    assert_eq!(remaining_after(&mut svc, "1").await, Some(749));
}

#[tokio::test]
async fn the_response_shows_the_settled_state_when_the_cost_comes_with_the_head() {
    let mut svc = tokens(Metered::new().charged_by_handler());
    let res = send(
        &mut svc,
        post(&[("x-estimate", "100"), ("x-charge", "250")]),
    )
    .await;
    let d = res.extensions().get::<Decision>().unwrap();
    assert_eq!(d.remaining(), Some(750));
    let field = res.headers()["ratelimit"].to_str().unwrap();
    assert!(field.contains("r=750"), "{field}");
    drain(res).await;
    // Streamed: the head comes before the cost, and shows the reservation.
    let res = send(
        &mut svc,
        post(&[("x-estimate", "100"), ("x-stream-charge", "50")]),
    )
    .await;
    assert_eq!(
        res.extensions().get::<Decision>().unwrap().remaining(),
        Some(650)
    );
    drain(res).await;
    assert_eq!(remaining_after(&mut svc, "0").await, Some(700));
}

#[tokio::test]
async fn two_stacked_layers_charged_by_the_handler_share_one_handle() {
    let backend = memory();
    let inner = RateLimitLayer::builder()
        .backend(backend.clone())
        .metered(
            Limit::gcra("inner", Quota::per_hour(1000).unwrap()).unwrap(),
            Global,
            Metered::new()
                .header(HeaderName::from_static("x-estimate"))
                .charged_by_handler(),
        )
        .build()
        .unwrap();
    let outer = RateLimitLayer::builder()
        .backend(backend.clone())
        .metered(
            Limit::gcra("outer", Quota::per_hour(1000).unwrap()).unwrap(),
            Global,
            Metered::new()
                .header(HeaderName::from_static("x-estimate"))
                .charged_by_handler(),
        )
        .build()
        .unwrap();
    let handler = service_fn(|req: Request<Body>| async move {
        req.extensions().get::<Settle>().unwrap().charge(250);
        Ok::<_, Infallible>(Response::new(Body::empty()))
    });
    let svc = outer.layer(inner.layer(handler));
    let mut svc: Svc = tower::util::BoxCloneService::new(svc.map_response(
        |r: Response<tollgate::ResponseBody<tollgate::ResponseBody<Body>>>| r.map(Body::new),
    ));
    drain(send(&mut svc, post(&[("x-estimate", "100")])).await).await;
    for name in ["inner", "outer"] {
        let limit = Limit::gcra(name, Quota::per_hour(1000).unwrap()).unwrap();
        let v = backend
            .check_now(&[tollgate::engine::Check::new(&limit, b"global").with_cost(0)])
            .unwrap();
        assert_eq!(v[0].remaining, 750, "{name}");
    }
}

#[tokio::test]
async fn a_charge_above_what_was_left_is_a_debt_the_next_request_waits_for() {
    let mut svc = tokens(Metered::new().charged_by_handler());
    drain(
        send(
            &mut svc,
            post(&[("x-estimate", "900"), ("x-charge", "1100")]),
        )
        .await,
    )
    .await;
    // 1,100 of 1,000 used: 100 in debt, 3.6 s a unit.
    let res = send(&mut svc, post(&[("x-estimate", "1")])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["retry-after"], "364");
}

#[tokio::test]
async fn a_settle_through_the_handle_comes_when_a_streamed_body_ends() {
    let mut svc = tokens(Metered::new().charged_by_handler());
    let res = send(
        &mut svc,
        post(&[("x-estimate", "100"), ("x-stream-charge", "400")]),
    )
    .await;
    // The head is there, the body not read: only the reservation is taken.
    assert_eq!(remaining_after(&mut svc, "1").await, Some(899));
    drain(res).await;
    assert_eq!(remaining_after(&mut svc, "1").await, Some(598));
}

#[tokio::test]
async fn a_body_dropped_before_its_end_settles_with_what_was_reported() {
    let mut svc = tokens(Metered::new().charged_by_handler());
    let res = send(
        &mut svc,
        post(&[("x-estimate", "100"), ("x-stream-charge", "400")]),
    )
    .await;
    drop(res);
    // Nothing was reported: the reservation stands.
    assert_eq!(remaining_after(&mut svc, "1").await, Some(899));
}

#[tokio::test]
async fn a_handler_that_reports_nothing_keeps_the_reservation() {
    let mut svc = tokens(Metered::new().charged_by_handler());
    drain(send(&mut svc, post(&[("x-estimate", "100")])).await).await;
    assert_eq!(remaining_after(&mut svc, "1").await, Some(899));
}

#[tokio::test]
async fn bad_cost_headers_are_refused_with_400_and_consume_nothing() {
    let mut svc = tokens(Metered::new());
    for bad in ["-1", "ten", "1.5", "4294967296", "99999999999999999999", ""] {
        let res = send(&mut svc, post(&[("x-estimate", bad)])).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        let body = http_body_util::BodyExt::collect(res.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(
            String::from_utf8_lossy(&body).contains("is not a whole number of units"),
            "{bad:?}"
        );
    }
    let res = send(&mut svc, post(&[])).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // A number above what the limit can ever admit: 429 without Retry-After.
    let res = send(&mut svc, post(&[("x-estimate", "1001")])).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().get("retry-after").is_none());
    let d = res.extensions().get::<Decision>().unwrap();
    assert!(matches!(
        d.limits()[0].outcome(),
        Outcome::Denied {
            reason: DenyReason::CostTooHigh,
            ..
        }
    ));
    assert_eq!(remaining_after(&mut svc, "1").await, Some(999));
}

#[tokio::test]
async fn a_login_limit_counts_only_failures() {
    let layer = RateLimitLayer::builder()
        .backend(memory())
        .metered(
            Limit::gcra("login-failures", Quota::per_minute(5).unwrap()).unwrap(),
            Global,
            Metered::new().count_if(|r| r.status() == StatusCode::UNAUTHORIZED),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    let login = |status: &'static str| post(&[("x-status", status)]);
    for round in 0..5 {
        for _ in 0..2 {
            let res = send(&mut svc, login("200")).await;
            assert_eq!(res.status(), StatusCode::OK, "round {round}");
            drain(res).await;
        }
        let res = send(&mut svc, login("401")).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "round {round}");
        drain(res).await;
    }
    // 10 successes never counted, 5 failures did: the 6th attempt is refused.
    let res = send(&mut svc, login("401")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["retry-after"], "12");
}

#[tokio::test]
async fn server_errors_do_not_count() {
    let layer = RateLimitLayer::builder()
        .backend(memory())
        .metered(
            Limit::fixed_window("api", Quota::per_minute(3).unwrap()).unwrap(),
            Global,
            Metered::new().count_if(|r| !r.status().is_server_error()),
        )
        .build()
        .unwrap();
    let mut svc = app(layer);
    for _ in 0..10 {
        let res = send(&mut svc, post(&[("x-status", "503")])).await;
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    for _ in 0..3 {
        assert_eq!(send(&mut svc, post(&[])).await.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&mut svc, post(&[])).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A handler that never answers: the client goes away first.
fn hanging(metered: Metered) -> Svc {
    let layer = RateLimitLayer::builder()
        .backend(memory())
        .metered(
            Limit::gcra("tokens", Quota::per_hour(1000).unwrap()).unwrap(),
            Global,
            metered.header(HeaderName::from_static("x-estimate")),
        )
        .build()
        .unwrap();
    let handler = service_fn(|req: Request<Body>| async move {
        if req.headers().contains_key("x-hang") {
            std::future::pending::<()>().await;
        }
        let remaining = req.extensions().get::<Decision>().unwrap().remaining();
        Ok::<_, Infallible>(Response::new(Body::from(format!("{remaining:?}"))))
    });
    tower::util::BoxCloneService::new(layer.layer(handler).map_response(|r| r.map(Body::new)))
}

async fn dropped_before_answering(svc: &mut Svc) {
    let call = svc
        .ready()
        .await
        .unwrap()
        .call(post(&[("x-estimate", "300"), ("x-hang", "1")]));
    let polled = tokio::time::timeout(std::time::Duration::ZERO, call).await;
    assert!(polled.is_err());
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_before_it_answered_keeps_its_reservation_by_default() {
    let mut svc = hanging(Metered::new().charged_by_handler());
    dropped_before_answering(&mut svc).await;
    assert_eq!(remaining_after(&mut svc, "1").await, Some(699));
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_before_it_answered_can_give_its_reservation_back() {
    let mut svc = hanging(Metered::new().on_drop(OnDrop::Refund));
    dropped_before_answering(&mut svc).await;
    assert_eq!(remaining_after(&mut svc, "1").await, Some(999));
}

mod on_redis {
    //! The same through real Redis servers: a settle is sent without waiting, so each test
    //! reads the backend until the settle it expects has landed, then checks the exact figure.

    use super::*;
    use tollgate::engine::{Backend, Check};
    use tollgate_redis::RedisBackend;
    use tollgate_testsupport::{RedisCluster, RedisServer};

    /// What `key` has left of `limit` once it is no longer `before` (read with checks of
    /// cost 0, each a round trip during which the settle's task runs).
    /// What `key` has left once a settle has landed: in Redis (it no longer has `before`
    /// left), and in this replica (the settle's answer came back, and its deny cache forgot
    /// the denial it had foreseen while the units were held; checks and settles travel on
    /// different connections, so a check can see a refund before the settle's answer is in).
    async fn landed(backend: &RedisBackend, limit: &Limit, key: &[u8], before: u64) -> u64 {
        let mut left = before;
        for _ in 0..500 {
            let v = backend
                .check(&[Check::new(limit, key).with_cost(0)])
                .await
                .unwrap();
            left = v[0].remaining;
            if left != before && backend.deny_cache_len() == 0 {
                break;
            }
        }
        left
    }

    fn builder(urls: &[String]) -> RedisBackend {
        let b = if urls.len() == 1 {
            RedisBackend::builder().url(urls[0].as_str())
        } else {
            RedisBackend::builder().cluster(urls.to_vec())
        };
        b.deadline(std::time::Duration::from_secs(5))
            .build()
            .unwrap()
    }

    async fn streamed_and_login(urls: Vec<String>) {
        let backend = builder(&urls);
        let tokens = Limit::gcra("tokens", Quota::per_hour(1000).unwrap()).unwrap();
        let layer = RateLimitLayer::builder()
            .metered(
                tokens.clone(),
                Global,
                Metered::new()
                    .header(HeaderName::from_static("x-estimate"))
                    .charged_by_handler(),
            )
            .backend(backend.clone())
            .build()
            .unwrap();
        let mut svc = app(layer);
        let res = send(
            &mut svc,
            post(&[("x-estimate", "100"), ("x-stream-charge", "400")]),
        )
        .await;
        // The head came; the body has not ended: the reservation only.
        let v = backend
            .check(&[Check::new(&tokens, b"global").with_cost(0)])
            .await
            .unwrap();
        assert_eq!(v[0].remaining, 900);
        drain(res).await;
        assert_eq!(landed(&backend, &tokens, b"global", 900).await, 600);

        let login = Limit::gcra("login-failures", Quota::per_hour(5).unwrap()).unwrap();
        let layer = RateLimitLayer::builder()
            .metered(
                login.clone(),
                Global,
                Metered::new().count_if(|r| r.status() == StatusCode::UNAUTHORIZED),
            )
            .backend(backend.clone())
            .build()
            .unwrap();
        let mut svc = app(layer);
        for round in 0..5u64 {
            for _ in 0..2 {
                let res = send(&mut svc, post(&[("x-status", "200")])).await;
                assert_eq!(res.status(), StatusCode::OK, "round {round}");
                drain(res).await;
                // The success gives its unit back.
                assert_eq!(
                    landed(&backend, &login, b"global", 4 - round).await,
                    5 - round
                );
            }
            let res = send(&mut svc, post(&[("x-status", "401")])).await;
            assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "round {round}");
            drain(res).await;
        }
        let res = send(&mut svc, post(&[("x-status", "401")])).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    }

    #[tokio::test]
    async fn on_redis_a_streamed_settle_and_a_login_limit_are_exact() {
        let server = RedisServer::start();
        streamed_and_login(vec![server.url()]).await;
    }

    #[tokio::test]
    async fn on_a_cluster_a_streamed_settle_and_a_login_limit_are_exact() {
        let cluster = RedisCluster::start(3);
        streamed_and_login(cluster.urls()).await;
    }
}

/// A concurrency limit of 2 whose cost (the slots a request holds) is `x-estimate`: a cost of
/// 0 is refused with 400 and takes nothing, so it neither passes a full limit nor, released,
/// frees a slot another request holds. Held responses keep their slots.
async fn a_cost_of_0_on_a_concurrency_limit_is_refused<B: tollgate::engine::Backend>(backend: B) {
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .metered(
            Limit::concurrency("in-flight", 2).unwrap(),
            Global,
            Metered::new().header(HeaderName::from_static("x-estimate")),
        )
        .build()
        .unwrap();
    let mut svc = app(layer.clone());
    let first = send(&mut svc, post(&[("x-estimate", "1")])).await;
    assert_eq!(first.status(), StatusCode::OK);
    // On a free slot as on a full limit: 400, and the response that held nothing gives
    // nothing back.
    let zero = send(&mut svc, post(&[("x-estimate", "0")])).await;
    assert_eq!(zero.status(), StatusCode::BAD_REQUEST);
    drain(zero).await;
    let second = send(&mut svc, post(&[("x-estimate", "1")])).await;
    assert_eq!(second.status(), StatusCode::OK);
    for _ in 0..3 {
        let zero = send(&mut svc, post(&[("x-estimate", "0")])).await;
        assert_eq!(zero.status(), StatusCode::BAD_REQUEST);
        drain(zero).await;
    }
    // Both slots still held: a third request of 1 is refused.
    let third = send(&mut svc, post(&[("x-estimate", "1")])).await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(layer.peek("in-flight", "").await.unwrap().remaining, 0);
    drop((first, second));
}

#[tokio::test]
async fn a_cost_of_0_on_a_concurrency_limit_is_refused_in_memory() {
    a_cost_of_0_on_a_concurrency_limit_is_refused(memory()).await;
}

#[tokio::test]
async fn a_cost_of_0_on_a_concurrency_limit_is_refused_on_redis() {
    let server = tollgate_testsupport::RedisServer::start();
    let backend = tollgate_redis::RedisBackend::builder()
        .url(server.url())
        .deadline(std::time::Duration::from_secs(5))
        .build()
        .unwrap();
    a_cost_of_0_on_a_concurrency_limit_is_refused(backend).await;
}

/// `pause_from_upstream` holds back a GCRA key's emission time: on any other limit it would
/// do nothing, and the layer refuses it when built.
#[test]
fn pause_from_upstream_on_a_limit_that_is_not_gcra_is_refused_when_built() {
    use tollgate::engine::{Algorithm, ConfigError};
    let q = Quota::per_minute(10).unwrap();
    let limits = [
        Limit::fixed_window("window", q).unwrap(),
        Limit::sliding_log("log", q).unwrap(),
        Limit::concurrency("in-flight", 2).unwrap(),
    ];
    let mut errors = Vec::new();
    for limit in limits {
        let e = RateLimitLayer::builder()
            .metered(limit, Global, Metered::new().pause_from_upstream())
            .build()
            .err();
        errors.push(e);
    }
    let refused = |limit: &str, algorithm| {
        Some(ConfigError::PauseUnsupported {
            limit: limit.to_owned(),
            algorithm,
        })
    };
    assert_eq!(
        errors,
        [
            refused("window", Algorithm::FixedWindow),
            refused("log", Algorithm::SlidingLog),
            refused("in-flight", Algorithm::Concurrency),
        ]
    );
    assert!(RateLimitLayer::builder()
        .metered(
            Limit::gcra("gcra", q).unwrap(),
            Global,
            Metered::new().pause_from_upstream()
        )
        .build()
        .is_ok());
}
