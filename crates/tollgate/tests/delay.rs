//! Delayed GCRA limits through the layer, in memory: a request that would conform within the
//! delay is admitted, its time reserved at once, and served at that time; one dropped while it
//! waits gives its units back; the waiters of a key are bounded.
//!
//! The backend's clock is a `FakeClock` that stands still: every check is made at the same
//! instant, so each admitted request's wait is exact, and tokio's paused clock runs the
//! layer's timers.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::time::Instant;
use tollgate::cost::Metered;
use tollgate::key::{Global, Tenant};
use tollgate::{Decision, FakeClock, Limit, Limits, MemoryBackend, Quota, RateLimitLayer};
use tower::{Service, ServiceExt};

use support::{Res, Started};

fn memory() -> MemoryBackend<FakeClock> {
    MemoryBackend::builder()
        .clock(FakeClock::new(1_700_000_000_000_000))
        .build()
}

/// `per_second` a second, a burst of `burst`, waiting up to `delay` (ms).
fn delayed(name: &str, per_second: u32, burst: u32, delay_ms: u64) -> Limit {
    Limit::gcra(
        name,
        Quota::per_second(per_second)
            .unwrap()
            .with_burst(burst)
            .unwrap(),
    )
    .unwrap()
    .delay_up_to(Duration::from_millis(delay_ms))
    .unwrap()
}

/// One request every `secs` seconds.
fn every(name: &str, secs: u64, burst: u32, delay_secs: u64) -> Limit {
    Limit::gcra(
        name,
        Quota::new(1, Duration::from_secs(secs))
            .unwrap()
            .with_burst(burst)
            .unwrap(),
    )
    .unwrap()
    .delay_up_to(Duration::from_secs(delay_secs))
    .unwrap()
}

fn req(id: usize, tenant: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .header("x-id", id.to_string())
        .header("x-tenant", tenant)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Sends `n` requests at once (each decided as it is called) and waits for every answer.
async fn concurrently<S>(svc: &mut S, n: usize, tenant: &str) -> Vec<Res>
where
    S: Service<Request<Full<Bytes>>, Response = Res, Error = Infallible>,
    S::Future: Send + 'static,
{
    let mut tasks = Vec::new();
    for id in 0..n {
        let fut = svc.ready().await.unwrap().call(req(id, tenant));
        tasks.push(tokio::spawn(fut));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap().unwrap());
    }
    out
}

fn starts(started: &Started) -> Vec<(usize, Duration)> {
    let mut s = started.lock().unwrap().clone();
    s.sort();
    s
}

fn secs(s: &[(usize, u64)]) -> Vec<(usize, Duration)> {
    s.iter()
        .map(|&(i, t)| (i, Duration::from_secs(t)))
        .collect()
}

fn retry_after(res: &Res) -> Option<&str> {
    res.headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap())
}

