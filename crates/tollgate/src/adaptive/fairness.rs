//! Fairness within a class: how many requests each key has in flight, and the share one key
//! may hold when its level is contended.
//!
//! Keys are held as 64-bit keyed hashes (never the key itself), and only while they have a
//! request in flight: the map never holds more keys than the limit's ceiling.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;

/// The requests in flight per key.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    counts: HashMap<u64, u32>,
}

/// The fingerprint of a key's bytes under `hasher` (`None`: the request had no key; such
/// requests share one fingerprint, so that together they count as one client).
pub(crate) fn fingerprint(hasher: &RandomState, key: Option<&[u8]>) -> u64 {
    match key {
        Some(key) => hasher.hash_one(key) | 1,
        None => 0,
    }
}

impl Keys {
    /// Whether the key `fp` may take one more request of a level whose share of the limit is
    /// `share`, with `in_flight` requests in flight in all: always while fewer than half of
    /// the share are in flight; beyond, only while the key holds less than its fair part of
    /// the share (the share divided among the keys in flight, this one included).
    pub(crate) fn fair(&self, fp: u64, share: u32, in_flight: u32) -> bool {
        if u64::from(in_flight) * 2 < u64::from(share) {
            return true;
        }
        let held = self.counts.get(&fp).copied().unwrap_or(0);
        let keys = self.counts.len() + usize::from(held == 0);
        let keys = u32::try_from(keys).unwrap_or(u32::MAX).max(1);
        held < share.div_ceil(keys)
    }

    pub(crate) fn add(&mut self, fp: u64) {
        *self.counts.entry(fp).or_insert(0) += 1;
    }

    pub(crate) fn remove(&mut self, fp: u64) {
        if let Some(count) = self.counts.get_mut(&fp) {
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&fp);
            }
        }
    }

    /// How many keys have a request in flight.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.counts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heaviest_key_is_refused_first() {
        let mut keys = Keys::default();
        let hasher = RandomState::new();
        let (heavy, light) = (
            fingerprint(&hasher, Some(b"a")),
            fingerprint(&hasher, Some(b"b")),
        );
        for _ in 0..6 {
            keys.add(heavy);
        }
        keys.add(light);
        // 7 of a share of 8: contended; two keys, a fair part of 4.
        assert!(!keys.fair(heavy, 8, 7));
        assert!(keys.fair(light, 8, 7));
        // A third key's fair part is 3.
        let third = fingerprint(&hasher, Some(b"c"));
        assert!(keys.fair(third, 8, 7));
        // Not contended: anyone.
        assert!(keys.fair(heavy, 16, 7));
        for _ in 0..6 {
            keys.remove(heavy);
        }
        keys.remove(light);
        assert_eq!(keys.len(), 0);
        assert_eq!(fingerprint(&hasher, None), 0);
    }
}
