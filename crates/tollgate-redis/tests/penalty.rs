//! The penalty box and denies on a real Redis server and a real 3-master cluster: a block
//! starts at exactly the n-th refusal, holds on every replica, costs no call per blocked
//! request after the first on each replica, escalates, and a reset lifts it; a deny reaches
//! a second replica and an undeny lifts it.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use tollgate_engine::{Admin, Backend, Check, Limit, Penalty, Quota, Settlement, Status};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};

const NOW: u64 = 1_700_000_000_000_000;
const S: u64 = 1_000_000;

/// 5 a minute; 3 refusals within a minute block for 10 minutes.
fn login() -> Limit {
    Limit::gcra("login", Quota::per_minute(5).unwrap())
        .unwrap()
        .penalty(
            Penalty::after(3)
                .within(Duration::from_secs(60))
                .block_for(Duration::from_secs(600)),
        )
        .unwrap()
}

/// Lets the deny cache's TTL (1 s) pass on tokio's clock, not the wall clock (the cache's
/// clock); Redis' own time moves on as it does.
async fn past_the_cache_ttl() {
    tokio::time::pause();
    tokio::time::advance(Duration::from_millis(1_100)).await;
    tokio::time::resume();
}

async fn at(backend: &RedisBackend, limit: &Limit, key: &[u8], now: u64) -> Status {
    backend
        .check_at(&[Check::new(limit, key)], now)
        .await
        .unwrap()[0]
        .status
}

/// The block's figures at fixed times (`check_at`, which the deny cache does not learn from).
async fn blocks_at_the_third_refusal(backend: &RedisBackend) {
    let limit = login();
    for i in 0..5 {
        assert_eq!(at(backend, &limit, b"ip", NOW + i).await, Status::Allowed);
    }
    for i in 0..2 {
        assert!(matches!(
            at(backend, &limit, b"ip", NOW + 10 + i).await,
            Status::Denied { .. }
        ));
    }
    assert_eq!(
        at(backend, &limit, b"ip", NOW + 20).await,
        Status::Blocked {
            retry_after: 600 * S
        }
    );
    // Two minutes on, the quota is whole again, but the block stands.
    assert_eq!(
        at(backend, &limit, b"ip", NOW + 20 + 120 * S).await,
        Status::Blocked {
            retry_after: 480 * S
        }
    );
    assert_eq!(
        at(backend, &limit, b"ip", NOW + 20 + 600 * S).await,
        Status::Allowed
    );
}

#[tokio::test]
async fn a_server_blocks_at_exactly_the_nth_refusal() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    blocks_at_the_third_refusal(&backend).await;
}

#[tokio::test]
async fn a_cluster_blocks_at_exactly_the_nth_refusal() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    blocks_at_the_third_refusal(&backend).await;
}

#[tokio::test]
async fn escalation_doubles_the_block_on_a_sliding_log_and_a_fixed_window() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let p = Penalty::after(1)
        .block_for(Duration::from_secs(10))
        .escalating_up_to(Duration::from_secs(25));
    for limit in [
        Limit::sliding_log("log", Quota::per_hour(1).unwrap()).unwrap(),
        Limit::fixed_window("win", Quota::per_hour(1).unwrap()).unwrap(),
    ] {
        let limit = limit.penalty(p).unwrap();
        let mut now = NOW;
        assert_eq!(at(&backend, &limit, b"k", now).await, Status::Allowed);
        let mut blocks = Vec::new();
        for _ in 0..3 {
            let Status::Blocked { retry_after } = at(&backend, &limit, b"k", now).await else {
                panic!("{}: the refusal blocks", limit.name());
            };
            blocks.push(retry_after / S);
            now += retry_after;
        }
        assert_eq!(blocks, [10, 20, 25], "{}", limit.name());
    }
}

