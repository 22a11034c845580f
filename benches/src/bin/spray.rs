//! A spray of unique keys through one in-memory backend, on one thread: the time of every
//! check, to see the worst one and the tail, not only the mean.
//!
//! ```text
//! spray [KEYS] [PERIOD_SECS]
//! ```
//!
//! `KEYS` new keys (default 3,000,000), each checked once, through `MemoryBackend::new()` (the
//! default cap of 1,048,576 keys) with one GCRA limit of 1,000 per `PERIOD_SECS` (default
//! 86,400: a key's state expires 86.4 s after its check, so nothing expires during the run,
//! the cap is reached and every key past it is refused). A short period (`spray 3000000 1`: a key's state expires after a millisecond)
//! shows the reclaiming side instead: expired keys make room for new ones. Prints p50, p99,
//! p99.99 and the maximum of the time per check, and how many checks were admitted and refused.

// A measurement tool: a setup failure should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use tollgate_core::{Check, Limit, MemoryBackend, Quota, Status};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u32 = args.next().map_or(3_000_000, |s| s.parse().unwrap());
    let period: u64 = args.next().map_or(86_400, |s| s.parse().unwrap());
    let quota = Quota::new(1_000, Duration::from_secs(period)).unwrap();
    let limit = Limit::gcra("per-ip", quota).unwrap();
    let backend = MemoryBackend::new();

    let mut took = Vec::with_capacity(n as usize);
    let (mut admitted, mut refused) = (0u64, 0u64);
    let began = Instant::now();
    for i in 0..n {
        let key = i.to_le_bytes();
        let start = Instant::now();
        let verdicts = backend.check_now(&[Check::new(&limit, &key)]).unwrap();
        let elapsed = start.elapsed();
        match black_box(verdicts[0].status) {
            Status::Allowed => admitted += 1,
            Status::AtCapacity { .. } => refused += 1,
            other => panic!("a new key answered {other:?}"),
        }
        took.push(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
    }
    let total = began.elapsed();

    took.sort_unstable();
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    let us = |ns: u64| ns as f64 / 1_000.0;
    println!(
        "spray: {n} new keys, period {period} s, {:.2} s: admitted {admitted}, refused at \
         capacity {refused}, tracked at the end {}",
        total.as_secs_f64(),
        backend.stats().tracked_keys
    );
    println!(
        "per check: p50 {:.3} µs, p99 {:.3} µs, p99.99 {:.3} µs, max {:.3} µs",
        us(at(0.50)),
        us(at(0.99)),
        us(at(0.9999)),
        us(took[took.len() - 1])
    );
}
