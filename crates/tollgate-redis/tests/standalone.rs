//! The backend against one real `redis-server`: exact counts, one call per batch,
//! all-or-nothing, what is written and what is not, and the deny cache.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{admitted, check, check_at, concurrent_admissions, fixed, gcra, sliding};
use tollgate_engine::{Backend, Check, Quota, Status};
use tollgate_testsupport::redis;
use tollgate_testsupport::RedisServer;

/// 2024-10-04T00:00:00Z, a UTC midnight, in microseconds.
const MIDNIGHT: u64 = 1_728_000_000_000_000;

#[tokio::test]
async fn two_backends_on_one_redis_share_the_limit() {
    let server = RedisServer::start();
    let a = support::standalone(&server.url()).build().unwrap();
    let b = support::standalone(&server.url()).build().unwrap();
    let limit = gcra("two", 2);
    let mut count = 0;
    for i in 0..10 {
        let backend = if i % 2 == 0 { &a } else { &b };
        if admitted(backend, &[&limit], b"visitor").await {
            count += 1;
        }
    }
    assert_eq!(count, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_on_two_backends_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let backends = [
        support::standalone(&server.url()).build().unwrap(),
        support::standalone(&server.url()).build().unwrap(),
    ];
    let limit = gcra("ten", 10);
    assert_eq!(concurrent_admissions(&backends, &limit, 100).await, 10);
}

/// A GCRA, a fixed window and a sliding log, each far from its limit.
fn one_of_each_algorithm() -> [tollgate_engine::Limit; 3] {
    [
        gcra("burst", 1_000),
        fixed("hourly", Quota::per_hour(1_000).unwrap()),
        sliding("log", Quota::per_minute(1_000).unwrap()),
    ]
}

#[tokio::test]
async fn one_script_call_per_batch_whatever_the_number_of_limits() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let [burst, hourly, log] = one_of_each_algorithm();
    let limits = [&burst, &hourly, &log];
    // Load the script first: a NOSCRIPT round is not part of the steady state.
    assert!(admitted(&backend, &limits, b"warm-up").await);
    server.reset_stats();
    for i in 0..20u32 {
        let key = format!("visitor-{i}");
        assert!(admitted(&backend, &limits, key.as_bytes()).await);
    }
    let stats = server.command_stats();
    assert_eq!(stats.get("evalsha"), Some(&20), "{stats:?}");
    assert_eq!(stats.get("eval"), None);
}

#[tokio::test]
async fn stacked_limits_are_all_or_nothing() {
    let server = RedisServer::start();
    // Without the deny cache every batch reaches Redis and reports every limit.
    let backend = support::standalone(&server.url())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let burst = gcra("burst", 2);
    let daily = fixed("daily", Quota::per_day(100).unwrap());
    let mut last = None;
    for _ in 0..50 {
        last = Some(check(&backend, &[&burst, &daily], b"abuser").await);
    }
    let last = last.unwrap();
    assert!(matches!(last[0].status, Status::Denied { .. }));
    assert_eq!(last[1].status, Status::Allowed);
    assert_eq!(last[1].remaining, 98);
}

#[tokio::test]
async fn shadow_checks_never_refuse_the_batch() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let shadow = gcra("shadow", 1).shadow();
    let real = gcra("real", 10);
    for _ in 0..3 {
        check(&backend, &[&shadow, &real], b"k").await;
    }
    let v = check(&backend, &[&shadow, &real], b"k").await;
    assert!(matches!(v[0].status, Status::Denied { .. }));
    assert_eq!((v[1].status, v[1].remaining), (Status::Allowed, 6));
}

/// Keys and the number of calls of every command that writes.
fn writes(server: &RedisServer) -> u64 {
    let stats = server.command_stats();
    [
        "set",
        "incrby",
        "decrby",
        "pexpire",
        "zadd",
        "zrem",
        "zremrangebyscore",
        "del",
    ]
    .iter()
    .map(|c| stats.get(*c).copied().unwrap_or(0))
    .sum()
}

/// Changes to the data set since the server started (`rdb_changes_since_last_save`: the server
/// saves nothing): a command that changed nothing, such as a `SET ... NX` of a key that has a
/// value, counts none.
fn changes(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("persistence")
        .query(&mut server.client())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("rdb_changes_since_last_save:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn dump_all(con: &mut redis::Connection) -> Vec<(String, Vec<u8>)> {
    let mut keys: Vec<String> = redis::cmd("KEYS").arg("*").query(con).unwrap();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let d: Vec<u8> = redis::cmd("DUMP").arg(&k).query(con).unwrap();
            (k, d)
        })
        .collect()
}

