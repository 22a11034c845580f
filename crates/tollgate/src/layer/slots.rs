//! The concurrency slots an admitted request holds, given back exactly once.
//!
//! A [`HeldSlots`] is made when a request that took slots is admitted, travels with the response
//! future and then the response body, and gives its slots back when it is dropped: when the
//! body ends, when the body is dropped unfinished, or when the future is dropped before the
//! service answered (the client went away, the handler panicked). Ownership makes "exactly
//! once" structural: one value, given back by its `Drop` unless the body's end gave it back
//! first ([`Hold::finish`], which also tells the body when the backend has the release: the
//! body holds its end until then).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tollgate_engine::{Backend, Check, Landing, MAX_CHECKS};

use super::body::Hold;
use super::limits::LimitSet;
use super::state::Shared;
use crate::decision::Source;
use crate::key::Key;

/// A slot id unique among the requests in flight on every replica: 128 bits, the keyed hash
/// of a per-process counter under two random keys drawn once per process. Replicas that
/// share a Redis prefix draw from 2^128 ids, so two of them never hold the same one (a shared
/// id would count two requests as one, and one release would free the other's slot).
pub(crate) fn next_id() -> u128 {
    static KEYS: OnceLock<(RandomState, RandomState)> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let (hi, lo) = KEYS.get_or_init(|| (RandomState::new(), RandomState::new()));
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let id = (u128::from(hi.hash_one(n)) << 64) | u128::from(lo.hash_one(n));
    id.max(1)
}

/// The slots an admitted request took: the limits (by index in the layer) whose slots it
/// holds, the key of each, and where each was taken.
pub(crate) struct Taken {
    pub(crate) items: Vec<(usize, Key<'static>, Source)>,
}

/// Taken slots, and the layer that gives them back.
struct Held<B> {
    shared: Arc<Shared<B>>,
    set: Arc<LimitSet>,
    slot: u128,
    items: Vec<(usize, Key<'static>, Source)>,
}

impl<B: Backend> Held<B> {
    /// The checks to release or renew: `source`'s slots, against the backend's limits or the
    /// fallback's local shares.
    fn with_checks(&self, source: Source, f: impl FnOnce(&[Check<'_>])) {
        let entries = &self.set.limits;
        let mut checks = [Check::new(&entries[0].limit, b""); MAX_CHECKS];
        let mut n = 0;
        for (i, key, from) in &self.items {
            let entry = &entries[*i];
            let limit = match source {
                Source::Fallback => match &entry.local {
                    Some(local) => local,
                    None => continue,
                },
                _ => &entry.limit,
            };
            if *from == source && n < MAX_CHECKS {
                checks[n] = Check::new(limit, key.as_bytes()).with_slot(self.slot);
                n += 1;
            }
        }
        if n > 0 {
            f(&checks[..n]);
        }
    }
}

/// The slots one admitted request holds; dropping it gives them back.
pub(crate) struct HeldSlots<B: Backend> {
    held: Arc<Held<B>>,
    renewing: Option<tokio::task::AbortHandle>,
    /// Whether the slots were given back already (by [`Hold::finish`]).
    given: bool,
}

impl<B: Backend> HeldSlots<B> {
    /// Holds the slots `taken` under the request's slot id `slot` and the limits `set` it was
    /// checked under (a reload may have replaced them since) until dropped, renewing them
    /// while the backend's slots expire.
    pub(crate) fn hold(
        shared: &Arc<Shared<B>>,
        taken: Taken,
        (set, slot): (&Arc<LimitSet>, u128),
    ) -> Self {
        let Taken { items } = taken;
        let set = Arc::clone(set);
        let held = Arc::new(Held {
            shared: Arc::clone(shared),
            set,
            slot,
            items,
        });
        let renewing = renew_every(&held).and_then(|every| {
            let handle = tokio::runtime::Handle::try_current().ok()?;
            let held = Arc::clone(&held);
            let task = handle.spawn(async move {
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticks.tick().await;
                loop {
                    ticks.tick().await;
                    held.with_checks(Source::Backend, |checks| {
                        if let Some(slots) = held.shared.backend.slots() {
                            slots.renew(checks);
                        }
                    });
                }
            });
            Some(task.abort_handle())
        });
        Self {
            held,
            renewing,
            given: false,
        }
    }

    /// Gives the slots back (once): the backend's through `release_landing` when `landing`,
    /// else through `release`; the fallback's now. What the backend's landing answers, if it
    /// has to wait for it.
    fn give_back(&mut self, landing: bool) -> Option<Landing> {
        if std::mem::replace(&mut self.given, true) {
            return None;
        }
        if let Some(task) = self.renewing.take() {
            task.abort();
        }
        let held = &self.held;
        let mut landed = None;
        held.with_checks(Source::Backend, |checks| {
            if let Some(slots) = held.shared.backend.slots() {
                if landing {
                    landed = slots.release_landing(checks);
                } else {
                    slots.release(checks);
                }
            }
        });
        held.with_checks(Source::Fallback, |checks| {
            held.shared.fallback.release_now(checks);
        });
        // The first request waiting for a slot of each key, if any, checks again.
        if held.set.queues {
            for (i, key, source) in &held.items {
                let limit = &held.set.limits[*i].limit;
                if *source == Source::Backend && limit.queue_micros() > 0 {
                    held.shared.lines.wake(limit.id(), key.as_bytes());
                }
            }
        }
        landed
    }
}

impl<B: Backend> Hold for HeldSlots<B> {
    fn finish(mut self: Box<Self>) -> Option<Landing> {
        self.give_back(true)
    }
}

/// How often slots are renewed: a third of the shortest slot lifetime among the request's
/// backend slots, when the backend's slots expire.
fn renew_every<B: Backend>(held: &Held<B>) -> Option<Duration> {
    if !held.shared.backend.slots().is_some_and(|s| s.expire()) {
        return None;
    }
    held.items
        .iter()
        .filter(|(_, _, source)| *source == Source::Backend)
        .map(|(i, _, _)| held.set.limits[*i].limit.quota().period() / 3)
        .min()
}

impl<B: Backend> Drop for HeldSlots<B> {
    fn drop(&mut self) {
        let _ = self.give_back(false);
    }
}

impl<B: Backend> std::fmt::Debug for HeldSlots<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldSlots")
            .field("slot", &self.held.slot)
            .field("limits", &self.held.items.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::next_id;

    #[test]
    fn slot_ids_are_distinct_and_use_all_128_bits() {
        let ids: Vec<u128> = (0..1000).map(|_| next_id()).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 1000);
        // Random above 64 bits: not a prefix shared by every id.
        let high: std::collections::HashSet<u64> = ids.iter().map(|id| (id >> 64) as u64).collect();
        assert_eq!(high.len(), 1000);
    }
}