/// Two replicas at the server's time: the block holds on both, each pays one call for its
/// first blocked request and none for the next ones (its deny cache answers them, for up to
/// its TTL at a time), and a reset on one lifts the block for both (the other asks again
/// once its cache's TTL ends).
#[tokio::test]
async fn a_block_holds_on_every_replica_for_one_call_each_and_a_reset_lifts_it() {
    let server = RedisServer::start();
    let a = support::standalone(&server.url()).build().unwrap();
    let b = support::standalone(&server.url()).build().unwrap();
    let limit = login();
    let check = |backend: &RedisBackend| {
        let f = backend.check(&[Check::new(&limit, b"ip")]);
        async move { f.await.unwrap()[0].status }
    };
    for _ in 0..5 {
        assert_eq!(check(&a).await, Status::Allowed);
    }
    // Every refusal reaches Redis (a limit with a penalty keeps no plain denial in its deny
    // cache), so the third starts the block.
    for _ in 0..2 {
        assert!(matches!(check(&a).await, Status::Denied { .. }));
    }
    assert_eq!(
        check(&a).await,
        Status::Blocked {
            retry_after: 600 * S
        }
    );
    let calls = server.calls("evalsha");
    for _ in 0..10 {
        assert!(matches!(check(&a).await, Status::Blocked { .. }));
    }
    assert_eq!(
        server.calls("evalsha"),
        calls,
        "A's blocked requests cost no call"
    );
    for _ in 0..10 {
        assert!(matches!(check(&b).await, Status::Blocked { .. }));
    }
    assert_eq!(
        server.calls("evalsha"),
        calls + 1,
        "B pays one call, for its first"
    );

    a.reset(&Check::new(&limit, b"ip")).await.unwrap();
    assert_eq!(check(&a).await, Status::Allowed);
    past_the_cache_ttl().await;
    assert_eq!(check(&b).await, Status::Allowed);
}

#[tokio::test]
async fn a_deny_reaches_a_second_replica_and_an_undeny_lifts_it() {
    let cluster = RedisCluster::start(3);
    let a = support::cluster(cluster.urls()).build().unwrap();
    let b = support::cluster(cluster.urls()).build().unwrap();
    let limit = Limit::gcra("api", Quota::per_minute(100).unwrap()).unwrap();
    let check = |backend: &RedisBackend| {
        let f = backend.check(&[Check::new(&limit, b"tenant-9")]);
        async move { f.await.unwrap()[0].status }
    };
    assert_eq!(check(&b).await, Status::Allowed);
    a.deny(&Check::new(&limit, b"tenant-9"), Duration::from_secs(3600))
        .await
        .unwrap();
    let Status::Denylisted { retry_after } = check(&b).await else {
        panic!("B refuses the denied key at its next check");
    };
    assert!(retry_after > 3599 * S && retry_after <= 3600 * S);
    // A reset leaves the deny; nothing was consumed meanwhile.
    a.reset(&Check::new(&limit, b"tenant-9")).await.unwrap();
    past_the_cache_ttl().await;
    assert!(matches!(check(&b).await, Status::Denylisted { .. }));
    a.undeny(&Check::new(&limit, b"tenant-9")).await.unwrap();
    assert_eq!(check(&a).await, Status::Allowed);
    // B's cache held the deny; it asks again after the cache's TTL.
    past_the_cache_ttl().await;
    assert_eq!(check(&b).await, Status::Allowed);
}

/// A peek says what the next request meets: nothing left while the key is blocked or
/// denied, with the time to the sanction's end, as the memory backend says; then the quota
/// the key had.
#[tokio::test]
async fn a_peek_of_a_blocked_or_denied_key_says_nothing_is_left_until_it_ends() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = login();
    let peek = |key: &'static [u8]| {
        let f = backend.peek(&Check::new(&limit, key));
        async move { f.await.unwrap() }
    };
    let check = |key: &'static [u8]| {
        let f = backend.check(&[Check::new(&limit, key)]);
        async move { f.await.unwrap()[0].status }
    };
    for _ in 0..5 {
        assert_eq!(check(b"ip").await, Status::Allowed);
    }
    for _ in 0..3 {
        check(b"ip").await;
    }
    // Blocked for 600 s at the third refusal.
    let blocked = peek(b"ip").await;
    assert_eq!(blocked.remaining, 0);
    let left = blocked.retry_after.unwrap();
    assert!(
        left <= Duration::from_secs(600) && left > Duration::from_secs(590),
        "{left:?}"
    );
    backend.reset(&Check::new(&limit, b"ip")).await.unwrap();
    assert_eq!(peek(b"ip").await.remaining, 5);

    // Two requests' worth used, then denied for an hour.
    for _ in 0..2 {
        assert_eq!(check(b"tenant").await, Status::Allowed);
    }
    backend
        .deny(&Check::new(&limit, b"tenant"), Duration::from_secs(3600))
        .await
        .unwrap();
    let denied = peek(b"tenant").await;
    assert_eq!(denied.remaining, 0);
    let left = denied.retry_after.unwrap();
    assert!(left > Duration::from_secs(3590) && left <= Duration::from_secs(3600));
    backend
        .undeny(&Check::new(&limit, b"tenant"))
        .await
        .unwrap();
    assert_eq!(peek(b"tenant").await.remaining, 3);
}

