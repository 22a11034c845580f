//! The layer around a client: a tower service that stands for an upstream API (its own body
//! and error types, as an HTTP client has), limited per upstream host in delay mode, in
//! memory. Calls made at once leave at the times the GCRA model gives, each seeing in its
//! request how long it waited; calls beyond the delay are answered by the layer and never
//! leave; another host has its own quota; the upstream's errors come back as they are.
//!
//! The backend's clock is a `FakeClock` that stands still, so every check is made at one
//! instant and each wait is exact; tokio's paused clock runs the layer's timers.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tollgate::key::{key_fn, RequestView};
use tollgate::{Decision, FakeClock, Limit, MemoryBackend, Quota, RateLimitLayer, ResponseBody};
use tower::{service_fn, Layer, Service, ServiceExt};

/// What a client's call fails with (an HTTP client's error type is its own, not `Infallible`).
#[derive(Debug, PartialEq)]
struct Unreachable(String);

/// When each call left for the upstream, from `start`: (host, id, time, the wait its
/// decision gave).
type Sent = Arc<Mutex<Vec<(String, usize, Duration, Option<Duration>)>>>;

type Answer = Result<Response<ResponseBody<Full<Bytes>>>, Unreachable>;

/// Ten calls a second to each upstream host, a burst of 3, waiting up to 1 s.
fn layer() -> RateLimitLayer<MemoryBackend<FakeClock>> {
    let quota = Quota::per_second(10).unwrap().with_burst(3).unwrap();
    let limit = Limit::gcra("upstream", quota)
        .unwrap()
        .delay_up_to(Duration::from_secs(1))
        .unwrap()
        .max_waiting(100)
        .unwrap();
    let backend = MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build();
    RateLimitLayer::builder()
        .limit(
            limit,
            key_fn(|req: &RequestView<'_>| {
                req.uri()
                    .authority()
                    .map(|a| a.as_str().as_bytes().to_vec())
            }),
        )
        .backend(backend)
        .build()
        .unwrap()
}

/// The upstream: records each call as it leaves, answers `200` with the host's name, and
/// fails (as a client does when it cannot connect) for the host `down.example`.
fn client(
    start: Instant,
    sent: Sent,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Unreachable,
    Future: Send,
> + Clone {
    service_fn(move |req: Request<Full<Bytes>>| {
        let sent = Arc::clone(&sent);
        async move {
            let host = req.uri().host().unwrap().to_owned();
            let id = req.headers()["x-id"].to_str().unwrap().parse().unwrap();
            let waited = req.extensions().get::<Decision>().unwrap().delayed();
            sent.lock()
                .unwrap()
                .push((host.clone(), id, start.elapsed(), waited));
            if host == "down.example" {
                return Err(Unreachable(host));
            }
            Ok(Response::new(Full::new(Bytes::from(host))))
        }
    })
}

fn call(host: &str, id: usize) -> Request<Full<Bytes>> {
    Request::post(format!("http://{host}/v1/chat"))
        .header("x-id", id.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Makes `n` calls to `host` at once (each decided as it is made) and waits for every answer.
async fn at_once<S>(svc: &mut S, host: &str, n: usize) -> Vec<Answer>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResponseBody<Full<Bytes>>>>,
    S: Service<Request<Full<Bytes>>, Error = Unreachable>,
    <S as Service<Request<Full<Bytes>>>>::Future: Send + 'static,
{
    let mut tasks = Vec::new();
    for id in 0..n {
        let fut = svc.ready().await.unwrap().call(call(host, id));
        tasks.push(tokio::spawn(fut));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(start_paused = true)]
async fn calls_at_once_leave_at_the_model_s_times_and_those_beyond_the_delay_never_leave() {
    let start = Instant::now();
    let sent = Sent::default();
    let mut svc = layer().layer(client(start, Arc::clone(&sent)));
    let answers = at_once(&mut svc, "api.example", 15).await;

    // GCRA, T = 100 ms, burst 3, delay 1 s: the k-th call (from 0) is reserved at
    // max(0, k − 2) × T, and admitted while that is within the delay: 3 + 10 = 13 calls.
    let model: Vec<(usize, Duration)> = (0..15u64)
        .map(|k| (k, ms(k.saturating_sub(2) * 100)))
        .filter(|(_, at)| *at <= Duration::from_secs(1))
        .map(|(k, at)| (k as usize, at))
        .collect();
    assert_eq!(model.len(), 13);
    let mut left = sent.lock().unwrap().clone();
    left.sort_by_key(|(_, id, _, _)| *id);
    let times: Vec<(usize, Duration)> = left.iter().map(|(_, id, at, _)| (*id, *at)).collect();
    assert_eq!(times, model);
    // Each call's request carried the layer's decision: how long it waited (none for the
    // burst).
    let waits: Vec<Option<Duration>> = left.iter().map(|(.., waited)| *waited).collect();
    let want: Vec<Option<Duration>> = model
        .iter()
        .map(|(_, at)| (!at.is_zero()).then_some(*at))
        .collect();
    assert_eq!(waits, want);

    // The 13 got the upstream's answer, body and all; the last 2 got the layer's 429, with
    // Retry-After (they would have waited 1.1 and 1.2 s: back in 0.1 s, rounded up to 1).
    let mut statuses = Vec::new();
    for answer in answers {
        let res = answer.unwrap();
        let status = res.status();
        if status == StatusCode::OK {
            let body = res.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, "api.example");
        } else {
            assert_eq!(res.headers()["retry-after"], "1");
        }
        statuses.push(status.as_u16());
    }
    let mut want = vec![200; 13];
    want.extend([429, 429]);
    assert_eq!(statuses, want);
}

#[tokio::test(start_paused = true)]
async fn each_upstream_host_has_its_own_quota_and_the_upstream_s_errors_come_back_as_they_are() {
    let start = Instant::now();
    let sent = Sent::default();
    let mut svc = layer().layer(client(start, Arc::clone(&sent)));
    let mut other = svc.clone();
    let (a, b) = tokio::join!(
        at_once(&mut other, "a.example", 4),
        at_once(&mut svc, "b.example", 4)
    );
    // Each host: 3 at once, the fourth 100 ms later.
    for (host, answers) in [("a.example", a), ("b.example", b)] {
        assert!(answers.iter().all(|r| r.as_ref().unwrap().status() == 200));
        let mut times: Vec<Duration> = sent
            .lock()
            .unwrap()
            .iter()
            .filter(|(h, ..)| h == host)
            .map(|(_, _, at, _)| *at)
            .collect();
        times.sort();
        assert_eq!(times, [ms(0), ms(0), ms(0), ms(100)], "{host}");
    }

    // A client error is the layer's error, unchanged; the call still took its unit (an
    // error is judged as a 500, and a plain limit counts every admitted call).
    let failed = at_once(&mut svc, "down.example", 4).await;
    let errors: Vec<&Unreachable> = failed.iter().map(|r| r.as_ref().unwrap_err()).collect();
    assert_eq!(errors, vec![&Unreachable("down.example".to_owned()); 4]);
    let next = svc
        .ready()
        .await
        .unwrap()
        .call(call("down.example", 4))
        .await;
    assert!(next.is_err());
    let last = sent.lock().unwrap().last().unwrap().clone();
    assert_eq!(last.1, 4);
    // The fifth call of the host waited for the 5th slot: 2 intervals beyond the burst,
    // counted from when the layer first checked the host (the paused clock moved 100 ms
    // since the burst of `a`/`b`, the backend's clock did not).
    assert_eq!(last.3, Some(ms(200)));
}
