//! What a key holds under one limit, read without consuming anything.

use std::time::Duration;

use crate::algorithm;
use crate::check::Check;
use crate::counting::Algorithm;
use crate::quota::Quota;
use crate::verdict::{Status, Verdict};

/// One key's state under one limit, read without consuming anything
/// ([`Backend::peek`](crate::Backend::peek)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyState {
    /// Units the key may take now (for a concurrency limit: slots free now).
    pub remaining: u64,
    /// Time until the quota is whole again (0 for a concurrency limit: nothing refills with
    /// time).
    pub reset: Duration,
    /// Time until one more unit can be taken, when none is left now; `None` when one is
    /// left, or when it never can be (a concurrency limit's slots free when requests end).
    pub retry_after: Option<Duration>,
}

impl KeyState {
    /// The state a check of one unit of `check`'s limit saw, from its `verdict`, which the
    /// backend did not consume.
    pub fn from_probe(check: &Check<'_>, verdict: Verdict) -> Self {
        let unconsumed = algorithm::unconsumed(check.limit.algorithm(), &check.quota, verdict, 1);
        let retry_after = match (check.limit.algorithm(), unconsumed.status) {
            (Algorithm::Concurrency, _) => None,
            (_, Status::Allowed) => None,
            _ => unconsumed.retry_after(),
        };
        Self {
            remaining: unconsumed.remaining,
            reset: unconsumed.reset(),
            retry_after,
        }
    }

    /// The state of a key the backend holds nothing for: its whole quota, or for GCRA its
    /// whole burst (what a request could take at once; the burst is the limit unless set).
    pub fn fresh(quota: &Quota) -> Self {
        Self {
            remaining: u64::from(quota.burst()),
            reset: Duration::ZERO,
            retry_after: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_gcra_key_has_its_burst_left() {
        let quota = Quota::per_minute(60).unwrap().with_burst(10).unwrap();
        assert_eq!(KeyState::fresh(&quota).remaining, 10);
        // One unit later, one less: what the first check of the key answers.
        let (verdict, _) = algorithm::gcra(&quota, None, 0, 1);
        assert_eq!(verdict.remaining, 9);
        assert_eq!(
            KeyState::fresh(&Quota::per_minute(60).unwrap()).remaining,
            60
        );
    }
}
