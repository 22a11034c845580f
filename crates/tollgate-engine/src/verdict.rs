//! How one limit answered one check.

use std::time::Duration;

use crate::clock::Micros;

/// How one limit answered one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// Within the limit. Consumed if the whole batch was admitted.
    Allowed,
    /// Over the limit; the same request could be admitted after `retry_after` microseconds.
    Denied {
        /// Microseconds until the same request would be admitted.
        retry_after: Micros,
    },
    /// The request costs more than the limit can ever admit at once.
    CostTooHigh,
    /// Not evaluated: another check of the batch was refused before this one was looked at
    /// (for example from a local deny cache). Nothing was consumed.
    NotChecked,
    /// The key is in the penalty box ([`Penalty`](crate::Penalty)): refused until its
    /// block ends, whatever the request's cost. Nothing was consumed.
    Blocked {
        /// Microseconds until the block ends.
        retry_after: Micros,
    },
    /// The key is denied by hand ([`Admin::deny`](crate::Admin::deny)) until the deny ends
    /// or is lifted. Nothing was consumed.
    Denylisted {
        /// Microseconds until the deny ends.
        retry_after: Micros,
    },
    /// The in-memory backend is tracking as many keys as it may and this key is new.
    AtCapacity {
        /// Microseconds until space is likely to have been reclaimed.
        retry_after: Micros,
    },
}

/// The answer of one limit for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Verdict {
    /// Admitted or why not.
    pub status: Status,
    /// Units left in the quota after this request (before it, when it was not admitted).
    pub remaining: u64,
    /// Microseconds until the quota is whole again.
    pub reset: Micros,
}

impl Verdict {
    pub(crate) const EMPTY: Self = Self::new(Status::Allowed, 0, 0);

    /// A verdict of `status`, with `remaining` units left and the quota whole again in
    /// `reset` microseconds.
    #[inline]
    pub const fn new(status: Status, remaining: u64, reset: Micros) -> Self {
        Self {
            status,
            remaining,
            reset,
        }
    }

    /// Whether this limit admits the request.
    #[inline]
    pub fn is_allowed(&self) -> bool {
        self.status == Status::Allowed
    }

    /// Time until the request could be admitted, if it was refused and can ever be.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.status {
            Status::Denied { retry_after }
            | Status::AtCapacity { retry_after }
            | Status::Blocked { retry_after }
            | Status::Denylisted { retry_after } => Some(Duration::from_micros(retry_after)),
            Status::Allowed | Status::CostTooHigh | Status::NotChecked => None,
        }
    }

    /// Time until the quota is whole again.
    pub fn reset(&self) -> Duration {
        Duration::from_micros(self.reset)
    }
}
