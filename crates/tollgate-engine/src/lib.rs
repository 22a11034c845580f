//! The parts of tollgate that know nothing of HTTP or Redis.
//!
//! - [`Quota`], [`Algorithm`] and [`Limit`]: what a limit is, validated when it is built.
//! - [`algorithm`]: the maths of GCRA, fixed window and sliding log as pure functions of
//!   (stored state, now, cost). Every backend implements exactly this maths.
//! - [`Clock`]: where `now` comes from; [`SystemClock`] in production, [`FakeClock`] in tests.
//! - [`Backend`]: checks every limit of one request in one call, all-or-nothing.
//! - [`MemoryBackend`]: the bounded, sharded in-memory backend (the default).
//!
//! Time is measured in whole microseconds since the Unix epoch ([`Micros`]) everywhere,
//! including in the Redis scripts, so that every backend computes the same figures.
//!
//! # Examples
//!
//! ```
//! use tollgate_engine::{Backend, Check, FakeClock, Limit, MemoryBackend, Quota};
//!
//! let clock = FakeClock::new(0);
//! let backend = MemoryBackend::builder().clock(clock.clone()).build();
//! let limit = Limit::gcra("login", Quota::per_minute(2)?)?;
//! let check = |key: &[u8]| backend.check_now(&[Check::new(&limit, key)]).unwrap()[0];
//!
//! assert!(check(b"alice").is_allowed());
//! assert!(check(b"alice").is_allowed());
//! assert!(!check(b"alice").is_allowed()); // the third within a minute
//! assert!(check(b"bob").is_allowed()); // keys are independent
//! # Ok::<(), tollgate_engine::ConfigError>(())
//! ```

pub mod algorithm;
mod backend;
mod bounds;
mod check;
mod clock;
mod counting;
mod error;
pub mod lease;
pub mod leased;
mod limit;
mod memory;
pub mod notice;
mod penalty;
mod quota;
mod reports;
mod sip;
mod system_clock;
// The Space-Saving summary the layer counts refusals in before a backend's `Reports` merges
// them: shared by this workspace's crates, not part of the documented API.
#[doc(hidden)]
pub mod topk;
mod tsc;
mod verdict;
mod verdicts;

pub use backend::{
    deny_micros, unsupported, Admin, AdminFuture, Backend, BackendError, BackendErrorKind,
    KeyState, Landing, Lifecycle, Reports, Slots, Standing,
};
pub use bounds::{
    DEFAULT_MAX_WAITING, MAX_CHECKS, MAX_DENY, MAX_LOG_UNITS, MAX_NAME_LEN, MAX_PERIOD, MAX_PLANS,
    MAX_WAITERS_PER_LIMIT,
};
pub use check::{Check, Receipt, Settlement};
pub use clock::{Clock, FakeClock, Micros};
pub use counting::Algorithm;
pub use error::ConfigError;
pub use lease::{Lease, MAX_SLICE};
pub use limit::{
    rollout_share, FailurePolicy, Limit, MissingKeyPolicy, DEFAULT_BUSY_RETRY_AFTER,
    DEFAULT_SLOT_TTL,
};
pub use memory::{MemoryBackend, MemoryBackendBuilder, MemoryStats};
pub use penalty::Penalty;
pub use quota::Quota;
pub use reports::{Refused, REPORT_BUCKET, REPORT_TICK};
// What a backend's `Reports` needs to bucket and merge reports as the in-memory one does;
// used by tollgate-redis, not part of the documented API.
#[doc(hidden)]
pub use reports::{bucket_of, combine};
pub use system_clock::SystemClock;
pub use verdict::{Status, Verdict};
pub use verdicts::Verdicts;