/// The commonest calls (one GCRA check per request, no penalty) read a key's sanctions only
/// when the key's value says it has some. A block that a limit's penalty started holds for
/// the same key under that limit without its penalty (a reload that dropped it), as in
/// memory, on a second replica.
async fn a_block_holds_under_the_limit_without_its_penalty(a: &RedisBackend, b: &RedisBackend) {
    let limit = login();
    let check = |backend: &RedisBackend, limit: &Limit| {
        let f = backend.check(&[Check::new(limit, b"ip")]);
        async move { f.await.unwrap()[0].status }
    };
    for _ in 0..5 {
        assert_eq!(check(a, &limit).await, Status::Allowed);
    }
    for _ in 0..2 {
        assert!(matches!(check(a, &limit).await, Status::Denied { .. }));
    }
    assert!(matches!(check(a, &limit).await, Status::Blocked { .. }));
    let plain = Limit::gcra("login", Quota::per_minute(5).unwrap()).unwrap();
    let Status::Blocked { retry_after } = check(b, &plain).await else {
        panic!("the block holds without the penalty");
    };
    assert!(
        retry_after > 590 * S && retry_after <= 600 * S,
        "{retry_after}"
    );
    // Another key of the same limit is untouched.
    let f = b.check(&[Check::new(&plain, b"other")]);
    assert_eq!(f.await.unwrap()[0].status, Status::Allowed);
}

#[tokio::test]
async fn a_server_holds_a_block_under_the_limit_without_its_penalty() {
    let server = RedisServer::start();
    let a = support::standalone(&server.url()).build().unwrap();
    let b = support::standalone(&server.url()).build().unwrap();
    a_block_holds_under_the_limit_without_its_penalty(&a, &b).await;
}

#[tokio::test]
async fn a_cluster_holds_a_block_under_the_limit_without_its_penalty() {
    let cluster = RedisCluster::start(3);
    let a = support::cluster(cluster.urls()).build().unwrap();
    let b = support::cluster(cluster.urls()).build().unwrap();
    a_block_holds_under_the_limit_without_its_penalty(&a, &b).await;
}

/// A deny holds through what rewrites its key's value: a refund of a request admitted before
/// it, and a reset.
#[tokio::test]
async fn a_deny_outlives_a_refund_and_a_reset_of_its_key() {
    let server = RedisServer::start();
    let a = support::standalone(&server.url()).build().unwrap();
    let b = support::standalone(&server.url()).build().unwrap();
    let limit = Limit::gcra("api", Quota::per_minute(100).unwrap()).unwrap();
    let check = |backend: &RedisBackend| {
        let f = backend.check(&[Check::new(&limit, b"tenant")]);
        async move { f.await.unwrap() }
    };
    let admitted = check(&a).await;
    assert_eq!(admitted[0].status, Status::Allowed);
    a.deny(&Check::new(&limit, b"tenant"), Duration::from_secs(3600))
        .await
        .unwrap();
    let refund = Settlement::new(&limit, b"tenant", 1, 0, admitted.receipt(0), *limit.quota());
    a.settle_at(&[refund], None).await.unwrap();
    assert!(matches!(
        check(&b).await[0].status,
        Status::Denylisted { .. }
    ));
    a.reset(&Check::new(&limit, b"tenant")).await.unwrap();
    let c = support::standalone(&server.url()).build().unwrap();
    assert!(matches!(
        check(&c).await[0].status,
        Status::Denylisted { .. }
    ));
    a.undeny(&Check::new(&limit, b"tenant")).await.unwrap();
    let d = support::standalone(&server.url()).build().unwrap();
    assert_eq!(check(&d).await[0].status, Status::Allowed);
}

