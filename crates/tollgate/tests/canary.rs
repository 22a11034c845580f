//! The canary: a synthetic key that must be denied, through the real backend. Time is Tokio's
//! paused clock: the schedule is exact and nothing sleeps on the wall clock.

#![allow(clippy::unwrap_used)]

mod support;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use support::{Flaky, Recorder};
use tollgate::engine::{Backend, BackendError, BackendErrorKind, Check, Verdicts};
use tollgate::{Canary, CanaryStatus, FakeClock, MemoryBackend};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::RedisServer;

const INTERVAL: Duration = Duration::from_secs(30);

fn ok(metrics: &Recorder, backend: &str) -> Option<f64> {
    metrics
        .snapshot()
        .gauge("tollgate_canary_ok", &[("backend", backend)])
}

/// Lets the spawned canary run what is due.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_gauge_follows_the_backend_within_one_interval() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    let canary = Canary::new(backend.clone(), INTERVAL).spawn();
    settle().await;
    // The first check runs at once: it consumes the unit, checks again, is denied.
    assert_eq!(backend.calls(), 2);
    assert_eq!(ok(&metrics, "flaky"), Some(1.0));

    // The backend goes down just after a check: at the next one, the gauge says so.
    backend.fail(Some(BackendErrorKind::Unavailable));
    tokio::time::advance(INTERVAL - Duration::from_millis(1)).await;
    settle().await;
    assert_eq!(
        backend.calls(),
        2,
        "no check before the interval has passed"
    );
    tokio::time::advance(Duration::from_millis(1)).await;
    settle().await;
    assert_eq!(backend.calls(), 3);
    assert_eq!(ok(&metrics, "flaky"), Some(0.0));
    tokio::time::advance(INTERVAL).await;
    settle().await;
    assert_eq!(backend.calls(), 4);
    assert_eq!(ok(&metrics, "flaky"), Some(0.0));

    // Back, with its state: 1 at the next check.
    backend.fail(None);
    tokio::time::advance(INTERVAL).await;
    settle().await;
    assert_eq!(backend.calls(), 5);
    assert_eq!(ok(&metrics, "flaky"), Some(1.0));

    // The canary stops with its handle, and a canary that no longer runs is not ok.
    assert!(!canary.is_finished());
    drop(canary);
    settle().await;
    assert_eq!(ok(&metrics, "flaky"), Some(0.0));
    tokio::time::advance(INTERVAL * 3).await;
    settle().await;
    assert_eq!(backend.calls(), 5, "no check after the handle was dropped");
}

/// Seconds since the Unix epoch, by the wall clock (the canary stamps its checks with it).
fn wall() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test(start_paused = true)]
async fn every_check_stamps_its_time_and_the_interval_whatever_it_found() {
    let metrics = Recorder::install();
    let checked = || {
        metrics.snapshot().gauge(
            "tollgate_canary_last_check_timestamp_seconds",
            &[("backend", "flaky")],
        )
    };
    let backend = Flaky::new();
    let canary = Canary::new(backend.clone(), INTERVAL);
    assert_eq!(checked(), None, "no check, no stamp");

    let before = wall();
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    let first = checked().unwrap();
    assert!(before <= first && first <= wall(), "{before} {first}");
    assert_eq!(
        metrics
            .snapshot()
            .gauge("tollgate_canary_interval_seconds", &[("backend", "flaky")]),
        Some(30.0)
    );

    // A failed check is a check: the stamp moves on while the canary's gauge reads 0.
    backend.fail(Some(BackendErrorKind::Unavailable));
    let before = wall();
    assert!(!canary.check_once().await.is_ok());
    let second = checked().unwrap();
    assert!(before <= second && second <= wall(), "{before} {second}");
    assert!(second >= first);
    assert_eq!(ok(&metrics, "flaky"), Some(0.0));
}

