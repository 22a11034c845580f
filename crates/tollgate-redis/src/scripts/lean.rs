//! The lean `CHECK` (`check_lean.lua`): the commonest call, made cheap for Redis.
//!
//! Most calls carry requests that each check one GCRA limit, with no penalty, on a key of
//! their own (a limit per client IP, sprayed over many addresses). [`check`](super::check)'s
//! general script pays for what such a call does not use: eight arguments per limit, a
//! table per kind of state, helpers made on every call and a read of every key's sanctions
//! (the lean script reads them only when the key's value says it has some: see `tat.lua`).
//! The lean script takes one argument and the keys, one per request, and answers exactly as
//! the general one does (the same reply, read by [`reply`](super::reply)), so a call is sent in
//! the lean form whenever it fits and in the general one otherwise. `tests/vectors.txt`
//! checks both against `tollgate_core::algorithm`.
//!
//! `ARGV[1]`: one string of little-endian doubles (integers below 2^53, as the general
//! script's): `now` (-1 for the server's `TIME`), the limit's emission interval, tolerance and
//! burst, the cost of every request and 1 if they are enforced (else 0). One string, not an
//! argument per figure: Redis makes a string of each argument and Lua's `tonumber` reads each
//! with `strtod`, which cost a lean call about as much as its commands. `ARGV[2]`: the TTL, in
//! milliseconds, of a fresh key that one request's cost takes (see `check_lean.lua`). In the
//! cross-slot form, the keys after the first follow.

use std::sync::LazyLock;

use crate::scripts::check::{EncodedCheck, Form};
use crate::scripts::Script;
use tollgate_core::Micros;

use crate::transport::args::Args;

/// The script's body, after the line that names its keys `K`.
const BODY: &str = include_str!("check_lean.lua");

/// Arguments before the keys that follow them in the cross-slot form.
const FIXED: usize = 2;

fn declared() -> &'static Script {
    static SCRIPT: LazyLock<Script> =
        LazyLock::new(|| Script::bare(&format!("local K = KEYS\n{BODY}")));
    &SCRIPT
}

fn cross_slot() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::bare(&format!(
            "#!lua flags=allow-cross-slot-keys\nlocal K = {{KEYS[1]}}\n\
             for x = {}, #ARGV do K[#K + 1] = ARGV[x] end\n{BODY}",
            FIXED + 1
        ))
    });
    &SCRIPT
}

/// The lean script of `form`.
pub(crate) fn script(form: Form) -> &'static Script {
    match form {
        Form::Declared => declared(),
        Form::CrossSlot => cross_slot(),
    }
}

/// Whether the call of `batches` fits the lean script: every request one check of one GCRA
/// limit (the same parameters, cost and enforcement for all) with no penalty, and no two on
/// the same key. Then the one check its requests share the figures of.
pub(crate) fn fits<'p>(batches: &[&'p [EncodedCheck]]) -> Option<&'p EncodedCheck> {
    let first = match batches.first()? {
        [only] => only,
        _ => return None,
    };
    if first.code != 1 || first.penalty[0] != 0 {
        return None;
    }
    let alike = |p: &EncodedCheck| {
        p.code == 1
            && p.params == first.params
            && p.cost == first.cost
            && p.enforce == first.enforce
            && p.penalty[0] == 0
            && p.name == first.name
    };
    for batch in batches {
        match batch {
            [only] if alike(only) => {}
            _ => return None,
        }
    }
    // Keys of their own: a key shared by several requests (a busy client) costs the general
    // script one argument, not one per request.
    if batches.len() > 1 {
        let mut digests: Vec<_> = batches.iter().map(|b| b[0].digest).collect();
        digests.sort_unstable();
        if digests.windows(2).any(|w| w[0] == w[1]) {
            return None;
        }
    }
    Some(first)
}

/// How many arguments a lean call of `requests` requests has: `EVALSHA`, the digest, the
/// number of declared keys, the figures and one key per request.
pub(crate) fn len(requests: usize) -> usize {
    3 + requests + FIXED
}

/// Writes the arguments of a lean call between its declared keys and the keys that follow
/// them in the cross-slot form: `now` (`None`: the server's `TIME`) and the figures of `first`,
/// which every request of the call shares, then a fresh key's TTL.
pub(crate) fn write_figures(out: &mut dyn Args, first: &EncodedCheck, now: Option<Micros>) {
    let [interval, tolerance, burst] = first.params;
    let figures = [
        now.map_or(-1.0, |now| now as f64),
        interval as f64,
        tolerance as f64,
        burst as f64,
        f64::from(first.cost),
        f64::from(u8::from(first.enforce)),
    ];
    let mut packed = [0u8; 48];
    for (slot, figure) in packed.chunks_exact_mut(8).zip(figures) {
        slot.copy_from_slice(&figure.to_le_bytes());
    }
    out.bytes(&packed);
    // As `ttl_ms` in `tat.lua`: whole milliseconds, rounded up, at least one.
    let step = interval.saturating_mul(u64::from(first.cost));
    out.number((step.saturating_add(999) / 1000).max(1));
}
