//! The adaptive concurrency limit's classes, fairness, queue and refusals, against a simulated
//! service that holds requests until the test lets them go. Limits are fixed (`min` = `max`)
//! where a figure depends on them.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::task::JoinHandle;
use tollgate::key::{key_fn, Global, RequestView};
use tollgate::{
    Adaptive, Decision, Limit, Priority, Quota, RateLimitLayer, RejectionKind, ShedReason,
};
use tower::{Layer, ServiceExt};

use support::sim::{Sim, SimService};
use support::Recorder;

const MS: Duration = Duration::from_millis(1);

type Svc = tollgate::RateLimit<SimService>;

/// A limit fixed at `limit` (measured at its floor, which is the same).
fn fixed(limit: u32) -> Adaptive {
    Adaptive::gradient()
        .name("api")
        .min(limit)
        .initial(limit)
        .max(limit)
}

fn by_user() -> impl tollgate::key::KeyExtractor {
    key_fn(|req: &RequestView<'_>| req.headers().get("x-user").map(|v| v.as_bytes().to_vec()))
}

fn layer(adaptive: Adaptive) -> RateLimitLayer {
    RateLimitLayer::builder()
        .limit(
            Limit::gcra("all", Quota::per_second(100_000).unwrap()).unwrap(),
            Global,
        )
        .adaptive(adaptive, by_user())
        .build()
        .unwrap()
}

fn request(priority: Priority, user: &str) -> Request<Full<Bytes>> {
    let mut req = Request::get("/")
        .header("x-user", user)
        .body(Full::new(Bytes::new()))
        .unwrap();
    req.extensions_mut().insert(priority);
    req
}

/// Sends `req` on a task of its own: its status, and its decision.
fn send(svc: &Svc, req: Request<Full<Bytes>>) -> JoinHandle<(StatusCode, Option<Decision>)> {
    let svc = svc.clone();
    tokio::spawn(async move {
        let response = svc.oneshot(req).await.unwrap();
        let decision = response.extensions().get::<Decision>().cloned();
        let status = response.status();
        // Read whole: the permit goes back at the body's end.
        response.into_body().collect().await.unwrap();
        (status, decision)
    })
}

/// Sends `n` requests and lets them reach the handler (or be answered): those answered.
async fn flood(
    svc: &Svc,
    n: usize,
    priority: Priority,
    user: &str,
) -> Vec<JoinHandle<(StatusCode, Option<Decision>)>> {
    let tasks: Vec<_> = (0..n).map(|_| send(svc, request(priority, user))).collect();
    tokio::time::sleep(MS).await;
    tasks
}

/// How many of `tasks` were answered with `status` (the others still wait).
async fn answered(
    tasks: &mut Vec<JoinHandle<(StatusCode, Option<Decision>)>>,
    status: StatusCode,
) -> usize {
    let mut count = 0;
    let mut waiting = Vec::new();
    for task in tasks.drain(..) {
        if task.is_finished() {
            if task.await.unwrap().0 == status {
                count += 1;
            }
        } else {
            waiting.push(task);
        }
    }
    *tasks = waiting;
    count
}

/// Many concurrent requests of every class against a learning limit: whenever a request
/// enters the handler, the requests there (itself included) are within the limit in force.
#[tokio::test(start_paused = true)]
async fn classes_never_exceed_the_whole() {
    let layer = layer(Adaptive::gradient().min(2).initial(12).max(100));
    let adaptive = layer.adaptive().unwrap();
    let sim = Sim::new(6, 30 * MS);
    let over = Arc::new(Mutex::new(Vec::new()));
    let entries = Arc::new(AtomicU32::new(0));
    let svc = layer.layer(sim.service_with({
        let (adaptive, over, entries) = (adaptive.clone(), Arc::clone(&over), Arc::clone(&entries));
        move |_, running| {
            entries.fetch_add(1, Ordering::SeqCst);
            let limit = adaptive.limit();
            if running > limit {
                over.lock().unwrap().push((running, limit));
            }
        }
    }));
    let classes = [
        Priority::Batch,
        Priority::level(30),
        Priority::Default,
        Priority::level(70),
        Priority::Critical,
    ];
    let mut tasks = Vec::new();
    for round in 0..400 {
        for (i, &class) in classes.iter().enumerate() {
            let user = format!("u{}", (round + i) % 7);
            tasks.push(send(&svc, request(class, &user)));
        }
        tokio::time::sleep(2 * MS).await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*over.lock().unwrap(), []);
    // 6 workers of 30 ms for about 800 ms, after a measurement at the floor.
    assert!(entries.load(Ordering::SeqCst) > 100, "{entries:?}");
    assert_eq!(adaptive.in_flight(), 0);
    assert_eq!(sim.running(), 0);
}

/// With a queue and a fixed limit of 8: 200 requests at once; exactly 8 at a time in the
/// handler, and the queue's waiters served as permits come back.
#[tokio::test(start_paused = true)]
async fn a_queue_never_exceeds_the_limit_either() {
    let layer = layer(fixed(8).queue(100, Duration::from_secs(10)));
    let adaptive = layer.adaptive().unwrap();
    let sim = Sim::new(100, 10 * MS);
    let svc = layer.layer(sim.service());
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let class = if i % 2 == 0 {
                Priority::Critical
            } else {
                Priority::Default
            };
            send(&svc, request(class, &format!("u{}", i % 50)))
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.unwrap().0);
    }
    assert_eq!(sim.max_running(), 8);
    // The queue holds up to 8 (100% of the limit): the rest of the burst is shed.
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let shed = statuses
        .iter()
        .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    assert_eq!((ok, shed), (16, 184));
    assert_eq!((adaptive.in_flight(), adaptive.queue_depth()), (0, 0));
}

