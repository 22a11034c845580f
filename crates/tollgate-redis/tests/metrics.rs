//! The backend's metrics: call durations, the health gauge and deny-cache hits, labelled by
//! backend and limit name, never by key.

#![allow(clippy::unwrap_used)]

mod support;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use support::{admitted, gcra};
use tollgate_engine::{Backend, Check};
use tollgate_testsupport::RedisServer;

/// A series: its name, its sorted labels and its value.
type Series = (String, Vec<(String, String)>, DebugValue);

/// Every series recorded since the last snapshot.
fn snapshot(snapshotter: &metrics_util::debugging::Snapshotter) -> Vec<Series> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            (key.name().to_owned(), labels, value)
        })
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

// The recorder is local to this thread; the current-thread runtime polls everything here.
#[tokio::test]
async fn calls_health_and_deny_cache_hits_are_recorded_without_keys() {
    let recorder: &'static DebuggingRecorder = Box::leak(Box::new(DebuggingRecorder::new()));
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(recorder);

    let mut server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let login = gcra("login", 2);
    for _ in 0..10 {
        admitted(&backend, &[&login], b"alice@example.com").await;
    }
    let series = snapshot(&snapshotter);
    let find = |name: &str| {
        series
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("no {name} in {series:?}"))
    };
    let (_, l, v) = find("tollgate_deny_cache_hits_total");
    assert_eq!(l, &labels(&[("limit", "login")]));
    // 2 admitted by Redis, the second foretelling the denial: 8 refused by the cache.
    assert_eq!(v, &DebugValue::Counter(8));
    let (_, l, v) = find("tollgate_backend_duration_seconds");
    assert_eq!(l, &labels(&[("backend", "redis")]));
    match v {
        DebugValue::Histogram(samples) => assert_eq!(samples.len(), 2),
        other => panic!("{other:?}"),
    }
    let (_, l, v) = find("tollgate_backend_up");
    assert_eq!(l, &labels(&[("backend", "redis")]));
    assert!(matches!(v, DebugValue::Gauge(g) if g.into_inner() == 1.0));
    for (_, labels, _) in &series {
        for (_, value) in labels {
            assert!(!value.contains("alice"), "a key in a label: {value}");
        }
    }

    server.stop();
    assert!(backend
        .check(&[Check::new(&gcra("other", 2), b"bob")])
        .await
        .is_err());
    let series = snapshot(&snapshotter);
    let up = series
        .iter()
        .find(|(n, _, _)| n == "tollgate_backend_up")
        .unwrap();
    assert!(matches!(up.2, DebugValue::Gauge(g) if g.into_inner() == 0.0));
}

/// A settle that Redis never applies is counted, by limit and reason, never by key.
#[tokio::test]
async fn settles_that_are_not_applied_are_counted() {
    let recorder: &'static DebuggingRecorder = Box::leak(Box::new(DebuggingRecorder::new()));
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(recorder);

    let mut server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let tokens = gcra("tokens", 100);
    let check = Check::new(&tokens, b"shop").with_cost(10);
    let verdicts = backend.check(&[check]).await.unwrap();
    server.stop();
    let refund = tollgate_engine::Settlement::of(&check, verdicts.receipt(0), 0);
    assert!(backend.settle_at(&[refund], None).await.is_err());
    let series = snapshot(&snapshotter);
    let dropped: Vec<_> = series
        .iter()
        .filter(|(n, _, _)| n == "tollgate_settles_dropped_total")
        .collect();
    assert_eq!(dropped.len(), 1, "{series:?}");
    let (_, l, v) = dropped[0];
    assert_eq!(l, &labels(&[("limit", "tokens"), ("reason", "failed")]));
    assert_eq!(v, &DebugValue::Counter(1));
}