#[tokio::test]
async fn denied_checks_write_nothing() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let mut con = server.client();
    let now = MIDNIGHT + 1_000_000;
    let limits = [
        gcra("g", 2),
        fixed("f", Quota::per_minute(2).unwrap()),
        sliding("s", Quota::per_minute(2).unwrap()),
    ];
    for limit in &limits {
        assert!(check_at(&backend, &[limit], b"k", now).await[0].is_allowed());
        assert!(check_at(&backend, &[limit], b"k", now).await[0].is_allowed());
        let keys_before = server.dbsize();
        let state_before = dump_all(&mut con);
        let changes_before = changes(&server);
        let v = check_at(&backend, &[limit], b"k", now + 1).await[0];
        assert!(
            matches!(v.status, Status::Denied { .. }),
            "{}",
            limit.name()
        );
        assert_eq!(changes(&server), changes_before, "{} wrote", limit.name());
        assert_eq!(server.dbsize(), keys_before);
        assert_eq!(dump_all(&mut con), state_before, "{}", limit.name());
    }
    // A cost above the quota writes nothing either.
    let g = gcra("fresh", 2);
    let too_much = Check::new(&g, b"k").with_cost(3).with_enforce(true);
    let keys_before = server.dbsize();
    let v = backend.check_at(&[too_much], now).await.unwrap()[0];
    assert_eq!(v.status, Status::CostTooHigh);
    assert_eq!(server.dbsize(), keys_before);
}

#[tokio::test]
async fn a_refused_batch_writes_nothing_for_its_admitted_checks() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let open = [
        gcra("open-g", 10),
        fixed("open-f", Quota::per_minute(10).unwrap()),
        sliding("open-s", Quota::per_minute(10).unwrap()),
    ];
    let shut = gcra("shut", 1);
    let now = MIDNIGHT;
    assert!(check_at(&backend, &[&shut], b"k", now).await[0].is_allowed());
    let keys_before = server.dbsize();
    let v = check_at(&backend, &[&open[0], &open[1], &open[2], &shut], b"k", now).await;
    assert!(matches!(v[3].status, Status::Denied { .. }));
    for (limit, verdict) in open.iter().zip(&v[..3]) {
        // Reported as allowed, with the figures of a request that consumed nothing.
        assert_eq!(
            (verdict.status, verdict.remaining),
            (Status::Allowed, 10),
            "{}",
            limit.name()
        );
    }
    assert_eq!(v[0].reset, 0);
    assert_eq!(server.dbsize(), keys_before);
}

#[tokio::test]
async fn a_fixed_window_sets_its_ttl_on_the_first_write_only() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let mut con = server.client();
    let limit = fixed("daily", Quota::per_day(100).unwrap());
    let window = MIDNIGHT / 86_400_000_000;
    let key = format!("{}:{window}", backend.key_for(&limit, b"shop"));

    // First write at 06:00: the key lives until midnight, 18 h later.
    let six = MIDNIGHT + 6 * 3_600_000_000;
    check_at(&backend, &[&limit], b"shop", six).await;
    let first: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
    let eighteen_hours = 18 * 3_600_000;
    assert!(
        (eighteen_hours - 5_000..=eighteen_hours).contains(&first),
        "{first}"
    );
    // A write at noon does not move it (it would be 12 h if it did).
    check_at(&backend, &[&limit], b"shop", six + 6 * 3_600_000_000).await;
    let second: i64 = redis::cmd("PTTL").arg(&key).query(&mut con).unwrap();
    assert!(
        second > first - 5_000 && second <= first,
        "{first} {second}"
    );
    let count: u64 = redis::cmd("GET").arg(&key).query(&mut con).unwrap();
    assert_eq!(count, 2);

    // A count that was already there (written without a TTL) keeps no TTL: not the first write.
    let other = format!("{}:{window}", backend.key_for(&limit, b"other"));
    let _: () = redis::cmd("SET")
        .arg(&other)
        .arg(5)
        .query(&mut con)
        .unwrap();
    let v = check_at(&backend, &[&limit], b"other", six).await[0];
    assert_eq!(v.remaining, 94);
    let ttl: i64 = redis::cmd("PTTL").arg(&other).query(&mut con).unwrap();
    assert_eq!(ttl, -1);
}

