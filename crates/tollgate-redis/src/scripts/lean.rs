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
//! checks both against `tollgate_engine::algorithm`.
//!
//! `ARGV[1]`: one string of little-endian doubles (integers below 2^53, as the general
//! script's): `now` (-1 for the server's `TIME`), the limit's emission interval, tolerance and
//! burst, the cost of every request and 1 if they are enforced (else 0). One string, not an
//! argument per figure: Redis makes a string of each argument and Lua's `tonumber` reads each
//! with `strtod`, which cost a lean call about as much as its commands. `ARGV[2]`: the TTL, in
//! milliseconds, of a fresh key that one request's cost takes (see `check_lean.lua`). In the
//! cross-slot form, the keys after the first follow.

use std::sync::LazyLock;

use crate::keys::DIGEST_LEN;
use crate::scripts::check::{EncodedCheck, Form};
use crate::scripts::{Script, TAT};
use tollgate_engine::Micros;

use crate::scripts::args::Args;

/// The script's body, after the GCRA value's functions (`tat.lua`) and the line that names its
/// keys `K`.
const BODY: &str = include_str!("check_lean.lua");

/// Arguments before the keys that follow them in the cross-slot form.
const FIXED: usize = 2;

fn declared() -> &'static Script {
    static SCRIPT: LazyLock<Script> =
        LazyLock::new(|| Script::bare(&format!("{TAT}local K = KEYS\n{BODY}")));
    &SCRIPT
}

fn cross_slot() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::bare(&format!(
            "#!lua flags=allow-cross-slot-keys\n{TAT}local K = {{KEYS[1]}}\n\
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
pub(crate) fn fits<B: AsRef<[EncodedCheck]>>(batches: &[B]) -> Option<&EncodedCheck> {
    let first = match batches.first()?.as_ref() {
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
        match batch.as_ref() {
            [only] if alike(only) => {}
            _ => return None,
        }
    }
    // Keys of their own: a key shared by several requests (a busy client) costs the general
    // script one argument, not one per request.
    if batches.len() > 1 {
        let mut inline = [[0u8; DIGEST_LEN]; INLINE_DIGESTS];
        let mut spilled = Vec::new();
        let digests = match inline.get_mut(..batches.len()) {
            Some(digests) => digests,
            None => {
                spilled.resize(batches.len(), [0u8; DIGEST_LEN]);
                &mut spilled[..]
            }
        };
        for (d, b) in digests.iter_mut().zip(batches) {
            *d = b.as_ref()[0].digest;
        }
        digests.sort_unstable();
        if digests.windows(2).any(|w| w[0] == w[1]) {
            return None;
        }
    }
    Some(first)
}

/// Requests whose digests [`fits`] compares on the stack: a merged call's most
/// (`coalesce::MAX_REQUESTS_PER_CALL`); a longer call's are compared in a vector.
const INLINE_DIGESTS: usize = 64;

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

#[cfg(test)]
mod tests {
    use tollgate_engine::{Algorithm, Check, Limit, Quota};
    use tollgate_testsupport::RedisServer;

    use super::{fits, BODY, TAT};
    use crate::scripts::check::EncodedCheck;

    /// A call fits only if no two of its requests share a key, however many requests it
    /// carries (more than compared on the stack included).
    #[test]
    fn a_call_fits_only_with_a_key_per_request() {
        let limit = Limit::new("ip", Algorithm::Gcra, Quota::per_second(5).unwrap()).unwrap();
        let batch = |n: u8| {
            let check = Check::new(&limit, b"k");
            [EncodedCheck::new(&check, [n; 16]).unwrap()]
        };
        for requests in [2u8, 64, 65, 100] {
            let mut batches: Vec<_> = (0..requests).map(batch).collect();
            assert!(fits(&batches).is_some(), "{requests}");
            batches.push(batch(requests / 2));
            assert!(fits(&batches).is_none(), "{requests}");
        }
    }

    const NOW: f64 = 1_700_000_000_000_000.0;

    /// Runs the lean script's declared form on `keys` at `NOW`: one unit of 5 a second
    /// (200,000 µs apart, a burst of 5), enforced. Answers the reply's figures and each
    /// key's value.
    fn run(
        conn: &mut redis::Connection,
        body: &str,
        keys: &[&str],
    ) -> (Vec<f64>, Vec<Option<String>>) {
        let mut packed = Vec::new();
        for figure in [NOW, 200_000.0, 800_000.0, 5.0, 1.0, 1.0] {
            packed.extend_from_slice(&f64::to_le_bytes(figure));
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(format!("{TAT}local K = KEYS\n{body}"))
            .arg(keys.len())
            .arg(keys)
            .arg(packed)
            .arg(200);
        let reply: Vec<u8> = cmd.query(conn).unwrap();
        let figures = reply
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let values = keys
            .iter()
            .map(|k| redis::cmd("GET").arg(k).query(conn).unwrap())
            .collect();
        (figures, values)
    }

    /// Before Redis 7 `SET` refuses `NX` with `GET` (a syntax error): the script then reads
    /// each key on its own, and answers and writes exactly what it does on Redis 7. The old
    /// server is stood for by an option Redis does not know, which it refuses the same way.
    #[test]
    fn a_server_that_refuses_set_nx_get_gets_the_same_answers_and_values() {
        let server = RedisServer::start();
        let mut conn = server.client();
        let old = BODY.replace("'NX', 'GET'", "'NX', 'GETX'");
        assert_ne!(old, BODY);
        let mut a = vec![];
        let mut b = vec![];
        // A fresh key, a key with a value, and the same key refused once its burst is gone.
        for round in 0..7 {
            let keys = if round == 0 {
                ["new-a", "x-a"]
            } else {
                ["x-a", "y-a"]
            };
            a.push(run(&mut conn, BODY, &keys));
            let keys = keys.map(|k| k.replace("-a", "-b"));
            let keys = [keys[0].as_str(), keys[1].as_str()];
            b.push(run(&mut conn, &old, &keys));
        }
        assert_eq!(a, b);
        // The fifth round found x's burst of 5 gone (its first take was in round 0).
        let (figures, _) = &a[5];
        assert_eq!((figures[1], figures[2]), (0.0, 1.0));
    }
}
