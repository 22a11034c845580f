//! What a limit does when its backend fails, and with a request it cannot find a key for.

use std::num::NonZeroU32;

/// What a limit does when its backend fails or does not answer within its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Admit the request. The decision says `Bypassed` and the bypass is counted, so a dead
    /// limiter is visible. The default: a limiter should not take a site down.
    #[default]
    FailOpen,
    /// Refuse the request (`503 Service Unavailable` with `Retry-After`).
    FailClosed,
    /// Check a bounded in-memory limiter instead, with the quota divided by `replicas` (the
    /// number of processes expected to share the load).
    Fallback {
        /// The expected number of replicas; 1 keeps the quota as it is.
        replicas: NonZeroU32,
    },
}

/// What a limit does with a request it cannot find a key for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKeyPolicy {
    /// Refuse the request (`400 Bad Request`). The default: no key must never mean no limit.
    #[default]
    Reject,
    /// Do not apply this limit to the request; the decision says `Skipped`.
    Skip,
    /// Count the request against one bucket shared by every keyless request.
    SharedBucket,
}
