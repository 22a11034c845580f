//! One rate-limit check through tollgate's in-memory backend, and through governor's
//! `DefaultKeyedRateLimiter` (what tower_governor uses) in the same run as the reference.
//!
//! Run with: `cargo bench -p tollgate-bench --bench memory`
//!
//! Cells: a hot key (every check on one key) and 100k distinct keys (each check on the next
//! key, all tracked before the measurement); allowed (a quota nothing reaches) and denied (a
//! quota of 1 a day, used up before the measurement); 1 and 2 threads on the same limiter.
//! With 2 threads the figure is each thread's time per check while the other runs the same
//! loop, so throughput is twice its inverse. Keys are what a real request hashes: tollgate gets
//! the bytes of its `ClientIp` key, governor an `IpAddr`, as tower_governor gives it.
//!
//! `stack3` checks three limits per request: per-IP GCRA, per-IP daily fixed window and one
//! global GCRA, all-or-nothing in tollgate; governor has no stacking, so its figure is three
//! limiters called one after another (which is not all-or-nothing: a later refusal does not
//! give back what the earlier ones took).

// A measurement tool: setup failures should stop it loudly.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use axum::extract::ConnectInfo;
use criterion::{criterion_group, criterion_main, Criterion};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, RateLimiter};
use tollgate::key::{ClientIp, KeyExtractor, RequestView};
use tollgate_bench::{addrs, ip_key};
use tollgate_engine::{Check, Limit, MemoryBackend, Quota};

const KEYS: usize = 100_000;

/// Something that checks one request, for key number `i`.
trait Target: Sync {
    fn keys(&self) -> usize;
    fn check(&self, i: usize) -> bool;
}

struct Tollgate {
    backend: MemoryBackend,
    limits: Vec<Limit>,
    keys: Vec<[u8; 6]>,
}

impl Target for Tollgate {
    fn keys(&self) -> usize {
        self.keys.len()
    }

    fn check(&self, i: usize) -> bool {
        let key = &self.keys[i];
        // As governor's side, the harness does no more than a caller must: one limit, one
        // check; three, an array (the global limit keyed by nothing). It reads the answer in
        // place, as the layer does: moving the verdicts out of the `Result` is a copy of 264
        // bytes that governor's `is_ok()` does not make.
        let answer = match self.limits.as_slice() {
            [limit] => self.backend.check_now(&[Check::new(limit, key)]),
            [ip, daily, global] => self.backend.check_now(&[
                Check::new(ip, key),
                Check::new(daily, key),
                Check::new(global, b""),
            ]),
            _ => unreachable!("one or three limits"),
        };
        match &answer {
            Ok(verdicts) => verdicts.iter().all(|v| v.is_allowed()),
            Err(e) => panic!("the in-memory backend failed: {e}"),
        }
    }
}

struct Governor {
    per_ip: Vec<DefaultKeyedRateLimiter<IpAddr>>,
    global: Option<DefaultDirectRateLimiter>,
    keys: Vec<IpAddr>,
}

impl Target for Governor {
    fn keys(&self) -> usize {
        self.keys.len()
    }

    fn check(&self, i: usize) -> bool {
        let key = &self.keys[i];
        self.per_ip.iter().all(|l| l.check_key(key).is_ok())
            && self.global.as_ref().is_none_or(|g| g.check().is_ok())
    }
}

#[derive(Clone, Copy)]
enum Quotas {
    Allow,
    Deny,
}

fn tollgate_quota(q: Quotas) -> Quota {
    match q {
        // A million a second with a burst of four billion: never reached.
        Quotas::Allow => Quota::per_second(1_000_000)
            .unwrap()
            .with_burst(u32::MAX)
            .unwrap(),
        Quotas::Deny => Quota::per_day(1).unwrap(),
    }
}

fn governor_quota(q: Quotas) -> governor::Quota {
    match q {
        Quotas::Allow => governor::Quota::per_second(NonZeroU32::new(1_000_000).unwrap())
            .allow_burst(NonZeroU32::MAX),
        Quotas::Deny => governor::Quota::with_period(Duration::from_secs(86_400))
            .unwrap()
            .allow_burst(NonZeroU32::MIN),
    }
}

