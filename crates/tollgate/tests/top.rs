//! Who is being refused: each limit's most-refused identities, in memory and on real Redis
//! servers and clusters shared by replicas.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response, StatusCode};
use tollgate::core::{Backend, FakeClock, MemoryBackend};
use tollgate::key::{ClientIp, Principal};
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
        .limit(per_ip(), ClientIp::peer())
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let flooder: IpAddr = "203.0.113.7".parse().unwrap();
    let mut refused = [0u64; 2];
    let mut flooder_refused = 0;
    for i in 0..100_000u32 {
        if i % 20 == 0 {
            if send(&mut svc, flooder).await == StatusCode::TOO_MANY_REQUESTS {
                flooder_refused += 1;
            }
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
        .limit(per_ip(), ClientIp::peer())
        .limit(
            Limit::gcra("shadow", Quota::per_minute(1).unwrap())
                .unwrap()
                .shadow(),
            ClientIp::peer(),
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
        .limit(per_ip(), ClientIp::peer())
        .top_refused_k(0)
        .build()
        .unwrap();
    let mut svc = app(&layer);
    let ip: IpAddr = "192.0.2.1".parse().unwrap();
    send(&mut svc, ip).await;
    assert_eq!(send(&mut svc, ip).await, StatusCode::TOO_MANY_REQUESTS);
    assert!(layer.top_refused("per-ip", 10).await.unwrap().is_empty());
}
