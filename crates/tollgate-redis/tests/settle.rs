//! Settles on a real Redis and a real Redis Cluster, held to the in-memory backend's figures:
//! the same scenarios, at the same fixed times, must give the same verdicts.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use tollgate_engine::{
    Backend, Check, FakeClock, Limit, MemoryBackend, Micros, Quota, Settlement, Status, Verdicts,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};

/// The start of a UTC day: windows of a minute or an hour start here.
const T0: Micros = 1_728_000_000_000_000;
const S: Micros = 1_000_000;

enum Target {
    Memory(MemoryBackend<FakeClock>, FakeClock),
    Redis(RedisBackend),
}

impl Target {
    fn memory() -> Self {
        let clock = FakeClock::new(T0);
        Self::Memory(MemoryBackend::builder().clock(clock.clone()).build(), clock)
    }

    async fn check(&self, limit: &Limit, key: &[u8], cost: u32, now: Micros) -> Verdicts {
        let checks = [Check::new(limit, key).with_cost(cost)];
        match self {
            Self::Memory(backend, clock) => {
                clock.set(now);
                backend.check_now(&checks).unwrap()
            }
            Self::Redis(backend) => backend.check_at(&checks, now).await.unwrap(),
        }
    }

    /// A check counted against `quota`, a plan's.
    async fn check_under(&self, limit: &Limit, quota: Quota, cost: u32, now: Micros) -> Verdicts {
        let checks = [Check::new(limit, b"shop").with_quota(quota).with_cost(cost)];
        match self {
            Self::Memory(backend, clock) => {
                clock.set(now);
                backend.check_now(&checks).unwrap()
            }
            Self::Redis(backend) => backend.check_at(&checks, now).await.unwrap(),
        }
    }

    async fn settle(&self, settlement: Settlement<'_>, now: Micros) {
        match self {
            Self::Memory(backend, clock) => {
                clock.set(now);
                backend.settle_now(&[settlement]);
            }
            Self::Redis(backend) => backend.settle_at(&[settlement], Some(now)).await.unwrap(),
        }
    }

    /// Reserves `reserved` at `now`, settles at `actual` at `later`.
    async fn reserve_settle(
        &self,
        limit: &Limit,
        key: &[u8],
        reserved: u32,
        actual: u32,
        now: Micros,
        later: Micros,
    ) {
        let v = self.check(limit, key, reserved, now).await;
        assert!(v[0].is_allowed(), "{v:?}");
        let settlement =
            Settlement::new(limit, key, reserved, actual, v.receipt(0), *limit.quota());
        self.settle(settlement, later).await;
    }
}

fn all_algorithms(name: &str, quota: Quota) -> [Limit; 3] {
    [
        Limit::gcra(&format!("{name}-gcra"), quota).unwrap(),
        Limit::fixed_window(&format!("{name}-window"), quota).unwrap(),
        Limit::sliding_log(&format!("{name}-log"), quota).unwrap(),
    ]
}

