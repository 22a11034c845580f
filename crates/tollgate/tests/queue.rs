//! Queued concurrency limits through the layer, in memory: a request that finds its key's
//! slots taken waits for one, first come first served, instead of being refused; the waiters
//! are bounded; one dropped while it waits leaves its line; one whose wait runs out is
//! refused; and a waiter holds no unit of the request's other limits.
//!
//! Handlers hold their slot for 100 ms of tokio's paused clock, so every time is exact.

#![allow(clippy::unwrap_used)]

mod support;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::time::Instant;
use tollgate::engine::{Admin, Backend, Check, Settlement, Slots};
use tollgate::key::{Global, Tenant};
use tollgate::{Decision, FakeClock, Limit, Limits, MemoryBackend, Quota, RateLimitLayer};
use tower::{Service, ServiceExt};

use support::{Res, Started};

/// How long a handler holds its slot.
const HOLD: Duration = Duration::from_millis(100);

/// A memory backend that counts the checks it is asked (each is one Redis call on Redis).
#[derive(Clone)]
struct Counting {
    memory: MemoryBackend<FakeClock>,
    checks: Arc<AtomicU64>,
}

impl Counting {
    fn new() -> Self {
        Self {
            memory: MemoryBackend::builder()
                .clock(FakeClock::new(1_700_000_000_000_000))
                .build(),
            checks: Arc::default(),
        }
    }

    fn checks(&self) -> u64 {
        self.checks.load(Ordering::SeqCst)
    }
}

impl Backend for Counting {
    type Future = <MemoryBackend<FakeClock> as Backend>::Future;