#[tokio::test]
async fn a_sliding_log_counts_two_requests_in_one_microsecond_as_two() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let mut con = server.client();
    let limit = sliding("log", Quota::new(2, Duration::from_secs(10)).unwrap());
    let now = MIDNIGHT + 123_456;
    let a = check_at(&backend, &[&limit], b"k", now).await[0];
    let b = check_at(&backend, &[&limit], b"k", now).await[0];
    assert_eq!((a.status, a.remaining), (Status::Allowed, 1));
    assert_eq!((b.status, b.remaining), (Status::Allowed, 0));
    let key = backend.key_for(&limit, b"k");
    let members: Vec<(String, u64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut con)
        .unwrap();
    assert_eq!(members.len(), 2);
    assert_ne!(members[0].0, members[1].0);
    assert!(members.iter().all(|(_, score)| *score == now));
    let c = check_at(&backend, &[&limit], b"k", now).await[0];
    assert_eq!(
        c.status,
        Status::Denied {
            retry_after: 10_000_000
        }
    );
    // Both leave together, exactly one period later.
    let d = check_at(&backend, &[&limit], b"k", now + 10_000_000).await[0];
    assert_eq!((d.status, d.remaining), (Status::Allowed, 1));
    let card: u64 = redis::cmd("ZCARD").arg(&key).query(&mut con).unwrap();
    assert_eq!(card, 1);
}

#[tokio::test]
async fn a_flood_on_one_key_costs_a_handful_of_calls() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = gcra("login", 5);
    assert!(admitted(&backend, &[&gcra("warm-up", 5)], b"x").await);
    server.reset_stats();
    let mut count = 0;
    for _ in 0..1_000 {
        if admitted(&backend, &[&limit], b"attacker").await {
            count += 1;
        }
    }
    assert_eq!(count, 5);
    let calls = server.calls("evalsha");
    assert_eq!(
        calls, 5,
        "5 admissions, the last foretelling the denial; then the deny cache"
    );
    assert_eq!(backend.deny_cache_len(), 1);
}

#[tokio::test]
async fn the_deny_cache_reports_the_denied_check_and_skips_the_others() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let tight = gcra("tight", 1);
    let loose = gcra("loose", 100);
    assert!(admitted(&backend, &[&tight, &loose], b"k").await);
    let v = check(&backend, &[&loose, &tight], b"k").await; // from Redis
    assert!(matches!(v[1].status, Status::Denied { .. }));
    server.reset_stats();
    let v = check(&backend, &[&loose, &tight], b"k").await; // from the cache
    assert_eq!(server.calls("evalsha"), 0);
    assert_eq!(v[0].status, Status::NotChecked);
    match v[1].status {
        Status::Denied { retry_after } => {
            assert!(retry_after > 50_000_000 && retry_after <= 60_000_000)
        }
        other => panic!("{other:?}"),
    }
    // Another identity is not affected, nor is the same identity on the loose limit alone.
    assert!(admitted(&backend, &[&tight], b"someone else").await);
    assert!(admitted(&backend, &[&loose], b"k").await);
}

#[tokio::test]
async fn keys_never_hold_the_identity_and_have_a_fixed_length() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .prefix("app")
        .build()
        .unwrap();
    let limit = gcra("per-ip", 10);
    let short = b"203.0.113.7".as_slice();
    let long = "alice@example.com".repeat(20);
    assert!(admitted(&backend, &[&limit], short).await);
    assert!(admitted(&backend, &[&limit], long.as_bytes()).await);
    let mut con = server.client();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    assert_eq!(keys.len(), 2);
    for key in &keys {
        assert!(key.starts_with("app:per-ip:{"), "{key}");
        assert!(!key.contains("203.0.113.7") && !key.contains("alice"));
        assert_eq!(key.len(), keys[0].len());
    }
    // A GCRA TAT lives at `<base key>:v3`, which `key_for` names.
    let tat = backend.key_for(&limit, short);
    assert!(tat.ends_with(":v3"), "{tat}");
    assert!(keys.contains(&tat), "{keys:?}");
    assert_eq!(tat.len(), keys[0].len());
}

#[tokio::test]
async fn a_fixed_window_turns_at_utc_midnight() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = fixed("daily", Quota::per_day(1).unwrap());
    // The unit is taken at the day's start: the count's TTL (set from the simulated time,
    // run out in real time) is a day, not the microseconds left before midnight.
    let morning = MIDNIGHT - 86_400_000_000;
    assert!(check_at(&backend, &[&limit], b"k", morning).await[0].is_allowed());
    let v = check_at(&backend, &[&limit], b"k", MIDNIGHT - 1).await[0];
    assert_eq!(v.status, Status::Denied { retry_after: 1 });
    assert!(check_at(&backend, &[&limit], b"k", MIDNIGHT).await[0].is_allowed());
}

