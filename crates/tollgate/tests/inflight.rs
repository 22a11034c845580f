//! Concurrency limits through the layer: a slot is held from admission until the response body
//! ends or is dropped, exactly once, and is all-or-nothing with the rate limits beside it.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::sync::Semaphore;
use tollgate::key::ClientIp;
use tollgate::{
    Decision, DenyReason, FakeClock, Limit, MemoryBackend, Outcome, Quota, RateLimitLayer,
};
use tower::{service_fn, Layer, Service, ServiceExt};

fn memory() -> MemoryBackend<FakeClock> {
    MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build()
}

fn from(ip: [u8; 4]) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(Bytes::new()));
    req.extensions_mut().insert(SocketAddr::from((ip, 4000)));
    req
}

/// A service whose handlers wait for a permit of `gate` before they answer.
fn gated(
    layer: &RateLimitLayer<MemoryBackend<FakeClock>>,
    gate: Arc<Semaphore>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<tollgate::ResponseBody<Full<Bytes>>>,
    Error = Infallible,
    Future: Send,
> + Clone {
    layer.layer(service_fn(move |_req: Request<Full<Bytes>>| {
        let gate = Arc::clone(&gate);
        async move {
            gate.acquire().await.unwrap().forget();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }))
}

/// Lets spawned tasks run until `waiting` handlers have started.
async fn until_waiting(waiting: usize, entered: &AtomicUsize) {
    while entered.load(Ordering::SeqCst) < waiting {
        tokio::task::yield_now().await;
    }
}

fn in_flight(n: u32) -> RateLimitLayer<MemoryBackend<FakeClock>> {
    RateLimitLayer::builder()
        .limit(
            Limit::concurrency("in-flight", n).unwrap(),
            ClientIp::peer(),
        )
        .backend(memory())
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_full_key_is_refused_until_a_body_ends() {
    let layer = in_flight(2);
    let entered = Arc::new(AtomicUsize::new(0));
    let gates: Vec<Arc<Semaphore>> = (0..3).map(|_| Arc::new(Semaphore::new(0))).collect();
    let svc = |gate: &Arc<Semaphore>| {
        let gate = Arc::clone(gate);
        let entered = Arc::clone(&entered);
        layer.layer(service_fn(move |_req: Request<Full<Bytes>>| {
            let gate = Arc::clone(&gate);
            let entered = Arc::clone(&entered);
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
            }
        }))
    };

    // Two requests in flight: their handlers wait.
    let first = tokio::spawn(svc(&gates[0]).oneshot(from([10, 0, 0, 1])));
    let second = tokio::spawn(svc(&gates[1]).oneshot(from([10, 0, 0, 1])));
    until_waiting(2, &entered).await;

    // The third is refused: 429, a second to wait, the policy in concurrent requests.
    let refused = svc(&gates[2]).oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(
        refused.headers()["ratelimit-policy"],
        "\"in-flight\";q=2;qu=\"concurrent-requests\""
    );
    assert_eq!(refused.headers()["ratelimit"], "\"in-flight\";r=0;t=1");
    let decision = refused.extensions().get::<Decision>().unwrap();
    assert!(matches!(
        decision.get("in-flight").unwrap().outcome(),
        Outcome::Denied {
            reason: DenyReason::InFlight,
            ..
        }
    ));
    assert_eq!(
        entered.load(Ordering::SeqCst),
        2,
        "the refused handler never ran"
    );
    // Another client has slots of its own.
    gates[2].add_permits(1);
    let other = svc(&gates[2]).oneshot(from([10, 0, 0, 2])).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    assert_eq!(other.headers()["ratelimit"], "\"in-flight\";r=1");
    drop(other);

    // One handler answers; its slot is held until its body ends.
    gates[0].add_permits(1);
    let done = first.await.unwrap().unwrap();
    assert_eq!(done.status(), StatusCode::OK);
    let refused = svc(&gates[2]).oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the body has not ended"
    );
    assert_eq!(done.into_body().collect().await.unwrap().to_bytes(), "done");
    gates[2].add_permits(1);
    let next = svc(&gates[2]).oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);

    // Everything given back: nothing is tracked for the key any more.
    drop(next);
    gates[1].add_permits(1);
    drop(second.await.unwrap().unwrap());
    assert_eq!(layer.backend().stats().tracked_keys, 0);
}

#[tokio::test]
async fn a_dropped_or_panicking_request_gives_its_slot_back() {
    let layer = in_flight(1);
    let gate = Arc::new(Semaphore::new(0));
    let svc = gated(&layer, Arc::clone(&gate));

    // The client goes away while the handler works: the future is dropped.
    let mut pending = Box::pin(svc.clone().oneshot(from([10, 0, 0, 1])));
    assert!(futures_poll(&mut pending).is_none());
    assert_eq!(layer.backend().stats().tracked_keys, 1);
    drop(pending);
    assert_eq!(layer.backend().stats().tracked_keys, 0);

    // A handler that panics: its task dies, and the slot comes back with it.
    let panicking = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async move {
        if true {
            panic!("the handler failed");
        }
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let task = tokio::spawn(panicking.oneshot(from([10, 0, 0, 1])));
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(layer.backend().stats().tracked_keys, 0);

    // A response dropped before its body was read gives its slot back too.
    gate.add_permits(1);
    let res = svc.clone().oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(layer.backend().stats().tracked_keys, 1);
    drop(res);
    assert_eq!(layer.backend().stats().tracked_keys, 0);
    gate.add_permits(1);
    let res = svc.oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn slots_and_rates_are_all_or_nothing() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("rate", Quota::per_minute(2).unwrap()).unwrap(),
            ClientIp::peer(),
        )
        .limit(
            Limit::concurrency("in-flight", 1)
                .unwrap()
                .busy_retry_after(Duration::from_secs(3)),
            ClientIp::peer(),
        )
        .backend(memory())
        .build()
        .unwrap();
    let gate = Arc::new(Semaphore::new(0));
    let svc = gated(&layer, Arc::clone(&gate));

    let held = tokio::spawn(svc.clone().oneshot(from([10, 0, 0, 1])));
    while layer.backend().stats().tracked_keys < 2 {
        tokio::task::yield_now().await;
    }
    // Refused for lack of a slot, three times: no rate consumed (1 of 2 left all along).
    for _ in 0..3 {
        let res = svc.clone().oneshot(from([10, 0, 0, 1])).await.unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()["retry-after"], "3");
        let d = res.extensions().get::<Decision>().unwrap();
        assert!(matches!(
            d.get("rate").unwrap().outcome(),
            Outcome::Allowed { remaining: 1, .. }
        ));
    }
    gate.add_permits(1);
    drop(held.await.unwrap().unwrap());
    // The second request fits both; the third is refused by the rate, and takes no slot.
    gate.add_permits(1);
    let res = svc.clone().oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        res.headers()["ratelimit"],
        "\"rate\";r=0;t=60, \"in-flight\";r=0"
    );
    drop(res);
    let res = svc.clone().oneshot(from([10, 0, 0, 1])).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()["retry-after"], "30");
    assert_eq!(
        layer.backend().stats().tracked_keys,
        1,
        "only the rate's state"
    );
}

/// Polls `fut` once.
fn futures_poll<F: std::future::Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(fut).poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}