/// Every scenario, with its exact figures, on `target`.
async fn scenarios(target: &Target) {
    let hour = Quota::per_hour(1000).unwrap();
    let minute = Quota::per_minute(10).unwrap();
    let at = T0 + 30 * S;

    // Reserve 100, charge 250: 250 consumed.
    for limit in all_algorithms("charge", hour) {
        target
            .reserve_settle(&limit, b"shop", 100, 250, at, at + 1)
            .await;
        let v = target.check(&limit, b"shop", 1, at + 2).await;
        assert_eq!(v[0].remaining, 749, "{}", limit.name());
    }

    // Three of 315 settled at 300: 900 consumed, 315 more refused, 100 left.
    for limit in all_algorithms("refund", hour) {
        for i in 0..3 {
            target
                .reserve_settle(&limit, b"shop", 315, 300, at + i, at + i)
                .await;
        }
        let v = target.check(&limit, b"shop", 315, at + 10).await;
        assert!(
            matches!(v[0].status, Status::Denied { .. }),
            "{}",
            limit.name()
        );
        assert_eq!(v[0].remaining, 100, "{}", limit.name());
    }

    // A refund of everything: the quota is whole again.
    for limit in all_algorithms("all", minute) {
        target
            .reserve_settle(&limit, b"shop", 7, 0, at, at + 1)
            .await;
        let v = target.check(&limit, b"shop", 1, at + 2).await;
        assert_eq!(v[0].remaining, 9, "{}", limit.name());
    }

    // GCRA's debt stops at twice the burst's refill: 120 s ahead, the next unit 66 s away.
    let gcra = Limit::gcra("debt-gcra", minute).unwrap();
    target.reserve_settle(&gcra, b"shop", 10, 30, at, at).await;
    let v = target.check(&gcra, b"shop", 1, at).await;
    assert_eq!(
        v[0].status,
        Status::Denied {
            retry_after: 66 * S
        }
    );
    let v = target.check(&gcra, b"shop", 1, at + 66 * S).await;
    assert_eq!((v[0].status, v[0].remaining), (Status::Allowed, 0));

    // A guarded GCRA refund (a lease's give-back: a receipt with a TAT and no time) applies
    // only while the TAT is the receipt's: 4 units at `at` leave the TAT at `at + 24 s`, one
    // interval is 6 s.
    let guarded = Limit::gcra("guarded", minute).unwrap();
    let refund = |tat: Micros| {
        Settlement::new(
            &guarded,
            b"shop",
            3,
            0,
            tollgate_engine::Receipt::guarded(tat),
            *guarded.quota(),
        )
    };
    target.check(&guarded, b"shop", 4, at).await;
    target.settle(refund(at + 24 * S + 1), at).await;
    let v = target.check(&guarded, b"shop", 1, at).await;
    assert_eq!(v[0].remaining, 5, "another TAT: nothing given back");
    target.settle(refund(at + 30 * S), at).await;
    let v = target.check(&guarded, b"shop", 1, at).await;
    assert_eq!(v[0].remaining, 7, "the TAT the receipt names: 3 given back");

    // A fixed window's debt ends with its window; a settle after it changes nothing.
    let window = Limit::fixed_window("debt-window", minute).unwrap();
    target.reserve_settle(&window, b"shop", 2, 15, at, at).await;
    let v = target.check(&window, b"shop", 1, at + 1).await;
    assert_eq!(
        v[0].status,
        Status::Denied {
            retry_after: 30 * S - 1
        }
    );
    target
        .reserve_settle(&window, b"late", 8, 0, at, T0 + 60 * S)
        .await;
    target
        .reserve_settle(&window, b"late", 1, 9, T0 + 60 * S, T0 + 60 * S)
        .await;
    let v = target.check(&window, b"late", 1, T0 + 61 * S).await;
    assert_eq!(v[0].remaining, 0);
    let v = target.check(&window, b"shop", 1, T0 + 60 * S).await;
    assert_eq!(v[0].remaining, 9);

    // A sliding log gives back the check's own units: 3 at T0, 5 at +20 s settled at 2.
    let log = Limit::sliding_log("own-log", minute).unwrap();
    target.check(&log, b"shop", 3, T0).await;
    target
        .reserve_settle(&log, b"shop", 5, 2, T0 + 20 * S, T0 + 21 * S)
        .await;
    let v = target.check(&log, b"shop", 5, T0 + 22 * S).await;
    assert_eq!(v[0].remaining, 0);
    let v = target.check(&log, b"shop", 4, T0 + 60 * S).await;
    assert_eq!(
        v[0].status,
        Status::Denied {
            retry_after: 20 * S
        }
    );
    assert_eq!(v[0].remaining, 3);

    // A cost no quota can admit is refused as such; huge charges stop at their caps, and a
    // refund after one is counted from the cap.
    for limit in all_algorithms("huge", minute) {
        let v = target.check(&limit, b"shop", u32::MAX, at).await;
        assert_eq!(v[0].status, Status::CostTooHigh, "{}", limit.name());
        target
            .reserve_settle(&limit, b"shop", 1, u32::MAX, at, at)
            .await;
        target.reserve_settle(&limit, b"other", 10, 0, at, at).await;
        let v = target.check(&limit, b"shop", 1, at + 1).await;
        assert!(
            matches!(v[0].status, Status::Denied { .. }),
            "{}",
            limit.name()
        );
        assert_eq!(v[0].remaining, 0, "{}", limit.name());
    }
    let window = Limit::fixed_window("huge-window-refund", minute).unwrap();
    let v = target.check(&window, b"shop", 1, at).await;
    let settlement = Settlement::new(&window, b"shop", 1, u32::MAX, v.receipt(0), *window.quota());
    target.settle(settlement, at).await;
    // The count is 21 (1 + twice the limit): a refund of 12 in the same window leaves 9, one
    // unit free.
    let refund = Settlement::new(&window, b"shop", 12, 0, v.receipt(0), *window.quota());
    target.settle(refund, at).await;
    let v = target.check(&window, b"shop", 1, at).await;
    assert_eq!((v[0].status, v[0].remaining), (Status::Allowed, 0));

    // A sliding log's debt is at most twice its limit, and leaves a period later.
    let log = Limit::sliding_log("debt-log", minute).unwrap();
    target
        .reserve_settle(&log, b"shop", 1, u32::MAX, at, at)
        .await;
    let v = target.check(&log, b"shop", 1, at + S).await;
    assert_eq!(
        (v[0].status, v[0].remaining),
        (
            Status::Denied {
                retry_after: 59 * S
            },
            0
        )
    );
    let v = target.check(&log, b"shop", 1, at + 60 * S).await;
    assert_eq!(v[0].remaining, 9);

    // Plans of 10 per 60 s and 10 per 1 s share one log: an admission or a charge under the
    // short plan leaves the units the long one counts. 5 units at T0 (long), 1 at +2 s
    // (short), then 1 at +2 s (long): 7 of the last minute, 3 left.
    let long = Quota::new(10, Duration::from_secs(60)).unwrap();
    let short = Quota::new(10, Duration::from_secs(1)).unwrap();
    let log = Limit::sliding_log("plans-log", long)
        .unwrap()
        .plan("short", short)
        .unwrap();
    assert_eq!(target.check_under(&log, long, 5, T0).await[0].remaining, 5);
    let v = target.check_under(&log, short, 1, T0 + 2 * S).await;
    assert_eq!(v[0].remaining, 9);
    let v = target.check_under(&log, long, 1, T0 + 2 * S).await;
    assert_eq!(v[0].remaining, 3);
    // At +3 s, 1 unit under the short plan settled at 3: 10 of the last minute, the oldest
    // (T0's) leaving at +60 s.
    let v = target.check_under(&log, short, 1, T0 + 3 * S).await;
    assert_eq!(v[0].remaining, 9);
    let charge = Settlement::new(&log, b"shop", 1, 3, v.receipt(0), short);
    target.settle(charge, T0 + 3 * S).await;
    let v = target.check_under(&log, long, 1, T0 + 3 * S).await;
    assert_eq!(
        (v[0].status, v[0].remaining),
        (
            Status::Denied {
                retry_after: 57 * S
            },
            0
        )
    );
}

