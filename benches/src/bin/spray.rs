//! A spray of unique keys through one in-memory backend, on one thread: the time of every
//! check, to see the worst one and the tail, not only the mean.
//!
//! ```text
//! spray [KEYS] [PERIOD_SECS] [alone]
//! ```
//!
//! `KEYS` new keys (default 3,000,000), each checked once, through `MemoryBackend::new()` (the
//! default cap of 1,048,576 keys) with one GCRA limit of 1,000 per `PERIOD_SECS` (default
//! 86,400: a key's state expires 86.4 s after its check, so nothing expires during the run,
//! the cap is reached and every key past it is refused). A short period (`spray 3000000 1`: a key's state expires after a millisecond)
//! shows the reclaiming side instead: expired keys make room for new ones. Prints p50, p99,
//! p99.99 and the maximum of the time per check, how many checks were admitted and refused, the
//! five slowest checks, and how often the process was preempted. On a busy machine the slowest
//! checks hold another process's time slice: with `alone`, the figures are printed a second
//! time over the checks during which the thread was not switched out (it reads how often it
//! has been scheduled before and after each check, outside the timed span; those reads make
//! the run several times longer and add to every check's cache misses).

// A measurement tool: a setup failure should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use tollgate_engine::{Check, Limit, MemoryBackend, Quota, Status};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u32 = args.next().map_or(3_000_000, |s| s.parse().unwrap());
    let period: u64 = args.next().map_or(86_400, |s| s.parse().unwrap());
    let sched = match args.next().as_deref() {
        None => None,
        Some("alone") => Some(std::fs::File::open("/proc/thread-self/schedstat").unwrap()),
        Some(other) => panic!("unknown argument {other:?}: only `alone`"),
    };
    let mut buf = [0u8; 128];
    let quota = Quota::new(1_000, Duration::from_secs(period)).unwrap();
    let limit = Limit::gcra("per-ip", quota).unwrap();
    let backend = MemoryBackend::new();

    let mut took = Vec::with_capacity(n as usize);
    // The times of the checks during which this thread was not switched out.
    let mut alone = Vec::with_capacity(n as usize);
    let switches_before = involuntary_switches();
    let (mut admitted, mut refused) = (0u64, 0u64);
    let began = Instant::now();
    for i in 0..n {
        let key = i.to_le_bytes();
        let scheduled = sched.as_ref().and_then(|f| times_scheduled(f, &mut buf));
        let start = Instant::now();
        let verdicts = backend.check_now(&[Check::new(&limit, &key)]).unwrap();
        let elapsed = start.elapsed();
        let preempted = sched
            .as_ref()
            .is_some_and(|f| times_scheduled(f, &mut buf) != scheduled);
        match black_box(verdicts[0].status) {
            Status::Allowed => admitted += 1,
            Status::AtCapacity { .. } => refused += 1,
            other => panic!("a new key answered {other:?}"),
        }
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        took.push(ns);
        if !preempted {
            alone.push(ns);
        }
    }
    let total = began.elapsed();
    let switches = involuntary_switches().saturating_sub(switches_before);

    let mut slowest: Vec<(u64, usize)> = took.iter().copied().zip(0..).collect();
    slowest.sort_unstable_by(|a, b| b.cmp(a));
    slowest.truncate(5);
    let over_100us = took.iter().filter(|&&t| t > 100_000).count();
    took.sort_unstable();
    alone.sort_unstable();
    let at = |took: &[u64], q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    let us = |ns: u64| ns as f64 / 1_000.0;
    println!(
        "spray: {n} new keys, period {period} s, {:.2} s: admitted {admitted}, refused at \
         capacity {refused}, tracked at the end {}",
        total.as_secs_f64(),
        backend.stats().tracked_keys
    );
    let mut sets = vec![("every check", &took)];
    if sched.is_some() {
        sets.push(("not switched out", &alone));
    }
    for (what, took) in sets {
        println!(
            "{what} ({}): p50 {:.3} µs, p99 {:.3} µs, p99.99 {:.3} µs, max {:.3} µs",
            took.len(),
            us(at(took, 0.50)),
            us(at(took, 0.99)),
            us(at(took, 0.9999)),
            us(took[took.len() - 1])
        );
    }
    let slowest: Vec<String> = slowest
        .iter()
        .map(|&(t, i)| format!("#{i} {:.1} µs", us(t)))
        .collect();
    println!(
        "slowest: {}; {over_100us} checks over 100 µs; {switches} involuntary context switches",
        slowest.join(", ")
    );
}

/// How many times this thread has been put on a CPU so far: the third field of
/// `/proc/thread-self/schedstat`, read again through the same open file. `None` when it
/// cannot be read.
fn times_scheduled(file: &std::fs::File, buf: &mut [u8; 128]) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let n = file.read_at(buf, 0).ok()?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    text.split_whitespace().nth(2)?.parse().ok()
}

/// This process's involuntary context switches so far, from `/proc/self/status` (0 when it
/// cannot be read).
fn involuntary_switches() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("nonvoluntary_ctxt_switches:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
