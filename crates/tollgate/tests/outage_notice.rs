//! A layer whose Redis is down, in a program that installed no tracing subscriber and no
//! metrics exporter, still tells a person: one line on standard error at its first bypass,
//! one when the circuit breaker opens, and no more within a minute.
//!
//! Each case runs this test program again as a child process (a closed loopback port for
//! Redis), and reads the child's standard error as a person would.

#![allow(clippy::unwrap_used, missing_docs)]

use std::convert::Infallible;
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use tollgate::key::Global;
use tollgate::{Decision, Limit, Quota, RateLimitLayer};
use tollgate_redis::RedisBackend;
use tower::{service_fn, Layer, ServiceExt};

/// Set in the child: how many requests it sends, and whether it listens to tracing.
const CHILD: &str = "TOLLGATE_OUTAGE_NOTICE_CHILD";

fn main() {
    match std::env::var(CHILD) {
        Ok(how) => child(&how),
        Err(_) => {
            the_first_bypass_writes_one_line();
            the_breaker_opening_writes_one_more_line_and_later_bypasses_none();
            a_program_that_listens_to_tracing_gets_nothing_on_stderr();
            // In the words of the test harness, so that a run's summary counts these too.
            println!("test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
        }
    }
}

/// The child's standard output (one outcome per request) and standard error, in lines.
fn run(how: &str) -> (Vec<String>, Vec<String>) {
    let out = Command::new(std::env::current_exe().unwrap())
        .env(CHILD, how)
        .output()
        .unwrap();
    assert!(out.status.success(), "child {how}: {out:?}");
    let lines = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    (lines(&out.stdout), lines(&out.stderr))
}

fn the_first_bypass_writes_one_line() {
    let (outcomes, err) = run("1");
    assert_eq!(outcomes, ["bypassed error"]);
    assert_eq!(err.len(), 1, "{err:#?}");
    assert!(
        err[0].starts_with(
            "tollgate: WARNING rate limit \"api\" bypassed (error): the backend failed and the \
             limit fails open; 1 bypassed since the last such line."
        ),
        "{}",
        err[0]
    );
    assert!(err[0].contains("every 60s"), "{}", err[0]);
}

fn the_breaker_opening_writes_one_more_line_and_later_bypasses_none() {
    // The breaker opens at the third failure; the fourth and fifth requests fail fast.
    let (outcomes, err) = run("5");
    assert_eq!(
        outcomes,
        [
            "bypassed error",
            "bypassed error",
            "bypassed error",
            "bypassed circuit_open",
            "bypassed circuit_open"
        ]
    );
    assert_eq!(err.len(), 2, "{err:#?}");
    assert!(err[0].starts_with("tollgate: WARNING rate limit \"api\" bypassed (error)"));
    assert!(
        err[1].starts_with(
            "tollgate-redis: WARNING circuit breaker opened: Redis failed 3 times in a row; \
             calls fail at once for 60000ms"
        ),
        "{}",
        err[1]
    );
}

fn a_program_that_listens_to_tracing_gets_nothing_on_stderr() {
    let (outcomes, err) = run("5 subscribed");
    assert_eq!(outcomes.len(), 5);
    assert_eq!(err, Vec::<String>::new());
}

/// Sends `how`'s number of requests through a fail-open limit on a Redis that is down.
fn child(how: &str) {
    let mut words = how.split(' ');
    let n: usize = words.next().unwrap().parse().unwrap();
    if words.next() == Some("subscribed") {
        tracing::dispatcher::set_global_default(tracing::Dispatch::new(Listening)).unwrap();
    }
    // A loopback port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let redis = RedisBackend::builder()
            .url(format!("redis://127.0.0.1:{port}/"))
            .breaker_open_for(Duration::from_secs(60))
            .breaker_max_open_for(Duration::from_secs(60))
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder()
            .limit(
                Limit::gcra("api", Quota::per_minute(60).unwrap())
                    .unwrap()
                    .fail_open(),
                Global,
            )
            .backend(redis)
            .build()
            .unwrap();
        let ok = service_fn(|_req: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::empty()))
        });
        let svc = layer.layer(ok);
        for _ in 0..n {
            let resp = svc
                .clone()
                .oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap();
            let decision = resp.extensions().get::<Decision>().unwrap();
            match decision.get("api").unwrap().outcome() {
                tollgate::Outcome::Bypassed { reason } => {
                    println!("bypassed {}", reason.as_str())
                }
                other => println!("{other:?}"),
            }
        }
    });
}

/// A subscriber that takes every event and does nothing with it.
struct Listening;

impl tracing::Subscriber for Listening {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
