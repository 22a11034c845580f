//! Quota leases on a real Redis and a real Redis Cluster: slices counted in Redis before any
//! local admission, exact totals across replicas, and units given back at shutdown and on
//! expiry.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use tollgate_engine::{
    Admin, Backend, Check, FakeClock, Lease, Lifecycle, Limit, Micros, Quota, Status, Verdicts,
};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{RedisCluster, RedisServer};

/// The start of a UTC day: windows of a minute or an hour start here.
const T0: Micros = 1_728_000_000_000_000;
const S: Micros = 1_000_000;

/// Slices of at most 4 units, half of what remains, living `life`.
fn lease(life: Duration) -> Lease {
    Lease::new(4)
        .unwrap()
        .with_divisor(2)
        .unwrap()
        .with_lifetime(life)
        .unwrap()
}

fn leased(limit: Limit, life: Duration) -> Limit {
    limit.with_lease(lease(life)).unwrap()
}

/// A standalone backend whose calls and leases are at `clock`'s time.
fn on_clock(url: &str, clock: &FakeClock) -> RedisBackend {
    support::standalone(url)
        .clock(clock.clone())
        .build()
        .unwrap()
}

/// Checks `limits` for `key` on `backend`, whose clock is `clock`, at `now`.
async fn at(
    clock: &FakeClock,
    backend: &RedisBackend,
    limits: &[&Limit],
    key: &[u8],
    now: Micros,
) -> Verdicts {
    let checks: Vec<Check<'_>> = limits.iter().map(|l| Check::new(l, key)).collect();
    clock.set(now);
    backend.check(&checks).await.unwrap()
}

/// `backend`'s shutdown at `now`, on its clock `clock`.
async fn shutdown_at(clock: &FakeClock, backend: &RedisBackend, now: Micros) {
    clock.set(now);
    backend.shutdown().await;
}

/// Admissions of `n` checks of `limit` for `key` at `now`.
async fn admitted_at(
    clock: &FakeClock,
    backend: &RedisBackend,
    limit: &Limit,
    key: &[u8],
    n: usize,
    now: Micros,
) -> usize {
    let mut count = 0;
    for _ in 0..n {
        if at(clock, backend, &[limit], key, now).await[0].is_allowed() {
            count += 1;
        }
    }
    count
}

#[tokio::test]
async fn a_slice_is_counted_in_redis_first_and_then_admits_without_a_call() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let backend = on_clock(&server.url(), &clock);
    let limit = leased(
        Limit::gcra("hot", Quota::per_hour(10).unwrap()).unwrap(),
        Duration::from_secs(60),
    );
    let plain = Limit::gcra("hot", Quota::per_hour(10).unwrap()).unwrap();
    // Loads the script.
    at(&clock, &backend, &[&plain], b"warm-up", T0).await;
    server.reset_stats();
    // 4 units taken (10 / 2, at most 4): one admitted, 3 held, already counted in Redis.
    let v = at(&clock, &backend, &[&limit], b"k", T0).await;
    assert!(v[0].is_allowed());
    assert!(!v.from_lease(0));
    assert_eq!(backend.leased_units(), 3);
    assert_eq!(server.calls("evalsha"), 1);
    let other = on_clock(&server.url(), &clock);
    let v = at(&clock, &other, &[&plain], b"k", T0).await;
    assert_eq!(v[0].remaining, 5, "Redis counts the whole slice");
    for _ in 0..3 {
        let v = at(&clock, &backend, &[&limit], b"k", T0).await;
        assert!(v[0].is_allowed());
        assert!(v.from_lease(0));
    }
    assert_eq!(server.calls("evalsha"), 2);
    assert_eq!(backend.leased_units(), 0);
    // 5 left: a smaller slice, then single checks near the limit, then refusals.
    let rest = admitted_at(&clock, &backend, &limit, b"k", 10, T0).await;
    assert_eq!(rest, 5);
    assert_eq!(backend.leased_units(), 0);
    // A slice of 3 (2 local), 2 single checks, 5 refusals.
    assert_eq!(server.calls("evalsha"), 2 + 1 + 2 + 5);
}

