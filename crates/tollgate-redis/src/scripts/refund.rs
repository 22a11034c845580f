//! `refund.lua`: undoes what one `CHECK` call wrote, for a Redis Cluster batch split over
//! several hash slots of which one refused.

use tollgate_engine::{algorithm, Micros};

use std::sync::LazyLock;

use crate::keys::Suffix;
use crate::scripts::check::EncodedCheck;
use crate::scripts::reply::Answer;
use crate::scripts::slot_id;
use crate::scripts::Script;

/// Undoes what one `CHECK` call wrote.
///
/// `KEYS[i]`: the key each check to refund wrote (a GCRA TAT, a window's count, a log).
/// `ARGV[1]`: `now` or empty, as for `CHECK`. `ARGV[2 + 4 (i - 1) ..]`: per check: algorithm,
/// then GCRA: `cost * interval`, the TAT the check left when the refund requires it (a leased
/// limit's) or 0, and `cost`, given back in the interval the key's TAT is stored under when the
/// refund runs (a check of another plan may have carried it since the consume); fixed window: window index, cost, 0; sliding log: the `now` of the
/// consume, last sequence number, cost; concurrency: the slot id's three parts
/// ([`slot_id::member`]).
pub(crate) const REFUND: &str = include_str!("refund.lua");

/// The script: the prelude and [`REFUND`], loaded once per process.
pub(crate) fn script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(REFUND));
    &SCRIPT
}

/// The key `p` wrote, for a refund of what `CHECK` answered.
pub(crate) fn key(p: &EncodedCheck, answer: &Answer) -> Suffix {
    match p.code {
        1 => Suffix::Tat,
        2 => Suffix::Window(answer.extra),
        4 => Suffix::Slots,
        _ => Suffix::Log,
    }
}

/// The arguments that undo `p`'s write, given what `CHECK` answered at `now`.
pub(crate) fn args(p: &EncodedCheck, now: Micros, answer: &Answer) -> [u64; 4] {
    let cost = u64::from(p.cost);
    match p.code {
        1 => {
            // The TAT this check left (from the TAT it read), which a guarded refund requires
            // (0: any; a TAT no key holds, should the check not have admitted).
            let read = (answer.extra > 0).then_some(answer.extra);
            let left = match p.guarded {
                true => algorithm::gcra_delayed(&p.quota, read, now, p.cost, p.delay)
                    .1
                    .unwrap_or(u64::MAX),
                false => 0,
            };
            [1, p.params[0].saturating_mul(cost), left, cost]
        }
        2 => [2, answer.extra, cost, 0],
        4 => {
            let [a, b, c] = slot_id::parts(p.slot);
            [4, a, b, c]
        }
        _ => [3, now, answer.extra, cost],
    }
}