fn tollgate(keys: usize, q: Quotas, stacked: bool) -> Tollgate {
    let quota = tollgate_quota(q);
    let mut limits = vec![Limit::gcra("per-ip", quota).unwrap()];
    if stacked {
        limits
            .push(Limit::fixed_window("per-ip-daily", Quota::per_day(u32::MAX).unwrap()).unwrap());
        limits.push(Limit::gcra("global", quota).unwrap());
    }
    let t = Tollgate {
        backend: MemoryBackend::new(),
        limits,
        keys: addrs(keys).into_iter().map(ip_key).collect(),
    };
    prime(&t, q);
    t
}

fn governor(keys: usize, q: Quotas, stacked: bool) -> Governor {
    let quota = governor_quota(q);
    let mut per_ip = vec![RateLimiter::keyed(quota)];
    let mut global = None;
    if stacked {
        per_ip.push(RateLimiter::keyed(governor::Quota::per_hour(
            NonZeroU32::MAX,
        )));
        global = Some(RateLimiter::direct(quota));
    }
    let g = Governor {
        per_ip,
        global,
        keys: addrs(keys).into_iter().map(IpAddr::V4).collect(),
    };
    prime(&g, q);
    g
}

/// Tracks every key before the measurement (and uses up the quota of the denied cells), then
/// checks that the cell measures what it says.
fn prime(t: &impl Target, q: Quotas) {
    for i in 0..t.keys() {
        t.check(i);
    }
    for i in [0, t.keys() - 1] {
        assert_eq!(t.check(i), matches!(q, Quotas::Allow));
    }
}

/// Runs `iters` checks on each of `threads` threads, all started together; the slowest
/// thread's time.
fn run(t: &impl Target, threads: usize, iters: u64) -> Duration {
    let n = t.keys();
    let lap = |start: usize| {
        let mut i = start;
        let began = Instant::now();
        for _ in 0..iters {
            black_box(t.check(black_box(i)));
            i += 1;
            if i == n {
                i = 0;
            }
        }
        began.elapsed()
    };
    if threads == 1 {
        return lap(0);
    }
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                let (barrier, lap) = (&barrier, &lap);
                s.spawn(move || {
                    barrier.wait();
                    lap(k * n / threads)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap_or_default()
    })
}

/// The bytes hashed here must be the ones `ClientIp` takes from a real request.
fn assert_key_layout() {
    let addr = Ipv4Addr::new(10, 0, 0, 7);
    let mut req = axum::http::Request::new(());
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((addr, 4242))));
    let key = ClientIp::peer().extract(&RequestView::new(&req)).unwrap();
    assert_eq!(key.as_bytes(), ip_key(addr));
}

fn one_check(c: &mut Criterion) {
    assert_key_layout();
    let mut group = c.benchmark_group("check");
    for (keys, keys_name) in [(1, "hot"), (KEYS, "100k")] {
        for (q, q_name) in [(Quotas::Allow, "allowed"), (Quotas::Deny, "denied")] {
            let ours = tollgate(keys, q, false);
            let theirs = governor(keys, q, false);
            for threads in [1, 2] {
                let cell = format!("{keys_name}/{q_name}/{threads}t");
                group.bench_function(format!("tollgate/{cell}"), |b| {
                    b.iter_custom(|iters| run(&ours, threads, iters))
                });
                group.bench_function(format!("governor/{cell}"), |b| {
                    b.iter_custom(|iters| run(&theirs, threads, iters))
                });
            }
        }
    }
    group.finish();

    let mut group = c.benchmark_group("stack3");
    for (keys, keys_name) in [(1, "hot"), (KEYS, "100k")] {
        let ours = tollgate(keys, Quotas::Allow, true);
        let theirs = governor(keys, Quotas::Allow, true);
        group.bench_function(format!("tollgate/{keys_name}/allowed/1t"), |b| {
            b.iter_custom(|iters| run(&ours, 1, iters))
        });
        group.bench_function(format!("governor/{keys_name}/allowed/1t"), |b| {
            b.iter_custom(|iters| run(&theirs, 1, iters))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(700))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = one_check
}
criterion_main!(benches);