#[tokio::test]
async fn over_four_replicas_a_leased_limit_of_ten_admits_exactly_ten() {
    let server = RedisServer::start();
    run_four_replicas(|| support::standalone(&server.url()).build().unwrap()).await;
}

#[tokio::test]
async fn on_a_cluster_four_replicas_admit_exactly_ten() {
    let cluster = RedisCluster::start(3);
    run_four_replicas(|| support::cluster(cluster.urls()).build().unwrap()).await;
}

async fn run_four_replicas(backend: impl Fn() -> RedisBackend) {
    let day = Duration::from_secs(86_400);
    for (name, limit) in [
        (
            "gcra",
            Limit::gcra("burst", Quota::per_hour(10).unwrap()).unwrap(),
        ),
        (
            "fixed",
            Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap(),
        ),
    ] {
        let limit = leased(limit, Duration::from_secs(3_600));
        // 100 requests at once: whatever is not admitted is held in slices, nothing more.
        let replicas: Vec<RedisBackend> = (0..4).map(|_| backend()).collect();
        let admitted = support::concurrent_admissions(&replicas, &limit, 100).await;
        let held: u64 = replicas.iter().map(RedisBackend::leased_units).sum();
        assert!(admitted <= 10, "{name}: {admitted} admitted");
        assert_eq!(
            admitted as u64 + held,
            10,
            "{name}: {admitted} admitted, {held} held"
        );
        // Every replica keeps sending: every slice is spent, exactly 10 in all.
        let limit = leased(
            Limit::new(&format!("{name}-busy"), limit.algorithm(), *limit.quota()).unwrap(),
            day,
        );
        let replicas: Vec<RedisBackend> = (0..4).map(|_| backend()).collect();
        let tasks: Vec<_> = replicas
            .iter()
            .map(|r| {
                let (r, limit) = (r.clone(), limit.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    for _ in 0..25 {
                        if support::admitted(&r, &[&limit], b"shared-key").await {
                            n += 1;
                        }
                    }
                    n
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += t.await.unwrap();
        }
        assert_eq!(admitted, 10, "{name}");
        let held: u64 = replicas.iter().map(RedisBackend::leased_units).sum();
        assert_eq!(held, 0, "{name}");
    }
}

#[tokio::test]
async fn a_replica_shut_down_gives_its_units_back() {
    let server = RedisServer::start();
    shut_down_gives_back(|| support::standalone(&server.url()).build().unwrap()).await;
}

#[tokio::test]
async fn on_a_cluster_a_replica_shut_down_gives_its_units_back() {
    let cluster = RedisCluster::start(3);
    shut_down_gives_back(|| support::cluster(cluster.urls()).build().unwrap()).await;
}

async fn shut_down_gives_back(backend: impl Fn() -> RedisBackend) {
    let replica = backend();
    let limit = leased(
        Limit::gcra("gone", Quota::per_hour(10).unwrap()).unwrap(),
        Duration::from_secs(3_600),
    );
    let plain = Limit::gcra("gone", Quota::per_hour(10).unwrap()).unwrap();
    assert!(support::admitted(&replica, &[&limit], b"k").await);
    assert_eq!(replica.leased_units(), 3);
    replica.shutdown().await;
    assert_eq!(replica.leased_units(), 0);
    // The other replica finds the 9 units the first did not use.
    let other = backend();
    let mut n = 0;
    for _ in 0..12 {
        if support::admitted(&other, &[&plain], b"k").await {
            n += 1;
        }
    }
    assert_eq!(n, 9);
    // After shutdown, the replica takes no slice: each check is Redis'.
    let mut fresh = Vec::new();
    for key in [&b"a"[..], b"b"] {
        fresh.push(support::check(&replica, &[&limit], key).await[0].remaining);
    }
    assert_eq!(fresh, [9, 9]);
    assert_eq!(replica.leased_units(), 0);
}

#[tokio::test]
async fn a_live_replica_gives_an_expired_slice_back() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let replica = on_clock(&server.url(), &clock);
    let limit = leased(
        Limit::gcra("expiring", Quota::per_hour(10).unwrap()).unwrap(),
        Duration::from_secs(1),
    );
    let plain = Limit::gcra("expiring", Quota::per_hour(10).unwrap()).unwrap();
    assert!(at(&clock, &replica, &[&limit], b"idle", T0).await[0].is_allowed());
    assert_eq!(replica.leased_units(), 3);
    // Two seconds later, a check of another key finds the idle key's slice expired.
    assert!(at(&clock, &replica, &[&limit], b"busy", T0 + 2 * S).await[0].is_allowed());
    assert_eq!(replica.leased_units(), 3, "only the busy key's slice");
    let other = on_clock(&server.url(), &clock);
    assert_eq!(
        admitted_at(&clock, &other, &plain, b"idle", 12, T0 + 2 * S).await,
        9
    );
}

#[tokio::test]
async fn a_killed_replicas_units_come_back_when_its_slice_expires() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    killed_replica(&clock, || on_clock(&server.url(), &clock)).await;
}