#[tokio::test(start_paused = true)]
async fn only_an_answered_denial_is_ok() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    let canary = Canary::new(backend.clone(), INTERVAL);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "flaky"), Some(1.0));
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "flaky"), Some(1.0));

    for kind in support::KINDS {
        // From 1 to 0.
        backend.fail(None);
        assert_eq!(canary.check_once().await, CanaryStatus::Denied);
        backend.fail(Some(kind));
        let status = canary.check_once().await;
        assert_eq!(status, CanaryStatus::Failed(kind));
        assert!(!status.is_ok());
        assert_eq!(ok(&metrics, "flaky"), Some(0.0));
    }
    backend.fail(None);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "flaky"), Some(1.0));
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_lost_its_state_fails_the_canary() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    let canary = Canary::new(backend.clone(), INTERVAL);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    tokio::time::advance(Duration::from_secs(3_600)).await;
    // Restarted empty: the used-up key is admitted again, well within its day.
    backend.forget();
    assert_eq!(canary.check_once().await, CanaryStatus::Admitted);
    assert_eq!(ok(&metrics, "flaky"), Some(0.0));
    // That admission seeded the state again: the next check is denied.
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "flaky"), Some(1.0));
}

#[tokio::test(start_paused = true)]
async fn a_canary_that_only_saw_denials_still_notices_lost_state() {
    let metrics = Recorder::install();
    let backend = Flaky::new();
    // Two replicas' canaries on one backend: the first takes the unit, the second has only
    // ever seen it denied.
    let first = Canary::new(backend.clone(), INTERVAL);
    let second = Canary::new(backend.clone(), INTERVAL);
    assert_eq!(first.check_once().await, CanaryStatus::Denied);
    assert_eq!(second.check_once().await, CanaryStatus::Denied);
    tokio::time::advance(Duration::from_secs(3_600)).await;
    // Restarted empty, and the second checks first: the denial it saw said the unit comes
    // back in a day, so an admission an hour later is lost state.
    backend.forget();
    assert_eq!(second.check_once().await, CanaryStatus::Admitted);
    assert_eq!(ok(&metrics, "flaky"), Some(0.0));
    // That admission took the unit again: the first one is denied, as it should be.
    assert_eq!(first.check_once().await, CanaryStatus::Denied);
}

#[tokio::test(start_paused = true)]
async fn the_unit_coming_back_after_a_day_is_not_a_failure() {
    let metrics = Recorder::install();
    let clock = FakeClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let canary = Canary::new(backend, INTERVAL);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    let day = Duration::from_secs(86_400);
    clock.advance(day);
    tokio::time::advance(day).await;
    // Admitted (the unit is back), checked again at once, denied.
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "memory"), Some(1.0));
}

/// Admits everything: a backend that keeps no state.
#[derive(Clone)]
struct Forgetful;

impl Backend for Forgetful {
    type Future = std::future::Ready<Result<Verdicts, BackendError>>;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        std::future::ready(MemoryBackend::new().check_now(checks))
    }

    fn kind(&self) -> &'static str {
        "forgetful"
    }
}

/// Never answers.
#[derive(Clone)]
struct Hanging;

impl Backend for Hanging {
    type Future = Pin<Box<dyn Future<Output = Result<Verdicts, BackendError>> + Send>>;

