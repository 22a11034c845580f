//! Who is being refused: per limit, the most-refused identities over the last one to two
//! buckets of [`REPORT_BUCKET`], merged from every replica's local summary
//! ([`topk::SpaceSaving`](crate::topk::SpaceSaving)).
//!
//! A replica counts its refusals in a local summary of `k` counters (no backend call) and, at
//! most once per [`REPORT_TICK`], hands the counters it gathered to its backend's [`Reports`](crate::Reports),
//! ([`Reports`](crate::Reports)), which adds them to the limit's summary of the current bucket, bounded to `2k` identities. A
//! read merges the current and the previous bucket, so it covers between one and two buckets.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::clock::Micros;
use crate::topk::{sort_counters, Counter, SpaceSaving};

/// How long one bucket of a limit's report lasts: a report covers the current bucket and the
/// previous one.
pub const REPORT_BUCKET: Duration = Duration::from_secs(60);

/// How often, at most, a replica hands its local counters to the backend.
pub const REPORT_TICK: Duration = Duration::from_secs(1);

/// One identity's refusals under one limit.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refused {
    /// Whom the refusals were for, as the layer's `KeyExtractor::identity_of` names it: a
    /// fingerprint (`#3f0c9a51b2d4`) by default, or, where the extractor reveals identities,
    /// an address (`203.0.113.7`), an IPv6 network (`2001:db8:1:2::/64`), a tenant's or a
    /// principal's name. Backends store it as it is.
    pub identity: String,
    /// How many requests were refused, over-counted by at most [`error`](Self::error).
    pub count: u64,
    /// The most `count` may exceed the true number (Space-Saving's bound, 0 when exact).
    pub error: u64,
    /// When the first counted refusal happened, in microseconds since the Unix epoch.
    pub first_seen: Micros,
    /// When the last one happened.
    pub last_seen: Micros,
}

impl Refused {
    /// `count` refusals of `identity` (over-counted by at most `error`), between `first_seen`
    /// and `last_seen`.
    pub fn new(
        identity: impl Into<String>,
        count: u64,
        error: u64,
        first_seen: Micros,
        last_seen: Micros,
    ) -> Self {
        Self {
            identity: identity.into(),
            count,
            error,
            first_seen,
            last_seen,
        }
    }

    /// The first and last time seen: [`first_seen`](Self::first_seen) and
    /// [`last_seen`](Self::last_seen) as system times.
    pub fn seen(&self) -> (std::time::SystemTime, std::time::SystemTime) {
        let at = |micros| std::time::UNIX_EPOCH + Duration::from_micros(micros);
        (at(self.first_seen), at(self.last_seen))
    }
}

impl From<Counter<String>> for Refused {
    fn from(c: Counter<String>) -> Self {
        Self::new(c.key, c.count, c.error, c.first_seen, c.last_seen)
    }
}

/// The index of the bucket of `now`.
pub fn bucket_of(now: Micros) -> u64 {
    now / REPORT_BUCKET.as_micros() as u64
}

/// Merges counters of one identity from several summaries (buckets, replicas) into one each,
/// and keeps the `n` largest, largest first.
pub fn combine(refused: impl IntoIterator<Item = Refused>, n: usize) -> Vec<Refused> {
    let mut by_identity: HashMap<String, Counter<String>> = HashMap::new();
    for r in refused {
        let c = by_identity
            .entry(r.identity.clone())
            .or_insert_with(|| Counter {
                key: r.identity,
                count: 0,
                error: 0,
                first_seen: r.first_seen,
                last_seen: r.last_seen,
            });
        c.count = c.count.saturating_add(r.count);
        c.error = c.error.saturating_add(r.error);
        c.first_seen = c.first_seen.min(r.first_seen);
        c.last_seen = c.last_seen.max(r.last_seen);
    }
    let mut all: Vec<_> = by_identity.into_values().collect();
    sort_counters(&mut all);
    all.truncate(n);
    all.into_iter().map(Refused::from).collect()
}

/// Reports held in the process: per limit, a summary of the current bucket and of the
/// previous one (the memory backend's [`Reports`]).
#[derive(Debug, Default)]
pub(crate) struct Board {
    limits: Mutex<HashMap<String, Buckets>>,
}

#[derive(Debug)]
struct Buckets {
    current: (u64, SpaceSaving<String>),
    previous: Option<(u64, SpaceSaving<String>)>,
}

impl Board {
    /// [`Reports::merge`], at once.
    pub(crate) fn merge(&self, limit: &str, keep: usize, refused: Vec<Refused>, now: Micros) {
        let bucket = bucket_of(now);
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        // Limits that a reload removed leave once their report has expired.
        limits.retain(|_, b| b.current.0 + 1 >= bucket);
        let buckets = limits.entry(limit.to_owned()).or_insert_with(|| Buckets {
            current: (bucket, SpaceSaving::new(keep)),
            previous: None,
        });
        if bucket > buckets.current.0 {
            let fresh = (bucket, SpaceSaving::new(keep));
            let old = std::mem::replace(&mut buckets.current, fresh);
            buckets.previous = (old.0 + 1 == bucket).then_some(old);
        }
        for r in refused {
            buckets.current.1.add_counted(
                r.identity.as_str(),
                r.count,
                r.error,
                (r.first_seen, r.last_seen),
            );
        }
    }

    /// [`Reports::top`], at once.
    pub(crate) fn top(&self, limit: &str, n: usize, now: Micros) -> Vec<Refused> {
        let bucket = bucket_of(now);
        let limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(buckets) = limits.get(limit) else {
            return Vec::new();
        };
        let recent = |(at, summary): &(u64, SpaceSaving<String>)| {
            (*at == bucket || *at + 1 == bucket).then(|| summary.top(summary.len()))
        };
        let counters = [Some(&buckets.current), buckets.previous.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(recent)
            .flatten()
            .map(Refused::from);
        combine(counters, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Micros = REPORT_BUCKET.as_micros() as Micros;

    #[test]
    fn a_report_covers_the_current_and_the_previous_bucket() {
        let board = Board::default();
        board.merge("l", 10, vec![Refused::new("a", 3, 0, 10, 20)], 5);
        board.merge("l", 10, vec![Refused::new("a", 2, 1, 5, B + 1)], B + 1);
        board.merge("l", 10, vec![Refused::new("b", 1, 0, B + 2, B + 2)], B + 2);
        let top = board.top("l", 10, B + 3);
        assert_eq!(top[0], Refused::new("a", 5, 1, 5, B + 1));
        assert_eq!(top[1], Refused::new("b", 1, 0, B + 2, B + 2));
        // A bucket later, the first bucket is gone.
        let top = board.top("l", 10, 2 * B);
        assert_eq!(top[0], Refused::new("a", 2, 1, 5, B + 1));
        // Two later, everything.
        assert!(board.top("l", 10, 3 * B).is_empty());
        assert!(board.top("other", 10, B).is_empty());
    }

    #[test]
    fn a_bucket_keeps_at_most_its_bound() {
        let board = Board::default();
        let many = (0..500)
            .map(|i| Refused::new(i.to_string(), 1, 0, 0, 0))
            .collect();
        board.merge("l", 200, many, 0);
        assert_eq!(board.top("l", usize::MAX, 0).len(), 200);
    }
}