#[tokio::test]
async fn on_a_cluster_a_killed_replicas_units_come_back_when_its_slice_expires() {
    let cluster = RedisCluster::start(3);
    let clock = FakeClock::new(T0);
    killed_replica(&clock, || {
        support::cluster(cluster.urls())
            .clock(clock.clone())
            .build()
            .unwrap()
    })
    .await;
}

async fn killed_replica(clock: &FakeClock, backend: impl Fn() -> RedisBackend) {
    let other = backend();
    let day = Duration::from_secs(86_400);
    // A fixed window: the slice ends with its window, and so do its units.
    let fixed = leased(
        Limit::fixed_window("fw", Quota::per_minute(10).unwrap()).unwrap(),
        day,
    );
    let plain = Limit::fixed_window("fw", Quota::per_minute(10).unwrap()).unwrap();
    let killed = backend();
    assert!(at(clock, &killed, &[&fixed], b"k", T0).await[0].is_allowed());
    assert_eq!(killed.leased_units(), 3);
    drop(killed);
    assert_eq!(
        admitted_at(clock, &other, &plain, b"k", 12, T0 + S).await,
        6
    );
    assert_eq!(
        admitted_at(clock, &other, &plain, b"k", 12, T0 + 60 * S).await,
        10
    );
    // GCRA (one unit per 6 s): the slice's 4 units are TAT taken at the take, so they refill
    // like admitted requests; 24 s later the bucket is whole.
    let gcra = leased(
        Limit::gcra("g", Quota::per_minute(10).unwrap()).unwrap(),
        day,
    );
    let plain = Limit::gcra("g", Quota::per_minute(10).unwrap()).unwrap();
    let killed = backend();
    assert!(at(clock, &killed, &[&gcra], b"k", T0).await[0].is_allowed());
    assert_eq!(killed.leased_units(), 3);
    drop(killed);
    assert_eq!(
        at(clock, &other, &[&plain], b"k", T0 + 18 * S).await[0].remaining,
        8
    );
    assert_eq!(
        admitted_at(clock, &other, &plain, b"k", 12, T0 + 24 * S + 6 * S).await,
        10
    );
    // Given back at shutdown instead, the 3 units are there at once.
    let graceful = backend();
    assert!(at(clock, &graceful, &[&gcra], b"j", T0).await[0].is_allowed());
    shutdown_at(clock, &graceful, T0).await;
    assert_eq!(admitted_at(clock, &other, &plain, b"j", 12, T0).await, 9);
}

#[tokio::test]
async fn a_gcra_slice_is_not_given_back_once_another_check_moved_the_tat() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let limit = leased(
        Limit::gcra("moved", Quota::per_hour(10).unwrap()).unwrap(),
        Duration::from_secs(3_600),
    );
    let plain = Limit::gcra("moved", Quota::per_hour(10).unwrap()).unwrap();
    let holder = on_clock(&server.url(), &clock);
    let other = on_clock(&server.url(), &clock);
    assert!(at(&clock, &holder, &[&limit], b"k", T0).await[0].is_allowed());
    assert_eq!(holder.leased_units(), 3);
    // Nothing moved the TAT: the 3 units go back.
    shutdown_at(&clock, &holder, T0).await;
    assert_eq!(
        at(&clock, &other, &[&plain], b"k", T0).await[0].remaining,
        8
    );
    // Another take, then another replica's admission moves the TAT on: other replicas' slices
    // could be paced by it, so the units stay counted and refill with the TAT.
    let holder = on_clock(&server.url(), &clock);
    assert!(at(&clock, &holder, &[&limit], b"k", T0).await[0].is_allowed());
    assert_eq!(holder.leased_units(), 3);
    assert_eq!(
        at(&clock, &other, &[&plain], b"k", T0).await[0].remaining,
        3
    );
    shutdown_at(&clock, &holder, T0).await;
    assert_eq!(
        at(&clock, &other, &[&plain], b"k", T0).await[0].remaining,
        2
    );
}

