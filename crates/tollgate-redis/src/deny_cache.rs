//! The local deny cache: a key Redis denied until T is denied here until T, without a call.
//!
//! A flood on one identity then costs Redis about one call per window per replica instead of
//! one per request. Entries are keyed by the (limit, key) digest, so no raw key is held; the
//! cache is bounded: at capacity it first drops expired entries and, if still full, does not
//! insert (the next denial goes to Redis, which is correct, only slower).
//!
//! A denial for a cost also stands for any higher cost (no algorithm admits more units sooner),
//! but not for a lower one.
//!
//! Two refinements keep a flood at about one call per admitted request:
//!
//! - **Foreseen denials.** An admitted GCRA or fixed-window check that left less than its cost
//!   tells exactly when the next such request can be admitted; the cache denies until then
//!   without waiting for Redis to deny once.
//! - **One asker at a time.** When a denial runs out, the first request asks Redis and the
//!   others are still refused here until its answer comes (at most one deadline): otherwise
//!   every request that arrives during that round trip would go to Redis, and almost all would
//!   be denied there. At a window's turn this can refuse, for up to one round trip, requests
//!   that Redis would have admitted: it errs on the side of limiting.
//! - **Until there is room for those held back.** If Redis admits the asker with room left, but
//!   less room than the requests held back during its round trip would need, the next request
//!   asks again, alone: otherwise they would all go to Redis at once and all but a few be denied
//!   there. The cache forgets the key once Redis reports room for all of them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::Counter;
use tokio::time::Instant;
use tollgate_engine::{Micros, Quota, Status, Verdict};

use crate::keys::KeyDigest;

const SHARDS: usize = 16;

/// The keys Redis refused, held to refuse them here until their refusal ends: 429 denials
/// (under the quota and delay they were made under) and 403 sanctions (a block, a deny).
#[derive(Debug)]
pub(crate) struct RefusedKeys {
    shards: Box<[Mutex<HashMap<KeyDigest, KeyRefusal>>]>,
    per_shard: usize,
    /// Entries held in every shard, counted under their shard's lock: while it is 0 (no key
    /// refused lately, most of the time) a lookup takes no lock.
    held: AtomicUsize,
    /// How long the request that asks Redis after a denial ran out holds the others back.
    turn: Duration,
    /// How long a denial is answered here before a request asks Redis again, however long
    /// the denial is: what another replica's reset (or a raised quota) waits at most.
    ttl: Duration,
}

/// What the cache knows of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// Nothing: ask Redis.
    Miss,
    /// A denial ran out and it is this request's turn to ask Redis, then to end the turn.
    Asks,
    /// Refused locally.
    Denied(Verdict),
}

#[cfg(test)]
impl Lookup {
    /// The local denial, if any.
    pub(crate) fn denial(self) -> Option<Verdict> {
        match self {
            Self::Denied(v) => Some(v),
            Self::Miss | Self::Asks => None,
        }
    }
}

/// One key's refusal, as Redis answered it.
#[derive(Debug, Clone)]
struct KeyRefusal {
    /// `tollgate_deny_cache_hits_total` of the entry's limit, registered when the entry is
    /// made: a hit increments it under the shard's lock it already holds, with no registry
    /// lookup.
    hits: Counter,
    /// The quota the denial was made under: a request of the same key under another quota
    /// (another plan) asks Redis.
    quota: Quota,
    /// The delay of the check that was denied (`Check::delay`): a denial under one delay
    /// says nothing of a request under another, which is checked as under another quota.
    delay: Micros,
    /// Until when requests are refused here without asking Redis: the denial's end, or its
    /// `ttl` if sooner.
    until: Instant,
    /// When the denial ends, as Redis said: what a refusal's Retry-After counts to.
    denied_until: Instant,
    reset_at: Instant,
    remaining: u64,
    cost: u32,
    /// How much longer a request of one more unit than `cost` waits: a GCRA emission interval,
    /// 0 in a fixed window; `None` when it depends on more than the cost (a sliding log), and a
    /// costlier request then asks Redis.
    per_unit: Option<Micros>,
    /// A block or a deny (whatever the quota, delay and cost), not the quota's denial.
    sanction: Option<Sanction>,
    /// A request is asking Redis (until `until`).
    asking: bool,
    /// Requests refused here while it did.
    held: u32,
}

impl KeyRefusal {
    /// Ends the turn: the next request takes a new one and asks Redis.
    fn reopen(&mut self) {
        self.until = Instant::now();
        self.asking = false;
        self.held = 0;
    }
}