#[tokio::test]
async fn a_batch_of_more_than_max_checks_is_refused() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limits: Vec<_> = (0..9).map(|i| gcra(&format!("l{i}"), 10)).collect();
    let checks: Vec<Check<'_>> = limits.iter().map(|l| Check::new(l, b"k")).collect();
    let err = backend.check(&checks).await.unwrap_err();
    assert_eq!(err.kind(), tollgate_engine::BackendErrorKind::Protocol);
    assert!(backend.check(&[]).await.unwrap().is_empty());
    assert_eq!(backend.kind(), "redis");
}

#[tokio::test]
async fn the_script_is_loaded_again_after_a_flush() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = gcra("l", 10);
    assert!(admitted(&backend, &[&limit], b"k").await);
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut server.client())
        .unwrap();
    let v = check(&backend, &[&limit], b"k").await;
    assert_eq!(v[0].remaining, 8);
}

/// Runs one check of `limits` per key, all at once on this task, and counts the admissions.
async fn at_once(
    backend: &tollgate_redis::RedisBackend,
    limits: &[&tollgate_engine::Limit],
    keys: &[Vec<u8>],
) -> usize {
    let checks = keys
        .iter()
        .map(|key| support::admitted(backend, limits, key));
    futures_util::future::join_all(checks)
        .await
        .into_iter()
        .filter(|admitted| *admitted)
        .count()
}

#[tokio::test]
async fn concurrent_requests_share_one_script_call() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let [burst, hourly, log] = one_of_each_algorithm();
    let limits = [&burst, &hourly, &log];
    assert!(admitted(&backend, &limits, b"warm-up").await);
    server.reset_stats();
    let keys: Vec<Vec<u8>> = (0..64)
        .map(|i| format!("visitor-{i}").into_bytes())
        .collect();
    // All 64 batches are queued before the first call goes out: one call carries them all.
    assert_eq!(at_once(&backend, &limits, &keys).await, 64);
    assert_eq!(server.calls("evalsha"), 1);
    // Each request wrote its own state, in every limit.
    assert_eq!(server.dbsize(), (1 + 64) * 4);
}

#[tokio::test]
async fn clients_that_ask_again_on_each_answer_share_one_call_a_round() {
    // Eight clients, each sending its next request as soon as it has its answer, as a load
    // generator's connections do: each round of eight goes out in one call, 10 rounds in 10
    // calls (not 80), and every request is counted.
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let limit = gcra("rounds", 1_000);
    assert!(admitted(&backend, &[&limit], b"warm-up").await);
    server.reset_stats();
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let backend = backend.clone();
            let limit = limit.clone();
            tokio::spawn(async move {
                let key = format!("client-{i}").into_bytes();
                let mut admitted_here = 0;
                for _ in 0..10 {
                    admitted_here += usize::from(admitted(&backend, &[&limit], &key).await);
                }
                admitted_here
            })
        })
        .collect();
    let mut total = 0;
    for client in clients {
        total += client.await.unwrap();
    }
    assert_eq!(total, 80);
    assert_eq!(server.calls("evalsha"), 10);
    let v = check(&backend, &[&limit], b"client-3").await;
    assert_eq!(v[0].remaining, 1_000 - 10 - 1);
}

#[tokio::test]
async fn merged_requests_on_one_key_admit_exactly_the_limit_and_consume_nothing_when_refused() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    let burst = gcra("burst", 10);
    let daily = fixed("daily", Quota::per_day(1_000).unwrap());
    assert!(admitted(&backend, &[&gcra("warm-up", 5)], b"x").await);
    server.reset_stats();
    let keys = vec![b"abuser".to_vec(); 100];
    assert_eq!(at_once(&backend, &[&burst, &daily], &keys).await, 10);
    // 64 batches in the first call, 36 in the second.
    assert_eq!(server.calls("evalsha"), 2);
    // Each call read each of the two keys, and each key's sanctions (`:pb`), once, whatever
    // its number of requests; only the first wrote, once per key: the burst's TAT, the
    // window's count and the window's TTL.
    assert_eq!(server.calls("get"), 2 * 2 * 2);
    assert_eq!(writes(&server), 3);
    // The window's count, written once for ten admissions, got its TTL with that write.
    let pattern = format!("{}:*", backend.key_for(&daily, b"abuser"));
    let window_keys: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query(&mut server.client())
        .unwrap();
    assert_eq!(window_keys.len(), 1, "{window_keys:?}");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&window_keys[0])
        .query(&mut server.client())
        .unwrap();
    assert!(ttl > 0, "the window's count has no TTL ({ttl})");
    // The 90 refused requests took nothing from the daily window.
    let v = check(&backend, &[&daily], b"abuser").await;
    assert_eq!(v[0].remaining, 1_000 - 10 - 1);
}

