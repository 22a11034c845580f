//! The `CHECK` call's arguments: each check encoded for `check.lua`, and the batches of one
//! call packed together.
//!
//! What a check costs Redis is mostly handling arguments, turning strings into numbers and
//! back, Lua's interpreter and calling commands, so `CHECK` takes each distinct limit's
//! parameters and each distinct key once per call, and every request's figures in one packed
//! string (see `docs/benchmarks.md` for what each saves).

use std::sync::{Arc, LazyLock};

use tollgate_engine::{algorithm, Algorithm, BackendError, BackendErrorKind, Check, Micros, Quota};

use crate::few::Few;
use crate::keys::{KeyDigest, Suffix};
use crate::scripts::{slot_id, Script};

/// Checks and consumes the batches of one or more requests, in order.
///
/// Each request's batch is all-or-nothing on its own: it writes only if every one of its
/// enforced checks admits, and a later request in the same call sees what an earlier one wrote,
/// exactly as if each had been its own call. Merging the batches of concurrent requests into one
/// call saves a round trip and the script's set-up per request.
///
/// `KEYS`: every key the call may touch, each distinct (limit, identity) once, as Redis requires
/// of a script: a GCRA TAT and its emission interval at `<base>:v3`; a fixed window's count at
/// `<base>:<window index>`, declared for the client's current window and the next one (the
/// window that holds the server's `TIME` is not known until the script runs); a sliding log at
/// `<base>:log`, followed by its sequence counter at `<base>:seq`. The script also reads
/// (and, counting a penalty's refusal, writes) the key's sanctions at `<base>:pb`, named from
/// its first key and not declared: most keys have none, and a call that declares a key
/// missing on a node whose slot is migrating is refused (`TRYAGAIN`). All share the base key's
/// hash tag, so the same cluster hash slot. No two algorithms share a key: a limit whose algorithm changes
/// under the same name (old and new replicas side by side during a deploy) never finds a key
/// of the wrong type, which would fail the whole call.
///
/// `ARGV[1]`: `now` in microseconds, or empty to read the server's `TIME`. The override exists
/// for tests (`RedisBackend::check_at`) only.
///
/// `ARGV[2]`: the number `L` of distinct limits in the call, then 8 arguments per limit:
/// algorithm (1 GCRA, 2 fixed window, 3 sliding log, 4 concurrency), three parameters (GCRA: emission
/// interval, tolerance (the burst's span, and the check's delay: see
/// `tollgate_engine::algorithm::gcra_delayed`), burst; fixed window: period, limit, the index of the client's current
/// window; sliding log: period, limit, how long the log keeps an entry (the longest period of
/// the limit's quotas, `Limit::log_keep_micros`)) and the limit's penalty (refusals, window, first
/// and longest block; zeros for none). If the window that holds `now` is neither the
/// client's current one nor the next, the script writes nothing and answers the error
/// `TOLLGATE_WINDOW <now>`; the client then declares the windows of that `now` and calls again.
///
/// The last argument: one string of little-endian doubles (integers below 2^53), per request
/// its number of checks `n`, then per check two figures: `(cost × 2 + e) × 1024 + l`, where `e`
/// is 1 if the check is enforced and `l` the index of its limit (from 0), and the number of its
/// first key in `KEYS` (from 1). One string rather than an argument per figure: Redis handles each
/// argument of a call as a string of its own and Lua's `tonumber` reads each with the C
/// library's `strtod`, while `struct.unpack` decodes the whole string in one call.
///
/// Reply: one string of little-endian doubles (all integers below 2^53): `now`, then per
/// request `committed` and per check its `status` (0 allowed, 1 denied, 2 cost too high,
/// 3 blocked, 4 denied by hand: then the next figure, a sliding log's reset and retry, is the
/// time to the block's or deny's end) and:
/// - GCRA: the TAT the check read (0 for none), carried to the check's emission interval
///   when it was written under another ([`algorithm::gcra_carry`]);
/// - fixed window: the count the check read in the window that holds `now`;
/// - sliding log: `remaining, reset, retry_after` and the last sequence number the check wrote
///   (what a refund needs).
///
/// The client computes a GCRA or fixed-window verdict from that state with
/// `tollgate_engine::algorithm` and checks the status against it: the script only decides,
/// which spares it the arithmetic of the figures and half the reply. A sliding log's figures
/// need the log, so the script sends them. One string rather than an array of integers:
/// packing it is one call in Lua, and the client reads it without a parser per item.
pub(crate) const CHECK: &str = include_str!("check.lua");

