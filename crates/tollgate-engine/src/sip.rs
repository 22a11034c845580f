//! SipHash over a 64-bit word followed by a byte string, in one pass.
//!
//! The in-memory backend fingerprints (limit id, key) once per check. `std`'s `Hasher`
//! interface pays for buffering on every `write`; hashing the one message we need directly
//! costs less, with the same function (SipHash-1-3, as `std`'s `RandomState`) and a 128-bit
//! secret key as strong. What it saves: see `docs/benchmarks.md`, section "Hand-written parts
//! of the core, and what each saves", "The fingerprint's hash".

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// A SipHash-c-d key. `C` compression rounds per 8-byte word, `D` finalization rounds.
#[derive(Clone, Copy)]
pub(crate) struct SipKey<const C: usize, const D: usize> {
    k0: u64,
    k1: u64,
}

/// SipHash-1-3: what `std` uses against chosen-key flooding of hash tables.
pub(crate) type Sip13 = SipKey<1, 3>;

impl<const C: usize, const D: usize> SipKey<C, D> {
    pub(crate) const fn new(k0: u64, k1: u64) -> Self {
        Self { k0, k1 }
    }

    /// A secret key for this process: two outputs of `std`'s randomly keyed SipHash, which
    /// nobody without its key can predict.
    pub(crate) fn random() -> Self {
        let seed = RandomState::new();
        Self::new(seed.hash_one(0_u64), seed.hash_one(1_u64))
    }

    /// The hash of the byte string `word` (little-endian) ‖ `bytes`. `word` has a fixed width,
    /// so distinct (`word`, `bytes`) pairs are distinct messages.
    #[inline]
    pub(crate) fn hash(&self, word: u64, bytes: &[u8]) -> u64 {
        let mut s = State {
            v0: self.k0 ^ 0x736f_6d65_7073_6575,
            v1: self.k1 ^ 0x646f_7261_6e64_6f6d,
            v2: self.k0 ^ 0x6c79_6765_6e65_7261,
            v3: self.k1 ^ 0x7465_6462_7974_6573,
        };
        s.absorb::<C>(word);
        let mut words = bytes.chunks_exact(8);
        for chunk in &mut words {
            if let Ok(chunk) = <[u8; 8]>::try_from(chunk) {
                s.absorb::<C>(u64::from_le_bytes(chunk));
            }
        }
        // The last word holds the remaining bytes and, in its top byte, the message's length
        // modulo 256.
        let len = (8 + bytes.len()) as u64;
        s.absorb::<C>(load_tail(words.remainder()) | (len << 56));
        s.v2 ^= 0xff;
        for _ in 0..D {
            s.round();
        }
        s.v0 ^ s.v1 ^ s.v2 ^ s.v3
    }
}

/// A [`BuildHasher`] of byte-string keys (`Box<[u8]>`, `Vec<u8>`) for `std`'s `HashMap`:
/// their length and bytes hashed in one pass by [`SipKey::hash`], under a random key, instead
/// of `std`'s buffered SipHash. Other keys hash too (each further word or byte string is
/// folded in by another pass), but only a length followed by bytes takes one pass.
#[derive(Clone, Copy)]
pub(crate) struct BytesKeyed(Sip13);

impl BytesKeyed {
    pub(crate) fn random() -> Self {
        Self(Sip13::random())
    }
}

impl BuildHasher for BytesKeyed {
    type Hasher = BytesHasher;

    #[inline]
    fn build_hasher(&self) -> BytesHasher {
        BytesHasher {
            key: self.0,
            hash: 0,
            word: None,
        }
    }
}

/// The hasher of [`BytesKeyed`].
pub(crate) struct BytesHasher {
    key: Sip13,
    hash: u64,
    /// A word written and not yet hashed: a byte string's length, hashed with its bytes.
    word: Option<u64>,
}

impl Hasher for BytesHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let word = self.word.take().unwrap_or(0);
        self.hash = self.key.hash(self.hash ^ word, bytes);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        if let Some(word) = self.word.replace(n as u64) {
            self.hash = self.key.hash(self.hash ^ word, &[]);
        }
    }

    #[inline]
    fn finish(&self) -> u64 {
        match self.word {
            Some(word) => self.key.hash(self.hash ^ word, &[]),
            None => self.hash,
        }
    }
}

struct State {
    v0: u64,
    v1: u64,
    v2: u64,
    v3: u64,
}