#[tokio::test]
async fn stacked_limits_stay_all_or_nothing_with_a_slice() {
    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let backend = on_clock(&server.url(), &clock);
    let hot = leased(
        Limit::gcra("hot", Quota::per_hour(10).unwrap()).unwrap(),
        Duration::from_secs(3_600),
    );
    let strict = Limit::fixed_window("strict", Quota::per_hour(2).unwrap()).unwrap();
    let first = at(&clock, &backend, &[&hot, &strict], b"k", T0).await;
    assert!(first.iter().all(|v| v.is_allowed()));
    assert_eq!(backend.leased_units(), 3);
    let second = at(&clock, &backend, &[&hot, &strict], b"k", T0).await;
    assert!(second.iter().all(|v| v.is_allowed()));
    assert!(second.from_lease(0));
    assert_eq!(backend.leased_units(), 2);
    // The slice would admit, the other limit refuses: the unit goes back into the slice.
    let third = at(&clock, &backend, &[&hot, &strict], b"k", T0).await;
    assert!(third[0].is_allowed());
    assert!(matches!(third[1].status, Status::Denied { .. }));
    assert_eq!(backend.leased_units(), 2);
    // Redis counted the slice's 4 units and nothing for the refused request.
    let plain = Limit::gcra("hot", Quota::per_hour(10).unwrap()).unwrap();
    assert_eq!(
        at(&clock, &backend, &[&plain], b"k", T0).await[0].remaining,
        5
    );
}

#[tokio::test]
async fn a_slice_in_hand_is_used_while_redis_is_down_then_the_failure_is_reported() {
    let mut server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = leased(
        Limit::gcra("down", Quota::per_hour(10).unwrap()).unwrap(),
        Duration::from_secs(3_600),
    );
    assert!(support::admitted(&backend, &[&limit], b"k").await);
    server.stop();
    for _ in 0..3 {
        let v = backend.check(&[Check::new(&limit, b"k")]).await.unwrap();
        assert!(v.from_lease(0));
    }
    assert!(backend.check(&[Check::new(&limit, b"k")]).await.is_err());
}

#[tokio::test]
async fn the_deny_cache_answers_only_once_the_slice_is_spent() {
    let server = RedisServer::start();
    let a = support::standalone(&server.url()).build().unwrap();
    let b = support::standalone(&server.url()).build().unwrap();
    let limit = leased(
        Limit::fixed_window("dc", Quota::per_day(10).unwrap()).unwrap(),
        Duration::from_secs(3_600),
    );
    assert!(support::admitted(&a, &[&limit], b"k").await);
    assert_eq!(a.leased_units(), 3);
    // The other replica spends the rest and learns that the key is denied.
    let plain = Limit::fixed_window("dc", Quota::per_day(10).unwrap()).unwrap();
    let mut n = 0;
    for _ in 0..8 {
        if support::admitted(&b, &[&plain], b"k").await {
            n += 1;
        }
    }
    assert_eq!(n, 6);
    // The slice in hand still admits: its units were counted before.
    for _ in 0..3 {
        assert!(support::admitted(&a, &[&limit], b"k").await);
    }
    server.reset_stats();
    // Spent: a slice is refused, the request's own check is refused and cached.
    assert!(!support::admitted(&a, &[&limit], b"k").await);
    assert_eq!(server.calls("evalsha"), 2);
    assert!(!support::admitted(&a, &[&limit], b"k").await);
    assert_eq!(server.calls("evalsha"), 2, "answered by the deny cache");
    assert_eq!(a.leased_units(), 0);
}

