//! A limit's penalty box.

use crate::counting::Algorithm;
use crate::error::ConfigError;
use crate::limit::Limit;
use crate::penalty::Penalty;

impl Limit {
    /// This limit with a penalty box: a key it refuses often enough is blocked (see
    /// [`Penalty`]). Every backend applies it in the check itself; on Redis the block is
    /// shared by every replica with no call of its own, and a replica's deny cache answers a
    /// blocked key's requests until the block ends (or the cache's lease runs out).
    /// [`Admin::reset`](crate::Admin::reset) lifts a block.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidPenalty`] for bad figures; [`ConfigError::PenaltyUnsupported`]
    /// on a concurrency limit or a leased one (in either order).
    pub fn penalty(mut self, penalty: Penalty) -> Result<Self, ConfigError> {
        penalty.validate()?;
        if self.algorithm == Algorithm::Concurrency {
            return Err(ConfigError::PenaltyUnsupported(
                "a concurrency limit's refusals are busy keys, not misbehaving ones",
            ));
        }
        if self.lease.is_some() {
            return Err(ConfigError::PenaltyUnsupported(
                "a leased limit answers from its slice, where no refusal is counted",
            ));
        }
        self.penalty = Some(penalty);
        Ok(self)
    }

    /// The limit's penalty box, if it has one.
    #[inline]
    pub fn penalty_box(&self) -> Option<&Penalty> {
        self.penalty.as_ref()
    }
}
