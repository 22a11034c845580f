//! The cost of a Redis key's digest (SHA-256 over the limit's name and the key, as
//! `tollgate-redis` computes it once per check), natively: callgrind runs sha2's portable code,
//! because valgrind does not emulate the SHA extensions, so `instructions.sh` overstates it.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin digest-cost [N]
//! ```
//!
//! Prints whether the CPU has the SHA extensions (which sha2 then uses) and the nanoseconds per
//! digest over N (default 5,000,000) distinct 32-byte inputs, the size of an IPv4 key's input.

use std::hint::black_box;
use std::time::Instant;

use sha2::{Digest, Sha256};

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000);
    #[cfg(target_arch = "x86_64")]
    let sha_ni = std::arch::is_x86_feature_detected!("sha");
    #[cfg(not(target_arch = "x86_64"))]
    let sha_ni = false;
    // The digest's input for a limit "per-ip" and an IPv4 key: a domain separator, the name's
    // length and bytes, the key's length and bytes.
    let mut input = [0u8; 32];
    input[..12].copy_from_slice(b"tollgate/v1\0");
    input[12..16].copy_from_slice(&6u32.to_be_bytes());
    input[16..22].copy_from_slice(b"per-ip");
    input[22..26].copy_from_slice(&6u32.to_be_bytes());
    let started = Instant::now();
    let mut acc = 0u8;
    for i in 0..n {
        input[26..32].copy_from_slice(&i.to_le_bytes()[..6]);
        let digest = Sha256::digest(black_box(&input));
        acc ^= digest[0];
    }
    let elapsed = started.elapsed();
    black_box(acc);
    println!(
        "sha extensions: {}; {:.1} ns per digest over {n} digests",
        if sha_ni { "yes" } else { "no" },
        elapsed.as_nanos() as f64 / n as f64
    );
}
