//! Queued concurrency limits on Redis, two replicas (two backends, two layers) sharing one
//! limit of one slot: no slot is lost or doubled. Requests spread over both are all served,
//! never two at once (counted in the handler), on a real server and a real 3-master cluster.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tollgate::key::Tenant;
use tollgate::{Decision, Limit, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::{service_fn, Layer, Service, ServiceExt};

/// Requests in the handler now, and the most there ever were.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    most: AtomicUsize,
}

fn replica(
    backend: RedisBackend,
    in_flight: &Arc<InFlight>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<tollgate::ResponseBody<Full<Bytes>>>,
    Error = Infallible,
    Future: Send,
> + Clone {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::concurrency("exports", 1)
                .unwrap()
                .queue_up_to(Duration::from_secs(30), 64)
                .unwrap(),
            Tenant::header("x-tenant"),
        )
        .backend(backend)
        .build()
        .unwrap();
    let in_flight = Arc::clone(in_flight);
    layer.layer(service_fn(move |_req: Request<Full<Bytes>>| {
        let in_flight = Arc::clone(&in_flight);
        async move {
            let n = in_flight.now.fetch_add(1, Ordering::SeqCst) + 1;
            in_flight.most.fetch_max(n, Ordering::SeqCst);
            // Some work, giving the other requests' tasks their turns meanwhile.
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            // Out before the slot goes back (when the body is dropped).
            in_flight.now.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    }))
}

/// Sends `n` requests at once, alternately to each replica; the status of each and whether
/// it waited in the queue.
async fn spread(backends: [RedisBackend; 2], n: usize) -> (Vec<u16>, usize, Arc<InFlight>) {
    let in_flight = Arc::new(InFlight::default());
    let replicas = backends.map(|b| replica(b, &in_flight));
    let mut tasks = Vec::new();
    for i in 0..n {
        let svc = replicas[i % 2].clone();
        let req = Request::builder()
            .header("x-tenant", "shop")
            .body(Full::new(Bytes::new()))
            .unwrap();
        tasks.push(tokio::spawn(async move {
            let res = svc.oneshot(req).await.unwrap();
            let queued = res
                .extensions()
                .get::<Decision>()
                .unwrap()
                .queued()
                .is_some();
            // The body is dropped here: the slot goes back.
            (res.status().as_u16(), queued)
        }));
    }
    let mut status = Vec::new();
    let mut queued = 0;
    for task in tasks {
        let (s, q) = task.await.unwrap();
        status.push(s);
        queued += usize::from(q);
    }
    (status, queued, in_flight)
}

const N: usize = 40;

/// A deadline long enough for a loaded machine: a call past the default deadline fails, and
/// the limit fails open, which would admit requests together.
const LOADED: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_slot_and_serve_every_waiter_one_at_a_time() {
    let server = RedisServer::start();
    let backend = || {
        RedisBackend::builder()
            .url(server.url().as_str())
            .deadline(LOADED)
            .build()
            .unwrap()
    };
    server.reset_stats();
    let (status, queued, in_flight) = spread([backend(), backend()], N).await;
    assert_eq!(status, [200; N]);
    assert_eq!(in_flight.most.load(Ordering::SeqCst), 1);
    // Sent at once, most found the slot taken and waited.
    assert!(queued >= N / 2, "{queued}");
    let calls = server.calls("evalsha");
    eprintln!("standalone: {N} requests, {queued} queued, {calls} EVALSHA calls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_slot_on_a_cluster() {
    let cluster = RedisCluster::start(3);
    let backend = || {
        RedisBackend::builder()
            .cluster(cluster.urls())
            .deadline(LOADED)
            .build()
            .unwrap()
    };
    let (status, queued, in_flight) = spread([backend(), backend()], N).await;
    assert_eq!(status, [200; N]);
    assert_eq!(in_flight.most.load(Ordering::SeqCst), 1);
    assert!(queued >= N / 2, "{queued}");
    eprintln!("cluster: {N} requests, {queued} queued");
}

/// A client of one request at a time, alternating between two replicas that share a
/// concurrency limit of 1 (no queue), which reads each response to its end before it sends the
/// next: the end comes only once Redis has the release, so its next request, on the other
/// replica, always finds the slot free. Exactly 40 of 40 admitted. (The deadline, which bounds
/// how long an end waits for its release, is long enough for a loaded machine.)
#[tokio::test]
async fn a_client_that_reads_each_end_is_never_refused_for_its_own_slot_on_either_replica() {
    use http_body_util::BodyExt;

    let server = RedisServer::start();
    let replica = || {
        let backend = RedisBackend::builder()
            .url(server.url().as_str())
            .deadline(Duration::from_secs(5))
            .build()
            .unwrap();
        RateLimitLayer::builder()
            .limit(
                Limit::concurrency("one", 1).unwrap(),
                Tenant::header("x-tenant"),
            )
            .backend(backend)
            .build()
            .unwrap()
            .layer(service_fn(|_req: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
            }))
    };
    let replicas = [replica(), replica()];
    let mut status = Vec::new();
    for i in 0..N {
        let req = Request::builder()
            .header("x-tenant", "shop")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = replicas[i % 2].clone().oneshot(req).await.unwrap();
        status.push(res.status().as_u16());
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert!(!body.is_empty());
    }
    assert_eq!(status, [200; N]);
}