/// A limit of 10 keeps 2 (20%) for critical requests: a batch flood gets half of the other 8
/// (4), the default class the rest of the 8, and critical requests the last 2.
#[tokio::test(start_paused = true)]
async fn critical_keeps_its_reserve_under_a_batch_flood() {
    let layer = layer(fixed(10));
    let sim = Sim::new(0, MS);
    let svc = layer.layer(sim.service());
    let mut batch = flood(&svc, 50, Priority::Batch, "b").await;
    assert_eq!(
        answered(&mut batch, StatusCode::SERVICE_UNAVAILABLE).await,
        46
    );
    assert_eq!(sim.running(), 4);
    let mut default = flood(&svc, 50, Priority::Default, "d").await;
    assert_eq!(
        answered(&mut default, StatusCode::SERVICE_UNAVAILABLE).await,
        46
    );
    assert_eq!(sim.running(), 8);
    let mut critical = flood(&svc, 3, Priority::Critical, "c").await;
    assert_eq!(
        answered(&mut critical, StatusCode::SERVICE_UNAVAILABLE).await,
        1
    );
    assert_eq!(sim.running(), 10);
    sim.open(10);
    tokio::time::sleep(10 * MS).await;
    let ok = answered(&mut batch, StatusCode::OK).await
        + answered(&mut default, StatusCode::OK).await
        + answered(&mut critical, StatusCode::OK).await;
    assert_eq!(ok, 10);
}

/// In a contended class, the key holding more than its fair part is shed; a light key is not.
#[tokio::test(start_paused = true)]
async fn a_heavy_key_is_shed_before_a_light_one() {
    let layer = layer(fixed(10));
    let sim = Sim::new(0, MS);
    let svc = layer.layer(sim.service());
    // The default class's share is 8; 6 of the heavy key, 1 of the light one.
    let _heavy = flood(&svc, 6, Priority::Default, "heavy").await;
    let _light = flood(&svc, 1, Priority::Default, "light").await;
    assert_eq!(sim.running(), 7);
    // Contended (7 of 8): two keys, a fair part of 4 each.
    let (status, decision) = send(&svc, request(Priority::Default, "heavy"))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let part = *decision.unwrap().adaptive().unwrap();
    assert_eq!(part.shed_reason(), Some(ShedReason::KeyShare));
    let light = send(&svc, request(Priority::Default, "light"));
    tokio::time::sleep(MS).await;
    assert!(!light.is_finished());
    assert_eq!(sim.running(), 8);
}

