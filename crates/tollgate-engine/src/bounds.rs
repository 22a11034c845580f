//! The bounds every limit and batch is held to, as documented constants.

use std::time::Duration;

/// The most limits one request can be checked against in one call.
pub const MAX_CHECKS: usize = 8;

/// The longest limit name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// The longest period a quota may have (and the longest a GCRA burst may take to refill):
/// 100 years of 365.25 days. Times stay far below 2^53 microseconds, where the Redis scripts'
/// numbers stop being exact, and no sum of a time and a period can overflow.
pub const MAX_PERIOD: Duration = Duration::from_secs(36_525 * 86_400);

/// The longest a deny by hand may last ([`Admin::deny`](crate::Admin::deny)): 100 years, as
/// [`MAX_PERIOD`]. A longer one is refused with an error, never shortened: its end would lie
/// where the Redis scripts' numbers stop being exact (2^53 microseconds).
pub const MAX_DENY: Duration = MAX_PERIOD;

/// The most plans one limit may name.
pub const MAX_PLANS: usize = 255;

/// The largest quota a sliding-log limit may have, in units per period, and so the largest
/// cost one of its checks can be admitted at.
///
/// A sliding log keeps one entry per admitted unit and key for a period (in memory, or a
/// sorted-set member in Redis, where a check that admits `cost` units writes `cost` members),
/// so its quota bounds both the memory one key takes and the work one check does. A check
/// whose cost is above its quota is refused as too costly (`Status::CostTooHigh`) before any
/// entry is written, whatever the cost. For larger quotas, GCRA or a fixed window keep one
/// number per key.
pub const MAX_LOG_UNITS: u32 = 10_000;

/// The most requests one key of a delayed limit may have waiting at once, unless the limit
/// says otherwise ([`Limit::max_waiting`](crate::Limit::max_waiting)).
pub const DEFAULT_MAX_WAITING: u32 = 64;

/// The most requests that may wait for one delayed limit of one layer at once, over all its
/// keys: a spray of keys cannot grow the waiters past it. A request that would wait beyond it
/// is checked without the delay (admitted only if it need not wait, refused otherwise).
pub const MAX_WAITERS_PER_LIMIT: u32 = 10_000;
