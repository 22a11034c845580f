//! Merged calls of tollgate's Redis check script, each carrying the same number of requests,
//! for `benches/script-cost.sh`, which counts the instructions Redis spends on them.
//!
//! ```text
//! script-cost --redis redis://127.0.0.1:6379/ --mode one|distinct|three [--calls 100]
//!             [--per-call 16] [--from 0]
//! script-cost --cluster redis://127.0.0.1:7000/,redis://127.0.0.1:7001/,... --mode distinct
//! ```
//!
//! With `--cluster` the backend is a Redis Cluster client (`benches/cluster-cost.sh`): each
//! round's requests are merged per node, so a node's call carries its share of them. `--from`
//! numbers the `distinct` keys from there, so that a warm-up and the counted run share none.
//!
//! Modes: `one`, one GCRA limit and every request on one key (a busy client, a tenant);
//! `distinct`, one GCRA limit and a key never seen before per request; `three`, three GCRA
//! limits, each with one key for every request. No quota is reached. It prints the requests
//! it made and the script calls Redis counted for them.

// A measurement tool: a bad flag or an unreachable Redis should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tollgate_engine::{Backend, Check, Limit, Quota};
use tollgate_redis::RedisBackend;

fn main() {
    let mut url = "redis://127.0.0.1:6379/".to_owned();
    let mut cluster: Vec<String> = Vec::new();
    let mut mode = String::new();
    let (mut calls, mut per_call, mut from) = (100_usize, 16_usize, 0_usize);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_default();
        match flag.as_str() {
            "--redis" => url = value,
            "--mode" => mode = value,
            "--calls" => calls = value.parse().unwrap(),
            "--per-call" => per_call = value.parse().unwrap(),
            "--from" => from = value.parse().unwrap(),
            "--cluster" => cluster = value.split(',').map(str::to_owned).collect(),
            other => panic!("unknown flag {other}"),
        }
    }
    let quota = Quota::per_second(1_000_000)
        .unwrap()
        .with_burst(u32::MAX)
        .unwrap();
    let limits: Vec<Limit> = match mode.as_str() {
        "one" | "distinct" => vec![Limit::gcra("per-ip", quota).unwrap()],
        "three" => ["a", "b", "c"]
            .into_iter()
            .map(|name| Limit::gcra(name, quota).unwrap())
            .collect(),
        other => panic!("unknown mode {other:?}"),
    };
    // One thread: the requests of a round are all queued before the task that sends merged
    // calls first runs, so each round is exactly one call.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Redis runs under valgrind, many times slower than natively.
        let builder = RedisBackend::builder().deadline(Duration::from_secs(30));
        let builder = if cluster.is_empty() {
            builder.url(&url)
        } else {
            builder.cluster(cluster.iter())
        };
        let backend = builder.build().unwrap();
        let servers = if cluster.is_empty() {
            vec![url.clone()]
        } else {
            cluster.clone()
        };
        let count = || servers.iter().map(|u| evalsha_calls(u)).sum::<u64>();
        let before = count();
        for round in 0..calls {
            let answers: Vec<_> = (0..per_call)
                .map(|r| {
                    let n = if mode == "distinct" {
                        from + round * per_call + r
                    } else {
                        0
                    };
                    let key = (n as u64).to_be_bytes();
                    let checks: Vec<Check<'_>> =
                        limits.iter().map(|l| Check::new(l, &key)).collect();
                    tokio::spawn(backend.check(&checks))
                })
                .collect();
            for answer in answers {
                let verdicts = answer.await.unwrap().unwrap();
                assert!(verdicts.iter().all(|v| v.is_allowed()));
            }
        }
        let sent = count() - before;
        println!("requests {} calls {sent}", calls * per_call);
    });
}

/// The `EVALSHA` calls Redis has counted since it started.
fn evalsha_calls(url: &str) -> u64 {
    let mut conn = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .unwrap();
    tollgate_testsupport::parse_command_stats(&info)
        .get("evalsha")
        .copied()
        .unwrap_or(0)
}