#[tokio::test]
async fn in_memory() {
    scenarios(&Target::memory()).await;
}

#[tokio::test]
async fn on_redis_settles_are_exact_and_one_call_each() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let target = Target::Redis(backend);
    scenarios(&target).await;
    let Target::Redis(backend) = target else {
        unreachable!()
    };
    let limit = Limit::gcra("calls", Quota::per_hour(1000).unwrap()).unwrap();
    let v = backend
        .check_at(&[Check::new(&limit, b"shop").with_cost(10)], T0)
        .await
        .unwrap();
    server.reset_stats();
    let settlement = Settlement::new(&limit, b"shop", 10, 4, v.receipt(0), *limit.quota());
    backend.settle_at(&[settlement], Some(T0)).await.unwrap();
    assert_eq!(server.calls("evalsha"), 1);
    // Nothing to settle: no call.
    let same = Settlement::new(&limit, b"shop", 10, 10, v.receipt(0), *limit.quota());
    backend.settle_at(&[same], Some(T0)).await.unwrap();
    assert_eq!(server.calls("evalsha"), 1);
}

#[tokio::test]
async fn on_a_cluster_settles_are_exact_and_one_call_per_slot_group() {
    let cluster = RedisCluster::start(3);
    let backend = support::cluster(cluster.urls()).build().unwrap();
    let target = Target::Redis(backend);
    scenarios(&target).await;
    let Target::Redis(backend) = target else {
        unreachable!()
    };
    // Two keys in two slots: two calls, one per group.
    let limit = Limit::gcra("slots", Quota::per_hour(1000).unwrap()).unwrap();
    let (a, b) = (b"shop-a", b"shop-b");
    assert_ne!(
        cluster.slot_of_key(&backend.key_for(&limit, a)),
        cluster.slot_of_key(&backend.key_for(&limit, b))
    );
    // Each refund names its check's reservation by the check's receipt.
    let mut receipts = Vec::new();
    for key in [&a[..], &b[..]] {
        let v = backend
            .check_at(&[Check::new(&limit, key).with_cost(10)], T0)
            .await
            .unwrap();
        receipts.push(v.receipt(0));
    }
    let settle =
        |key: &'static [u8], receipt| Settlement::new(&limit, key, 10, 0, receipt, *limit.quota());
    for node in cluster.nodes() {
        node.reset_stats();
    }
    backend
        .settle_at(&[settle(a, receipts[0]), settle(b, receipts[1])], Some(T0))
        .await
        .unwrap();
    let calls: u64 = cluster.nodes().iter().map(|n| n.calls("evalsha")).sum();
    assert_eq!(calls, 2);
    for key in [&a[..], &b[..]] {
        let v = backend
            .check_at(&[Check::new(&limit, key)], T0)
            .await
            .unwrap();
        assert_eq!(v[0].remaining, 999);
    }
}

