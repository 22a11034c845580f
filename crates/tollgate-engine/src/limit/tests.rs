//! The unit tests of limits: names, quotas, plans and costs.

use super::*;
use crate::MAX_PERIOD;

#[test]
fn gcra_refuses_rates_that_whole_microseconds_cannot_space() {
    let gcra = |q: Result<Quota, ConfigError>| Limit::gcra("r", q.unwrap()).map(|_| ());
    // One every 1.67 µs would be counted as one every 1 µs: 67% fast.
    assert_eq!(
        gcra(Quota::per_second(600_000)),
        Err(ConfigError::ImpreciseRate)
    );
    // 33.33 µs counted as 33: 1.01% fast.
    assert_eq!(
        gcra(Quota::per_second(30_000)),
        Err(ConfigError::ImpreciseRate)
    );
    // Exact, or within 1%.
    assert_eq!(gcra(Quota::per_second(1_000_000)), Ok(()));
    assert_eq!(gcra(Quota::per_second(25_000)), Ok(()));
    assert_eq!(gcra(Quota::per_second(9_000)), Ok(()));
    assert_eq!(gcra(Quota::per_day(u32::MAX)), Ok(()));
    // Windows and logs have no interval: any rate is exact.
    let q = Quota::per_second(600_000).unwrap();
    assert!(Limit::fixed_window("w", q).is_ok());
    assert!(Limit::sliding_log("l", Quota::per_second(10_000).unwrap()).is_ok());
}

#[test]
fn sliding_logs_above_the_most_units_a_log_may_hold_are_refused() {
    let log = |limit| Limit::sliding_log("l", Quota::per_day(limit).unwrap()).map(|_| ());
    assert_eq!(log(MAX_LOG_UNITS), Ok(()));
    let too_long = ConfigError::LogTooLong {
        limit: MAX_LOG_UNITS + 1,
        max: MAX_LOG_UNITS,
    };
    assert_eq!(log(MAX_LOG_UNITS + 1), Err(too_long));
    assert!(log(1_000_000).is_err());
    // Other algorithms keep one number per key: any quota.
    assert!(Limit::fixed_window("w", Quota::per_day(1_000_000).unwrap()).is_ok());
    // A cost fits the quota, so never the log's maximum either.
    let full = Limit::sliding_log("l", Quota::per_day(MAX_LOG_UNITS).unwrap()).unwrap();
    assert_eq!(
        full.clone().with_cost(MAX_LOG_UNITS).unwrap().cost(),
        MAX_LOG_UNITS
    );
    assert_eq!(
        full.with_cost(MAX_LOG_UNITS + 1).unwrap_err(),
        ConfigError::InvalidCost {
            cost: MAX_LOG_UNITS + 1,
            max: MAX_LOG_UNITS
        }
    );
}

#[test]
fn plans_are_checked_like_the_default_quota() {
    let minute = |n| Quota::per_minute(n).unwrap();
    let w = Limit::fixed_window("w", minute(5)).unwrap();
    assert_eq!(
        w.clone().plan("", minute(9)).unwrap_err(),
        ConfigError::InvalidPlan(String::new())
    );
    assert_eq!(
        w.clone().plan("a b", minute(9)).unwrap_err(),
        ConfigError::InvalidPlan("a b".into())
    );
    let pro = w.clone().plan("pro", minute(50)).unwrap();
    assert_eq!(
        pro.clone().plan("pro", minute(60)).unwrap_err(),
        ConfigError::InvalidPlan("pro".into())
    );
    // One period per fixed window.
    assert_eq!(
        w.clone()
            .plan("day", Quota::per_day(100).unwrap())
            .unwrap_err(),
        ConfigError::PlanPeriod("day".into())
    );
    // A burst only on GCRA; GCRA's precision; a log's size.
    assert_eq!(
        w.clone()
            .plan("b", minute(9).with_burst(3).unwrap())
            .unwrap_err(),
        ConfigError::InvalidBurst
    );
    let g = Limit::gcra("g", minute(5)).unwrap();
    assert_eq!(
        g.clone()
            .plan("fast", Quota::per_second(600_000).unwrap())
            .unwrap_err(),
        ConfigError::ImpreciseRate
    );
    let l = Limit::sliding_log("l", minute(5)).unwrap();
    assert_eq!(
        l.plan("big", minute(MAX_LOG_UNITS + 1)).unwrap_err(),
        ConfigError::LogTooLong {
            limit: MAX_LOG_UNITS + 1,
            max: MAX_LOG_UNITS
        }
    );
    // The cost fits every quota, whichever comes first.
    let costly = w.clone().with_cost(4).unwrap();
    assert_eq!(
        costly.plan("tiny", minute(3)).unwrap_err(),
        ConfigError::InvalidCost { cost: 4, max: 3 }
    );
    let tiny = w.plan("tiny", minute(3)).unwrap();
    assert_eq!(
        tiny.clone().with_cost(4).unwrap_err(),
        ConfigError::InvalidCost { cost: 4, max: 3 }
    );
    // At most MAX_PLANS.
    let mut many = Limit::gcra("many", minute(5)).unwrap();
    for i in 0..MAX_PLANS {
        many = many.plan(&format!("p{i}"), minute(6)).unwrap();
    }
    assert_eq!(
        many.plan("one-more", minute(6)).unwrap_err(),
        ConfigError::InvalidPlan("one-more".into())
    );
    // Lookups, and the indices the layer keeps.
    assert_eq!(pro.quota_of(Some("pro")), (1, &minute(50)));
    assert_eq!(pro.quota_of(Some("free")), (0, &minute(5)));
    assert_eq!(pro.quota_of(None), (0, &minute(5)));
    assert_eq!(pro.quota_at(1), &minute(50));
    assert_eq!(pro.quota_at(7), &minute(5));
    // The fallback's share divides every plan.
    let share = pro.local_share(NonZeroU32::new(5).unwrap());
    assert_eq!(share.quota_of(Some("pro")).1.limit(), 10);
    assert_eq!(share.quota().limit(), 1);
}

