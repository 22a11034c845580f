//! The adaptive concurrency limit against a simulated service: `workers` requests run at once,
//! each for `work` of Tokio's (paused) time; the others wait for a worker. Its controller:
//! where the limit settles, a poisoned baseline, and what is not a sample.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tollgate::key::{key_fn, Global, RequestView};
use tollgate::{Adaptive, Limit, Quota, RateLimitLayer};
use tower::{service_fn, Layer, Service, ServiceExt};

use support::sim::Sim;

const MS: Duration = Duration::from_millis(1);

/// A layer with a generous rate limit and `adaptive`, by one key for every request.
fn layer(adaptive: Adaptive) -> RateLimitLayer {
    RateLimitLayer::builder()
        .limit(
            Limit::gcra("all", Quota::per_second(100_000).unwrap()).unwrap(),
            Global,
        )
        .adaptive(adaptive, Global)
        .build()
        .unwrap()
}

/// `clients` clients that each send requests one after another for `run`, waiting 10 ms
/// after a 503; the number of 200s.
async fn load<S>(svc: S, clients: usize, run: Duration) -> u64
where
    S: Service<Request<Full<Bytes>>, Response = Response<tollgate::ResponseBody<Full<Bytes>>>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    let ok = Arc::new(AtomicU64::new(0));
    let end = tokio::time::Instant::now() + run;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (svc, ok) = (svc.clone(), Arc::clone(&ok));
        tasks.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < end {
                let req = Request::get("/").body(Full::new(Bytes::new())).unwrap();
                let response = svc.clone().oneshot(req).await.unwrap();
                if response.status() == StatusCode::OK {
                    ok.fetch_add(1, Ordering::Relaxed);
                } else {
                    tokio::time::sleep(10 * MS).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    ok.load(Ordering::Relaxed)
}

/// 10 workers of 50 ms and 40 clients of the default class: the requests in flight settle
/// near `1.1 × 10` (the tolerance), which is the default class's 80% of a limit near 13.75;
/// the limit stays within 13 to 17 (one probe of headroom), and the workers are kept busy.
#[tokio::test(start_paused = true)]
async fn the_limit_converges_near_the_capacity() {
    let sim = Sim::new(10, 50 * MS);
    let layer = layer(Adaptive::gradient().min(2).initial(5).max(200));
    let adaptive = layer.adaptive().unwrap();
    let svc = layer.layer(sim.service());
    let ok = load(svc.clone(), 40, Duration::from_secs(10)).await;
    assert_eq!(adaptive.min_rtt(), Some(50 * MS));
    // After the warm-up, every later limit stays within bounds.
    let mut seen = Vec::new();
    for _ in 0..20 {
        let svc = svc.clone();
        let ok = load(svc, 40, Duration::from_millis(500)).await;
        seen.push((adaptive.limit(), ok));
    }
    for &(limit, served) in &seen {
        assert!((13..=17).contains(&limit), "{seen:?}");
        // 10 workers × 10 requests of 50 ms in 500 ms: the service is kept busy.
        assert!(served >= 95, "{seen:?}");
    }
    assert!(ok > 1_500, "{ok}");
    // The handler never ran more than the default class's share of the limit.
    assert!(sim.max_running() <= 14, "{}", sim.max_running());
}

/// A baseline measured on fast answers (1 ms: a cache, say) makes the real latency look like
/// overload: the limit falls to its floor. The next measurement (within 8 to 12 s) finds
/// 50 ms, and the limit grows back past the capacity.
#[tokio::test(start_paused = true)]
async fn a_poisoned_baseline_recovers() {
    let sim = Sim::new(10, 50 * MS);
    sim.fast.store(true, Ordering::SeqCst);
    let layer = layer(
        Adaptive::gradient()
            .min(2)
            .initial(10)
            .max(200)
            .remeasure_every(Duration::from_secs(10)),
    );
    let adaptive = layer.adaptive().unwrap();
    let svc = layer.layer(sim.service());
    load(svc.clone(), 40, 100 * MS).await;
    assert_eq!(adaptive.min_rtt(), Some(MS));
    sim.fast.store(false, Ordering::SeqCst);
    let mut seen = Vec::new();
    for _ in 0..30 {
        load(svc.clone(), 40, 100 * MS).await;
        seen.push(adaptive.learned());
    }
    // Halved toward its floor, a window (100 ms) at a time, smoothed.
    assert_eq!(seen[..4], [10, 9, 8, 7], "{seen:?}");
    assert_eq!(adaptive.learned(), 2);
    assert_eq!(adaptive.min_rtt(), Some(MS));
    load(svc.clone(), 40, Duration::from_secs(10)).await;
    assert_eq!(adaptive.min_rtt(), Some(50 * MS));
    load(svc.clone(), 40, Duration::from_secs(10)).await;
    assert!(adaptive.learned() >= 10, "{}", adaptive.learned());
}

/// Refused requests (by the layer's rate limit) and cancelled ones (dropped before their
/// answer) hold a permit for a moment, but tell the controller nothing: the limit stays
/// exactly where it was. The same number of answered requests moves it.
#[tokio::test(start_paused = true)]
async fn refused_and_cancelled_requests_are_not_samples() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-user", Quota::per_hour(1).unwrap()).unwrap(),
            key_fn(|req: &RequestView<'_>| {
                req.headers().get("x-user").map(|v| v.as_bytes().to_vec())
            }),
        )
        .adaptive(Adaptive::gradient().min(2).initial(10).max(200), Global)
        .build()
        .unwrap();
    let adaptive = layer.adaptive().unwrap();
    let users = Arc::new(AtomicU64::new(0));
    let hang = Arc::new(AtomicBool::new(false));
    let svc = layer.layer(service_fn({
        let hang = Arc::clone(&hang);
        move |_req: Request<Full<Bytes>>| {
            let hang = hang.load(Ordering::SeqCst);
            async move {
                let work = if hang {
                    Duration::from_secs(3600)
                } else {
                    20 * MS
                };
                tokio::time::sleep(work).await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        }
    }));
    let request = |user: u64| {
        Request::get("/")
            .header("x-user", user.to_string())
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    // The baseline, from 16 answered requests of their own users.
    for _ in 0..16 {
        let user = users.fetch_add(1, Ordering::SeqCst);
        let response = svc.clone().oneshot(request(user)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    assert_eq!(adaptive.min_rtt(), Some(20 * MS));
    assert_eq!(adaptive.learned(), 10);
    // Refused by the rate limit (user 0 has used its hour): 400 of them, 8 at a time (the
    // default class's share of 10).
    for _ in 0..50 {
        let batch: Vec<_> = (0..8)
            .map(|_| tokio::spawn(svc.clone().oneshot(request(0))))
            .collect();
        for task in batch {
            let response = task.await.unwrap().unwrap();
            assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        }
        tokio::time::sleep(50 * MS).await;
    }
    // Cancelled: 8 at a time (the default class's share of 10), dropped after 5 ms of a handler that never answers.
    hang.store(true, Ordering::SeqCst);
    for _ in 0..50 {
        let batch: Vec<_> = (0..8)
            .map(|_| {
                let user = users.fetch_add(1, Ordering::SeqCst);
                let svc = svc.clone();
                tokio::spawn(tokio::time::timeout(5 * MS, svc.oneshot(request(user))))
            })
            .collect();
        for task in batch {
            assert!(task.await.unwrap().is_err());
        }
        tokio::time::sleep(50 * MS).await;
    }
    assert_eq!(adaptive.in_flight(), 0);
    assert_eq!(adaptive.learned(), 10);
    // The control: answered requests, 8 at a time (the default class's share of 10), grow it.
    hang.store(false, Ordering::SeqCst);
    for _ in 0..20 {
        let batch: Vec<_> = (0..8)
            .map(|_| {
                let user = users.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(svc.clone().oneshot(request(user)))
            })
            .collect();
        for task in batch {
            assert_eq!(task.await.unwrap().unwrap().status(), StatusCode::OK);
        }
    }
    assert!(adaptive.learned() > 10, "{}", adaptive.learned());
}

/// 5xx answers are overload, however fast: with every answer a 500, each window halves the
/// limit, down to its floor; answers of 200 again let it grow back.
#[tokio::test(start_paused = true)]
async fn failures_are_overload_however_fast() {
    let sim = Sim::new(10, 50 * MS);
    let layer = layer(Adaptive::gradient().min(2).initial(10).max(200));
    let adaptive = layer.adaptive().unwrap();
    let svc = layer.layer(sim.service());
    load(svc.clone(), 12, Duration::from_secs(2)).await;
    let before = adaptive.learned();
    assert!(before >= 12, "{before}");
    sim.status.store(500, Ordering::SeqCst);
    let mut seen = Vec::new();
    for _ in 0..6 {
        load(svc.clone(), 12, 100 * MS).await;
        seen.push(adaptive.learned());
    }
    // Halved a window (100 ms) at a time.
    assert_eq!(seen[0], before / 2, "{before} {seen:?}");
    assert_eq!(seen[5], 2, "{seen:?}");
    sim.status.store(0, Ordering::SeqCst);
    load(svc.clone(), 12, Duration::from_secs(3)).await;
    assert!(adaptive.learned() >= 10, "{}", adaptive.learned());
}

/// A latency flat at the timeout is overload: every answer taking the timeout halves the
/// limit at each window (where a slow latency under the timeout moves it a tenth at most).
#[tokio::test(start_paused = true)]
async fn a_latency_at_the_timeout_halves_the_limit() {
    let sim = Sim::new(100, 200 * MS);
    sim.fast.store(true, Ordering::SeqCst);
    let layer = layer(
        Adaptive::gradient()
            .min(2)
            .initial(20)
            .max(200)
            .timeout(200 * MS)
            .max_baseline(100 * MS),
    );
    let adaptive = layer.adaptive().unwrap();
    let svc = layer.layer(sim.service());
    load(svc.clone(), 4, 100 * MS).await;
    assert_eq!((adaptive.min_rtt(), adaptive.learned()), (Some(MS), 20));
    sim.fast.store(false, Ordering::SeqCst);
    let mut seen = Vec::new();
    for _ in 0..4 {
        load(svc.clone(), 4, 200 * MS).await;
        seen.push(adaptive.learned());
    }
    // The first answers at the timeout land as the first 200 ms end; then each window halves.
    assert_eq!(seen, [20, 10, 5, 2]);
}

/// A reload of the layer's limits makes the adaptive limit measure its baseline again, at its
/// floor, as at start.
#[tokio::test(start_paused = true)]
async fn a_reload_measures_the_baseline_again() {
    let sim = Sim::new(10, 50 * MS);
    let layer = layer(Adaptive::gradient().min(3).initial(10).max(200));
    let adaptive = layer.adaptive().unwrap();
    let svc = layer.layer(sim.service());
    assert!(adaptive.is_measuring());
    load(svc.clone(), 4, Duration::from_secs(1)).await;
    assert!(!adaptive.is_measuring());
    assert_eq!(adaptive.limit(), 10);
    layer
        .reloader()
        .reload(tollgate::Limits::new().limit(
            Limit::gcra("all", Quota::per_second(50_000).unwrap()).unwrap(),
            Global,
        ))
        .unwrap();
    assert!(adaptive.is_measuring());
    assert_eq!((adaptive.limit(), adaptive.learned()), (3, 10));
    load(svc.clone(), 4, Duration::from_secs(1)).await;
    assert!(!adaptive.is_measuring());
    assert_eq!(adaptive.min_rtt(), Some(50 * MS));
}