/// A reset is one script call (its values deleted and its sanctions lifted at once), so no
/// moment, and no failed second call, leaves a denied GCRA key's value without the deny's end
/// that the lean check reads: a denied key stays refused, a blocked or spent one of each
/// algorithm has its whole quota again. `evals` counts the `EVAL`s Redis ran.
async fn a_reset_is_one_call(fresh: impl Fn() -> RedisBackend, evals: impl Fn() -> u64) {
    let status = |backend: RedisBackend, limit: &Limit, key: &'static [u8]| {
        let f = backend.check(&[Check::new(limit, key)]);
        async move { f.await.unwrap()[0].status }
    };
    let admin = fresh();
    let reset = |limit: &Limit, key: &'static [u8]| {
        let before = evals();
        let f = admin.reset(&Check::new(limit, key));
        let evals = &evals;
        async move {
            f.await.unwrap();
            evals() - before
        }
    };
    // A denied GCRA key: after the reset, still refused by a replica that never saw it.
    let api = Limit::gcra("api", Quota::per_minute(100).unwrap()).unwrap();
    assert_eq!(status(fresh(), &api, b"t").await, Status::Allowed);
    admin
        .deny(&Check::new(&api, b"t"), Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(reset(&api, b"t").await, 1);
    assert!(matches!(
        status(fresh(), &api, b"t").await,
        Status::Denylisted { .. }
    ));
    // A blocked GCRA key: its block and its usage go.
    let login = login();
    let mut refused = 0;
    for _ in 0..8 {
        refused += usize::from(status(fresh(), &login, b"ip").await != Status::Allowed);
    }
    assert_eq!(refused, 3);
    assert!(matches!(
        status(fresh(), &login, b"ip").await,
        Status::Blocked { .. }
    ));
    assert_eq!(reset(&login, b"ip").await, 1);
    let mut admitted = 0;
    for _ in 0..6 {
        admitted += usize::from(status(fresh(), &login, b"ip").await == Status::Allowed);
    }
    assert_eq!(admitted, 5);
    // A spent fixed window and a spent sliding log: whole again.
    for limit in [
        Limit::fixed_window("win", Quota::per_minute(2).unwrap()).unwrap(),
        Limit::sliding_log("log", Quota::per_minute(2).unwrap()).unwrap(),
    ] {
        let mut admitted = 0;
        for _ in 0..3 {
            admitted += usize::from(status(fresh(), &limit, b"k").await == Status::Allowed);
        }
        assert_eq!(admitted, 2);
        assert_eq!(reset(&limit, b"k").await, 1);
        let mut admitted = 0;
        for _ in 0..3 {
            admitted += usize::from(status(fresh(), &limit, b"k").await == Status::Allowed);
        }
        assert_eq!(admitted, 2, "{}", limit.name());
    }
}

#[tokio::test]
async fn a_reset_is_one_call_that_keeps_a_deny_and_lifts_a_block() {
    let server = RedisServer::start();
    a_reset_is_one_call(
        || support::standalone(&server.url()).build().unwrap(),
        || server.calls("eval"),
    )
    .await;
}

/// The penalty box's round trip on a cluster, every script on the key's node: refusals, a
/// block, a deny (`sanction.lua` declares the key's sanctions and its value), a reset (one call
/// that declares the sanctions and the values, all in the key's hash slot).
#[tokio::test]
async fn a_reset_on_a_cluster_is_one_call_on_the_keys_node() {
    let cluster = RedisCluster::start(3);
    a_reset_is_one_call(
        || support::cluster(cluster.urls()).build().unwrap(),
        || cluster.nodes().iter().map(|n| n.calls("eval")).sum(),
    )
    .await;
}
