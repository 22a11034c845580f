//! The cost of counting refusals for the reports of who is refused (`docs/benchmarks.md`):
//! one Space-Saving update alone (a key already held; a new key in a full summary), and one
//! request through the layer in memory, refused and admitted, with the reports on (k = 100)
//! and off (k = 0).
//!
//! `cargo bench -p tollgate-bench --bench top`

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use criterion::{criterion_group, criterion_main, Criterion};
use http::{Request, Response, StatusCode};
use tollgate::key::ClientIp;
use tollgate::{Limit, Quota, RateLimitLayer};
use tollgate_engine::topk::SpaceSaving;
use tower::{service_fn, Layer, Service};

fn summary(c: &mut Criterion) {
    let mut group = c.benchmark_group("space-saving");
    let mut top = SpaceSaving::<Vec<u8>>::new(100);
    for i in 0..100u32 {
        top.add(&i.to_be_bytes()[..], 1, 0);
    }
    group.bench_function("held key", |b| {
        let mut i = 0u32;
        b.iter(|| {
            i = (i + 1) % 100;
            top.add(&i.to_be_bytes()[..], 1, 0);
        })
    });
    group.bench_function("new key, full", |b| {
        let mut i = 1_000u32;
        b.iter(|| {
            i = i.wrapping_add(1);
            top.add(&i.to_be_bytes()[..], 1, 0);
        })
    });
    group.finish();
}

fn request(ip: IpAddr) -> Request<Body> {
    let mut req = Request::new(Body::empty());
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::new(ip, 4000)));
    req
}

/// `iters` requests through a layer of one GCRA limit per address, refused (`refused`: the
/// addresses spent their one request) or admitted (a quota nobody reaches), from `keys`
/// addresses in turn.
fn through_layer(k: usize, refused: bool, keys: u32, iters: u64) -> Duration {
    let quota = if refused {
        Quota::per_hour(1)
    } else {
        Quota::per_second(1_000_000)
    };
    let Ok(layer) = quota
        .and_then(|q| Limit::gcra("per-ip", q))
        .and_then(|limit| {
            RateLimitLayer::builder()
                .limit(limit, ClientIp::peer())
                .top_refused_k(k)
                .decision_on_allowed(false)
                .build()
        })
    else {
        return Duration::ZERO;
    };
    let mut svc = layer.layer(service_fn(|_: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    }));
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return Duration::ZERO;
    };
    let ip = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i % keys));
    rt.block_on(async {
        for i in 0..keys {
            let _ = svc.call(request(ip(i))).await;
        }
        let start = Instant::now();
        for i in 0..iters {
            let status = svc
                .call(request(ip(i as u32)))
                .await
                .map(|r| r.status())
                .unwrap_or(StatusCode::OK);
            assert_eq!(status == StatusCode::TOO_MANY_REQUESTS, refused);
        }
        start.elapsed()
    })
}

fn layer(c: &mut Criterion) {
    let mut group = c.benchmark_group("layer");
    for (name, k) in [("reports", 100), ("no-reports", 0)] {
        group.bench_function(format!("refused/1-key/{name}"), |b| {
            b.iter_custom(|iters| through_layer(k, true, 1, iters))
        });
        group.bench_function(format!("refused/spray-10k/{name}"), |b| {
            b.iter_custom(|iters| through_layer(k, true, 10_000, iters))
        });
        group.bench_function(format!("admitted/{name}"), |b| {
            b.iter_custom(|iters| through_layer(k, false, 1_000, iters))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(700))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = summary, layer
}
criterion_main!(benches);
