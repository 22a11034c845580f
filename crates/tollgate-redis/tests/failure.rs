//! Failure of Redis: down at start-up, stopped, frozen. Errors come within the deadline, the
//! circuit breaker then fails calls at once, and a probe closes it when Redis is back.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use futures_util::FutureExt;
use support::gcra;
use tollgate_engine::{Backend, BackendErrorKind, Check, Limit};
use tollgate_redis::{BuildError, CircuitState, RedisBackend};
use tollgate_testsupport::RedisServer;

#[tokio::test]
async fn builds_while_redis_is_down_and_answers_once_it_is_up() {
    let mut server = RedisServer::start();
    server.stop();
    let backend = support::standalone(&server.url())
        .breaker_threshold(0)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    let err = backend
        .check(&[Check::new(&limit, b"k")])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), BackendErrorKind::Unavailable, "{err}");
    assert!(backend.ping().await.is_err());
    server.start_again();
    let v = backend.check(&[Check::new(&limit, b"k")]).await.unwrap();
    assert_eq!(v[0].remaining, 9);
    assert!(backend.ping().await.is_ok());
}

#[test]
fn bad_configuration_is_refused_with_what_is_wrong() {
    let err = |b: tollgate_redis::RedisBackendBuilder| b.build().unwrap_err();
    assert_eq!(err(RedisBackend::builder()), BuildError::NoServer);
    assert!(matches!(
        err(RedisBackend::builder().url("not a url")),
        BuildError::InvalidUrl { .. }
    ));
    let url = "redis://127.0.0.1:1/";
    assert_eq!(
        err(RedisBackend::builder().url(url).prefix("a{b}")),
        BuildError::InvalidPrefix {
            prefix: "a{b}".into()
        }
    );
    assert_eq!(
        err(RedisBackend::builder().url(url).deadline(Duration::ZERO)),
        BuildError::ZeroDeadline
    );
    assert_eq!(
        err(RedisBackend::builder()
            .url(url)
            .connect_timeout(Duration::ZERO)),
        BuildError::ZeroConnectTimeout
    );
    assert_eq!(
        err(RedisBackend::builder().cluster(Vec::<String>::new())),
        BuildError::NoClusterSeeds
    );
    // A password in a URL never reaches the message.
    let secret = err(RedisBackend::builder().url("redis://:hunter2@127.0.0.1:bad/"));
    assert!(
        secret.is_server() && !secret.to_string().contains("hunter2"),
        "{secret}"
    );
    // Building outside a runtime, with nothing listening, is fine.
    assert!(RedisBackend::builder().url(url).build().is_ok());
}

#[tokio::test]
async fn an_outage_opens_the_breaker_and_a_probe_closes_it() {
    let mut server = RedisServer::start();
    let open_for = Duration::from_secs(30);
    let backend = support::standalone(&server.url())
        .breaker_threshold(3)
        .breaker_open_for(open_for)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    let check = || backend.check(&[Check::new(&limit, b"k")]);
    assert!(check().await.is_ok());

    server.stop();
    for _ in 0..3 {
        let err = check().await.unwrap_err();
        assert!(
            matches!(
                err.kind(),
                BackendErrorKind::Unavailable | BackendErrorKind::Timeout
            ),
            "{err}"
        );
    }
    assert_eq!(backend.circuit_state(), CircuitState::Open);
    // Open: answered at once, without I/O.
    let err = check().now_or_never().expect("no I/O").unwrap_err();
    assert_eq!(err.kind(), BackendErrorKind::CircuitOpen);

    server.start_again();
    let err = check().now_or_never().expect("no I/O").unwrap_err();
    assert!(
        err.is_circuit_open(),
        "still open until the interval has passed"
    );

    // Let the open interval pass on tokio's clock, not the wall clock.
    tokio::time::pause();
    tokio::time::advance(open_for).await;
    tokio::time::resume();
    assert_eq!(backend.circuit_state(), CircuitState::HalfOpen);
    let v = check().await.unwrap();
    assert_eq!(v[0].remaining, 9, "Redis lost its data in the restart");
    assert_eq!(backend.circuit_state(), CircuitState::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_costs_at_most_the_deadline() {
    let mut server = RedisServer::start();
    let deadline = Duration::from_millis(100);
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(deadline)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    let check = || backend.check(&[Check::new(&limit, b"k")]);
    // Connect and load the script while Redis answers.
    assert!(check().await.is_ok());

    server.pause();
    // A bound with a generous margin for a loaded machine, not a benchmark.
    let margin = Duration::from_millis(400);
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let err = check().await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.kind(), BackendErrorKind::Timeout, "{err}");
        assert!(took >= deadline && took < deadline + margin, "{took:?}");
    }
    // The breaker is open now: no more deadlines paid.
    let started = std::time::Instant::now();
    let err = check().await.unwrap_err();
    assert!(err.is_circuit_open());
    assert!(started.elapsed() < margin);
    let ping = backend.ping().await.unwrap_err();
    assert!(ping.is_timeout());

    server.resume();
    // The canary sees Redis back at once, whatever the breaker says.
    assert!(backend.ping().await.is_ok());
}

