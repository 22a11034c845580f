//! Benchmarks of tollgate: the pieces shared by the bench server, the memory measurement and
//! the criterion benches. Not published; see `docs/benchmarks.md` for what is measured and how
//! to rerun it (`benches/run.sh`).
//!
//! - [`naive`]: the reference a user would otherwise write by hand, a per-request
//!   `INCR` + `EXPIRE NX` middleware on Redis.
//! - [`layers`]: the in-memory layers measured feature by feature (the bench server's
//!   `tollgate-mem-allow+FEATURE` modes, and the allocation count).
//! - [`overload`]: the overload benchmark's server of known capacity, the systems it
//!   compares, its open-loop load and its figures (`benches/overload.sh`).
//! - [`ip_key`]: the key bytes tollgate's `ClientIp` extractor makes for an IPv4 peer, so that
//!   the micro benchmarks hash what a real request hashes.

pub mod layers;
pub mod naive;
pub mod overload;

use std::net::Ipv4Addr;

/// The key bytes `tollgate::key::ClientIp` produces for an IPv4 peer kept whole (`/32`):
/// a version byte, the four octets, the prefix length.
pub fn ip_key(addr: Ipv4Addr) -> [u8; 6] {
    let [a, b, c, d] = addr.octets();
    [4, a, b, c, d, 32]
}

/// `n` distinct IPv4 addresses, from 10.0.0.0 upwards.
pub fn addrs(n: usize) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|i| Ipv4Addr::from(0x0a00_0000_u32.wrapping_add(i as u32)))
        .collect()
}

/// A process's CPU time so far (user + system, all threads), in clock ticks, from
/// `/proc/<pid>/stat`; `None` when it cannot be read.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// This process's resident set size in bytes, from `/proc/self/statm`.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split(' ').nth(1)?.parse().ok()?;
    Some(pages * 4096)
}
