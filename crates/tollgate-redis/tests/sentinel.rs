//! Redis Sentinel: the backend finds the master through the sentinels, and finds the new one
//! after a failover. Real processes: a master, a replica and three sentinels on loopback.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::*;
use tollgate_engine::{Backend, BackendErrorKind, Check};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{server_info, RedisServer, Sentinel, SENTINEL_MASTER};

/// How long a failover may take before a test gives up: generous, as a loaded machine is slow.
/// The time it really takes is measured by `benches/examples/failover.rs`.
const FAILOVER_BOUND: Duration = Duration::from_secs(60);

fn connections_received(server: &RedisServer) -> u64 {
    server_info(server, "stats", "total_connections_received")
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_server_answering_readonly_is_left_and_the_next_call_connects_again() {
    let master = RedisServer::start();
    let replica = RedisServer::start_replica_of(&master);
    // A breaker that stays closed: when it opens, or when it is off, every failure replaces
    // the connection anyway.
    let backend = standalone(&replica.url())
        .breaker_threshold(100)
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let limit = gcra("readonly", 10);
    let before = connections_received(&replica);
    for _ in 0..3 {
        let err = backend
            .check(&[Check::new(&limit, b"k")])
            .await
            .unwrap_err();
        assert_eq!(err.kind(), BackendErrorKind::Unavailable, "{err}");
        assert!(err.to_string().contains("read only replica"), "{err}");
    }
    // Each of the 3 calls made its own connection (a demoted master's connection is not kept),
    // and reading the figure made one more.
    assert_eq!(connections_received(&replica) - before, 3 + 1);
}

#[tokio::test]
async fn the_master_is_found_through_the_sentinels() {
    let setup = Sentinel::start();
    let backend = RedisBackend::builder()
        .sentinel(SENTINEL_MASTER, setup.sentinel_urls())
        .deadline(DEADLINE)
        .build()
        .unwrap();
    let limit = gcra("sentinel-found", 2);
    let mut admitted = Vec::new();
    for _ in 0..3 {
        admitted.push(check(&backend, &[&limit], b"shop").await[0].is_allowed());
    }
    assert_eq!(admitted, [true, true, false], "two per minute");
    assert_eq!(setup.master().dbsize(), 1);
}

#[test]
fn sentinel_needs_sentinels_and_a_master_name() {
    let none = RedisBackend::builder()
        .sentinel("m", Vec::<String>::new())
        .build()
        .unwrap_err();
    assert_eq!(none, tollgate_redis::BuildError::NoSentinels);
    assert!(none.is_server());
    let unnamed = RedisBackend::builder()
        .sentinel("", ["redis://127.0.0.1:26379/"])
        .build()
        .unwrap_err();
    assert_eq!(unnamed, tollgate_redis::BuildError::NoMasterName);
    let bad = RedisBackend::builder()
        .sentinel("m", ["nonsense://x"])
        .build()
        .unwrap_err();
    assert!(matches!(bad, tollgate_redis::BuildError::InvalidUrl { .. }));
}

/// Checks `key` until Redis answers; returns how many checks failed before it did.
async fn until_answered(backend: &RedisBackend, limit: &tollgate_engine::Limit, key: &[u8]) -> u64 {
    let started = tokio::time::Instant::now();
    let mut failed = 0;
    loop {
        match backend.check(&[Check::new(limit, key)]).await {
            Ok(_) => return failed,
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        BackendErrorKind::Unavailable
                            | BackendErrorKind::Timeout
                            | BackendErrorKind::CircuitOpen
                    ),
                    "{e}"
                );
                failed += 1;
            }
        }
        assert!(
            started.elapsed() < FAILOVER_BOUND,
            "limiting did not resume within {FAILOVER_BOUND:?}"
        );
        // Polls, as requests would keep coming.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn limiting_resumes_on_the_promoted_replica_when_the_master_dies() {
    let mut setup = Sentinel::start();
    let backend = RedisBackend::builder()
        .sentinel(SENTINEL_MASTER, setup.sentinel_urls())
        .deadline(Duration::from_millis(250))
        .build()
        .unwrap();
    let flow = gcra("sentinel-flow", 600);
    assert_eq!(until_answered(&backend, &flow, b"flow").await, 0);
    assert_eq!(setup.master().dbsize(), 1);

    setup.master_mut().stop();
    let failed = until_answered(&backend, &flow, b"flow").await;
    // The sentinels wait a second before they call the master down: checks failed meanwhile.
    assert!(failed >= 1, "no check failed while the master was down");
    assert_eq!(setup.master_port(), setup.replica().port());

    // The promoted replica limits: exactly its quota, then a denial.
    let after = gcra("sentinel-after", 3);
    let mut admitted = Vec::new();
    for _ in 0..4 {
        admitted.push(check(&backend, &[&after], b"shop").await[0].is_allowed());
    }
    assert_eq!(admitted, [true, true, true, false]);
    assert_eq!(
        server_info(setup.replica(), "replication", "role").as_deref(),
        Some("master")
    );
}

#[tokio::test]
async fn a_forced_failover_moves_the_backend_to_the_new_master() {
    let setup = Sentinel::start();
    let backend = RedisBackend::builder()
        .sentinel(SENTINEL_MASTER, setup.sentinel_urls())
        .deadline(Duration::from_millis(250))
        .build()
        .unwrap();
    let limit = gcra("sentinel-forced", 600);
    assert_eq!(until_answered(&backend, &limit, b"before").await, 0);

    // The old master stays up and is demoted to a replica of the new one.
    let mut con = redis::Client::open(setup.sentinel_urls()[0].as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(SENTINEL_MASTER)
        .query(&mut con)
        .unwrap();
    let started = tokio::time::Instant::now();
    while server_info(setup.master(), "replication", "role").as_deref() != Some("slave")
        || setup.master_port() != setup.replica().port()
    {
        assert!(started.elapsed() < FAILOVER_BOUND, "no failover");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    until_answered(&backend, &limit, b"after").await;
    // The key written after the failover is on the new master: the backend writes there.
    let key = backend.key_for(&limit, b"after");
    let on_new: bool = redis::cmd("EXISTS")
        .arg(&key)
        .query(&mut setup.replica().client())
        .unwrap();
    assert!(on_new);
}