#[tokio::test]
async fn requests_queued_behind_a_frozen_call_get_their_answer_by_their_own_deadline() {
    let mut server = RedisServer::start();
    // Long against the margin: a request queued behind the frozen call that waited a whole
    // deadline of its own once that call gave up would take twice as long.
    let deadline = Duration::from_secs(1);
    let backend = RedisBackend::builder()
        .url(server.url())
        .deadline(deadline)
        .breaker_threshold(0) // off: every request goes to Redis
        .build()
        .unwrap();
    let limit = std::sync::Arc::new(gcra("l", 10));
    assert!(backend.check(&[Check::new(&limit, b"k")]).await.is_ok());

    server.pause();
    let spawn_check = || {
        let (backend, limit) = (backend.clone(), limit.clone());
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let result = backend.check(&[Check::new(&limit, b"k")]).await;
            (result.map(|_| ()), started.elapsed())
        })
    };
    // One request first, and (on this single-threaded runtime) time for its call to go out
    // alone; the others then queue behind that call.
    let mut tasks = vec![spawn_check()];
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    tasks.extend((0..31).map(|_| spawn_check()));
    let margin = Duration::from_millis(400);
    for (i, task) in tasks.into_iter().enumerate() {
        let (result, took) = task.await.unwrap();
        let err = result.unwrap_err();
        // A queued request whose deadline passed before the frozen call gave up (the timer
        // fires on the next millisecond) is not sent at all.
        let expected: &[BackendErrorKind] = if i == 0 {
            &[BackendErrorKind::Timeout]
        } else {
            &[BackendErrorKind::Timeout, BackendErrorKind::Overloaded]
        };
        assert!(expected.contains(&err.kind()), "{err}");
        assert!(took >= deadline && took < deadline + margin, "{took:?}");
    }
    server.resume();
}

#[tokio::test]
async fn a_connection_that_went_silent_is_dropped_with_the_call_that_timed_out_on_it() {
    let server = RedisServer::start();
    let relay = support::SilentRelay::start(server.port());
    let backend = RedisBackend::builder()
        .url(relay.url())
        .deadline(Duration::from_secs(1))
        .breaker_threshold(3)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    let check = || backend.check(&[Check::new(&limit, b"k")]);
    assert_eq!(check().await.unwrap()[0].remaining, 9);
    assert_eq!(relay.accepted(), 1);

    // The connection dies without an error: the call on it times out, and the connection is
    // not used again (its reply, were it to come, would be taken for the next call's).
    relay.silence_existing();
    assert!(check().await.unwrap_err().is_timeout());
    // The next call goes out on a new connection, which Redis answers (the call that timed
    // out never reached it).
    assert_eq!(check().await.unwrap()[0].remaining, 8);
    assert_eq!(relay.accepted(), 2);
    assert_eq!(backend.circuit_state(), CircuitState::Closed);
}

