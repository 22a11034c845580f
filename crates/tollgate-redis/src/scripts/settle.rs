//! `settle.lua`: what admitted checks reserved, given back or charged to what they cost.

use tollgate_engine::{Algorithm, BackendError, Check, Settlement};

use std::sync::LazyLock;

use crate::keys::{Keyer, Suffix};
use crate::scripts::check::EncodedCheck;
use crate::scripts::Script;

/// Settles checks admitted earlier: gives back or consumes the difference between what each
/// reserved and what it should have cost (see `tollgate_engine::Settlement` for each algorithm).
///
/// `KEYS`: per settlement, its key (a GCRA TAT at `<base>:v3`, a fixed window's
/// `<base>:<index>`), or two for
/// a sliding log (`<base>:log`, `<base>:seq`). `ARGV[1]`: `now` or empty, as for `CHECK`.
/// `ARGV[2 + 7 (i - 1) ..]`: per settlement: algorithm, refund, charge, then GCRA: interval,
/// the burst's span (a charge runs the TAT at most twice that ahead of now), the TAT the check
/// left and the check's time (its receipt: a refund applies as
/// `tollgate_engine::algorithm::gcra_refund` says, `refunded` in `tat.lua`);
/// fixed window: the end of its window, 0, 0, 0;
/// sliding log: the stamp of its units (a refund) or how long the log keeps an entry (a
/// charge: the longest period of the limit's quotas), their last sequence number, the
/// period, the most units the log may hold. Refunds and charges are cut in the client so that every product
/// here stays an exact integer.
pub(crate) const SETTLE: &str = include_str!("settle.lua");

/// The script: the prelude and [`SETTLE`], loaded once per process.
pub(crate) fn script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SETTLE));
    &SCRIPT
}

/// One settlement, ready for `SETTLE`.
#[derive(Debug, Clone)]
pub(crate) struct Settling {
    pub(crate) check: EncodedCheck,
    /// The keys it touches, after the base key: one, or two for a sliding log.
    pub(crate) suffixes: [Option<Suffix>; 2],
    pub(crate) args: [u64; 7],
    /// Whether it gives units back (and so clears a cached denial of its key).
    pub(crate) refunds: bool,
}

impl Settling {
    /// `s` encoded. A GCRA refund applies within its check's run, when the key's TAT is still
    /// the receipt's TAT or nobody waits; one whose receipt has no time only while the TAT is
    /// exactly the receipt's TAT (a lease's give-back, see [`Receipt`](tollgate_engine::Receipt)).
    pub(crate) fn new(s: &Settlement<'_>, keyer: &Keyer) -> Result<Option<Self>, BackendError> {
        // A concurrency slot is one request: nothing to settle.
        if s.actual == s.reserved || s.limit.algorithm() == Algorithm::Concurrency {
            return Ok(None);
        }
        let digest = keyer.digest(s.limit.name(), s.key);
        let check = EncodedCheck::new(
            &Check::new(s.limit, s.key)
                .with_cost(s.reserved)
                .with_quota(s.quota),
            digest,
        )?;
        // The quota the check was made under (its plan's), never the limit's default.
        let quota = &s.quota;
        let refund = u64::from(s.reserved.saturating_sub(s.actual));
        let charge = u64::from(s.actual.saturating_sub(s.reserved));
        let (suffixes, args) = match s.limit.algorithm() {
            Algorithm::Gcra => {
                // Past twice the burst, a charge meets the cap: cut there, every product in
                // the script stays exact. A refund is at most the check's cost, never above
                // the burst.
                let most = 2 * u64::from(quota.burst());
                let interval = quota.emission_interval();
                let span = interval * u64::from(quota.burst());
                (
                    [Some(Suffix::Tat), None],
                    [
                        1,
                        refund.min(most),
                        charge.min(most),
                        interval,
                        span,
                        s.receipt.tat(),
                        s.receipt.at,
                    ],
                )
            }
            Algorithm::FixedWindow => {
                let period = quota.period_micros();
                let Some(index) = (s.receipt.window_end() / period).checked_sub(1) else {
                    return Ok(None);
                };
                let most = u64::from(quota.limit()).saturating_mul(2);
                (
                    [Some(Suffix::Window(index)), None],
                    [2, refund, charge.min(most), s.receipt.window_end(), 0, 0, 0],
                )
            }
            _ => {
                let limit = u64::from(quota.limit());
                // A refund finds its units by their stamp; a charge keeps its own as long as
                // a check keeps its (`Limit::log_keep_micros`).
                let stamp_or_keep = if refund > 0 {
                    s.receipt.at
                } else {
                    s.limit.log_keep_micros(quota)
                };
                (
                    [Some(Suffix::Log), Some(Suffix::Seq)],
                    [
                        3,
                        refund.min(u64::from(s.reserved)),
                        charge.min(2 * limit),
                        stamp_or_keep,
                        s.receipt.last_seq(),
                        quota.period_micros(),
                        2 * limit,
                    ],
                )
            }
        };
        Ok(Some(Self {
            check,
            suffixes,
            args,
            refunds: refund > 0,
        }))
    }
}

/// `settlements` encoded, their keys digested by `keyer`, those with nothing to settle left
/// out.
///
/// # Errors
///
/// As [`EncodedCheck::new`].
pub(crate) fn encode(
    settlements: &[Settlement<'_>],
    keyer: &Keyer,
) -> Result<Vec<Settling>, BackendError> {
    settlements
        .iter()
        .filter_map(|s| Settling::new(s, keyer).transpose())
        .collect()
}