#[tokio::test]
async fn sliding_logs_and_slots_cannot_be_leased() {
    let lease = lease(Duration::from_secs(1));
    let log = Limit::sliding_log("log", Quota::per_minute(10).unwrap()).unwrap();
    assert!(matches!(
        log.with_lease(lease),
        Err(tollgate_engine::ConfigError::LeaseUnsupported(_))
    ));
    let slots = Limit::concurrency("slots", 4).unwrap();
    assert!(slots.with_lease(lease).is_err());
}

/// One sequential trace (three replicas, irregular times across expiries, window turns and
/// refills, one replica shut down half-way) on a real Redis and through the engine's `Leased` over
/// the in-memory backend, which the accuracy simulation runs: every answer, every replica's
/// holdings and the number of calls agree.
#[tokio::test]
async fn a_trace_on_redis_matches_leases_over_memory() {
    use tollgate_testsupport::leases::{self, splitmix};

    let server = RedisServer::start();
    let clock = FakeClock::new(T0);
    for (i, (_, limit)) in leases::trace_limits().into_iter().enumerate() {
        let replicas: Vec<RedisBackend> = (0..3).map(|_| on_clock(&server.url(), &clock)).collect();
        let memory = leases::memory(&clock);
        let models: Vec<leases::Replica> =
            (0..3).map(|_| leases::replica(&memory, &clock)).collect();
        // Loads the scripts before counting calls.
        let warm = Limit::gcra("warm", *limit.quota()).unwrap();
        at(&clock, &replicas[0], &[&warm], b"w", T0).await;
        replicas[0].settle_at(&[], Some(T0)).await.unwrap();
        let settle =
            tollgate_engine::Settlement::new(&warm, b"w", 1, 0, Default::default(), *warm.quota());
        replicas[0].settle_at(&[settle], Some(T0)).await.unwrap();
        server.reset_stats();
        let mut seed = 0x5eed_u64 + i as u64;
        let mut now = T0;
        let (mut admitted, mut local) = (0, 0);
        for n in 0..400 {
            let r = splitmix(&mut seed);
            now += r % 120_000;
            let who = (r >> 32) as usize % 3;
            if n == 200 {
                shutdown_at(&clock, &replicas[2], now).await;
                clock.set(now);
                models[2].shutdown().await;
            }
            let v = at(&clock, &replicas[who], &[&limit], b"key", now).await;
            let got = (v[0].is_allowed(), v.from_lease(0), v[0].remaining);
            clock.set(now);
            let v = models[who]
                .check_now(&[Check::new(&limit, b"key")])
                .unwrap();
            let want = (v[0].is_allowed(), v.from_lease(0), v[0].remaining);
            assert_eq!(
                got,
                want,
                "{} request {n} at +{} µs",
                limit.name(),
                now - T0
            );
            assert_eq!(replicas[who].leased_units(), models[who].leased_units());
            admitted += usize::from(got.0);
            local += usize::from(got.1);
        }
        let calls: u64 = models.iter().map(|m| m.inner().calls()).sum();
        assert_eq!(server.calls("evalsha"), calls, "{}", limit.name());
        // The trace is worth something: slices were used, and the limit was reached.
        assert!(
            local >= 10 && admitted < 400,
            "{admitted} admitted, {local} from slices"
        );
    }
}

#[tokio::test]
async fn a_reset_drops_this_replicas_slice_of_the_key() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = leased(
        Limit::fixed_window("daily", Quota::per_day(10).unwrap()).unwrap(),
        Duration::from_secs(60),
    );
    let check = |b: &RedisBackend| {
        let limit = limit.clone();
        let b = b.clone();
        async move { b.check(&[Check::new(&limit, b"k")]).await.unwrap()[0].is_allowed() }
    };
    // One admitted, 3 held in this replica's slice, all 4 counted in Redis.
    assert!(check(&backend).await);
    assert_eq!(backend.leased_units(), 3);
    backend.reset(&Check::new(&limit, b"k")).await.unwrap();
    // The slice went with the state it was counted in: after the reset, exactly the quota.
    assert_eq!(backend.leased_units(), 0);
    let mut admitted = 0;
    for _ in 0..20 {
        admitted += usize::from(check(&backend).await);
    }
    assert_eq!(admitted, 10);
}