/// A shed request: 503, `Retry-After`, problem+json naming the limit; its decision says shed
/// and its class; metrics count it. gRPC: `UNAVAILABLE` (14).
#[tokio::test(start_paused = true)]
async fn a_shed_is_503_with_retry_after() {
    let recorder = Recorder::install();
    let refused_kind = Arc::new(Mutex::new(None));
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("all", Quota::per_second(100_000).unwrap()).unwrap(),
            Global,
        )
        .adaptive(fixed(1).retry_after(Duration::from_millis(2_500)), Global)
        .build()
        .unwrap();
    let sim = Sim::new(0, MS);
    let svc = layer.layer(sim.service());
    let _held = flood(&svc, 1, Priority::Default, "a").await;
    let response = svc
        .clone()
        .oneshot(request(Priority::Batch, "a"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "3");
    assert!(!response.headers().contains_key("ratelimit"));
    let decision = response.extensions().get::<Decision>().unwrap().clone();
    assert!(decision.is_shed() && !decision.is_admitted());
    let part = decision.adaptive().unwrap();
    assert_eq!(
        (part.priority(), part.shed_reason()),
        (Priority::Batch, Some(ShedReason::Limit))
    );
    // The rate limit was not asked.
    assert_eq!(decision.get("all").unwrap().label(), "skipped");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        std::str::from_utf8(&body).unwrap(),
        r#"{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"The server is overloaded (\"api\"); retry in 3 s."}"#
    );
    let mut grpc = request(Priority::Default, "a");
    grpc.headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    let response = svc.clone().oneshot(grpc).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["grpc-status"], "14");
    assert_eq!(response.headers()["retry-after"], "3");
    let seen = recorder.snapshot();
    let shed = |priority| {
        seen.counter(
            "tollgate_adaptive_shed_total",
            &[
                ("limit", "api"),
                ("priority", priority),
                ("reason", "limit"),
            ],
        )
    };
    assert_eq!(
        (shed("batch"), shed("default"), shed("critical")),
        (Some(1), Some(1), Some(0))
    );
    assert_eq!(
        seen.gauge("tollgate_adaptive_in_flight", &[("limit", "api")]),
        Some(1.0)
    );
    assert_eq!(
        seen.gauge("tollgate_adaptive_limit", &[("limit", "api")]),
        Some(1.0)
    );
    assert_eq!(seen.decisions("all", "skipped"), 2);
    // A custom responder sees the kind.
    let seen_kind = Arc::clone(&refused_kind);
    let custom = RateLimitLayer::builder()
        .limit(
            Limit::gcra("all", Quota::per_second(100_000).unwrap()).unwrap(),
            Global,
        )
        .adaptive(fixed(1), Global)
        .on_rejection(move |r| {
            *seen_kind.lock().unwrap() = Some((r.kind(), r.status()));
            http::Response::new(Bytes::from_static(b"busy"))
        })
        .build()
        .unwrap()
        .layer(sim.service());
    let _held = send(&custom, request(Priority::Default, "a"));
    tokio::time::sleep(MS).await;
    let _ = custom
        .clone()
        .oneshot(request(Priority::Default, "a"))
        .await
        .unwrap();
    assert_eq!(
        *refused_kind.lock().unwrap(),
        Some((RejectionKind::Shed, StatusCode::SERVICE_UNAVAILABLE))
    );
}

/// Monitor-only: the same requests are all admitted, and the decision and metrics say which
/// would have been shed.
#[tokio::test(start_paused = true)]
async fn monitor_only_sheds_nothing_but_reports() {
    let recorder = Recorder::install();
    let layer = layer(fixed(10).monitor_only(true));
    let adaptive = layer.adaptive().unwrap();
    let sim = Sim::new(0, MS);
    let svc = layer.layer(sim.service());
    let mut batch = flood(&svc, 50, Priority::Batch, "b").await;
    assert_eq!(
        answered(&mut batch, StatusCode::SERVICE_UNAVAILABLE).await,
        0
    );
    assert_eq!((sim.running(), adaptive.in_flight()), (50, 50));
    let seen = recorder.snapshot();
    assert_eq!(
        seen.counter(
            "tollgate_adaptive_shadow_shed_total",
            &[("limit", "api"), ("priority", "batch"), ("reason", "limit")],
        ),
        Some(46)
    );
    assert_eq!(seen.total("tollgate_adaptive_shed_total"), 0);
    sim.open(50);
    let mut would = 0;
    for task in batch {
        let (status, decision) = task.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        let decision = decision.unwrap();
        assert!(decision.is_admitted() && !decision.is_shed());
        let part = decision.adaptive().unwrap();
        assert!(part.is_monitor_only());
        would += usize::from(part.shed_reason() == Some(ShedReason::Limit));
    }
    assert_eq!(would, 46);
}

