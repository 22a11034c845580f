//! Memory per tracked key, measured: the resident set size of this process before and after
//! one million distinct client-IP keys are checked through an in-memory limiter.
//!
//! ```text
//! mem-per-key [tollgate|tollgate-window|governor] [KEYS]
//! ```
//!
//! `tollgate` is `MemoryBackend` with one GCRA limit (the default algorithm), `tollgate-window`
//! the same with a fixed window, `governor` governor's `DefaultKeyedRateLimiter<IpAddr>` (what
//! tower_governor keeps) as the reference; one limiter per process. The keys' addresses are
//! made before the first reading, so only the limiter's state is counted. (Fixing glibc's
//! `MALLOC_MMAP_THRESHOLD_`, so that freed tables surely go back to the system, gave the same
//! figures.)

// A measurement tool: a setup failure should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::net::IpAddr;
use std::num::NonZeroU32;

use tollgate_bench::{addrs, ip_key, rss_bytes};
use tollgate_engine::{Check, Limit, MemoryBackend, Quota};

fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "tollgate".into());
    let n: usize = args.next().map_or(1_000_000, |s| s.parse().unwrap());
    // Generated before the baseline, freed after the measurement: not counted.
    let ips = addrs(n);

    let (before, after, tracked) = match which.as_str() {
        "tollgate" | "tollgate-window" => {
            let quota = Quota::per_hour(1_000).unwrap();
            let limit = if which == "tollgate" {
                Limit::gcra("per-ip", quota).unwrap()
            } else {
                Limit::fixed_window("per-ip", quota).unwrap()
            };
            let backend = MemoryBackend::builder().max_keys(n).build();
            let before = rss_bytes().unwrap();
            for ip in &ips {
                let key = ip_key(*ip);
                let v = backend.check_now(&[Check::new(&limit, &key)]).unwrap();
                assert!(v[0].is_allowed());
            }
            let after = rss_bytes().unwrap();
            let tracked = backend.stats().tracked_keys;
            drop(backend);
            (before, after, tracked)
        }
        "governor" => {
            let quota = governor::Quota::per_hour(NonZeroU32::new(1_000).unwrap());
            let limiter = governor::RateLimiter::<IpAddr, _, _>::dashmap(quota);
            let before = rss_bytes().unwrap();
            for ip in &ips {
                assert!(limiter.check_key(&IpAddr::V4(*ip)).is_ok());
            }
            let after = rss_bytes().unwrap();
            let tracked = limiter.len();
            drop(limiter);
            (before, after, tracked)
        }
        other => panic!("unknown limiter {other:?}: tollgate, tollgate-window or governor"),
    };
    assert_eq!(tracked, n, "every key must be tracked");
    let peak = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0);
    println!(
        "{which}: {n} keys, RSS {:.1} MiB -> {:.1} MiB (peak {:.1} MiB): {:.1} bytes per key",
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        peak as f64 / 1024.0,
        (after - before) as f64 / n as f64
    );
}
