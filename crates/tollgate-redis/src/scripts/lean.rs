//! The lean `CHECK` (`check_lean.lua`): the commonest call, made cheap for Redis.
//!
//! Most calls carry requests that each check one GCRA limit, with no penalty, on a key of
//! their own (a limit per client IP, sprayed over many addresses). [`check`](super::check)'s
//! general script pays for what such a call does not use: eight arguments per limit, a
//! packed string to decode, a table per kind of state and helpers made on every call. The
//! lean script takes six arguments and the keys, one per request, and answers exactly as the
//! general one does (the same reply, read by [`reply`](super::reply)), so a call is sent in
//! the lean form whenever it fits and in the general one otherwise. `tests/vectors.txt`
//! checks both against `tollgate_core::algorithm`.
//!
//! `ARGV`: `now` (as in [`check::CHECK`](super::check::CHECK)), the limit's emission interval,
//! tolerance and burst, the cost of every request and 1 if they are enforced (else 0); in the
//! cross-slot form, the keys after the first follow.

use std::sync::LazyLock;

use crate::scripts::check::{EncodedCheck, Form};
use crate::scripts::Script;
use crate::transport::args::Args;

/// The script's body, after the line that names its keys `K`.
const BODY: &str = include_str!("check_lean.lua");

/// Arguments before the keys that follow them in the cross-slot form.
const FIXED: usize = 6;

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
/// number of declared keys, `now`, the figures and one key per request.
pub(crate) fn len(requests: usize) -> usize {
    3 + requests + FIXED
}

/// Writes the arguments of a lean call between `now` and the keys that follow them in the
/// cross-slot form: the figures of `first`, which every request of the call shares.
pub(crate) fn write_figures(out: &mut dyn Args, first: &EncodedCheck) {
    let [interval, tolerance, burst] = first.params;
    out.number(interval);
    out.number(tolerance);
    out.number(burst);
    out.number(u64::from(first.cost));
    out.number(u64::from(first.enforce));
}