/// The script: the prelude and [`CHECK`] with every key declared, loaded once per process.
pub(crate) fn script() -> &'static Script {
    static SCRIPT: LazyLock<Script> =
        LazyLock::new(|| Script::new(&format!("{}{CHECK}", include_str!("keys_declared.lua"))));
    &SCRIPT
}

/// The cross-slot form of the script, for a Redis Cluster node (Redis 7 and later): flagged
/// `allow-cross-slot-keys`, it takes the checks of several hash slots of one node in one
/// call. Its first key is declared (the call is routed by it) and the others follow the
/// packed checks; it reads every key before it writes any, so that a call that meets a key
/// the node does not serve (its slot moved) fails having written nothing. (The lean script,
/// whose requests have one check each, leaves out such a request instead: see `lean.rs`.)
pub(crate) fn cross_slot_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::with_flags(
            "allow-cross-slot-keys",
            &format!("{}{CHECK}", include_str!("keys_cross_slot.lua")),
        )
    });
    &SCRIPT
}

/// How a `CHECK` call names its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// Every key declared: a standalone server, or one hash slot of a cluster.
    Declared,
    /// The cross-slot form ([`cross_slot_script`]): the first key declared, the others after
    /// the packed checks.
    CrossSlot,
}

impl Form {
    /// The script of this form.
    pub(crate) fn script(self) -> &'static Script {
        match self {
            Self::Declared => script(),
            Self::CrossSlot => cross_slot_script(),
        }
    }
}

/// Distinct limits one `CHECK` call can carry (the packing of a check's argument).
pub(crate) const LIMITS_PER_CALL: usize = 1024;

/// One check, ready for the scripts: owned, so the future that runs it can be `'static`.
#[derive(Debug, Clone)]
pub(crate) struct EncodedCheck {
    /// The limit's name; with the digest and the backend's prefix, it makes the Redis key.
    pub(crate) name: Arc<str>,
    pub(crate) digest: KeyDigest,
    pub(crate) algorithm: Algorithm,
    pub(crate) quota: Quota,
    /// Script code and parameters (see [`CHECK`]).
    pub(crate) code: u8,
    pub(crate) params: [u64; 3],
    pub(crate) cost: u32,
    pub(crate) enforce: bool,
    /// A concurrency check's slot id (see [`Check::slot`]).
    pub(crate) slot: u128,
    /// A concurrency refusal's `Retry-After`, in microseconds.
    pub(crate) busy_retry_after: Micros,
    /// Whether it is this check's turn to ask Redis about a key whose cached denial ran out
    /// (see `RefusedKeys::lookup`).
    pub(crate) asks: bool,
    /// Whether `cost` is a quota lease's slice (the request's cost and more,
    /// [`Check::slice_of`]): its answer says nothing of the request's own cost to the deny
    /// cache.
    pub(crate) slice: bool,
    /// The limit is leased: a GCRA refund of this check applies only while the key's TAT is
    /// still the one the check left (other replicas' slices are paced by it: see
    /// `tollgate_engine::leased`).
    pub(crate) guarded: bool,
    /// A GCRA check's delay ([`Check::delay`]), in microseconds: its tolerance, as the script
    /// gets it, is the burst's span and this.
    pub(crate) delay: Micros,
    /// The limit's penalty ([`tollgate_engine::Penalty::figures`]), zeros for none.
    pub(crate) penalty: [u64; 4],
}

impl EncodedCheck {
    /// Encodes one check for `CHECK`.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Protocol`] for an algorithm these scripts do not implement.
    pub(crate) fn new(check: &Check<'_>, digest: KeyDigest) -> Result<Self, BackendError> {
        let quota = &check.quota;
        let algorithm = check.limit.algorithm();
        let (code, params) = match algorithm {
            Algorithm::Gcra => {
                let interval = quota.emission_interval();
                let burst = u64::from(quota.burst());
                // A delay widens the tolerance: the script compares with it and nothing else,
                // so a delayed check needs no argument of its own.
                let tolerance = interval.saturating_mul(burst).saturating_add(check.delay);
                (1, [interval, tolerance, burst])
            }
            Algorithm::FixedWindow => (2, [quota.period_micros(), u64::from(quota.limit()), 0]),
            Algorithm::SlidingLog => {
                let keep = check.limit.log_keep_micros(quota);
                (3, [quota.period_micros(), u64::from(quota.limit()), keep])
            }
            // A slot lives the limit's slot lifetime under every plan (a plan sets how many
            // slots, not how long they live): its renewals are paced by that lifetime.
            Algorithm::Concurrency => (
                4,
                [
                    check.limit.quota().period_micros(),
                    u64::from(quota.limit()),
                    0,
                ],
            ),
            other => {
                return Err(BackendError::new(
                    BackendErrorKind::Protocol,
                    format!("the Redis backend does not implement {}", other.as_str()),
                ))
            }
        };
        Ok(Self {
            name: Arc::clone(check.limit.name_arc()),
            digest,
            algorithm,
            quota: *quota,
            code,
            params,
            cost: check.cost,
            enforce: check.enforce,
            slot: check.slot,
            busy_retry_after: check.limit.busy_retry_after_micros(),
            asks: false,
            slice: check.slice_of > 0,
            guarded: check.limit.lease().is_some(),
            delay: match algorithm {
                Algorithm::Gcra => check.delay,
                _ => 0,
            },
            penalty: check.limit.penalty_box().map_or([0; 4], |p| p.figures()),
        })
    }

