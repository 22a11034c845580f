//! The penalty box: a key refused often enough is blocked for a while, and the state of a
//! key's sanctions (its recent refusals, its block, a deny set by hand) as every backend keeps
//! and applies it.

use std::time::Duration;

use crate::bounds::MAX_PERIOD;
use crate::clock::Micros;
use crate::error::ConfigError;
use crate::verdict::Status;

/// A block after repeated refusals, for one limit ([`Limit::penalty`](crate::Limit::penalty)).
///
/// A key that this limit refuses `after` times within `within` is blocked for `block_for`:
/// during the block every request of the key is refused ([`Status::Blocked`]) with a
/// `Retry-After` that counts to the block's end, whatever its cost and quota, and without
/// consuming anything. The `within` interval opens at the key's first refusal (outside a
/// block) and closes `within` later: the refusal that makes `after` in it starts the block,
/// and is itself answered `Blocked`. Requests refused during a block do not count toward the
/// next one.
///
/// With [`escalating_up_to`](Self::escalating_up_to), a block that starts while the key's
/// previous block is remembered (until `max` after it ended) lasts twice as long as that
/// one, up to `max`.
///
/// ```
/// use std::time::Duration;
/// use tollgate_engine::{Limit, Penalty, Quota};
///
/// let login = Limit::gcra("login", Quota::per_minute(5)?)?.penalty(
///     Penalty::after(3)
///         .within(Duration::from_secs(60))
///         .block_for(Duration::from_secs(600)),
/// )?;
/// assert_eq!(login.penalty_box().map(|p| p.block()), Some(Duration::from_secs(600)));
/// # Ok::<(), tollgate_engine::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Penalty {
    after: u32,
    within: Micros,
    block: Micros,
    max_block: Micros,
}

const MINUTE: Micros = 60_000_000;

impl Penalty {
    /// A block after `refusals` refusals; within a minute and for a minute until said
    /// otherwise.
    pub fn after(refusals: u32) -> Self {
        Self {
            after: refusals,
            within: MINUTE,
            block: MINUTE,
            max_block: MINUTE,
        }
    }

    /// The refusals count toward a block for `window` after the first of them.
    #[must_use]
    pub fn within(mut self, window: Duration) -> Self {
        self.within = micros(window);
        self
    }

    /// A block lasts `block`.
    #[must_use]
    pub fn block_for(mut self, block: Duration) -> Self {
        let was_escalating = self.max_block > self.block;
        self.block = micros(block);
        if !was_escalating {
            self.max_block = self.block;
        }
        self
    }

    /// Each block that follows a remembered one doubles it, up to `max`.
    #[must_use]
    pub fn escalating_up_to(mut self, max: Duration) -> Self {
        self.max_block = micros(max);
        self
    }

    /// Refusals that start a block.
    pub fn refusals(&self) -> u32 {
        self.after
    }

    /// How long refusals count toward a block after the first of them.
    pub fn window(&self) -> Duration {
        Duration::from_micros(self.within)
    }

    /// How long a first block lasts.
    pub fn block(&self) -> Duration {
        Duration::from_micros(self.block)
    }

    /// The longest block (the first block's length without escalation).
    pub fn max_block(&self) -> Duration {
        Duration::from_micros(self.max_block)
    }

    /// The figures a backend that runs the penalty elsewhere (a Redis script) needs:
    /// refusals, window, first block and longest block, the times in microseconds.
    pub fn figures(&self) -> [u64; 4] {
        [
            u64::from(self.after),
            self.within,
            self.block,
            self.max_block,
        ]
    }

    /// Checks the figures a limit takes.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let max = MAX_PERIOD.as_micros() as Micros;
        let what = if self.after == 0 {
            "a penalty needs at least one refusal"
        } else if self.within == 0 || self.block == 0 {
            "a penalty's window and block must be longer than zero"
        } else if self.within > max || self.max_block > max {
            "a penalty's window and block must not exceed 100 years"
        } else if self.max_block < self.block {
            "a penalty's longest block must not be shorter than its first"
        } else {
            return Ok(());
        };
        Err(ConfigError::InvalidPenalty(what))
    }
}

fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A key's sanctions: refusals counted toward a block, the block, how many blocks are
/// remembered for escalation, and a deny set by hand. Every backend keeps one per (limit,
/// key) that has any, and drops it when [`live`](Self::live) turns false.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Sanction {
    pub(crate) refusals: u32,
    pub(crate) window_end: Micros,
    pub(crate) blocked_until: Micros,
    /// Blocks before the current one that escalated it (0 for a first block).
    pub(crate) strikes: u32,
    /// Until when the last block is remembered for escalation.
    pub(crate) strikes_until: Micros,
    pub(crate) denied_until: Micros,
}