/// What refuses a key whatever the request: a penalty's block, or a deny by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sanction {
    Blocked,
    Denylisted,
}

impl Sanction {
    fn status(self, retry_after: Micros) -> Status {
        match self {
            Self::Blocked => Status::Blocked { retry_after },
            Self::Denylisted => Status::Denylisted { retry_after },
        }
    }
}

fn micros_until(t: Instant, now: Instant) -> Micros {
    u64::try_from(t.saturating_duration_since(now).as_micros()).unwrap_or(u64::MAX)
}

impl RefusedKeys {
    /// A cache of about `capacity` entries (0 disables it); `turn` (how long an asker holds the others back) is the backend's deadline;
    /// a denial is trusted for at most `ttl` before Redis is asked again.
    pub(crate) fn new(capacity: usize, turn: Duration, ttl: Duration) -> Self {
        let per_shard = capacity.div_ceil(SHARDS);
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard,
            held: AtomicUsize::new(0),
            turn,
            ttl,
        }
    }

    /// Removes `digest`'s entry from `shard` (its lock held), counted.
    fn remove(&self, shard: &mut HashMap<KeyDigest, KeyRefusal>, digest: &KeyDigest) {
        if shard.remove(digest).is_some() {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn shard(
        &self,
        digest: &KeyDigest,
    ) -> std::sync::MutexGuard<'_, HashMap<KeyDigest, KeyRefusal>> {
        self.shards[usize::from(digest[0]) % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Drops what the cache holds for `digest`: units of its key were given back (a cluster
    /// refund), so a denial seen while they were held may no longer stand.
    pub(crate) fn forget(&self, digest: &KeyDigest) {
        if self.per_shard > 0 {
            self.remove(&mut self.shard(digest), digest);
        }
    }

    /// The cached denial of `digest` for a request of `cost`, if one stands; or whether this
    /// request took the turn to ask Redis after a denial ran out (and must [`forget`](Self::forget) it
    /// when Redis admits it with room left).
    #[cfg(test)]
    pub(crate) fn lookup(&self, digest: &KeyDigest, cost: u32, quota: &Quota) -> Lookup {
        self.lookup_delayed(digest, cost, quota, 0)
    }

    /// [`lookup`](Self::lookup) for a check with a delay of `delay` microseconds.
    pub(crate) fn lookup_delayed(
        &self,
        digest: &KeyDigest,
        cost: u32,
        quota: &Quota,
        delay: Micros,
    ) -> Lookup {
        // A denial inserted while this reads 0 is missed by this request only, which asks
        // Redis, as one that took the lock first would.
        if self.per_shard == 0 || self.held.load(Ordering::Relaxed) == 0 {
            return Lookup::Miss;
        }
        let mut shard = self.shard(digest);
        let Some(entry) = shard.get_mut(digest) else {
            return Lookup::Miss;
        };
        if let Some(sanction) = entry.sanction {
            // A block or a deny stands for every request of the key until `until`; then
            // Redis is asked again (a reset or an undeny elsewhere shows there).
            let now = Instant::now();
            if entry.until <= now {
                self.remove(&mut shard, digest);
                return Lookup::Miss;
            }
            entry.hits.increment(1);
            let left = micros_until(entry.denied_until, now);
            return Lookup::Denied(Verdict::new(sanction.status(left), 0, left));
        }
        if entry.quota != *quota || entry.delay != delay {
            // Made under another quota (a reload or another plan changed it since): it
            // stands for nothing now.
            self.remove(&mut shard, digest);
            return Lookup::Miss;
        }
        // Only a key with a cached denial reads the clock.
        let now = Instant::now();
        if entry.until <= now {
            // This request asks Redis; the others wait for its answer (or the deadline).
            entry.until = now + self.turn;
            entry.asking = true;
            entry.held = 0;
            return Lookup::Asks;
        }
        if cost < entry.cost {
            return Lookup::Miss;
        }
        let mut retry_after = micros_until(entry.denied_until.max(entry.until), now);
        if cost > entry.cost && !entry.asking {
            // A costlier request waits longer: its Retry-After must say so.
            let Some(per_unit) = entry.per_unit else {
                return Lookup::Miss;
            };
            let more = per_unit.saturating_mul(u64::from(cost - entry.cost));
            retry_after = retry_after.saturating_add(more);
        }
        if entry.asking {
            entry.held = entry.held.saturating_add(1);
        }
        entry.hits.increment(1);
        Lookup::Denied(Verdict::new(
            Status::Denied { retry_after },
            entry.remaining,
            micros_until(entry.reset_at, now),
        ))
    }

    /// Remembers that Redis denied `digest`, a key of limit `limit`, for a request of `cost`
    /// with `verdict`.
    #[cfg(test)]
    pub(crate) fn insert(
        &self,
        digest: &KeyDigest,
        limit: &Arc<str>,
        quota: &Quota,
        cost: u32,
        per_unit: Option<Micros>,
        verdict: &Verdict,
    ) {
        self.insert_delayed(digest, limit, (quota, 0), cost, per_unit, verdict);
    }

    /// [`insert`](Self::insert) for a check with a delay (its quota and delay).
    pub(crate) fn insert_delayed(
        &self,
        digest: &KeyDigest,
        limit: &Arc<str>,
        (quota, delay): (&Quota, Micros),
        cost: u32,
        per_unit: Option<Micros>,
        verdict: &Verdict,
    ) {
        let (retry_after, sanction) = match verdict.status {
            Status::Denied { retry_after } => (retry_after, None),
            Status::Blocked { retry_after } => (retry_after, Some(Sanction::Blocked)),
            Status::Denylisted { retry_after } => (retry_after, Some(Sanction::Denylisted)),
            _ => return,
        };
        if self.per_shard == 0 || retry_after == 0 {
            return;
        }
        let now = Instant::now();
        let denied_until = now + Duration::from_micros(retry_after);
        let mut entry = KeyRefusal {
            hits: Counter::noop(),
            quota: *quota,
            delay,
            until: denied_until.min(now + self.ttl),
            denied_until,
            reset_at: now + Duration::from_micros(verdict.reset),
            remaining: verdict.remaining,
            cost,
            per_unit,
            sanction,
            asking: false,
            held: 0,
        };
        let mut shard = self.shard(digest);
        if let Some(old) = shard.get_mut(digest) {
            // Keep the denial that covers the most requests: a block or a deny, else the
            // lowest cost (an answer always ends the turn its request held).
            if sanction.is_some() || entry.cost <= old.cost || old.until <= now + self.turn {
                entry.hits = old.hits.clone();
                *old = entry;
            }
            return;
        }
        if shard.len() >= self.per_shard {
            let before = shard.len();
            shard.retain(|_, e| e.until > now);
            self.held.fetch_sub(before - shard.len(), Ordering::Relaxed);
            if shard.len() >= self.per_shard {
                return;
            }
        }
        entry.hits =
            metrics::counter!("tollgate_deny_cache_hits_total", "limit" => Arc::clone(limit));
        shard.insert(*digest, entry);
        self.held.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the turn the request for `digest` held: Redis admitted it at `cost`, with
    /// `remaining` units left. With room for every request held back meanwhile, the key is
    /// forgotten; with less, the next request asks Redis alone again.
    pub(crate) fn end_turn(&self, digest: &KeyDigest, cost: u32, remaining: u64) {
        if self.per_shard == 0 {
            return;
        }
        let mut shard = self.shard(digest);
        let Some(entry) = shard.get_mut(digest) else {
            return;
        };
        if !entry.asking {
            // A newer denial took its place: it stands.
            return;
        }
        if remaining >= u64::from(entry.held).saturating_add(1) * u64::from(cost) {
            self.remove(&mut shard, digest);
        } else {
            entry.reopen();
        }
    }

    /// Passes on a turn whose request will not ask Redis after all (another check refused
    /// it here): the next request asks instead.
    pub(crate) fn pass_turn(&self, digest: &KeyDigest) {
        if self.per_shard == 0 {
            return;
        }
        if let Some(entry) = self.shard(digest).get_mut(digest) {
            if entry.asking {
                entry.reopen();
            }
        }
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

    fn q() -> Quota {
        Quota::per_minute(5).unwrap()
    }

    fn limit() -> Arc<str> {
        Arc::from("login")
    }

    fn denied(retry_after: Micros) -> Verdict {
        Verdict::new(Status::Denied { retry_after }, 0, retry_after)
    }

    #[tokio::test(start_paused = true)]
    async fn denies_until_the_time_redis_gave() {
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        let d = [1u8; 16];
        cache.insert(&d, &limit(), &q(), 1, Some(0), &denied(1_000_000));
        let v = cache.lookup(&d, 1, &q()).denial().unwrap();
        assert_eq!(
            v.status,
            Status::Denied {
                retry_after: 1_000_000
            }
        );
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(
            cache.lookup(&d, 1, &q()).denial().unwrap().status,
            Status::Denied {
                retry_after: 600_000
            }
        );
        tokio::time::advance(Duration::from_millis(600)).await;
        // Run out: this request asks Redis, the others wait for its answer for one turn.
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks);
        assert_eq!(
            cache.lookup(&d, 1, &q()).denial().unwrap().status,
            Status::Denied {
                retry_after: 50_000
            }
        );
        // Its answer (admitted, room left for the one held back and the next) ends the wait
        // for everyone.
        cache.end_turn(&d, 1, 2);
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Miss);
        assert_eq!(cache.len(), 0);
    }

    /// The count that lets a lookup skip the locks follows every insert and removal: a miss
    /// with nothing held takes no lock, and a denial is found again once one is.
    #[tokio::test(start_paused = true)]
    async fn the_count_of_entries_follows_inserts_and_removals() {
        // One entry per shard.
        let cache = RefusedKeys::new(SHARDS, Duration::from_millis(50), Duration::from_secs(3600));
        let counted = |cache: &RefusedKeys| cache.held.load(Ordering::Relaxed);
        let (a, b) = ([1u8; 16], [1u8 + SHARDS as u8; 16]);
        assert_eq!(cache.lookup(&a, 1, &q()), Lookup::Miss);
        cache.insert(&a, &limit(), &q(), 1, Some(0), &denied(1_000));
        assert!(cache.lookup(&a, 1, &q()).denial().is_some());
        // The same key again: replaced, not counted twice.
        cache.insert(&a, &limit(), &q(), 1, Some(0), &denied(2_000));
        assert_eq!((counted(&cache), cache.len()), (1, 1));
        // `b` shares `a`'s shard, which is full until `a` runs out; then `a` is evicted.
        cache.insert(&b, &limit(), &q(), 1, Some(0), &denied(1_000));
        assert_eq!((counted(&cache), cache.len()), (1, 1));
        tokio::time::advance(Duration::from_millis(3)).await;
        cache.insert(&b, &limit(), &q(), 1, Some(0), &denied(1_000));
        assert_eq!((counted(&cache), cache.len()), (1, 1));
        assert_eq!(cache.lookup(&a, 1, &q()), Lookup::Miss);
        // Another quota's lookup removes it; so does a forget.
        assert_eq!(
            cache.lookup(&b, 1, &Quota::per_minute(6).unwrap()),
            Lookup::Miss
        );
        assert_eq!((counted(&cache), cache.len()), (0, 0));
        cache.insert(&b, &limit(), &q(), 1, Some(0), &denied(1_000));
        cache.forget(&b);
        cache.forget(&b);
        assert_eq!((counted(&cache), cache.len()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn room_for_fewer_than_were_held_back_lets_one_more_ask_alone() {
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        let d = [4u8; 16];
        cache.insert(&d, &limit(), &q(), 1, Some(0), &denied(1_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks);
        for _ in 0..3 {
            assert!(cache.lookup(&d, 1, &q()).denial().is_some());
        }
        // Room for 3 units: not for the 3 held back and one more.
        cache.end_turn(&d, 1, 3);
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks);
        assert!(cache.lookup(&d, 1, &q()).denial().is_some());
        // Room for 2 with one held back: forgotten.
        cache.end_turn(&d, 1, 2);
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Miss);
        // A newer denial is not undone by a late end of a turn.
        cache.insert(&d, &limit(), &q(), 1, Some(0), &denied(1_000));
        cache.end_turn(&d, 1, 100);
        assert!(cache.lookup(&d, 1, &q()).denial().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_whose_answer_never_came_runs_out() {
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        let d = [2u8; 16];
        cache.insert(&d, &limit(), &q(), 1, Some(0), &denied(1_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks); // then fails (no answer)
        tokio::time::advance(Duration::from_micros(49_999)).await;
        assert!(cache.lookup(&d, 1, &q()).denial().is_some());
        tokio::time::advance(Duration::from_micros(1)).await;
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks); // the next request asks
    }

    #[tokio::test(start_paused = true)]
    async fn a_passed_turn_goes_to_the_next_request() {
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        let d = [5u8; 16];
        cache.insert(&d, &limit(), &q(), 1, Some(0), &denied(1_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks);
        assert!(cache.lookup(&d, 1, &q()).denial().is_some());
        cache.pass_turn(&d);
        assert_eq!(cache.lookup(&d, 1, &q()), Lookup::Asks);
    }

    #[tokio::test(start_paused = true)]
    async fn a_denial_covers_higher_costs_only() {
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        let d = [2u8; 16];
        cache.insert(&d, &limit(), &q(), 3, Some(0), &denied(1_000));
        assert!(cache.lookup(&d, 3, &q()).denial().is_some());
        assert!(cache.lookup(&d, 5, &q()).denial().is_some());
        assert!(cache.lookup(&d, 1, &q()).denial().is_none());
        cache.insert(&d, &limit(), &q(), 1, Some(0), &denied(1_000));
        assert!(cache.lookup(&d, 1, &q()).denial().is_some());
        // Allowed verdicts are not cached.
        let e = [3u8; 16];
        cache.insert(
            &e,
            &limit(),
            &q(),
            1,
            Some(0),
            &Verdict::new(Status::Allowed, 1, 5),
        );
        assert!(cache.lookup(&e, 1, &q()).denial().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_costlier_request_waits_longer_by_what_each_unit_adds() {
        let retry = |l: Lookup| match l.denial().map(|v| v.status) {
            Some(Status::Denied { retry_after }) => Some(retry_after),
            _ => None,
        };
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        // GCRA, one unit every 6 s: a request of 5 units waits 4 × 6 s more than one of 1.
        let gcra = [4u8; 16];
        cache.insert(
            &gcra,
            &limit(),
            &q(),
            1,
            Some(6_000_000),
            &denied(1_000_000),
        );
        assert_eq!(retry(cache.lookup(&gcra, 1, &q())), Some(1_000_000));
        assert_eq!(retry(cache.lookup(&gcra, 5, &q())), Some(25_000_000));
        // A fixed window: every cost waits for the window to turn.
        let window = [5u8; 16];
        cache.insert(&window, &limit(), &q(), 1, Some(0), &denied(1_000_000));
        assert_eq!(retry(cache.lookup(&window, 5, &q())), Some(1_000_000));
        // A sliding log: unknown, so a costlier request asks Redis.
        let log = [6u8; 16];
        cache.insert(&log, &limit(), &q(), 1, None, &denied(1_000_000));
        assert_eq!(retry(cache.lookup(&log, 1, &q())), Some(1_000_000));
        assert_eq!(cache.lookup(&log, 5, &q()), Lookup::Miss);
    }

    #[tokio::test(start_paused = true)]
    async fn a_denial_stands_only_under_the_quota_it_was_made_under() {
        let cache = RefusedKeys::new(100, Duration::from_millis(50), Duration::from_secs(3600));
        let a = [1u8; 16];
        cache.insert(&a, &limit(), &q(), 1, Some(0), &denied(1_000_000));
        // A request under another quota (another plan, or a reload that changed the quota)
        // is not answered by a denial made under the first: it asks Redis.
        let pro = Quota::per_minute(50).unwrap();
        assert_eq!(cache.lookup(&a, 1, &pro), Lookup::Miss);
        // ... and it is gone: the quota in use is another.
        assert_eq!(cache.len(), 0);
        assert_eq!(cache.lookup(&a, 1, &q()), Lookup::Miss);
    }

    #[tokio::test(start_paused = true)]
    async fn stays_bounded_and_reclaims_expired_entries() {
        let cache = RefusedKeys::new(
            SHARDS * 2,
            Duration::from_millis(50),
            Duration::from_secs(3600),
        );
        // Three digests in the same shard (same first byte): the third does not fit.
        let ds: Vec<KeyDigest> = (0..3u8)
            .map(|i| {
                let mut d = [0u8; 16];
                d[1] = i;
                d
            })
            .collect();
        cache.insert(&ds[0], &limit(), &q(), 1, Some(0), &denied(1_000));
        cache.insert(&ds[1], &limit(), &q(), 1, Some(0), &denied(5_000));
        cache.insert(&ds[2], &limit(), &q(), 1, Some(0), &denied(5_000));
        assert!(cache.lookup(&ds[2], 1, &q()).denial().is_none());
        assert_eq!(cache.len(), 2);
        // Once one has expired, a new one takes its place.
        tokio::time::advance(Duration::from_millis(1)).await;
        cache.insert(&ds[2], &limit(), &q(), 1, Some(0), &denied(5_000));
        assert!(cache.lookup(&ds[2], 1, &q()).denial().is_some());
        assert_eq!(cache.len(), 2);
        // Disabled.
        let off = RefusedKeys::new(0, Duration::from_millis(50), Duration::from_secs(3600));
        off.insert(&ds[0], &limit(), &q(), 1, Some(0), &denied(1_000));
        assert!(off.lookup(&ds[0], 1, &q()).denial().is_none());
    }
}