    fn check(&self, checks: &[Check<'_>]) -> Self::Future {
        self.checks.fetch_add(1, Ordering::SeqCst);
        self.memory.check(checks)
    }

    fn settle(&self, settlements: &[Settlement<'_>]) {
        self.memory.settle(settlements);
    }

    fn kind(&self) -> &'static str {
        "counting"
    }

    fn slots(&self) -> Option<&dyn Slots> {
        self.memory.slots()
    }

    fn admin(&self) -> Option<&dyn Admin> {
        self.memory.admin()
    }
}

fn queued(name: &str, in_flight: u32, wait: Duration, max_waiting: u32) -> Limit {
    Limit::concurrency(name, in_flight)
        .unwrap()
        .queue_up_to(wait, max_waiting)
        .unwrap()
}

fn req(id: usize, tenant: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .header("x-id", id.to_string())
        .header("x-tenant", tenant)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// A request's answer without its body (dropped at once, so its slot goes back), and when
/// it came from `start`.
type Answer = (http::response::Parts, Duration);

fn answer(
    fut: impl Future<Output = Result<Res, Infallible>> + Send + 'static,
    start: Instant,
) -> tokio::task::JoinHandle<Answer> {
    tokio::spawn(async move {
        let (parts, _body) = fut.await.unwrap().into_parts();
        (parts, start.elapsed())
    })
}

/// Sends requests `ids` of `tenant` at once, each decided (or put in line) as it is called.
async fn send<S>(
    svc: &mut S,
    ids: std::ops::Range<usize>,
    tenant: &str,
    start: Instant,
) -> Vec<tokio::task::JoinHandle<Answer>>
where
    S: Service<Request<Full<Bytes>>, Response = Res, Error = Infallible>,
    S::Future: Send + 'static,
{
    let mut tasks = Vec::new();
    for id in ids {
        tasks.push(answer(
            svc.ready().await.unwrap().call(req(id, tenant)),
            start,
        ));
    }
    tasks
}

async fn all(tasks: Vec<tokio::task::JoinHandle<Answer>>) -> Vec<Answer> {
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// Each answer's status, and when it came.
fn statuses(answers: &[Answer]) -> Vec<(u16, Duration)> {
    answers
        .iter()
        .map(|(p, at)| (p.status.as_u16(), *at))
        .collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn decision(parts: &http::response::Parts) -> &Decision {
    parts.extensions.get::<Decision>().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_full_key_s_requests_are_served_one_after_another_in_arrival_order() {
    let recorder = support::Recorder::install();
    let backend = Counting::new();
    let layer = RateLimitLayer::builder()
        .limit(queued("exports", 1, Duration::from_secs(10), 10), Global)
        .backend(backend.clone())
        .build()
        .unwrap();
    let start = Instant::now();
    let started = Started::default();
    let mut svc = support::recording(&layer, start, Arc::clone(&started), HOLD);
    let answers = all(send(&mut svc, 0..5, "t", start).await).await;
    // None refused; one served at once, then each as the one before it ends.
    let status: Vec<u16> = answers.iter().map(|(p, _)| p.status.as_u16()).collect();
    assert_eq!(status, [200; 5]);
    assert_eq!(
        *started.lock().unwrap(),
        [
            (0, ms(0)),
            (1, ms(100)),
            (2, ms(200)),
            (3, ms(300)),
            (4, ms(400))
        ]
    );
    // Each decision says how long its request waited in the queue.
    let waited: Vec<Option<Duration>> = answers.iter().map(|(p, _)| decision(p).queued()).collect();
    assert_eq!(
        waited,
        [
            None,
            Some(ms(100)),
            Some(ms(200)),
            Some(ms(300)),
            Some(ms(400))
        ]
    );
    assert_eq!(decision(&answers[0].0).limits()[0].label(), "allowed");
    assert_eq!(decision(&answers[4].0).limits()[0].label(), "queued");
    let snapshot = recorder.snapshot();
    assert_eq!(snapshot.decisions("exports", "allowed"), 1);
    assert_eq!(snapshot.decisions("exports", "queued"), 4);
    assert_eq!(snapshot.decisions("exports", "denied"), 0);
    assert_eq!(
        snapshot.histograms[&(
            "tollgate_delay_seconds".to_owned(),
            vec![("limit".to_owned(), "exports".to_owned())]
        )],
        4
    );
    drop(svc);
    // Nothing is left in line, and the key's slot is free.
    let mut svc = support::recording(&layer, start, Started::default(), HOLD);
    let (last, _) = all(send(&mut svc, 5..6, "t", start).await).await.remove(0);
    assert_eq!(decision(&last).limits()[0].label(), "allowed");
    // Checks: the first request's, the second's (refused: it takes the front of the line),
    // and then per waiter, at the front for 100 ms: four polls (at 5, 15, 35 and 75 ms, each
    // ±20%, the fifth past 100 ms) and the check after the slot came back; and the last
    // request's. The others waited behind without a check.
    assert_eq!(backend.checks(), 1 + 1 + 4 * (4 + 1) + 1);
}

#[tokio::test(start_paused = true)]
async fn at_most_max_waiting_requests_wait_and_the_others_are_refused_at_once() {
    let layer = RateLimitLayer::builder()
        .limit(
            queued("exports", 1, Duration::from_secs(10), 2),
            Tenant::header("x-tenant"),
        )
        .backend(Counting::new())
        .build()
        .unwrap();
    let start = Instant::now();
    let started = Started::default();
    let mut svc = support::recording(&layer, start, Arc::clone(&started), HOLD);
    let answers = all(send(&mut svc, 0..5, "a", start).await).await;
    let status = statuses(&answers);
    // One served, two waited, two refused at once (Retry-After: the limit's 1 s).
    assert_eq!(
        status,
        [
            (200, ms(100)),
            (200, ms(200)),
            (200, ms(300)),
            (429, ms(0)),
            (429, ms(0))
        ]
    );
    assert_eq!(answers[3].0.headers["retry-after"], "1");
    let refused = decision(&answers[3].0);
    assert_eq!(refused.limits()[0].label(), "denied");
    assert_eq!(refused.queued(), None);
    assert_eq!(
        *started.lock().unwrap(),
        [(0, ms(0)), (1, ms(100)), (2, ms(200))]
    );
    // Another key has a line of its own.
    let others = all(send(&mut svc, 5..8, "b", start).await).await;
    assert!(others.iter().all(|(p, _)| p.status == 200));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_leaves_the_line_and_the_next_gets_the_slot() {
    let layer = RateLimitLayer::builder()
        .limit(queued("exports", 1, Duration::from_secs(10), 10), Global)
        .backend(Counting::new())
        .build()
        .unwrap();
    let start = Instant::now();
    let started = Started::default();
    let mut svc = support::recording(&layer, start, Arc::clone(&started), HOLD);
    let first = answer(svc.ready().await.unwrap().call(req(0, "t")), start);
    // The second waits at the front, the third behind it; the second's client goes away.
    let second = svc.ready().await.unwrap().call(req(1, "t"));
    let third = answer(svc.ready().await.unwrap().call(req(2, "t")), start);
    let second = tokio::spawn(second);
    tokio::time::sleep(ms(50)).await;
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    let (first, third) = (first.await.unwrap(), third.await.unwrap());
    assert_eq!(
        (first.0.status.as_u16(), third.0.status.as_u16()),
        (200, 200)
    );
    assert_eq!(*started.lock().unwrap(), [(0, ms(0)), (2, ms(100))]);
    assert_eq!(decision(&third.0).queued(), Some(ms(100)));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_past_its_wait_is_refused() {
    // Waits up to 250 ms: the second and third are served at 100 and 200 ms, the fourth
    // and fifth are still waiting at 250 ms, and refused then.
    let layer = RateLimitLayer::builder()
        .limit(queued("exports", 1, ms(250), 10), Global)
        .backend(Counting::new())
        .build()
        .unwrap();
    let start = Instant::now();
    let started = Started::default();
    let mut svc = support::recording(&layer, start, Arc::clone(&started), HOLD);
    let answers = all(send(&mut svc, 0..5, "t", start).await).await;
    let status = statuses(&answers);
    assert_eq!(
        status,
        [
            (200, ms(100)),
            (200, ms(200)),
            (200, ms(300)),
            (429, ms(250)),
            (429, ms(250))
        ]
    );
    assert_eq!(answers[4].0.headers["retry-after"], "1");
    let refused = decision(&answers[4].0);
    assert_eq!(refused.limits()[0].label(), "denied");
    assert_eq!(refused.queued(), Some(ms(250)));
    assert_eq!(started.lock().unwrap().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_holds_no_rate_units_and_is_checked_whole_at_its_turn() {
    // A rate limit of 3 a minute per tenant, and one slot per tenant, queued.
    let layer = RateLimitLayer::builder()
        .limits(
            Limits::new()
                .limit(
                    Limit::fixed_window("per-minute", Quota::per_minute(3).unwrap()).unwrap(),
                    Tenant::header("x-tenant"),
                )
                .limit(
                    queued("one-at-a-time", 1, Duration::from_secs(10), 10),
                    Tenant::header("x-tenant"),
                ),
        )
        .backend(Counting::new())
        .build()
        .unwrap();
    let start = Instant::now();
    let started = Started::default();
    let mut svc = support::recording(&layer, start, Arc::clone(&started), HOLD);
    let tasks = send(&mut svc, 0..5, "a", start).await;
    // While four wait, only the one served has taken a unit of the rate limit.
    tokio::time::sleep(ms(50)).await;
    let state = layer.peek("per-minute", "a").await.unwrap();
    assert_eq!(state.remaining, 2);
    let answers = all(tasks).await;
    let status = statuses(&answers);
    // Three served one after another. The fourth comes to the front when the third is
    // served (200 ms), and its first poll (5 ms later, ±20%) finds the minute's units spent:
    // refused there and then, by the rate limit, not kept waiting for the slot; so is the
    // fifth at its first poll after that.
    assert_eq!(
        status[..3],
        [(200, ms(100)), (200, ms(200)), (200, ms(300))]
    );
    let (fourth, fifth) = (status[3], status[4]);
    assert!(
        fourth.0 == 429 && fourth.1 >= ms(204) && fourth.1 <= ms(206),
        "{fourth:?}"
    );
    assert!(
        fifth.0 == 429 && fifth.1 >= fourth.1 + ms(4) && fifth.1 <= fourth.1 + ms(6),
        "{fifth:?}"
    );
    let refused = decision(&answers[3].0);
    assert_eq!(refused.get("per-minute").unwrap().label(), "denied");
    assert_eq!(
        refused.retry_after().map(|t| t > Duration::from_secs(1)),
        Some(true)
    );
    // Three units spent by the three served, however often the waiters were checked.
    assert_eq!(layer.peek("per-minute", "a").await.unwrap().remaining, 0);
}