/// Stacked with a rate limit: a shed request never reaches the backend (no unit taken), and
/// one the rate limit refuses gives its permit back at once.
#[tokio::test(start_paused = true)]
async fn a_shed_request_consumes_no_rate_limit_units() {
    let layer = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-user", Quota::per_minute(100).unwrap()).unwrap(),
            by_user(),
        )
        .adaptive(fixed(2), Global)
        .build()
        .unwrap();
    let adaptive = layer.adaptive().unwrap();
    let sim = Sim::new(0, MS);
    let svc = layer.layer(sim.service());
    let _held = flood(&svc, 2, Priority::Critical, "alice").await;
    let mut shed = flood(&svc, 30, Priority::Critical, "alice").await;
    assert_eq!(
        answered(&mut shed, StatusCode::SERVICE_UNAVAILABLE).await,
        30
    );
    assert_eq!(layer.peek("per-user", "alice").await.unwrap().remaining, 98);
    // Refused by the rate limit: the permit comes back with the answer.
    let exhausted = RateLimitLayer::builder()
        .limit(
            Limit::gcra("per-user", Quota::per_hour(1).unwrap()).unwrap(),
            by_user(),
        )
        .adaptive(fixed(2), Global)
        .build()
        .unwrap();
    let adaptive2 = exhausted.adaptive().unwrap();
    let svc2 = exhausted.layer(Sim::new(100, MS).service());
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(
            svc2.clone()
                .oneshot(request(Priority::Default, "bob"))
                .await
                .unwrap()
                .status(),
        );
        assert_eq!(adaptive2.in_flight(), 0);
    }
    assert_eq!(
        answers,
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(adaptive.in_flight(), 2);
}

/// The queue serves the highest class first; a waiter whose wait is over is shed with its
/// reason; a waiter of a higher class takes the place of a lower one in a full queue.
#[tokio::test(start_paused = true)]
async fn the_queue_serves_the_highest_class_first() {
    let layer = layer(fixed(2).queue(100, Duration::from_millis(300)));
    let adaptive = layer.adaptive().unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let sim = Sim::new(0, 200 * MS);
    let svc = layer.layer(sim.service_with({
        let order = Arc::clone(&order);
        move |req, _| {
            let user = req.headers()["x-user"].to_str().unwrap().to_owned();
            order.lock().unwrap().push(user);
        }
    }));
    // The default class's share of 2 is 1: a critical request holds the other.
    let _held = flood(&svc, 1, Priority::Default, "first").await;
    let _held2 = flood(&svc, 1, Priority::Critical, "second").await;
    let batch = send(&svc, request(Priority::Batch, "batch"));
    tokio::time::sleep(MS).await;
    let critical = send(&svc, request(Priority::Critical, "critical"));
    tokio::time::sleep(MS).await;
    assert_eq!(adaptive.queue_depth(), 2);
    // Full (2): a default request takes the batch one's place.
    let default = send(&svc, request(Priority::Default, "default"));
    tokio::time::sleep(MS).await;
    let (status, decision) = batch.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let part = *decision.unwrap().adaptive().unwrap();
    assert_eq!(part.shed_reason(), Some(ShedReason::QueueFull));
    assert_eq!(part.queued(), Some(2 * MS));
    // One worker: the first request ends after 200 ms, and the critical waiter goes first.
    sim.open(1);
    tokio::time::sleep(210 * MS).await;
    assert_eq!(*order.lock().unwrap(), ["first", "second", "critical"]);
    let (status, decision) = critical.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(decision.unwrap().adaptive().unwrap().queued().is_some());
    // The default waiter's 300 ms run out while the others hold on (its share is 1, and
    // the critical one runs).
    let (status, decision) = default.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let part = *decision.unwrap().adaptive().unwrap();
    assert_eq!(
        (part.shed_reason(), part.queued()),
        (Some(ShedReason::QueueTimeout), Some(300 * MS))
    );
    assert_eq!(adaptive.queue_depth(), 0);
}

/// A layer may hold an adaptive limit alone: admitted requests carry a decision with no
/// limit (and no rate-limit fields), shed ones a 503.
#[tokio::test(start_paused = true)]
async fn an_adaptive_limit_alone() {
    let layer = RateLimitLayer::builder()
        .adaptive(fixed(1), Global)
        .build()
        .unwrap();
    let sim = Sim::new(0, MS);
    let svc = layer.layer(sim.service());
    let held = send(&svc, request(Priority::Default, "a"));
    tokio::time::sleep(MS).await;
    let (status, decision) = send(&svc, request(Priority::Critical, "a")).await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(decision.unwrap().limits().is_empty());
    sim.open(1);
    let (status, decision) = held.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let decision = decision.unwrap();
    assert_eq!(decision.adaptive().unwrap().priority(), Priority::Default);
    assert!(decision.limits().is_empty() && decision.is_admitted());
    let response = svc
        .clone()
        .oneshot(request(Priority::Default, "a"))
        .await
        .unwrap();
    assert!(!response.headers().contains_key("ratelimit"));
    assert!(!response.headers().contains_key("ratelimit-policy"));
}