    /// The arguments of this check's limit in a `CHECK` call whose fixed windows are named
    /// for `window_now`.
    pub(crate) fn limit_args(&self, window_now: Micros) -> [u64; 8] {
        let [p1, p2, p3] = self.params;
        let p3 = match self.code {
            2 => algorithm::window_index(&self.quota, window_now),
            _ => p3,
        };
        let [after, within, block, max] = self.penalty;
        [u64::from(self.code), p1, p2, p3, after, within, block, max]
    }

    /// The one argument of this check in a `CHECK` call, given the index of its limit there.
    pub(crate) fn check_arg(&self, limit: usize) -> u64 {
        let flags = u64::from(self.cost) * 2 + u64::from(self.enforce);
        flags * LIMITS_PER_CALL as u64 + limit as u64
    }
}

/// One request's checks, in order: inline when there is one (the commonest batch: a limit
/// per client), else in a vector; a request's wait for its call holds it, so it is kept no
/// larger than one check.
pub(crate) type Batch = Few<EncodedCheck>;

/// What one `CHECK` call sends for the batches of several requests (see [`CHECK`]).
pub(crate) struct CheckArgs<'p> {
    /// Each distinct limit's parameters, once.
    pub(crate) limits: Vec<[u64; 8]>,
    /// The call's `KEYS`: a check of each distinct (limit, identity), once, and the suffix of
    /// each of its keys.
    pub(crate) keys: Vec<(&'p EncodedCheck, Suffix)>,
    /// Per request its size, then per check its number and its key's, as little-endian doubles.
    pub(crate) packed: Vec<u8>,
}

impl<'p> CheckArgs<'p> {
    /// Encodes `batches`, one per request, in order; fixed windows are named for the client's
    /// estimate of the server's time, `window_now`.
    ///
    /// # Errors
    ///
    /// [`BackendErrorKind::Protocol`] for more than [`LIMITS_PER_CALL`] distinct limits.
    pub(crate) fn new<B: AsRef<[EncodedCheck]>>(
        batches: &'p [B],
        window_now: Micros,
    ) -> Result<Self, BackendError> {
        // Every check of the call, each with its limit's index and its first key's number:
        // one vector, sorted by key to number the keys, then back into the requests' order.
        let mut all: Vec<Numbered<'p>> = batches
            .iter()
            .flat_map(|b| b.as_ref().iter())
            .enumerate()
            .map(|(at, p)| Numbered {
                p,
                at,
                limit: 0,
                key: 0,
            })
            .collect();
        // Each check refers to its limit by index.
        let mut limits: Vec<[u64; 8]> = Vec::new();
        for c in &mut all {
            let args = c.p.limit_args(window_now);
            c.limit = match limits.iter().position(|l| *l == args) {
                Some(i) => i,
                None => {
                    limits.push(args);
                    limits.len() - 1
                }
            };
        }
        if limits.len() > LIMITS_PER_CALL {
            return Err(protocol(format!(
                "more than {LIMITS_PER_CALL} limits in one call"
            )));
        }
        // Each check refers to its first key by number: requests that share a key (one
        // client, one tenant) send it once per call. The digest covers the limit's name, so
        // equal digests of one limit are the same keys; sorting finds them in O(n log n)
        // whatever the keys.
        all.sort_unstable_by_key(|c| (c.p.digest, c.limit, c.at));
        let mut keys: Vec<(&EncodedCheck, Suffix)> = Vec::with_capacity(2 * all.len());
        let (mut last, mut first): (Option<(KeyDigest, usize)>, usize) = (None, 0);
        for c in &mut all {
            let id = (c.p.digest, c.limit);
            if last != Some(id) {
                last = Some(id);
                first = keys.len() + 1;
                match c.p.code {
                    2 => {
                        let index = limits[c.limit][3];
                        keys.push((c.p, Suffix::Window(index)));
                        keys.push((c.p, Suffix::Window(index.saturating_add(1))));
                    }
                    3 => {
                        keys.push((c.p, Suffix::Log));
                        keys.push((c.p, Suffix::Seq));
                    }
                    4 => keys.push((c.p, Suffix::Slots)),
                    _ => keys.push((c.p, Suffix::Tat)),
                }
            }
            c.key = first;
        }
        all.sort_unstable_by_key(|c| c.at);
        let mut packed = Vec::with_capacity(8 * (batches.len() + 3 * all.len()));
        let mut checks = all.iter();
        for batch in batches {
            let len = batch.as_ref().len();
            packed.extend_from_slice(&figure_bytes(len as u64));
            for c in checks.by_ref().take(len) {
                packed.extend_from_slice(&figure_bytes(c.p.check_arg(c.limit)));
                packed.extend_from_slice(&figure_bytes(c.key as u64));
                if c.p.code == 4 {
                    for part in slot_id::parts(c.p.slot) {
                        packed.extend_from_slice(&figure_bytes(part));
                    }
                }
            }
        }
        Ok(Self {
            limits,
            keys,
            packed,
        })
    }
}