impl Sanction {
    /// The refusal that stands at `now`, if any: a deny before a block.
    #[inline]
    pub(crate) fn standing(&self, now: Micros) -> Option<Status> {
        if self.denied_until > now {
            Some(Status::Denylisted {
                retry_after: self.denied_until - now,
            })
        } else if self.blocked_until > now {
            Some(Status::Blocked {
                retry_after: self.blocked_until - now,
            })
        } else {
            None
        }
    }

    /// Counts one refusal by `penalty`'s limit at `now`; the block's length if it starts one.
    pub(crate) fn refused(&mut self, penalty: &Penalty, now: Micros) -> Option<Micros> {
        if self.window_end <= now {
            self.refusals = 0;
            self.window_end = now.saturating_add(penalty.within);
        }
        self.refusals = self.refusals.saturating_add(1);
        if self.refusals < penalty.after {
            return None;
        }
        let strikes = if self.strikes_until > now {
            self.strikes.saturating_add(1)
        } else {
            0
        };
        let block = doubled(penalty.block, strikes).min(penalty.max_block);
        self.blocked_until = now.saturating_add(block);
        self.strikes = strikes;
        self.strikes_until = self.blocked_until.saturating_add(penalty.max_block);
        self.refusals = 0;
        self.window_end = 0;
        Some(block)
    }

    /// Lifts the block and forgets the refusals and strikes (a reset); a deny stays.
    pub(crate) fn lift(&mut self) {
        *self = Self {
            denied_until: self.denied_until,
            ..Self::default()
        };
    }

    /// Whether anything is still counted or standing at `now`.
    #[inline]
    pub(crate) fn live(&self, now: Micros) -> bool {
        self.window_end > now
            || self.blocked_until > now
            || self.strikes_until > now
            || self.denied_until > now
    }
}

/// `block` doubled `times` times, saturating.
fn doubled(block: Micros, times: u32) -> Micros {
    if times >= block.leading_zeros() {
        u64::MAX
    } else {
        block << times
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    fn login() -> Penalty {
        Penalty::after(3)
            .within(Duration::from_secs(60))
            .block_for(Duration::from_secs(600))
    }

    #[test]
    fn the_nth_refusal_within_the_window_starts_the_block() {
        let mut s = Sanction::default();
        assert_eq!(s.refused(&login(), 0), None);
        assert_eq!(s.refused(&login(), 30 * S), None);
        assert_eq!(s.refused(&login(), 59 * S), Some(600 * S));
        assert_eq!(
            s.standing(60 * S),
            Some(Status::Blocked {
                retry_after: 599 * S
            })
        );
        assert_eq!(s.standing(659 * S), None);
    }

    #[test]
    fn refusals_outside_the_window_start_a_new_count() {
        let mut s = Sanction::default();
        s.refused(&login(), 0);
        s.refused(&login(), 10 * S);
        // The window closed at 60 s: this is the first refusal of a new one.
        assert_eq!(s.refused(&login(), 60 * S), None);
        assert_eq!(s.refused(&login(), 61 * S), None);
        assert_eq!(s.refused(&login(), 62 * S), Some(600 * S));
    }

    #[test]
    fn escalation_doubles_up_to_the_longest_block() {
        let p = Penalty::after(1)
            .block_for(Duration::from_secs(10))
            .escalating_up_to(Duration::from_secs(35));
        let mut s = Sanction::default();
        assert_eq!(s.refused(&p, 0), Some(10 * S));
        assert_eq!(s.refused(&p, 10 * S), Some(20 * S));
        assert_eq!(s.refused(&p, 30 * S), Some(35 * S));
        // Remembered until 35 s after the last block ended (at 65 s).
        assert_eq!(s.refused(&p, 65 * S + 35 * S), Some(10 * S));
        assert_eq!(doubled(u64::MAX / 2, 3), u64::MAX);
    }

    #[test]
    fn a_lift_keeps_a_deny() {
        let mut s = Sanction {
            denied_until: 100,
            blocked_until: 200,
            ..Sanction::default()
        };
        assert_eq!(s.standing(0), Some(Status::Denylisted { retry_after: 100 }));
        s.lift();
        assert_eq!(s.standing(150), None);
        assert!(s.live(50) && !s.live(100));
    }

    #[test]
    fn bad_figures_are_refused() {
        assert!(Penalty::after(0).validate().is_err());
        assert!(Penalty::after(1).within(Duration::ZERO).validate().is_err());
        assert!(Penalty::after(1)
            .block_for(Duration::from_secs(10))
            .escalating_up_to(Duration::from_secs(5))
            .validate()
            .is_err());
        assert!(login().validate().is_ok());
    }
}
