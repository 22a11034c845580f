use std::fmt;

use crate::bounds::{MAX_CHECKS, MAX_NAME_LEN};
use crate::counting::Algorithm;

/// A limit, quota or backend that cannot be built as configured.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A quota of zero requests.
    ZeroLimit,
    /// A period shorter than one microsecond per admitted request.
    PeriodTooShort,
    /// A period, or the time a GCRA burst takes to refill, longer than [`crate::MAX_PERIOD`].
    PeriodTooLong,
    /// A GCRA rate that whole microseconds cannot space within 1% (see [`crate::Limit::new`]).
    ImpreciseRate,
    /// A burst of zero, or a burst set on an algorithm that has none.
    InvalidBurst,
    /// A fixed cost of zero, or larger than the quota admits at once.
    InvalidCost {
        /// The configured cost.
        cost: u32,
        /// The most the quota admits at once.
        max: u32,
    },
    /// A sliding log whose quota is above [`crate::MAX_LOG_UNITS`]: its log, one entry per
    /// admitted unit, would be unbounded in practice.
    LogTooLong {
        /// The quota's limit.
        limit: u32,
        /// The most a sliding log may admit per period.
        max: u32,
    },
    /// A limit name that is empty, too long, or has characters outside `[A-Za-z0-9_.-]`.
    InvalidName(String),
    /// Two limits of one layer with the same name.
    DuplicateName(String),
    /// More limits on one layer than [`crate::MAX_CHECKS`].
    TooManyLimits,
    /// A layer with no limit.
    NoLimits,
    /// A limit name reserved for the layer's own use (the canary's).
    ReservedName(String),
    /// An address prefix longer than the address: IPv4 has 32 bits, IPv6 128.
    InvalidPrefix {
        /// The configured prefix length.
        bits: u8,
        /// The longest prefix the address family has.
        max: u8,
    },
    /// A plan name that is empty, longer than [`MAX_NAME_LEN`], has characters outside
    /// `[A-Za-z0-9_.-]`, or is given twice for one limit.
    InvalidPlan(String),
    /// A fixed-window plan quota whose period differs from the limit's default: a window's
    /// count belongs to one period, so every plan of a fixed window shares it.
    PlanPeriod(String),
    /// A key length bound outside `1..=max`.
    InvalidKeyLength {
        /// The configured length.
        len: usize,
        /// The longest key.
        max: usize,
    },
    /// An allowlist entry that no request could match: a name its key extractor refuses
    /// (an address that does not parse, a tenant with characters tenants cannot have).
    InvalidAllowlistEntry(String),
    /// A denylist entry that no request could match, as for
    /// [`InvalidAllowlistEntry`](Self::InvalidAllowlistEntry).
    InvalidDenylistEntry(String),
    /// A lease whose parameters are out of range (what is wrong is said).
    InvalidLease(&'static str),
    /// A lease on an algorithm that cannot be leased (a sliding log, a concurrency limit):
    /// only GCRA and fixed windows count units that a slice can take.
    LeaseUnsupported(Algorithm),
    /// A leased GCRA limit that settles after the response (a metered limit with `count_if`,
    /// a charge by the handler, or a refund on drop): a refund moves the key's TAT back under
    /// the slices other replicas hold, paced by the TATs their takes left, and could let them
    /// admit more than the quota.
    LeaseWithSettle(String),
    /// A delay ([`crate::Limit::delay_up_to`]) on an algorithm that has no exact one: a fixed
    /// window or a sliding log cannot reserve a later time without a queue of the requests
    /// that wait (their units are counted when they are admitted, not when they are served),
    /// and a concurrency slot frees at no time anyone knows. Only GCRA reserves an emission
    /// time.
    DelayUnsupported(Algorithm),
    /// A delay or a queue's wait longer than [`crate::MAX_PERIOD`], or a bound of 0 waiting
    /// requests.
    InvalidDelay(&'static str),
    /// A queue ([`crate::Limit::queue_up_to`]) on a limit that is not a concurrency limit: a
    /// queue waits for a slot to be given back; a rate limit's units come back with time, for
    /// which GCRA has [`crate::Limit::delay_up_to`].
    QueueUnsupported(Algorithm),
    /// A penalty ([`crate::Limit::penalty`]) on a limit that cannot have one: a concurrency
    /// limit (a busy key is not misbehaving: its slots free as its requests end) or a leased
    /// one (a replica answers from its slice, where no refusal would be counted).
    PenaltyUnsupported(&'static str),
    /// A penalty of zero refusals, a zero or too long window or block, or a longest block
    /// shorter than the first.
    InvalidPenalty(&'static str),
    /// A layer whose delayed limit (`delayed`, see [`crate::Limit::delay_up_to`]) is stacked
    /// with a fixed window or a sliding log (`window`): the window counts a delayed request
    /// when it is checked, not when it runs, so a window could see up to the delay's waiters
    /// run beyond its limit. Put the window on a layer of its own inside the delayed one (it
    /// then counts a request when it runs), or drop the delay.
    DelayWithWindow {
        /// The delayed limit's name.
        delayed: String,
        /// The fixed window's or sliding log's name.
        window: String,
    },
    /// `pause_from_upstream` on a limit that is not GCRA: only a GCRA key's TAT can be held
    /// back until a time the upstream names.
    PauseUnsupported {
        /// The limit's name.
        limit: String,
        /// Its algorithm.
        algorithm: Algorithm,
    },
    /// An enforced share ([`crate::Limit::enforce_percent`]) above 100 percent.
    InvalidEnforcePercent(u32),
    /// An adaptive concurrency limit's settings that cannot work together (a floor above the
    /// ceiling, a reserve over 100 percent...): what is wrong, in words.
    InvalidAdaptive(String),
}

/// The words of `Display`: `main() -> Result<(), Box<dyn Error>>` prints an error with
/// `Debug`, and a person reading it needs what is wrong and how to fix it.
impl fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroLimit => f.write_str("a quota must admit at least one request"),
            Self::PeriodTooShort => {
                f.write_str("the period must last at least one microsecond per admitted request")
            }
            Self::PeriodTooLong => {
                f.write_str("the period (and a GCRA burst's refill time) must not exceed 100 years")
            }
            Self::ImpreciseRate => f.write_str(
                "GCRA spaces requests by whole microseconds, and this rate would run over 1% \
                 fast: make the period a multiple of the limit, or lower the rate",
            ),
            Self::InvalidBurst => f.write_str("burst must be at least 1, and only GCRA has one"),
            Self::InvalidCost { cost, max } => {
                write!(f, "cost {cost} is invalid: it must be between 1 and {max}")
            }
            Self::LogTooLong { limit, max } => write!(
                f,
                "a sliding log keeps one entry per admitted unit: its quota must be at most \
                 {max} per period, not {limit} (use GCRA or a fixed window)"
            ),
            Self::InvalidName(name) => write!(
                f,
                "limit name {name:?} must be 1 to {} characters of [A-Za-z0-9_.-]",
                MAX_NAME_LEN
            ),
            Self::DuplicateName(name) => write!(f, "two limits are named {name:?}"),
            Self::TooManyLimits => write!(f, "at most {} limits per layer", MAX_CHECKS),
            Self::NoLimits => f.write_str("a rate-limit layer needs at least one limit"),
            Self::ReservedName(name) => {
                write!(f, "the limit name {name:?} is reserved for the canary")
            }
            Self::InvalidPrefix { bits, max } => {
                write!(
                    f,
                    "prefix /{bits} is invalid: it must be between 0 and {max}"
                )
            }
            Self::InvalidPlan(name) => write!(
                f,
                "plan name {name:?} must be 1 to {} characters of [A-Za-z0-9_.-], once per limit",
                MAX_NAME_LEN
            ),
            Self::PlanPeriod(name) => write!(
                f,
                "plan {name:?} of a fixed window must have the period of the limit's default quota"
            ),
            Self::InvalidKeyLength { len, max } => {
                write!(
                    f,
                    "key length {len} is invalid: it must be between 1 and {max}"
                )
            }
            Self::InvalidAllowlistEntry(entry) => write!(
                f,
                "allowlist entry {entry:?} is not a key that any request could have"
            ),
            Self::InvalidDenylistEntry(entry) => write!(
                f,
                "denylist entry {entry:?} is not a key that any request could have"
            ),
            Self::InvalidLease(why) => write!(f, "invalid lease: {why}"),
            Self::LeaseUnsupported(algorithm) => write!(
                f,
                "a {} limit cannot be leased: only GCRA and fixed windows can",
                algorithm.as_str()
            ),
            Self::LeaseWithSettle(name) => write!(
                f,
                "limit {name:?} is a leased GCRA limit that settles after the response: a \
                 refund could let other replicas' slices admit more than the quota; lease it \
                 or settle it, not both (a fixed window can be both)"
            ),
            Self::DelayUnsupported(algorithm) => write!(
                f,
                "a {} limit cannot delay requests: only GCRA reserves an emission time \
                 (a concurrency limit can queue them instead)",
                algorithm.as_str()
            ),
            Self::InvalidDelay(what) => write!(f, "invalid delay: {what}"),
            Self::QueueUnsupported(algorithm) => write!(
                f,
                "a {} limit cannot queue requests: only a concurrency limit waits for a slot \
                 (GCRA can delay them instead)",
                algorithm.as_str()
            ),
            Self::PenaltyUnsupported(why) => write!(f, "this limit cannot have a penalty: {why}"),
            Self::InvalidPenalty(what) => write!(f, "invalid penalty: {what}"),
            Self::DelayWithWindow { delayed, window } => write!(
                f,
                "limit {delayed:?} delays requests and limit {window:?} counts them by window \
                 on the same layer: the window would count a delayed request when it is \
                 checked, not when it runs, and could let more than its limit run in one \
                 window; put {window:?} on a layer of its own inside this one (it then counts a \
                 request when it runs), or drop the delay"
            ),
            Self::PauseUnsupported { limit, algorithm } => write!(
                f,
                "limit {limit:?} is a {} limit: pause_from_upstream holds back a GCRA key's \
                 emission time, and only a GCRA limit has one",
                algorithm.as_str()
            ),
            Self::InvalidAdaptive(why) => write!(f, "invalid adaptive concurrency limit: {why}"),
            Self::InvalidEnforcePercent(p) => write!(
                f,
                "enforce_percent {p} is invalid: it must be between 0 (shadow) and 100 (enforced)"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    /// `main() -> Result<(), Box<dyn Error>>` prints `Debug`: it must say what `Display` says.
    #[test]
    fn debug_says_what_display_says() {
        for e in [
            ConfigError::ZeroLimit,
            ConfigError::InvalidName("a b".to_owned()),
            ConfigError::InvalidCost { cost: 0, max: 5 },
        ] {
            assert_eq!(format!("{e:?}"), e.to_string());
        }
    }
}