/// Polls `fut` once, so that it starts what it starts, and drops it.
fn poll_once<F: std::future::Future>(fut: F) {
    let mut fut = std::pin::pin!(fut);
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(fut.as_mut().poll(&mut cx).is_pending());
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn tasks_dropped_with_their_runtime_before_they_ran_leave_the_backend_working() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .breaker_threshold(0)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    // A connection attempt, then a sending task, each spawned on a runtime that shuts down
    // before they run.
    runtime().block_on(async { poll_once(backend.ping()) });
    runtime().block_on(async { poll_once(backend.check(&[Check::new(&limit, b"k")])) });
    // Another runtime: the backend connects and sends again, and the first check, never
    // sent, consumed nothing.
    runtime().block_on(async {
        let check = backend.check(&[Check::new(&limit, b"k")]);
        let answer = tokio::time::timeout(support::DEADLINE * 2, check).await;
        let v = answer
            .expect("no answer: the request was never sent")
            .unwrap();
        assert_eq!(v[0].remaining, 9);
    });
}

#[tokio::test]
async fn a_full_queue_of_waiting_checks_is_not_a_redis_failure() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .breaker_threshold(3)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    assert!(backend.check(&[Check::new(&limit, b"k")]).await.is_ok());

    // On this single-threaded runtime the task that sends merged calls does not run before
    // this loop yields, so every check waits in the queue until it is full (8,192); the three
    // beyond are refused at once, without asking Redis.
    let mut waiting = Vec::new();
    let mut refused = 0;
    for i in 0u32..8_192 + 3 {
        let mut check = backend.check(&[Check::new(&limit, &i.to_le_bytes())]);
        match (&mut check).now_or_never() {
            None => waiting.push(check),
            Some(Err(e)) => {
                assert_eq!(e.kind(), BackendErrorKind::Overloaded, "{e}");
                refused += 1;
            }
            Some(Ok(v)) => panic!("answered without Redis: {v:?}"),
        }
    }
    assert_eq!((waiting.len(), refused), (8_192, 3));
    // Redis did nothing wrong: the breaker stays closed and the backend up.
    assert_eq!(backend.circuit_state(), CircuitState::Closed);
    for check in waiting {
        assert!(check.await.is_ok());
    }
}

/// Starts a backend on `server` with a breaker that opens after `threshold` failures, and
/// makes its first call (connecting, loading the script) while Redis answers.
async fn warmed_up(server: &RedisServer, threshold: u32) -> (RedisBackend, std::sync::Arc<Limit>) {
    let backend = support::standalone(&server.url())
        .breaker_threshold(threshold)
        .build()
        .unwrap();
    let limit = std::sync::Arc::new(gcra("l", 10));
    assert!(backend.check(&[Check::new(&limit, b"k")]).await.is_ok());
    (backend, limit)
}

#[tokio::test]
async fn a_merged_call_that_fails_is_one_failure_however_many_requests_it_carried() {
    let mut server = RedisServer::start();
    let (backend, limit) = warmed_up(&server, 2).await;
    server.pause();
    // From now on tokio's clock moves only when nothing else can run: the call times out at
    // once, on that clock, and every check below was made at the same instant.
    tokio::time::pause();
    // Polled together, all five are queued before the sending task first runs: one call.
    let checks = (0..5).map(|_| backend.check(&[Check::new(&limit, b"k")]));
    let results = futures_util::future::join_all(checks).await;
    for result in results {
        assert_eq!(result.unwrap_err().kind(), BackendErrorKind::Timeout);
    }
    // One failed call of two that open the breaker.
    assert_eq!(backend.circuit_state(), CircuitState::Closed);
    server.resume();
    tokio::time::resume();
    // The connection was kept: the call that timed out reaches Redis first, and its five
    // requests take effect late (as the crate documents), then this one.
    assert_eq!(
        backend.check(&[Check::new(&limit, b"k")]).await.unwrap()[0].remaining,
        3
    );
}

