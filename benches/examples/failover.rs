//! How long limiting stops when a Sentinel-watched master dies: the time from the kill to
//! the first check answered by the promoted replica, and the checks that failed meanwhile.
//!
//! ```text
//! failover [RUNS] [MAX_OPEN_MS]
//! ```
//!
//! Each run (default 3) starts a master, a replica and three sentinels on loopback
//! (`down-after-milliseconds` 1000, quorum 2; see `tollgate_testsupport::Sentinel`), sends a
//! check every millisecond through a `RedisBackend` built with `.sentinel(..)` and the
//! default deadline (50 ms) and breaker (its longest interval between probes
//! `MAX_OPEN_MS`, default 5000), kills the master with `SIGKILL`, and waits for the first
//! check that Redis answers again. Prints per run the time until the sentinels name the
//! replica, the time without limiting, and the failed checks by kind (each would be a bypass
//! under a fail-open limit), then the minimum, median and maximum.

// A measurement tool: a setup failure should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tollgate_engine::{Backend, Check, Limit, Quota};
use tollgate_redis::RedisBackend;
use tollgate_testsupport::{Sentinel, SENTINEL_MASTER};

fn main() {
    let mut args = std::env::args().skip(1);
    let runs: usize = args.next().map_or(3, |s| s.parse().unwrap());
    let max_open = Duration::from_millis(args.next().map_or(5_000, |s| s.parse().unwrap()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut gaps = Vec::new();
    for run in 1..=runs {
        let (promoted, gap, failed) = rt.block_on(one_run(max_open));
        let kinds: Vec<String> = failed.iter().map(|(k, n)| format!("{k} {n}")).collect();
        println!(
            "run {run}: replica named master after {:.0} ms; no limiting for {:.0} ms; \
             failed checks: {}",
            promoted.as_secs_f64() * 1e3,
            gap.as_secs_f64() * 1e3,
            kinds.join(", ")
        );
        gaps.push(gap);
    }
    gaps.sort();
    println!(
        "min {:.0} ms, median {:.0} ms, max {:.0} ms over {runs} runs",
        gaps[0].as_secs_f64() * 1e3,
        gaps[gaps.len() / 2].as_secs_f64() * 1e3,
        gaps[gaps.len() - 1].as_secs_f64() * 1e3
    );
}

async fn one_run(max_open: Duration) -> (Duration, Duration, BTreeMap<String, u64>) {
    let mut setup = Sentinel::start();
    let backend = RedisBackend::builder()
        .sentinel(SENTINEL_MASTER, setup.sentinel_urls())
        .breaker_max_open_for(max_open)
        .build()
        .unwrap();
    let limit = Limit::gcra("failover", Quota::per_second(1_000_000).unwrap()).unwrap();
    let check = || backend.check(&[Check::new(&limit, b"flow")]);
    // Connected and warm.
    while check().await.is_err() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    setup.master_mut().stop();
    let killed = Instant::now();
    let replica = setup.replica().port();
    let urls = setup.sentinel_urls();
    let promoted = tokio::task::spawn_blocking(move || {
        while sentinel_master_port(&urls) != Some(replica) {
            std::thread::sleep(Duration::from_millis(5));
        }
        killed.elapsed()
    });
    let mut failed = BTreeMap::new();
    let mut every = tokio::time::interval(Duration::from_millis(1));
    loop {
        every.tick().await;
        match check().await {
            Ok(_) => break,
            Err(e) => *failed.entry(format!("{:?}", e.kind())).or_insert(0) += 1,
        }
        assert!(killed.elapsed() < Duration::from_secs(120), "no failover");
    }
    let gap = killed.elapsed();
    (promoted.await.unwrap(), gap, failed)
}

/// The master's port as the first sentinel that answers names it.
fn sentinel_master_port(urls: &[String]) -> Option<u16> {
    urls.iter().find_map(|url| {
        let mut con = redis::Client::open(url.as_str())
            .ok()?
            .get_connection_with_timeout(Duration::from_millis(200))
            .ok()?;
        let (_, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(SENTINEL_MASTER)
            .query(&mut con)
            .ok()?;
        Some(port)
    })
}
