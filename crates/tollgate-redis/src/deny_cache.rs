//! The local deny cache: a key Redis denied until T is denied here until T, without a call.
//!
//! A flood on one identity then costs Redis about one call per window per replica instead of
//! one per request. Entries are keyed by the (limit, key) digest, so no raw key is held; the
//! cache is bounded: at capacity it first drops expired entries and, if still full, does not
//! insert (the next denial goes to Redis, which is correct, only slower).
//!
//! A denial for a cost also stands for any higher cost (no algorithm admits more units sooner),
//! but not for a lower one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tollgate_core::{Micros, Status, Verdict};

use crate::keys::KeyDigest;

const SHARDS: usize = 16;

#[derive(Debug)]
pub(crate) struct DenyCache {
    shards: Box<[Mutex<HashMap<KeyDigest, Entry>>]>,
    per_shard: usize,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    until: Instant,
    reset_at: Instant,
    remaining: u64,
    cost: u32,
}

fn micros_until(t: Instant, now: Instant) -> Micros {
    u64::try_from(t.saturating_duration_since(now).as_micros()).unwrap_or(u64::MAX)
}

impl DenyCache {
    /// A cache of about `capacity` entries; 0 disables it.
    pub(crate) fn new(capacity: usize) -> Self {
        let per_shard = capacity.div_ceil(SHARDS);
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard,
        }
    }

    fn shard(&self, digest: &KeyDigest) -> std::sync::MutexGuard<'_, HashMap<KeyDigest, Entry>> {
        self.shards[usize::from(digest[0]) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The cached denial of `digest` for a request of `cost`, if one stands.
    pub(crate) fn lookup(&self, digest: &KeyDigest, cost: u32) -> Option<Verdict> {
        if self.per_shard == 0 {
            return None;
        }
        let now = Instant::now();
        let mut shard = self.shard(digest);
        let entry = *shard.get(digest)?;
        if entry.until <= now {
            shard.remove(digest);
            return None;
        }
        (cost >= entry.cost).then(|| Verdict {
            status: Status::Denied {
                retry_after: micros_until(entry.until, now),
            },
            remaining: entry.remaining,
            reset: micros_until(entry.reset_at, now),
        })
    }

    /// Remembers that Redis denied `digest` for a request of `cost` with `verdict`.
    pub(crate) fn insert(&self, digest: &KeyDigest, cost: u32, verdict: &Verdict) {
        let Status::Denied { retry_after } = verdict.status else {
            return;
        };
        if self.per_shard == 0 || retry_after == 0 {
            return;
        }
        let now = Instant::now();
        let entry = Entry {
            until: now + Duration::from_micros(retry_after),
            reset_at: now + Duration::from_micros(verdict.reset),
            remaining: verdict.remaining,
            cost,
        };
        let mut shard = self.shard(digest);
        if let Some(old) = shard.get_mut(digest) {
            // Keep the denial that covers the most requests: the lowest cost.
            if entry.cost <= old.cost || old.until <= now {
                *old = entry;
            }
            return;
        }
        if shard.len() >= self.per_shard {
            shard.retain(|_, e| e.until > now);
            if shard.len() >= self.per_shard {
                return;
            }
        }
        shard.insert(*digest, entry);
    }

    /// Entries held, expired or not.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn denied(retry_after: Micros) -> Verdict {
        Verdict {
            status: Status::Denied { retry_after },
            remaining: 0,
            reset: retry_after,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn denies_until_the_time_redis_gave() {
        let cache = DenyCache::new(100);
        let d = [1u8; 16];
        cache.insert(&d, 1, &denied(1_000_000));
        let v = cache.lookup(&d, 1).unwrap();
        assert_eq!(
            v.status,
            Status::Denied {
                retry_after: 1_000_000
            }
        );
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(
            cache.lookup(&d, 1).unwrap().status,
            Status::Denied {
                retry_after: 600_000
            }
        );
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(cache.lookup(&d, 1), None);
        assert_eq!(cache.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_denial_covers_higher_costs_only() {
        let cache = DenyCache::new(100);
        let d = [2u8; 16];
        cache.insert(&d, 3, &denied(1_000));
        assert!(cache.lookup(&d, 3).is_some());
        assert!(cache.lookup(&d, 5).is_some());
        assert!(cache.lookup(&d, 1).is_none());
        cache.insert(&d, 1, &denied(1_000));
        assert!(cache.lookup(&d, 1).is_some());
        // Allowed verdicts are not cached.
        let e = [3u8; 16];
        cache.insert(
            &e,
            1,
            &Verdict {
                status: Status::Allowed,
                remaining: 1,
                reset: 5,
            },
        );
        assert!(cache.lookup(&e, 1).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn stays_bounded_and_reclaims_expired_entries() {
        let cache = DenyCache::new(SHARDS * 2);
        // Three digests in the same shard (same first byte): the third does not fit.
        let ds: Vec<KeyDigest> = (0..3u8)
            .map(|i| {
                let mut d = [0u8; 16];
                d[1] = i;
                d
            })
            .collect();
        cache.insert(&ds[0], 1, &denied(1_000));
        cache.insert(&ds[1], 1, &denied(5_000));
        cache.insert(&ds[2], 1, &denied(5_000));
        assert!(cache.lookup(&ds[2], 1).is_none());
        assert_eq!(cache.len(), 2);
        // Once one has expired, a new one takes its place.
        tokio::time::advance(Duration::from_millis(1)).await;
        cache.insert(&ds[2], 1, &denied(5_000));
        assert!(cache.lookup(&ds[2], 1).is_some());
        assert_eq!(cache.len(), 2);
        // Disabled.
        let off = DenyCache::new(0);
        off.insert(&ds[0], 1, &denied(1_000));
        assert!(off.lookup(&ds[0], 1).is_none());
    }
}