impl State {
    #[inline(always)]
    fn absorb<const C: usize>(&mut self, m: u64) {
        self.v3 ^= m;
        for _ in 0..C {
            self.round();
        }
        self.v0 ^= m;
    }

    #[inline(always)]
    fn round(&mut self) {
        self.v0 = self.v0.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(13) ^ self.v0;
        self.v0 = self.v0.rotate_left(32);
        self.v2 = self.v2.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(16) ^ self.v2;
        self.v0 = self.v0.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(21) ^ self.v0;
        self.v2 = self.v2.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(17) ^ self.v2;
        self.v2 = self.v2.rotate_left(32);
    }
}

/// Up to seven bytes as a little-endian word, in at most three loads.
#[inline(always)]
fn load_tail(mut rest: &[u8]) -> u64 {
    let mut word = 0;
    let mut shift = 0;
    if let [a, b, c, d, more @ ..] = rest {
        word = u64::from(u32::from_le_bytes([*a, *b, *c, *d]));
        shift = 32;
        rest = more;
    }
    if let [a, b, more @ ..] = rest {
        word |= u64::from(u16::from_le_bytes([*a, *b])) << shift;
        shift += 16;
        rest = more;
    }
    if let [a, ..] = rest {
        word |= u64::from(*a) << shift;
    }
    word
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    /// Messages of every length up to three words past the first, with varied bytes.
    fn messages() -> Vec<(u64, Vec<u8>)> {
        (0..40_u8)
            .map(|len| {
                let word = 0x0123_4567_89ab_cdef_u64.rotate_left(u32::from(len));
                let bytes = (0..len).map(|i| i.wrapping_mul(37) ^ len).collect();
                (word, bytes)
            })
            .collect()
    }

    fn std_hash(mut h: impl Hasher, word: u64, bytes: &[u8]) -> u64 {
        h.write(&word.to_le_bytes());
        h.write(bytes);
        h.finish()
    }

    /// A byte-string key hashes as its length then its bytes, in one pass; a map keyed so
    /// finds every key, and keys that differ only by their length hash apart.
    #[test]
    fn byte_string_keys_hash_in_one_pass() {
        use std::collections::HashMap;
        let keyed = BytesKeyed(Sip13::new(1, 2));
        for (_, bytes) in messages() {
            let key: Box<[u8]> = bytes.clone().into();
            assert_eq!(
                keyed.hash_one(&key),
                Sip13::new(1, 2).hash(bytes.len() as u64, &bytes)
            );
        }
        let mut map = HashMap::with_hasher(BytesKeyed::random());
        for (i, (_, bytes)) in messages().into_iter().enumerate() {
            map.insert(Box::<[u8]>::from(bytes), i);
        }
        for (i, (_, bytes)) in messages().into_iter().enumerate() {
            assert_eq!(map.get(&*bytes), Some(&i));
        }
        let (a, b): (Box<[u8]>, Box<[u8]>) = (Box::new([0; 3]), Box::new([0; 4]));
        assert_ne!(keyed.hash_one(&a), keyed.hash_one(&b));
    }

    #[test]
    fn sip13_matches_std_default_hasher() {
        // `DefaultHasher::new()` is SipHash-1-3 with the all-zero key.
        let key = Sip13::new(0, 0);
        for (word, bytes) in messages() {
            let ours = key.hash(word, &bytes);
            let std = std_hash(std::hash::DefaultHasher::new(), word, &bytes);
            assert_eq!(ours, std, "{} bytes", bytes.len());
        }
    }

    #[test]
    #[allow(deprecated)]
    fn sip24_matches_std_sip_hasher_with_keys() {
        // `std::hash::SipHasher` is SipHash-2-4 and takes a key: checks the key schedule.
        let (k0, k1) = (0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
        let key = SipKey::<2, 4>::new(k0, k1);
        for (word, bytes) in messages() {
            let std = std_hash(std::hash::SipHasher::new_with_keys(k0, k1), word, &bytes);
            assert_eq!(key.hash(word, &bytes), std, "{} bytes", bytes.len());
        }
    }

    #[test]
    fn sip24_reference_vector() {
        // The first vectors of the SipHash paper: key 00..0f, message 00 01 .. (len - 1).
        let key = SipKey::<2, 4>::new(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
        let message: Vec<u8> = (0..15).collect();
        let word = u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(key.hash(word, &message[8..]), 0xa129_ca61_49be_45e5);
    }
}
