//! Property test: the Redis backend gives the verdicts the in-memory backend gives, on the
//! same random sequence of batches, costs and times (`check_at` fixes the scripts' clock; the
//! in-memory backend runs on a `FakeClock`). A real redis-server, started once.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use support::*;
use tollgate_engine::{Check, FakeClock, Limit, MemoryBackend, Quota};
use tollgate_testsupport::RedisServer;

const START: u64 = 1_700_000_000_000_000;

/// Each case keys its checks apart, so that cases never see each other's state.
fn case_key() -> Vec<u8> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("case-{}", NEXT.fetch_add(1, Ordering::Relaxed)).into_bytes()
}

fn limits(limit: u32, secs: u64) -> [Limit; 3] {
    let q = Quota::new(limit, Duration::from_secs(secs)).unwrap();
    [
        Limit::gcra("p-gcra", q).unwrap(),
        Limit::fixed_window("p-fixed", q).unwrap(),
        Limit::sliding_log("p-sliding", q).unwrap(),
    ]
}

/// A step: time passes by `gap` µs (half of them whole quarters of a second, to land on the
/// edges of windows), then one batch of the limits picked by `mask` (bits 0 to 2), each with
/// its own cost.
fn steps() -> impl Strategy<Value = Vec<(u64, u8, [u32; 3])>> {
    let gap = prop_oneof![(0u64..12).prop_map(|n| n * 250_000), 0u64..3_000_000];
    prop::collection::vec((gap, 1u8..8, [1u32..5, 1u32..5, 1u32..5]), 1..30)
}

#[test]
fn redis_and_memory_give_the_same_verdicts() {
    // One server for every case, killed when the test ends (a server kept in a static would
    // outlive the test process).
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = runtime.block_on(async { standalone(&server.url()).build().unwrap() });
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 48,
        source_file: Some(file!()),
        ..ProptestConfig::default()
    });
    let cases = ((1u32..7, 1u64..6), steps());
    let result = runner.run(&cases, |((limit, secs), steps)| {
        let limits = limits(limit, secs);
        let key = case_key();
        let clock = FakeClock::new(START);
        let memory = MemoryBackend::builder().clock(clock.clone()).build();
        let mut now = START;
        for (gap, mask, costs) in steps {
            now += gap;
            clock.set(now);
            let batch: Vec<Check<'_>> = (0..3)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| Check::new(&limits[i], &key).with_cost(costs[i]))
                .collect();
            let from_memory = memory.check_now(&batch).unwrap();
            let from_redis = runtime.block_on(backend.check_at(&batch, now)).unwrap();
            prop_assert_eq!(&from_redis[..], &from_memory[..], "at {}", now - START);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}\n{runner}");
    }
}
