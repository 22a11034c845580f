//! What [`Shared::prepare`](super::state::Shared) decided of one request ([`Facts`]), and the
//! keys it kept for after its check ([`KeptKeys`]): read by its decision, its settle, its
//! slots, its refusal, and its check again after a wait in a line.

use std::sync::Arc;

use tollgate_engine::MAX_CHECKS;

use super::limits::LimitSet;
use super::queue::Queueing;
use super::wait::WaitSeats;
use crate::key::Key;
use crate::span::CheckSpan;

/// What [`Shared::prepare`](super::state::Shared) decided of one request, read by its decision, its settle, its
/// slots and its refusal.
#[derive(Debug)]
pub(crate) struct Facts {
    /// The limits the request started with.
    pub(crate) set: Arc<LimitSet>,
    /// How many limits were checked (those with a key).
    pub(crate) n: usize,
    /// The index in the set of each checked limit, in the order of the checks.
    pub(crate) limit_of: [usize; MAX_CHECKS],
    /// Per limit, the index of the quota the request got ([`Limit::quota_of`]).
    ///
    /// [`Limit::quota_of`]: tollgate_engine::Limit::quota_of
    pub(crate) quota_of: [u8; MAX_CHECKS],
    /// Per limit, the request's cost.
    pub(crate) cost: [u32; MAX_CHECKS],
    /// The limits (bit `i` for the limit at `i`) whose check did not enforce: shadow limits,
    /// and limits whose enforced share the request's key lies outside.
    pub(crate) shadowed: u8,
    /// The request's concurrency slot id (0 when the layer has no concurrency limit).
    pub(crate) slot: u128,
    /// The request's `tollgate.check` span, open from the keys to the decision.
    pub(crate) span: CheckSpan,
    /// The seats the request took among delayed limits' waiters, so that it was checked
    /// with their delays (only in a set with a delayed limit): given back by the decision
    /// unless the request waits.
    pub(crate) seats: Option<WaitSeats>,
    /// Its place in a queued concurrency limit's line, while it waits for a slot (boxed:
    /// most requests never wait).
    pub(crate) queueing: Option<Box<Queueing>>,
}

impl Facts {
    /// Whether the check of the limit at `i` did not enforce (see [`Facts::shadowed`]).
    #[inline]
    pub(crate) fn shadowed(&self, i: usize) -> bool {
        self.shadowed & (1 << i) != 0
    }
}

/// The keys of a request that are needed after its check ([`SetLimit::keeps_key`]), by limit.
///
/// Beside the [`Facts`] rather than in them, and made only when a limit keeps its key: most
/// layers keep none, and their requests then neither fill nor move nor drop room for eight
/// keys.
#[derive(Debug, Default)]
pub(crate) struct KeptKeys(Option<[Option<Key<'static>>; MAX_CHECKS]>);

impl KeptKeys {
    /// The kept key of the limit at `i`.
    pub(crate) fn get(&self, i: usize) -> Option<&Key<'static>> {
        self.0.as_ref()?[i].as_ref()
    }

    /// Takes the kept key of the limit at `i`.
    pub(crate) fn take(&mut self, i: usize) -> Option<Key<'static>> {
        self.0.as_mut()?[i].take()
    }

    pub(super) fn put(&mut self, i: usize, key: Key<'static>) {
        self.0.get_or_insert_with(Default::default)[i] = Some(key);
    }
}
