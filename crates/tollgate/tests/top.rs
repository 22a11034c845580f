//! Who is being refused: each limit's most-refused identities, in memory and on real Redis
//! servers and clusters shared by replicas.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response, StatusCode};
use tollgate::engine::{Backend, Clock, FakeClock, MemoryBackend};
use tollgate::key::ClientIp;
use tollgate::{AdminError, Limit, Quota, RateLimitLayer, Refused};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};
use tower::{service_fn, Layer, Service, ServiceExt};

type Svc = tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// 2025-01-01T00:00:10Z: ten seconds into a report bucket.
const T0: u64 = 1_735_689_610_000_000;

fn app<B: Backend>(layer: &RateLimitLayer<B>) -> Svc {
    let handler =
        service_fn(|_: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) });
    tower::util::BoxCloneService::new(
        layer
            .clone()
            .layer(handler)
            .map_response(|r| r.map(Body::new)),
    )
}

fn from(ip: IpAddr) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::new(ip, 4000)));
    req
}

async fn send(svc: &mut Svc, ip: IpAddr) -> StatusCode {
    svc.ready()
        .await
        .unwrap()
        .call(from(ip))
        .await
        .unwrap()
        .status()
}

/// One request a minute per client address: a client's second request is refused.
fn per_ip() -> Limit {
    Limit::gcra("per-ip", Quota::per_minute(1).unwrap()).unwrap()
}

/// Client addresses, named by address in reports (the default is a fingerprint).
fn by_ip() -> ClientIp {
    ClientIp::peer().reveal_identities()
}