#[tokio::test]
async fn a_refund_clears_this_replicas_cached_denial() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = Limit::gcra("cached", Quota::per_hour(10).unwrap()).unwrap();
    let first = backend
        .check(&[Check::new(&limit, b"shop").with_cost(10)])
        .await
        .unwrap();
    assert!(first[0].is_allowed());
    let denied = backend.check(&[Check::new(&limit, b"shop")]).await.unwrap();
    assert!(!denied[0].is_allowed());
    assert_eq!(backend.deny_cache_len(), 1);
    let settlement = Settlement::new(&limit, b"shop", 10, 3, first.receipt(0), *limit.quota());
    backend.settle_at(&[settlement], None).await.unwrap();
    assert_eq!(backend.deny_cache_len(), 0);
    server.reset_stats();
    let v = backend.check(&[Check::new(&limit, b"shop")]).await.unwrap();
    assert_eq!((v[0].status, v[0].remaining), (Status::Allowed, 6));
    assert_eq!(server.calls("evalsha"), 1);
}

#[tokio::test]
async fn the_backend_trait_sends_the_settle_without_waiting() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = Limit::gcra("spawned", Quota::per_hour(1000).unwrap()).unwrap();
    let v = backend
        .check(&[Check::new(&limit, b"shop").with_cost(100)])
        .await
        .unwrap();
    Backend::settle(
        &backend,
        &[Settlement::new(
            &limit,
            b"shop",
            100,
            250,
            v.receipt(0),
            *limit.quota(),
        )],
    );
    // The settle is sent from a task: a check made once it has run sees it (each check is a
    // round trip, during which the task runs).
    let mut left = 0;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        let v = backend
            .check(&[Check::new(&limit, b"shop").with_cost(0)])
            .await
            .unwrap();
        left = v[0].remaining;
        if left != 900 {
            break;
        }
    }
    assert_eq!(left, 750);
}

#[tokio::test]
async fn settles_that_wait_for_the_call_in_flight_share_the_next_one() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = Limit::gcra("merged", Quota::per_hour(1000).unwrap()).unwrap();
    let mut receipts = Vec::new();
    for _ in 0..50 {
        let v = backend
            .check(&[Check::new(&limit, b"shop").with_cost(10)])
            .await
            .unwrap();
        receipts.push(v.receipt(0));
    }
    // The script is loaded by a first settle.
    let warm = Settlement::new(&limit, b"other", 0, 1, Default::default(), *limit.quota());
    backend.settle_at(&[warm], None).await.unwrap();
    server.reset_stats();
    // Fifty settles before the sending task first runs: one call carries them all.
    for receipt in receipts {
        Backend::settle(
            &backend,
            &[Settlement::new(
                &limit,
                b"shop",
                10,
                4,
                receipt,
                *limit.quota(),
            )],
        );
    }
    let mut checks = 0;
    let mut left = 0;
    while checks < 100 {
        checks += 1;
        let v = backend
            .check(&[Check::new(&limit, b"shop").with_cost(0)])
            .await
            .unwrap();
        left = v[0].remaining;
        if left != 500 {
            break;
        }
    }
    assert_eq!(left, 800);
    assert_eq!(server.calls("evalsha"), 1 + checks);
}

/// Plans of 1 a day and 10,000 a second share a log kept for a day: three seconds of the
/// second's plan and a charge are 30,100 units, of which Redis keeps the newest 20,000 (as the
/// in-memory backend does). The day's plan still answers as if it had them all: refused, its
/// wait the newest unit's day.
#[tokio::test]
async fn on_redis_a_log_shared_by_plans_keeps_at_most_twice_the_largest_quota() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let day = Quota::per_day(1).unwrap();
    let burst = Quota::new(10_000, Duration::from_secs(1)).unwrap();
    let log = Limit::sliding_log("capped-log", day)
        .unwrap()
        .plan("burst", burst)
        .unwrap();
    let target = Target::Redis(backend);
    for i in 0..3 {
        let v = target.check_under(&log, burst, 10_000, T0 + i * S).await;
        assert_eq!((v[0].status, v[0].remaining), (Status::Allowed, 0));
    }
    let v = target.check_under(&log, burst, 0, T0 + 3 * S).await;
    let charge = Settlement::new(&log, b"shop", 0, 100, v.receipt(0), burst);
    target.settle(charge, T0 + 3 * S).await;
    let Target::Redis(backend) = &target else {
        unreachable!()
    };
    let members: u64 = tollgate_testsupport::redis::cmd("ZCARD")
        .arg(backend.key_for(&log, b"shop"))
        .query(&mut server.client())
        .unwrap();
    assert_eq!(members, 20_000);
    let v = target.check_under(&log, day, 1, T0 + 3 * S + 1).await;
    let wait = 86_400 * S - 1;
    assert_eq!(
        (v[0].status, v[0].remaining, v[0].reset),
        (Status::Denied { retry_after: wait }, 0, wait)
    );
}