#[tokio::test]
async fn a_limit_whose_algorithm_changes_under_its_name_keeps_working() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url())
        .deny_cache_capacity(0)
        .build()
        .unwrap();
    // A day: the fixed window must not turn between the two rounds (a minute's would, now and
    // then, on a slow run).
    let quota = Quota::per_day(2).unwrap();
    let as_log = sliding("shop", quota);
    let as_gcra = tollgate_engine::Limit::gcra("shop", quota).unwrap();
    let as_window = fixed("shop", quota);
    // Old and new replicas side by side during a deploy, on the same identity, in one merged
    // call with an unrelated request: every algorithm finds only its own state.
    for round in 0..2 {
        let log = [Check::new(&as_log, b"k")];
        let gcra = [Check::new(&as_gcra, b"k")];
        let window = [Check::new(&as_window, b"k")];
        let (log, gcra, window) = tokio::join!(
            backend.check(&log),
            backend.check(&gcra),
            backend.check(&window)
        );
        for (name, v) in [("log", log), ("gcra", gcra), ("window", window)] {
            let v = v.unwrap_or_else(|e| panic!("{name}, round {round}: {e}"));
            assert_eq!((v[0].status, v[0].remaining), (Status::Allowed, 1 - round));
        }
    }
}

#[tokio::test]
async fn a_costly_sliding_log_check_adds_its_members_a_thousand_per_zadd() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limit = sliding(
        "log",
        Quota::per_hour(tollgate_engine::MAX_LOG_UNITS).unwrap(),
    );
    let key = backend.key_for(&limit, b"k");
    let check = |cost| {
        let mut c = Check::new(&limit, b"k");
        c.cost = cost;
        backend.check_at(&[c], MIDNIGHT)
    };
    // Loads the script and connects, so that only the checks below count.
    assert!(check(1).await.unwrap()[0].is_allowed());
    server.reset_stats();
    let v = check(2_500).await.unwrap()[0];
    assert_eq!((v.status, v.remaining), (Status::Allowed, 10_000 - 2_501));
    assert_eq!(server.calls("zadd"), 3);
    let members: u64 = redis::cmd("ZCARD")
        .arg(&key)
        .query(&mut server.client())
        .unwrap();
    assert_eq!(members, 2_501);
}

#[tokio::test]
async fn a_check_costlier_than_any_log_holds_is_refused_and_writes_nothing() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limits = [
        sliding(
            "log",
            Quota::per_hour(tollgate_engine::MAX_LOG_UNITS).unwrap(),
        ),
        gcra("g", 10),
        fixed("w", Quota::per_minute(10).unwrap()),
    ];
    for limit in &limits {
        for cost in [tollgate_engine::MAX_LOG_UNITS + 1, u32::MAX] {
            let mut c = Check::new(limit, b"k");
            c.cost = cost;
            let v = backend.check(&[c]).await.unwrap()[0];
            assert_eq!(v.status, Status::CostTooHigh, "{} at {cost}", limit.name());
        }
    }
    assert_eq!(server.calls("zadd"), 0);
    assert_eq!(server.dbsize(), 0);
}

/// The keys of the `EVALSHA` calls in the server's slow log (every call, with a threshold of
/// 0 µs set before them).
fn declared_keys(server: &RedisServer) -> std::collections::BTreeSet<String> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(&mut server.client())
        .unwrap();
    let mut keys = std::collections::BTreeSet::new();
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            panic!("slow log entry {entry:?}")
        };
        let args: Vec<Vec<u8>> = redis::from_redis_value(fields[3].clone()).unwrap();
        let args: Vec<String> = args
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args[0].eq_ignore_ascii_case("evalsha") {
            let n: usize = args[2].parse().unwrap();
            keys.extend(args[3..3 + n].iter().cloned());
        }
    }
    keys
}