fn sprayed(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

/// A flooder among 100,000 sprayed addresses, each refused once or twice: the flooder comes
/// first with its exact count (it is refused far more than N/k times), and the summary holds
/// exactly k identities, whatever the spray.
#[tokio::test]
async fn a_flooder_among_a_spray_comes_first_with_its_exact_count() {
    let clock = FakeClock::new(T0);
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .max_keys(200_000)
        .build();
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .fallback_clock(clock.clone())
        .limit(per_ip(), by_ip())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let flooder: IpAddr = "203.0.113.7".parse().unwrap();
    let mut refused = [0u64; 2];
    let mut flooder_refused = 0;
    for i in 0..100_000u32 {
        if i % 20 == 0 && send(&mut svc, flooder).await == StatusCode::TOO_MANY_REQUESTS {
            flooder_refused += 1;
        }
        // Two or three requests: the first admitted, the others refused.
        let times = 2 + (i % 2);
        for _ in 0..times {
            if send(&mut svc, sprayed(i)).await == StatusCode::TOO_MANY_REQUESTS {
                refused[(times - 2) as usize] += 1;
            }
        }
    }
    assert_eq!(flooder_refused, 4_999);
    assert_eq!(refused, [50_000, 100_000]);
    let top = layer.top_refused("per-ip", 1_000).await.unwrap();
    // k = 100 counters: the spray never grows the summary.
    assert_eq!(top.len(), 100);
    assert_eq!(top[0].identity, "203.0.113.7");
    assert_eq!((top[0].count, top[0].error), (4_999, 0));
    assert_eq!((top[0].first_seen, top[0].last_seen), (T0, T0));
    // Every other identity is counted with the error it inherited: at most 2 of its own.
    for r in &top[1..] {
        assert!(r.count - r.error <= 2, "{r:?}");
    }
}

/// A client address's identity is the network its key groups (an IPv6 /64), a shadow
/// limit's would-be refusals are not counted, and the times seen follow the layer's clock.
#[tokio::test]
async fn identities_are_networks_and_shadow_limits_count_nothing() {
    let clock = FakeClock::new(T0);
    let layer = RateLimitLayer::builder()
        .backend(MemoryBackend::builder().clock(clock.clone()).build())
        .fallback_clock(clock.clone())
        .limit(per_ip(), by_ip())
        .limit(
            Limit::gcra("shadow", Quota::per_minute(1).unwrap())
                .unwrap()
                .shadow(),
            by_ip(),
        )
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let a: IpAddr = "2001:db8:1:2::a".parse().unwrap();
    let b: IpAddr = "2001:db8:1:2::b".parse().unwrap();
    assert_eq!(send(&mut svc, a).await, StatusCode::OK);
    clock.advance(Duration::from_millis(10));
    assert_eq!(send(&mut svc, b).await, StatusCode::TOO_MANY_REQUESTS);
    clock.advance(Duration::from_millis(10));
    assert_eq!(send(&mut svc, a).await, StatusCode::TOO_MANY_REQUESTS);
    let top = layer.top_refused("per-ip", 10).await.unwrap();
    assert_eq!(
        top,
        vec![Refused::new(
            "2001:db8:1:2::/64",
            2,
            0,
            T0 + 10_000,
            T0 + 20_000
        )]
    );
    assert!(layer.top_refused("shadow", 10).await.unwrap().is_empty());
    assert!(matches!(
        layer.top_refused("nope", 10).await,
        Err(AdminError::UnknownLimit(_))
    ));
}

/// A layer built with `top_refused_k(0)` counts nothing.
#[tokio::test]
async fn k_zero_counts_no_refusal() {
    let layer = RateLimitLayer::builder()
        .limit(per_ip(), by_ip())
        .top_refused_k(0)
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let ip: IpAddr = "192.0.2.1".parse().unwrap();
    send(&mut svc, ip).await;
    assert_eq!(send(&mut svc, ip).await, StatusCode::TOO_MANY_REQUESTS);
    assert!(layer.top_refused("per-ip", 10).await.unwrap().is_empty());
}

/// In memory, a limit's counters reach the backend's report with the first refusal a tick
/// (1 s) after the last hand-over, and not before.
#[tokio::test]
async fn counters_are_handed_to_the_backend_once_per_tick() {
    let clock = FakeClock::new(T0);
    let layer = RateLimitLayer::builder()
        .backend(MemoryBackend::builder().clock(clock.clone()).build())
        .fallback_clock(clock.clone())
        .limit(per_ip(), by_ip())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let ip: IpAddr = "192.0.2.1".parse().unwrap();
    let in_backend = || {
        let reports = layer.backend().reports().unwrap();
        let top = reports.top("per-ip", 10, clock.now());
        async move { top.await.unwrap() }
    };
    send(&mut svc, ip).await;
    send(&mut svc, ip).await;
    clock.advance(Duration::from_millis(999));
    send(&mut svc, ip).await;
    assert!(in_backend().await.is_empty());
    clock.advance(Duration::from_millis(1));
    send(&mut svc, ip).await;
    let top = in_backend().await;
    assert_eq!(
        top,
        vec![Refused::new("192.0.2.1", 3, 0, T0, T0 + 1_000_000)]
    );
}

fn redis(url: &str, prefix: &str) -> RedisBackend {
    RedisBackend::builder()
        .url(url)
        .prefix(prefix)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn cluster(urls: Vec<String>, prefix: &str) -> RedisBackend {
    RedisBackend::builder()
        .cluster(urls)
        .prefix(prefix)
        .deadline(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// Two replicas on one Redis: each hands its counters when asked, and either reads both
/// merged, over the current and the previous bucket, bounded to 2k identities per bucket.
async fn two_replicas_merge(a: RedisBackend, b: RedisBackend) {
    let clock = FakeClock::new(T0);
    let replica = |backend: RedisBackend| {
        RateLimitLayer::builder()
            .backend(backend)
            .fallback_clock(clock.clone())
            .limit(per_ip(), by_ip())
            .top_refused_k(3)
            .build()
            .unwrap()
    };
    let (a, b) = (replica(a), replica(b));
    let (mut svc_a, mut svc_b) = (app(&a), app(&b));
    let ip = |last: u8| IpAddr::V4(Ipv4Addr::new(198, 51, 100, last));
    // Each address's first request is admitted, wherever it lands: the quota is shared.
    let mut refused = 0;
    for (on_a, last, times) in [(true, 1, 4), (false, 1, 2), (true, 2, 2), (false, 3, 5)] {
        let svc = if on_a { &mut svc_a } else { &mut svc_b };
        for _ in 0..times {
            if send(svc, ip(last)).await == StatusCode::TOO_MANY_REQUESTS {
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 10);
    // B hands its counters as it reads; A then reads both replicas' merged.
    assert_eq!(b.top_refused("per-ip", 10).await.unwrap().len(), 2);
    let top = a.top_refused("per-ip", 10).await.unwrap();
    assert_eq!(
        top,
        vec![
            Refused::new("198.51.100.1", 5, 0, T0, T0),
            Refused::new("198.51.100.3", 4, 0, T0, T0),
            Refused::new("198.51.100.2", 1, 0, T0, T0),
        ]
    );
    // A bucket later the report still holds them; two buckets later it is empty.
    clock.advance(Duration::from_secs(60));
    assert_eq!(a.top_refused("per-ip", 1).await.unwrap(), top[..1]);
    clock.advance(Duration::from_secs(60));
    assert!(a.top_refused("per-ip", 10).await.unwrap().is_empty());
    // 2k = 6 identities at most per bucket, whatever the replicas hand over.
    for last in 10..20 {
        send(&mut svc_a, ip(last)).await;
        send(&mut svc_a, ip(last)).await;
        send(&mut svc_b, ip(last)).await;
        b.top_refused("per-ip", 10).await.unwrap();
    }
    assert_eq!(a.top_refused("per-ip", 100).await.unwrap().len(), 6);
}

#[tokio::test]
async fn two_replicas_on_one_server_merge_their_refusals() {
    let server = RedisServer::start();
    two_replicas_merge(redis(&server.url(), "top"), redis(&server.url(), "top")).await;
}

#[tokio::test]
async fn two_replicas_on_a_cluster_merge_their_refusals() {
    let cluster_ = RedisCluster::start(3);
    two_replicas_merge(
        cluster(cluster_.urls(), "top"),
        cluster(cluster_.urls(), "top"),
    )
    .await;
}