#[test]
fn only_gcra_can_delay_and_the_bounds_are_checked() {
    let q = Quota::per_minute(10).unwrap();
    let two = Duration::from_secs(2);
    assert_eq!(
        Limit::fixed_window("w", q).unwrap().delay_up_to(two).err(),
        Some(ConfigError::DelayUnsupported(Algorithm::FixedWindow))
    );
    assert_eq!(
        Limit::sliding_log("s", q).unwrap().delay_up_to(two).err(),
        Some(ConfigError::DelayUnsupported(Algorithm::SlidingLog))
    );
    assert_eq!(
        Limit::concurrency("c", 4).unwrap().delay_up_to(two).err(),
        Some(ConfigError::DelayUnsupported(Algorithm::Concurrency))
    );
    let gcra = Limit::gcra("g", q).unwrap();
    assert_eq!((gcra.delay_micros(), gcra.waiting_bound()), (0, 64));
    let delayed = gcra.clone().delay_up_to(two).unwrap();
    assert_eq!(delayed.delay_micros(), 2_000_000);
    assert!(matches!(
        gcra.clone()
            .delay_up_to(MAX_PERIOD + Duration::from_secs(1)),
        Err(ConfigError::InvalidDelay(_))
    ));
    assert!(matches!(
        gcra.clone().max_waiting(0),
        Err(ConfigError::InvalidDelay(_))
    ));
    assert_eq!(gcra.max_waiting(3).unwrap().waiting_bound(), 3);
    // A check carries no delay unless the caller gives it one.
    assert_eq!(crate::Check::new(&delayed, b"k").delay, 0);
}

#[test]
fn only_a_concurrency_limit_queues_and_a_queue_lets_someone_wait() {
    use std::time::Duration;
    let ten = Duration::from_secs(10);
    let queued = Limit::concurrency("exports", 2)
        .unwrap()
        .queue_up_to(ten, 3)
        .unwrap();
    assert_eq!((queued.queue(), queued.waiting_bound()), (ten, 3));
    assert_eq!(queued.queue_micros(), 10_000_000);
    assert_eq!(Limit::concurrency("c", 1).unwrap().queue(), Duration::ZERO);
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
    ] {
        let limit = Limit::new("r", algorithm, Quota::per_minute(5).unwrap()).unwrap();
        assert_eq!(
            limit.queue_up_to(ten, 3).unwrap_err(),
            ConfigError::QueueUnsupported(algorithm)
        );
    }
    assert!(matches!(
        Limit::concurrency("c", 1).unwrap().queue_up_to(ten, 0),
        Err(ConfigError::InvalidDelay(_))
    ));
    assert!(matches!(
        Limit::concurrency("c", 1)
            .unwrap()
            .queue_up_to(MAX_PERIOD + Duration::from_secs(1), 1),
        Err(ConfigError::InvalidDelay(_))
    ));
}