#[tokio::test]
async fn the_scripts_declare_every_key_they_write() {
    let server = RedisServer::start();
    let backend = support::standalone(&server.url()).build().unwrap();
    let limits = [
        gcra("g", 10),
        fixed("w", Quota::per_hour(10).unwrap()),
        sliding("s", Quota::per_hour(10).unwrap()),
    ];
    let refs: Vec<&_> = limits.iter().collect();
    let mut con = server.client();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut con).unwrap();
    // On the server's clock, then at a fixed time.
    assert!(admitted(&backend, &refs, b"k").await);
    let v = check_at(&backend, &refs, b"other", MIDNIGHT).await;
    assert!(v.iter().all(|v| v.is_allowed()));
    let written: std::collections::BTreeSet<String> =
        redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    // Per identity: GCRA's key, a window, a log and its sequence.
    assert_eq!(written.len(), 8, "{written:?}");
    let declared = declared_keys(&server);
    let undeclared: Vec<_> = written.difference(&declared).collect();
    assert!(
        undeclared.is_empty(),
        "written, not declared: {undeclared:?}"
    );
}

#[tokio::test]
async fn a_url_with_a_user_a_password_and_a_database_is_honoured() {
    let server = RedisServer::start();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "limiter", "on", ">s3cret", "~*", "+@all"])
        .query(&mut server.client())
        .unwrap();
    let url = |password: &str| format!("redis://limiter:{password}@127.0.0.1:{}/3", server.port());
    let backend = tollgate_redis::RedisBackend::builder()
        .url(url("s3cret").as_str())
        .build()
        .unwrap();
    let limit = gcra("auth", 10);
    assert_eq!(check(&backend, &[&limit], b"k").await[0].remaining, 9);
    assert_eq!(check(&backend, &[&limit], b"k").await[0].remaining, 8);
    // Written in database 3, none in 0.
    assert_eq!(server.dbsize(), 0);
    let mut db3 = server.client();
    let _: () = redis::cmd("SELECT").arg(3).query(&mut db3).unwrap();
    let keys: u64 = redis::cmd("DBSIZE").query(&mut db3).unwrap();
    assert_eq!(keys, 1);
    // A wrong password is a failed check, not an admission.
    let wrong = tollgate_redis::RedisBackend::builder()
        .url(url("wrong").as_str())
        .breaker_threshold(0)
        .build()
        .unwrap();
    let err = wrong.check(&[Check::new(&limit, b"k")]).await.unwrap_err();
    assert_eq!(
        err.kind(),
        tollgate_engine::BackendErrorKind::Unavailable,
        "{err}"
    );
    let keys: u64 = redis::cmd("DBSIZE").query(&mut db3).unwrap();
    assert_eq!(keys, 1);
}

/// A deadline or a deny cache TTL past its bound (an hour) is refused at build, with the
/// setting and the bound named: `Duration::MAX` never reaches a request, where a time would
/// overflow. At their bounds, a backend serves checks and a denied key's cached refusal.
#[tokio::test]
async fn durations_past_their_bounds_are_refused_at_build() {
    use tollgate_redis::{BuildError, MAX_DEADLINE, MAX_DENY_CACHE_TTL};
    let server = RedisServer::start();
    let deadline = support::standalone(&server.url())
        .deadline(Duration::MAX)
        .build()
        .err();
    assert_eq!(
        deadline,
        Some(BuildError::TooLong {
            setting: "deadline",
            max: MAX_DEADLINE
        })
    );
    assert_eq!(
        deadline.unwrap().to_string(),
        "the Redis backend's deadline must be at most 3600 s"
    );
    let ttl = support::standalone(&server.url())
        .deny_cache_ttl(Duration::MAX)
        .build()
        .err();
    assert_eq!(
        ttl,
        Some(BuildError::TooLong {
            setting: "deny_cache_ttl",
            max: MAX_DENY_CACHE_TTL
        })
    );

    let backend = support::standalone(&server.url())
        .deadline(MAX_DEADLINE)
        .deny_cache_ttl(MAX_DENY_CACHE_TTL)
        .build()
        .unwrap();
    let limit = gcra("bounded", 2);
    let admitted: Vec<bool> = [
        support::admitted(&backend, &[&limit], b"k").await,
        support::admitted(&backend, &[&limit], b"k").await,
        support::admitted(&backend, &[&limit], b"k").await,
        support::admitted(&backend, &[&limit], b"k").await,
    ]
    .into();
    assert_eq!(admitted, [true, true, false, false]);
    assert_eq!(backend.deny_cache_len(), 1);
}