#[tokio::test]
async fn checks_whose_deadline_passed_in_the_queue_are_overloaded_not_a_redis_failure() {
    let mut server = RedisServer::start();
    let (backend, limit) = warmed_up(&server, 2).await;
    server.pause();
    tokio::time::pause();
    let spawn_check = || {
        let (backend, limit) = (backend.clone(), limit.clone());
        tokio::spawn(async move { backend.check(&[Check::new(&limit, b"k")]).await })
    };
    // One check first, and (on this single-threaded runtime) time for its call to go out
    // alone; the others queue behind that call. Made at the same instant on the paused
    // clock, they all have the first one's deadline, so when its call times out the deadline
    // of every other has passed while it waited: they are not sent.
    let first = spawn_check();
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    let queued: Vec<_> = (0..5).map(|_| spawn_check()).collect();
    let err = first.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), BackendErrorKind::Timeout, "{err}");
    for task in queued {
        let err = task.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), BackendErrorKind::Overloaded, "{err}");
    }
    // Only the call that went out counts: one failure of two.
    assert_eq!(backend.circuit_state(), CircuitState::Closed);
    server.resume();
}

/// After a stall, a merged call carries one request whose deadline is 10 ms away and nine
/// fresh ones, and Redis answers 200 ms later (a client pause holds the call): the late
/// request fails alone, by its own deadline, the nine are answered, and the call counts no
/// breaker failure. Three such calls leave the breaker closed.
#[tokio::test]
async fn a_late_request_fails_alone_and_counts_no_breaker_failure() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .deadline(Duration::from_secs(1))
        .breaker_threshold(3)
        .build()
        .unwrap();
    let limit = Limit::gcra("api", tollgate_engine::Quota::per_hour(1000).unwrap()).unwrap();
    let admitted = |v: &Result<tollgate_engine::Verdicts, _>| {
        v.as_ref()
            .is_ok_and(|v: &tollgate_engine::Verdicts| v[0].is_allowed())
    };
    // Connected, its script loaded.
    assert!(admitted(
        &backend.check(&[Check::new(&limit, b"warm")]).await
    ));
    let keys: Vec<Vec<u8>> = (0..9).map(|i| format!("k{i}").into_bytes()).collect();
    for _ in 0..3 {
        let late = backend.check(&[Check::new(&limit, b"late")]);
        // The stall, on tokio's clock: the late request has 10 ms left.
        tokio::time::pause();
        tokio::time::advance(Duration::from_millis(990)).await;
        tokio::time::resume();
        let fresh: Vec<_> = keys
            .iter()
            .map(|k| backend.check(&[Check::new(&limit, k)]))
            .collect();
        let _: () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(200)
            .arg("ALL")
            .query(&mut server.client())
            .unwrap();
        let (late, fresh) = tokio::join!(late, futures_util::future::join_all(fresh));
        assert_eq!(late.unwrap_err().kind(), BackendErrorKind::Timeout);
        assert_eq!(fresh.iter().filter(|v| admitted(v)).count(), 9);
    }
    assert_eq!(backend.circuit_state(), CircuitState::Closed);
    assert!(admitted(
        &backend.check(&[Check::new(&limit, b"after")]).await
    ));
}

/// A server that answers as an HTTP server does, to every connection.
async fn not_redis() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n\
                          Content-Length: 11\r\nConnection: close\r\n\r\nBad Request",
                    )
                    .await;
            });
        }
    });
    url
}

#[tokio::test]
async fn a_server_that_is_not_redis_is_said_in_one_line() {
    let url = not_redis().await;
    let backend = RedisBackend::builder()
        .url(&url)
        .breaker_threshold(0)
        .build()
        .unwrap();
    let limit = gcra("l", 10);
    let check = backend
        .check(&[Check::new(&limit, b"k")])
        .await
        .unwrap_err();
    let ping = backend.ping().await.unwrap_err();
    for e in [check, ping] {
        let shown = e.to_string();
        assert_eq!(shown.lines().count(), 1, "{shown}");
        assert!(
            shown.contains(": the server does not answer as Redis does: is it a Redis server? ("),
            "{shown}"
        );
    }
}