#[tokio::test(start_paused = true)]
async fn exactly_the_burst_and_the_delay_s_intervals_are_admitted_each_at_its_time() {
    // One a second, burst 2, delay 3.5 s: 2 at once, then at 1, 2 and 3 s (2 + ⌊3.5/1⌋ = 5).
    let layer = RateLimitLayer::builder()
        .limit(
            every("chat", 1, 2, 0)
                .delay_up_to(Duration::from_millis(3_500))
                .unwrap(),
            Global,
        )
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let answers = concurrently(&mut svc, 10, "t").await;
    let status: Vec<u16> = answers.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(status, [200, 200, 200, 200, 200, 429, 429, 429, 429, 429]);
    assert_eq!(
        starts(&started),
        secs(&[(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)])
    );
    // The sixth would have waited 4 s: it may come back in 0.5 s (rounded up to 1).
    assert_eq!(retry_after(&answers[5]), Some("1"));
    // Each decision says how long its request waited, and the fields show the reservation.
    let delays: Vec<Option<Duration>> = answers[..5]
        .iter()
        .map(|r| r.extensions().get::<Decision>().unwrap().delayed())
        .collect();
    let s = |n| Some(Duration::from_secs(n));
    assert_eq!(delays, [None, None, s(1), s(2), s(3)]);
    let last = answers[4].extensions().get::<Decision>().unwrap();
    assert_eq!(last.limits()[0].label(), "delayed");
    assert_eq!(last.remaining(), Some(0));
    assert_eq!(
        answers[4].headers()["ratelimit"].to_str().unwrap(),
        "\"chat\";r=0;t=5"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_gives_its_unit_back_only_when_nobody_waits_behind_it() {
    // One a second, burst 1, delay 2 s: the first at once, the next two wait 1 and 2 s, and
    // a fourth (3 s) is refused...
    let layer = RateLimitLayer::builder()
        .limit(every("l", 1, 1, 2), Global)
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let first = svc.ready().await.unwrap().call(req(0, "t"));
    let second = svc.ready().await.unwrap().call(req(1, "t"));
    let third = svc.ready().await.unwrap().call(req(2, "t"));
    let refused = svc.ready().await.unwrap().call(req(3, "t")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // ... and still is once the second goes away before its time: the third waits behind the
    // second's reservation, so that unit is not given back (it would let the next request
    // start at 2 s, beside the third).
    drop(second);
    let refused = svc.ready().await.unwrap().call(req(4, "t")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&refused), Some("1"));
    // The third, the last reservation, goes away too: its unit comes back, and the next
    // request is admitted to wait 2 s, in the third's place.
    drop(third);
    let fifth = svc.ready().await.unwrap().call(req(5, "t"));
    let (a, e) = tokio::join!(first, fifth);
    let e = e.unwrap();
    assert_eq!(
        (a.unwrap().status(), e.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    assert_eq!(
        e.extensions().get::<Decision>().unwrap().delayed(),
        Some(Duration::from_secs(2))
    );
    assert_eq!(starts(&started), secs(&[(0, 0), (5, 2)]));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_never_lets_a_later_request_start_beside_one_that_waits() {
    // One a second, burst 1, delay 5 s: requests due at 0, 1 and 2 s; the one due at 1 s is
    // dropped. The next is due at 3 s, after the one that still waits for 2 s.
    let layer = RateLimitLayer::builder()
        .limit(every("l", 1, 1, 5), Global)
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let first = svc.ready().await.unwrap().call(req(0, "t"));
    let second = svc.ready().await.unwrap().call(req(1, "t"));
    let third = svc.ready().await.unwrap().call(req(2, "t"));
    drop(second);
    let fourth = svc.ready().await.unwrap().call(req(3, "t"));
    let (a, c, d) = tokio::join!(first, third, fourth);
    for res in [a, c, d] {
        assert_eq!(res.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(starts(&started), secs(&[(0, 0), (2, 2), (3, 3)]));
}

#[tokio::test(start_paused = true)]
async fn a_count_if_refund_while_requests_wait_never_lets_two_start_together() {
    // One a second, burst 1, delay 5 s, and no response counts: each gives its unit back when
    // its head comes. The first is answered while two wait (due at 1 and 2 s): its refund would
    // put the next request at 2 s beside the second waiter, so it is dropped.
    let layer = RateLimitLayer::builder()
        .metered(
            every("l", 1, 1, 5),
            Global,
            Metered::new().count_if(|_| false),
        )
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let first = svc.ready().await.unwrap().call(req(0, "t"));
    let second = tokio::spawn(svc.ready().await.unwrap().call(req(1, "t")));
    let third = tokio::spawn(svc.ready().await.unwrap().call(req(2, "t")));
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    let fourth = svc.ready().await.unwrap().call(req(3, "t")).await.unwrap();
    assert_eq!(
        fourth.extensions().get::<Decision>().unwrap().delayed(),
        Some(Duration::from_secs(3))
    );
    for res in [second.await.unwrap(), third.await.unwrap()] {
        assert_eq!(res.unwrap().status(), StatusCode::OK);
    }
    assert_eq!(starts(&started), secs(&[(0, 0), (1, 1), (2, 2), (3, 3)]));
    // The fourth was the last reservation: its refund gave its unit back, and the others'
    // (refused while someone waited) came back with time. The backend's clock still stands at
    // the checks' instant: the next waits 3 s, behind the three units still counted.
    let fifth = svc.ready().await.unwrap().call(req(4, "t")).await.unwrap();
    assert_eq!(
        fifth.extensions().get::<Decision>().unwrap().delayed(),
        Some(Duration::from_secs(3))
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_after_a_reset_gives_nothing_back_to_the_reset_key() {
    // One a second, burst 1, delay 5 s: the first at once, the second due at 1 s. The key is
    // reset; 100 ms later a request starts at once under the reset key. The second is dropped:
    // the reset key never counted its unit, so nothing comes back, and the next request waits
    // its second behind the one that just started.
    let clock = FakeClock::new(1_700_000_000_000_000);
    let layer = RateLimitLayer::builder()
        .limit(every("l", 1, 1, 5), Tenant::header("x-tenant"))
        .backend(MemoryBackend::builder().clock(clock.clone()).build())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let first = svc.ready().await.unwrap().call(req(0, "t")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let second = svc.ready().await.unwrap().call(req(1, "t"));
    layer.reset("l", "t").await.unwrap();
    let step = Duration::from_millis(100);
    clock.advance(step);
    tokio::time::advance(step).await;
    let third = svc.ready().await.unwrap().call(req(2, "t")).await.unwrap();
    assert_eq!(third.status(), StatusCode::OK);
    drop(second);
    let fourth = svc.ready().await.unwrap().call(req(3, "t")).await.unwrap();
    assert_eq!(
        fourth.extensions().get::<Decision>().unwrap().delayed(),
        Some(Duration::from_secs(1))
    );
    assert_eq!(
        starts(&started),
        [
            (0, Duration::ZERO),
            (2, step),
            (3, step + Duration::from_secs(1))
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn at_most_max_waiting_requests_of_a_key_wait_and_the_others_consume_nothing() {
    // One a second, burst 2, delay 10 s: all ten would conform within it, but only 3 may wait.
    let limit = every("l", 1, 2, 10).max_waiting(3).unwrap();
    let layer = RateLimitLayer::builder()
        .limit(limit, Tenant::header("x-tenant"))
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let answers = concurrently(&mut svc, 10, "a").await;
    let admitted = answers.iter().filter(|r| r.status() == 200).count();
    assert_eq!(admitted, 5); // 2 at once, 3 waiting
    assert_eq!(
        starts(&started),
        secs(&[(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)])
    );
    // The refused consumed nothing: the key's next request (its waiters gone) reserves the
    // sixth interval, 4 s beyond the burst from the backend's unmoved clock.
    let next = svc.ready().await.unwrap().call(req(10, "a")).await.unwrap();
    assert_eq!(
        next.extensions().get::<Decision>().unwrap().delayed(),
        Some(Duration::from_secs(4))
    );
    // Another key has waiters of its own.
    let other = concurrently(&mut svc, 10, "b").await;
    assert_eq!(other.iter().filter(|r| r.status() == 200).count(), 5);
}

#[tokio::test(start_paused = true)]
async fn stacked_limits_wait_for_the_latest_time_and_a_refusal_consumes_in_neither() {
    // `fast` one a second, `slow` one every 2 s (per tenant), both burst 1, both delay 5 s.
    let layer = RateLimitLayer::builder()
        .limits(
            Limits::new()
                .limit(every("fast", 1, 1, 5), Global)
                .limit(every("slow", 2, 1, 5), Tenant::header("x-tenant")),
        )
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let mut futs = Vec::new();
    for id in 0..3 {
        futs.push(tokio::spawn(svc.ready().await.unwrap().call(req(id, "a"))));
    }
    // The fourth: `fast` would wait 3 s, `slow` 6 s > 5 s: refused, and `fast` keeps its
    // third interval free.
    let refused = svc.ready().await.unwrap().call(req(3, "a")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let d = refused.extensions().get::<Decision>().unwrap();
    assert_eq!(d.get("slow").unwrap().label(), "denied");
    assert_eq!(d.delayed(), None);
    // Another tenant: `fast` reserves its third interval (3 s), `slow` its first (0 s).
    futs.push(tokio::spawn(svc.ready().await.unwrap().call(req(4, "b"))));
    let mut delays = Vec::new();
    for f in futs {
        let res = f.await.unwrap().unwrap();
        assert_eq!(res.status(), 200);
        let d = res.extensions().get::<Decision>().unwrap().clone();
        delays.push((
            d.get("fast").unwrap().delayed().map(|t| t.as_secs()),
            d.get("slow").unwrap().delayed().map(|t| t.as_secs()),
            d.delayed().map(|t| t.as_secs()),
        ));
    }
    assert_eq!(
        delays,
        [
            (None, None, None),
            (Some(1), Some(2), Some(2)),
            (Some(2), Some(4), Some(4)),
            (Some(3), None, Some(3)),
        ]
    );
    assert_eq!(starts(&started), secs(&[(0, 0), (1, 2), (2, 4), (4, 3)]));
}

#[tokio::test(start_paused = true)]
async fn a_shadow_limit_reports_its_delay_and_nobody_waits_for_it() {
    let layer = RateLimitLayer::builder()
        .limit(every("trial", 1, 1, 5).shadow(), Global)
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let answers = concurrently(&mut svc, 3, "t").await;
    assert!(answers.iter().all(|r| r.status() == 200));
    let last = answers[2].extensions().get::<Decision>().unwrap();
    assert_eq!(last.limits()[0].delayed(), Some(Duration::from_secs(2)));
    assert_eq!(last.delayed(), None);
    assert_eq!(starts(&started), secs(&[(0, 0), (1, 0), (2, 0)]));
}

#[tokio::test(start_paused = true)]
async fn a_reload_changes_the_delay() {
    let limits = |delay_secs| Limits::new().limit(every("l", 1, 1, delay_secs), Global);
    let layer = RateLimitLayer::builder()
        .limits(limits(0))
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let status = |a: &[Res]| a.iter().map(|r| r.status().as_u16()).collect::<Vec<_>>();
    assert_eq!(status(&concurrently(&mut svc, 2, "t").await), [200, 429]);
    layer.reloader().reload(limits(2)).unwrap();
    // The key used its interval: the next two wait 1 and 2 s, the third is refused.
    assert_eq!(
        status(&concurrently(&mut svc, 3, "t").await),
        [200, 200, 429]
    );
    assert_eq!(starts(&started), secs(&[(0, 0), (0, 1), (1, 2)]));
}

#[tokio::test(start_paused = true)]
async fn the_delay_applies_under_the_plan_s_quota() {
    // One a second by default, two a second for `pro`; burst 1, delay 1 s.
    let limit = every("l", 1, 1, 1)
        .plan("pro", Quota::per_second(2).unwrap().with_burst(1).unwrap())
        .unwrap();
    let layer = RateLimitLayer::builder()
        .limit(limit, Tenant::header("x-tenant"))
        .backend(memory())
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let mut tasks = Vec::new();
    for id in 0..4 {
        let mut r = req(id, "pro");
        r.extensions_mut().insert(tollgate::Plan::new("pro"));
        tasks.push(tokio::spawn(svc.ready().await.unwrap().call(r)));
    }
    let mut status = Vec::new();
    for t in tasks {
        status.push(t.await.unwrap().unwrap().status().as_u16());
    }
    // At once, then 0.5 and 1 s beyond the burst; the fourth (1.5 s) is refused.
    assert_eq!(status, [200, 200, 200, 429]);
    let ms = |s: &[(usize, u64)]| -> Vec<(usize, Duration)> {
        s.iter()
            .map(|&(i, t)| (i, Duration::from_millis(t)))
            .collect()
    };
    assert_eq!(starts(&started), ms(&[(0, 0), (1, 500), (2, 1_000)]));
}

#[tokio::test(start_paused = true)]
async fn allowlisted_requests_and_a_failed_backend_never_wait() {
    use std::num::NonZeroU32;
    use tollgate::engine::BackendErrorKind;
    use tollgate::Allowlist;
    // The backend fails: the fallback (its own share of the quota, checked without a delay)
    // admits the first and refuses the next two at once; the allowlisted tenant passes.
    let flaky = support::Flaky::new();
    flaky.fail(Some(BackendErrorKind::Unavailable));
    let limits = Limits::new()
        .limit(
            every("l", 1, 1, 5).fallback(NonZeroU32::new(1).unwrap()),
            Tenant::header("x-tenant"),
        )
        .with_allowlist(
            Allowlist::new()
                .keys(Tenant::header("x-tenant"), ["vip"])
                .unwrap(),
        );
    let layer = RateLimitLayer::builder()
        .limits(limits)
        .backend(flaky)
        .build()
        .unwrap();
    let started = Started::default();
    let mut svc = support::recording(&layer, Instant::now(), Arc::clone(&started), Duration::ZERO);
    let status = |a: &[Res]| a.iter().map(|r| r.status().as_u16()).collect::<Vec<_>>();
    let answers = concurrently(&mut svc, 3, "t").await;
    assert_eq!(status(&answers), [200, 429, 429]);
    assert_eq!(
        answers[0].extensions().get::<Decision>().unwrap().delayed(),
        None
    );
    let vip = concurrently(&mut svc, 3, "vip").await;
    assert_eq!(status(&vip), [200, 200, 200]);
    assert_eq!(starts(&started), secs(&[(0, 0), (0, 0), (1, 0), (2, 0)]));
}

#[test]
fn limits_without_an_emission_time_refuse_a_delay_when_built() {
    use tollgate::engine::{Algorithm, ConfigError};
    let q = Quota::per_minute(10).unwrap();
    let d = Duration::from_secs(2);
    let errors = [
        Limit::fixed_window("w", q).unwrap().delay_up_to(d).err(),
        Limit::sliding_log("s", q).unwrap().delay_up_to(d).err(),
        Limit::concurrency("c", 2).unwrap().delay_up_to(d).err(),
    ];
    assert_eq!(
        errors,
        [
            Some(ConfigError::DelayUnsupported(Algorithm::FixedWindow)),
            Some(ConfigError::DelayUnsupported(Algorithm::SlidingLog)),
            Some(ConfigError::DelayUnsupported(Algorithm::Concurrency)),
        ]
    );
    assert!(delayed("g", 10, 1, 250).delay_micros() == 250_000);
}

/// A fixed window or a sliding log counts a request when it is checked; stacked on one layer
/// with a delayed limit, a request checked near a window's end would run in the next window,
/// beyond that window's limit. The layer refuses the combination when built, and so does a
/// limits file. A shadow limit on either side refuses nothing and waits for nothing: allowed.
#[test]
fn a_delay_stacked_with_a_window_is_refused_when_built() {
    use tollgate::engine::ConfigError;
    use tollgate::LimitsFile;
    let chat = || delayed("chat", 1, 1, 5_000);
    let windows = [
        Limit::fixed_window("daily", Quota::per_day(100).unwrap()).unwrap(),
        Limit::sliding_log("hourly", Quota::per_hour(100).unwrap()).unwrap(),
    ];
    for window in windows {
        let name = window.name().to_owned();
        let e = RateLimitLayer::builder()
            .limit(window.clone(), Global)
            .limit(chat(), Global)
            .build()
            .err();
        assert_eq!(
            e,
            Some(ConfigError::DelayWithWindow {
                delayed: "chat".to_owned(),
                window: name,
            })
        );
        assert!(RateLimitLayer::builder()
            .limit(window.shadow(), Global)
            .limit(chat(), Global)
            .build()
            .is_ok());
    }
    assert!(RateLimitLayer::builder()
        .limit(
            Limit::fixed_window("daily", Quota::per_day(100).unwrap()).unwrap(),
            Global
        )
        .limit(chat().shadow(), Global)
        .build()
        .is_ok());
    // A delay beside GCRA and concurrency limits is what it was.
    assert!(RateLimitLayer::builder()
        .limit(chat(), Global)
        .limit(delayed("other", 5, 5, 0), Global)
        .limit(Limit::concurrency("in-flight", 4).unwrap(), Global)
        .build()
        .is_ok());

    let text = "[[limit]]\nname = \"chat\"\nperiod = \"1s\"\nkey = \"global\"\nquota = 1\n\
                delay = \"2s\"\n\n[[limit]]\nname = \"daily\"\nalgorithm = \"fixed_window\"\n\
                period = \"1d\"\nkey = \"global\"\nquota = 100\n";
    let e = LimitsFile::new().parse(text).err().unwrap().to_string();
    assert!(
        e.contains("limit \"chat\" delays requests and limit \"daily\" counts them by window"),
        "{e}"
    );
}
