//! A key's fingerprint: the keyed hash of (limit, key) that the shards store instead of the key.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use crate::check::Check;
use crate::counting::Algorithm;
use crate::sip::Sip13;

/// A key's fingerprint: a keyed 64-bit hash of (limit, key). Bits 32.. pick the shard; the
/// map uses the low bits (bucket) and the top 7 (tag), so the two never overlap.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Fp(u64);

impl Fp {
    #[inline]
    pub(super) fn shard(self, mask: usize) -> usize {
        ((self.0 >> 32) as usize) & mask
    }
}

impl Hash for Fp {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0);
    }
}

/// The fingerprint is already a keyed hash: use it as it is.
#[derive(Default)]
pub(super) struct FpHasher(u64);

impl Hasher for FpHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub(super) type FpMap<V> = HashMap<Fp, V, BuildHasherDefault<FpHasher>>;

/// The fingerprint of `check`'s key under `seed`.
#[inline]
pub(super) fn fingerprint(seed: &Sip13, check: &Check<'_>) -> Fp {
    // A fixed window's count belongs to its period: a limit whose period changes at run
    // time starts empty rather than reading a day's count as a minute's.
    let id = match check.limit.algorithm() {
        Algorithm::FixedWindow => {
            check.limit.id()
                ^ check
                    .quota
                    .period_micros()
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        }
        Algorithm::Gcra | Algorithm::SlidingLog | Algorithm::Concurrency => check.limit.id(),
    };
    Fp(seed.hash(id, check.key))
}