    fn check(&self, _: &[Check<'_>]) -> Self::Future {
        Box::pin(std::future::pending())
    }

    fn kind(&self) -> &'static str {
        "hanging"
    }
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_keeps_nothing_or_never_answers_fails() {
    let metrics = Recorder::install();
    let forgetful = Canary::new(Forgetful, INTERVAL);
    assert_eq!(forgetful.check_once().await, CanaryStatus::Admitted);
    assert_eq!(ok(&metrics, "forgetful"), Some(0.0));

    let hanging = Canary::new(Hanging, INTERVAL).timeout(Duration::from_secs(2));
    let started = tokio::time::Instant::now();
    assert_eq!(
        hanging.check_once().await,
        CanaryStatus::Failed(BackendErrorKind::Timeout)
    );
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert_eq!(ok(&metrics, "hanging"), Some(0.0));
}

#[tokio::test(start_paused = true)]
async fn the_canary_never_touches_the_requests_counters() {
    use tollgate::engine::{Limit, Quota};
    let _metrics = Recorder::install();
    let backend = MemoryBackend::new();
    let canary = Canary::new(backend.clone(), INTERVAL);
    for _ in 0..3 {
        canary.check_once().await;
    }
    // One key of its own: nothing else is tracked, and a limit of the app is untouched.
    assert_eq!(backend.stats().tracked_keys, 1);
    let app = Limit::gcra("api", Quota::per_day(1).unwrap()).unwrap();
    let v = backend.check_now(&[Check::new(&app, b"")]).unwrap();
    assert!(v[0].is_allowed());
}

// Against a real Redis the canary is driven by `check_once`: a paused clock would fire the
// backend's deadline while the runtime waits for the server. The schedule itself is tested
// above with paused time.

fn redis(server: &RedisServer, deadline: Duration) -> RedisBackend {
    RedisBackend::builder()
        .url(server.url())
        .deadline(deadline)
        // Timing without the breaker's back-off; with it, the canary reads `circuit_open`.
        .breaker_threshold(0)
        .build()
        .unwrap()
}

/// Lets the backend reconnect after a restart: the call that finds the old connection broken
/// drops it, a later one connects again. Bounded in calls, not in time.
async fn reconnected(backend: &RedisBackend) {
    for _ in 0..20 {
        if backend.ping().await.is_ok() {
            return;
        }
    }
    panic!("Redis did not come back");
}

#[tokio::test]
async fn against_redis_a_stop_fails_the_canary_and_a_restart_is_seen_as_lost_state() {
    let metrics = Recorder::install();
    let mut server = RedisServer::start();
    let backend = redis(&server, Duration::from_secs(2));
    let canary = Canary::new(backend.clone(), INTERVAL);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "redis"), Some(1.0));
    // One key, the canary's own; every check after the first reaches Redis (no deny cache).
    assert_eq!(server.dbsize(), 1);
    let evals = server.calls("evalsha") + server.calls("eval");
    for _ in 0..3 {
        assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    }
    assert_eq!(server.calls("evalsha") + server.calls("eval"), evals + 3);

    server.stop();
    let status = canary.check_once().await;
    assert!(
        matches!(
            status,
            CanaryStatus::Failed(BackendErrorKind::Unavailable | BackendErrorKind::Timeout)
        ),
        "{status:?}"
    );
    assert_eq!(ok(&metrics, "redis"), Some(0.0));

    // Back, but empty (no persistence): the used-up key is admitted, which the canary reports,
    // then the state is there again.
    server.start_again();
    reconnected(&backend).await;
    assert_eq!(canary.check_once().await, CanaryStatus::Admitted);
    assert_eq!(ok(&metrics, "redis"), Some(0.0));
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(ok(&metrics, "redis"), Some(1.0));
}

#[tokio::test(start_paused = true)]
async fn the_canarys_name_and_key_are_its_own() {
    use tollgate::engine::{ConfigError, Limit, Quota};
    use tollgate::key::key_fn;
    use tollgate::RateLimitLayer;
    use tower::{service_fn, Layer, ServiceExt};

    let _metrics = Recorder::install();
    let day = Quota::per_day(1).unwrap();
    // No layer may hold a limit under the canary's name: its requests would spend the canary's
    // unit, and a canary denied by them would say "ok" over a backend that lost its state.
    let err = RateLimitLayer::builder()
        .limit(
            Limit::gcra(tollgate::CANARY_LIMIT, day).unwrap(),
            tollgate::key::Global,
        )
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::ReservedName(tollgate::CANARY_LIMIT.to_owned())
    );

    // A key function may produce the canary's key bytes, but under another limit's name they
    // are another bucket: the canary's first check still takes its own unit.
    let backend = MemoryBackend::new();
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("api", day).unwrap(),
            key_fn(|_| Some(b"\xfetollgate-canary".to_vec())),
        )
        .backend(backend.clone())
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: http::Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    }));
    let codes = [
        svc.clone().oneshot(http::Request::new(())).await.unwrap(),
        svc.oneshot(http::Request::new(())).await.unwrap(),
    ]
    .map(|r| r.status().as_u16());
    assert_eq!(codes, [200, 429]);
    let canary = Canary::new(backend.clone(), INTERVAL);
    assert_eq!(canary.check_once().await, CanaryStatus::Denied);
    assert_eq!(backend.stats().tracked_keys, 2);
}
