//! A fixed-size cache of key digests, for the identities that come back.
//!
//! SHA-256 is the most expensive step of a check on this side of the network (see
//! `docs/benchmarks.md`). Clients that are limited at all send many requests, so most checks digest a pair that was
//! digested a moment ago. The cache remembers the last pair of each of its cells, found by a
//! cheap keyed hash and confirmed by comparing the whole pair, so a hit is the digest of
//! exactly that pair. It never grows: a new pair takes its cell's place, and an attacker who
//! aims pairs at one cell only makes those checks digest as if there were no cache.

use std::hash::BuildHasher;
use std::sync::Mutex;

use crate::keys::{self, KeyDigest, Keyer};

/// Cells in the cache (a power of two).
const CELLS: usize = 1024;

/// The longest (limit name, key) pair kept, in bytes: IP keys, tenants and principal ids fit;
/// longer pairs are digested every time.
const MAX_PAIR: usize = 96;

/// The remembered pair of one cell and its digest.
struct Cell {
    name_len: u8,
    /// 0 with `name_len` 0: the cell is empty (a limit name is never empty).
    key_len: u8,
    pair: [u8; MAX_PAIR],
    digest: KeyDigest,
}

impl Cell {
    const EMPTY: Self = Self {
        name_len: 0,
        key_len: 0,
        pair: [0; MAX_PAIR],
        digest: [0; keys::DIGEST_LEN],
    };

    fn holds(&self, name: &[u8], key: &[u8]) -> bool {
        usize::from(self.name_len) == name.len()
            && usize::from(self.key_len) == key.len()
            && self.pair[..name.len()] == *name
            && self.pair[name.len()..name.len() + key.len()] == *key
    }
}

/// The cache; about 120 KB whatever the traffic. It belongs to one backend and digests as
/// its [`Keyer`] does (under its key secret, if any), so a hit is that backend's digest.
pub(crate) struct DigestCache {
    seed: u64,
    keyer: Keyer,
    cells: Box<[Mutex<Cell>]>,
}

impl DigestCache {
    /// An empty cache of `keyer`'s digests.
    pub(crate) fn new(keyer: Keyer) -> Self {
        Self {
            seed: std::collections::hash_map::RandomState::new().hash_one(0_u64),
            keyer,
            cells: (0..CELLS).map(|_| Mutex::new(Cell::EMPTY)).collect(),
        }
    }

    /// The digest of (`limit_name`, `key`): the keyer's, remembered.
    pub(crate) fn digest(&self, limit_name: &str, key: &[u8]) -> KeyDigest {
        let name = limit_name.as_bytes();
        if name.is_empty() || name.len() + key.len() > MAX_PAIR {
            return self.keyer.digest(limit_name, key);
        }
        let index = self.index(name, key);
        let Some(cell) = self.cells.get(index) else {
            return self.keyer.digest(limit_name, key);
        };
        // A cell another thread holds is not waited for: the digest is computed instead.
        if let Ok(cell) = cell.try_lock() {
            if cell.holds(name, key) {
                return cell.digest;
            }
        }
        let digest = self.keyer.digest(limit_name, key);
        if let Ok(mut cell) = cell.try_lock() {
            cell.pair[..name.len()].copy_from_slice(name);
            cell.pair[name.len()..name.len() + key.len()].copy_from_slice(key);
            // Both lengths fit: the pair is at most `MAX_PAIR` (< 256) bytes.
            cell.name_len = name.len() as u8;
            cell.key_len = key.len() as u8;
            cell.digest = digest;
        }
        digest
    }

    /// The cell of a pair: a multiply-rotate hash seeded per process. Not collision-proof,
    /// and it need not be: the cell's whole pair is compared before its digest is used.
    fn index(&self, name: &[u8], key: &[u8]) -> usize {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut h = self.seed ^ (name.len() as u64) << 8 ^ key.len() as u64;
        for part in [name, key] {
            let mut words = part.chunks_exact(8);
            for w in &mut words {
                let mut word = [0u8; 8];
                word.copy_from_slice(w);
                h = (h.rotate_left(5) ^ u64::from_le_bytes(word)).wrapping_mul(K);
            }
            let mut tail = [0u8; 8];
            tail[..words.remainder().len()].copy_from_slice(words.remainder());
            h = (h.rotate_left(5) ^ u64::from_le_bytes(tail)).wrapping_mul(K);
        }
        (h >> 32) as usize & (CELLS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hit_is_the_digest_of_exactly_that_pair() {
        let cache = DigestCache::new(Keyer::default());
        // More pairs than cells, so that cells are shared and pairs evict each other; pairs
        // that differ only in where the name ends and the key begins.
        let mut pairs = Vec::new();
        for i in 0..3000_u32 {
            pairs.push(("per_ip".to_owned(), i.to_be_bytes().to_vec()));
        }
        pairs.push(("ab".to_owned(), b"c".to_vec()));
        pairs.push(("a".to_owned(), b"bc".to_vec()));
        pairs.push(("x".repeat(64), vec![7; 32]));
        pairs.push(("long".to_owned(), vec![1; 200]));
        for round in 0..3 {
            for (name, key) in &pairs {
                assert_eq!(
                    cache.digest(name, key),
                    keys::digest(name, key),
                    "round {round}, {name} {key:?}"
                );
            }
        }
        // Asked again at once, the last pairs come from the cache: their cells hold them.
        let (name, key) = &pairs[pairs.len() - 2];
        let cell = cache.cells[cache.index(name.as_bytes(), key)]
            .lock()
            .unwrap();
        assert!(cell.holds(name.as_bytes(), key));
    }

    /// A cache under a key secret answers that secret's digests, hit or miss, never the
    /// unkeyed ones.
    #[test]
    fn a_keyed_cache_answers_keyed_digests() {
        let keyer = Keyer::new(b"replica secret");
        let cache = DigestCache::new(keyer.clone());
        for _ in 0..2 {
            for key in [&b"10.0.0.1"[..], &[7; 200]] {
                assert_eq!(cache.digest("per_ip", key), keyer.digest("per_ip", key));
                assert_ne!(cache.digest("per_ip", key), keys::digest("per_ip", key));
            }
        }
    }

    #[test]
    fn an_empty_cell_matches_nothing() {
        assert!(!Cell::EMPTY.holds(b"a", b""));
        assert!(!Cell::EMPTY.holds(b"", b"x"));
    }
}