/// One check of a call: its place among the call's checks, its limit's index, and its first
/// key's number (1-based, as Lua counts `KEYS`).
struct Numbered<'p> {
    p: &'p EncodedCheck,
    at: usize,
    limit: usize,
    key: usize,
}

/// A figure of a `CHECK` call's packed argument: a little-endian double. Every figure sent
/// (a request's size, a check's number, a key's number) is below 2^53, so exact.
fn figure_bytes(x: u64) -> [u8; 8] {
    #[allow(clippy::cast_precision_loss)]
    (x as f64).to_le_bytes()
}

fn protocol(msg: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Protocol, msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_engine::Limit;

    use crate::keys;

    #[test]
    fn a_call_sends_each_limit_and_each_key_once() {
        let per_ip = Limit::new("ip", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
        let daily = Limit::new("day", Algorithm::FixedWindow, Quota::per_day(9).unwrap()).unwrap();
        let check = |limit: &Limit, key: &[u8], cost| {
            let mut check = Check::new(limit, key);
            check.cost = cost;
            EncodedCheck::new(&check, keys::digest(limit.name(), key)).unwrap()
        };
        let first = [check(&per_ip, b"a", 1)];
        let second = [check(&per_ip, b"a", 2), check(&daily, b"a", 1)];
        let third = [check(&per_ip, b"b", 1)];
        // Two days and a bit after the epoch: the window of day 2.
        let batches: [&[EncodedCheck]; 3] = [&first, &second, &third];
        let args = CheckArgs::new(&batches, 2 * 86_400_000_000 + 7).unwrap();
        assert_eq!(args.limits.len(), 2);
        assert!(args.limits.contains(&[2, 86_400_000_000, 9, 2, 0, 0, 0, 0]));
        // (ip, a); (day, a) in windows 2 and 3; (ip, b).
        let suffixes: Vec<Suffix> = args.keys.iter().map(|(_, s)| *s).collect();
        assert_eq!(args.keys.len(), 4);
        assert_eq!(suffixes.iter().filter(|s| **s == Suffix::Tat).count(), 2);
        let window = suffixes
            .iter()
            .position(|s| *s == Suffix::Window(2))
            .unwrap();
        assert_eq!(suffixes[window + 1], Suffix::Window(3));
        let key = |p: &EncodedCheck| {
            let i = args
                .keys
                .iter()
                .position(|(k, _)| k.digest == p.digest)
                .unwrap();
            (i + 1) as f64
        };
        let figures: Vec<f64> = args
            .packed
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // Per request its size; per check (cost × 2 + enforced) × 1024 + limit, and its key.
        let expected = [
            1.,
            3072.,
            key(&first[0]),
            2.,
            5120.,
            key(&second[0]),
            3073.,
            key(&second[1]),
            1.,
            3072.,
            key(&third[0]),
        ];
        assert_eq!(figures, expected);
        assert_eq!(key(&first[0]), key(&second[0]));
        assert_ne!(key(&first[0]), key(&third[0]));
    }
}
