//! The rate-limit header fields of a decision, and `Retry-After`.
//!
//! - `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers): one list item
//!   per limit, named by the limit, e.g. `"burst";q=5;w=60` and `"burst";r=0;t=12`. For a limit
//!   that refuses the request, `t` is its `Retry-After`, so the two never disagree. A refusal's
//!   `RateLimit` lists the limits that refused it (its `RateLimit-Policy` every limit): the
//!   same whether Redis or a replica's deny cache answered. A fail-closed `503` lists no item
//!   for a limit whose backend failed: what is left of its quota is unknown.
//! - `Retry-After` in whole seconds, rounded up, never 0.
//! - Legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` for the most
//!   constrained limit, when enabled.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::time::Duration;

use bytes::BytesMut;
use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use tollgate_engine::{Quota, MAX_CHECKS};

use crate::decision::{Decision, DenyReason, LimitDecision, Outcome};

pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit header fields the layer writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FieldOptions {
    /// `RateLimit-Policy` and `RateLimit` on admitted responses too (refusals always have them).
    pub(crate) on_allowed: bool,
    /// The legacy `X-RateLimit-*` fields as well.
    pub(crate) legacy: bool,
}

impl Default for FieldOptions {
    fn default() -> Self {
        Self {
            on_allowed: true,
            legacy: false,
        }
    }
}

/// One limit's item of a `RateLimit` value: remaining, seconds, the limit's name.
pub(crate) type Item<N> = (u64, Option<u64>, N);

/// What a decision's rate-limit fields say: one `RateLimit` item per limit that counted the
/// request, and the tightest limit for the legacy fields. Read from the decision when they
/// are written: a reused refusal only compares the items.
pub(crate) struct Fields<'a> {
    decision: &'a Decision,
    /// Whether the decision refused the request (its items are then the refusing limits').
    refused: bool,
}

impl<'a> Fields<'a> {
    /// The fields of an admitted request's `decision`.
    pub(crate) fn of(decision: &'a Decision) -> Self {
        Self {
            decision,
            refused: false,
        }
    }

    /// The fields of a refused request's `decision`.
    pub(crate) fn of_refusal(decision: &'a Decision) -> Self {
        Self {
            decision,
            refused: true,
        }
    }

    /// (remaining, seconds, quota) of the limit with the fewest units left.
    fn tightest(&self) -> Option<(u64, u64, u32)> {
        let mut tightest: Option<(u64, u64, u32)> = None;
        for (limit, (remaining, seconds, _)) in self.limits() {
            if tightest.is_none_or(|(r, _, _)| remaining < r) {
                let quota = if limit.is_concurrency() {
                    limit.quota().limit()
                } else {
                    policy_of(limit.quota()).0
                };
                tightest = Some((remaining, seconds.unwrap_or(0), quota));
            }
        }
        tightest
    }

    /// The limits that counted the request (at most [`MAX_CHECKS`]), each with its item. A
    /// refusal's items are its refusing limits only, whatever answered it: a refusal from a
    /// Redis replica's deny cache knows nothing of the other limits, and one from Redis must
    /// say the same. A limit refused because its backend failed has no item: nobody knows
    /// what is left of its quota.
    fn limits(&self) -> impl Iterator<Item = (&'a LimitDecision, Item<&'a str>)> + 'a {
        let refused = self.refused;
        self.decision
            .limits()
            .iter()
            .filter_map(move |limit| {
                let (remaining, seconds) = match *limit.outcome() {
                    // A refusal's items are its refusing limits'.
                    Outcome::Allowed { .. } if refused => return None,
                    Outcome::Allowed { remaining, reset } => (remaining, reset_seconds(reset)),
                    Outcome::Denied {
                        reason: DenyReason::BackendUnavailable,
                        ..
                    } => return None,
                    Outcome::Denied { .. } if refused && limit.is_shadow() => return None,
                    Outcome::Denied {
                        remaining,
                        retry_after,
                        reset,
                        ..
                    } => {
                        let seconds = match retry_after {
                            Some(after) if limit.refuses() => whole_seconds(after),
                            _ => reset_seconds(reset),
                        };
                        (remaining, seconds)
                    }
                    // Nothing counted, or a deny, which says nothing of a quota.
                    Outcome::Bypassed { .. }
                    | Outcome::Skipped { .. }
                    | Outcome::Allowlisted
                    | Outcome::Denylisted { .. } => return None,
                };
                // No `t` for a concurrency limit that admitted: nothing about it resets with
                // time.
                let seconds = match limit.outcome() {
                    Outcome::Allowed { .. } if limit.is_concurrency() => None,
                    _ => Some(seconds),
                };
                Some((limit, (remaining, seconds, limit.name())))
            })
            .take(MAX_CHECKS)
    }

    pub(crate) fn items(&self) -> impl Iterator<Item = Item<&'a str>> + 'a {
        self.limits().map(|(_, item)| item)
    }

    /// The `RateLimit` value, written without `fmt` into this thread's block of values
    /// (this runs on every admitted request): the `HeaderValue` shares the block, so that one
    /// allocation serves the values of many responses. A block with less than [`VALUE_ROOM`]
    /// left is left to the values that share it; a longer value grows the block.
    fn value(&self) -> Option<HeaderValue> {
        let bytes = VALUES.with_borrow_mut(|block| {
            if block.capacity() < VALUE_ROOM {
                *block = BytesMut::with_capacity(VALUES_BLOCK);
            }
            for (i, (remaining, seconds, name)) in self.items().enumerate() {
                block.extend_from_slice(if i == 0 { b"\"" } else { b", \"" });
                block.extend_from_slice(name.as_bytes());
                block.extend_from_slice(b"\";r=");
                block.extend_from_slice(digits(remaining, &mut [0; 20]));
                if let Some(seconds) = seconds {
                    block.extend_from_slice(b";t=");
                    block.extend_from_slice(digits(seconds, &mut [0; 20]));
                }
            }
            block.split().freeze()
        });
        if bytes.is_empty() {
            return None;
        }
        HeaderValue::from_maybe_shared(bytes).ok()
    }
}

/// The room a value of one or two limits takes at most, unless their names are long.
const VALUE_ROOM: usize = 256;

/// The size of a thread's block of `RateLimit` values: about a hundred values of one limit.
const VALUES_BLOCK: usize = 4096;

thread_local! {
    /// Where this thread writes `RateLimit` values: each value is a shared slice of the block,
    /// which is freed when the last response holding one is.
    static VALUES: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// Seconds for a header: rounded up, at least 1.
pub(crate) fn whole_seconds(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

/// Seconds for `t=` and `X-RateLimit-Reset`: rounded up, 0 allowed.
fn reset_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The `RateLimit-Policy` value of limits as (name, quota, whether it counts requests in
/// flight).
pub(crate) fn policy_value<'a>(
    limits: impl Iterator<Item = (&'a str, &'a Quota, bool)>,
) -> Option<HeaderValue> {
    let mut out = String::new();
    for (name, quota, concurrent) in limits {
        if !out.is_empty() {
            out.push_str(", ");
        }
        if concurrent {
            // Requests in flight: a quota with no window.
            let _ = write!(
                out,
                "\"{name}\";q={};qu=\"concurrent-requests\"",
                quota.limit()
            );
            continue;
        }
        let (quota, window) = policy_of(quota);
        let _ = write!(out, "\"{name}\";q={quota};w={}", reset_seconds(window));
    }
    HeaderValue::try_from(out).ok()
}

/// The quota and window a policy advertises. A GCRA burst larger than the limit is the same
/// rate over a longer window (burst units per burst × interval), so that the remaining units,
/// up to the burst, never exceed the advertised quota.
fn policy_of(quota: &Quota) -> (u32, Duration) {
    if quota.burst() == quota.limit() {
        return (quota.limit(), quota.period());
    }
    let window = quota
        .emission_interval()
        .saturating_mul(u64::from(quota.burst()));
    (quota.burst(), Duration::from_micros(window))
}

/// Writes the rate-limit fields `fields` and `policy` into `headers`.
pub(crate) fn write_headers(
    headers: &mut HeaderMap,
    fields: &Fields<'_>,
    policy: Option<&HeaderValue>,
    options: FieldOptions,
) {
    // Appended, not inserted: under stacked layers each adds its own items to the lists (the
    // draft lets a list span several field lines), and an outer layer must not hide the
    // limit of an inner one that refused.
    if let Some(policy) = policy {
        headers.append(RATELIMIT_POLICY.clone(), policy.clone());
    }
    if let Some(value) = fields.value() {
        headers.append(RATELIMIT.clone(), value);
    }
    if !options.legacy {
        return;
    }
    // The legacy fields hold one limit: the tightest, also across stacked layers.
    let tighter_inside = |remaining: u64| {
        headers
            .get(&X_REMAINING)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_some_and(|inside| inside <= remaining)
    };
    if let Some((remaining, seconds, limit)) = fields.tightest() {
        if tighter_inside(remaining) {
            return;
        }
        headers.insert(X_LIMIT.clone(), HeaderValue::from(limit));
        headers.insert(X_REMAINING.clone(), HeaderValue::from(remaining));
        headers.insert(X_RESET.clone(), HeaderValue::from(seconds));
    }
}

/// "00" to "99": two digits per division.
const PAIRS: &[u8; 200] = b"\
0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// The decimal digits of `n`, written at the end of `buf`.
pub(crate) fn digits(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    while n >= 100 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if n >= 10 {
        let pair = n as usize * 2;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        i -= 1;
        buf[i] = b'0' + n as u8;
    }
    &buf[i..]
}

/// Adds `Retry-After` unless the responder set one.
pub(crate) fn write_retry_after(headers: &mut HeaderMap, retry_after: Option<Duration>) {
    if let Some(after) = retry_after {
        if !headers.contains_key(RETRY_AFTER) {
            headers.insert(RETRY_AFTER, seconds_value(whole_seconds(after)));
        }
    }
}

/// A number of seconds as a field value. Refusals in a flood mostly say a few seconds: up to
/// a minute the value is a static string, so the refusal allocates nothing for it.
pub(crate) fn seconds_value(seconds: u64) -> HeaderValue {
    const SMALL: [&str; 61] = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
        "17", "18", "19", "20", "21", "22", "23", "24", "25", "26", "27", "28", "29", "30", "31",
        "32", "33", "34", "35", "36", "37", "38", "39", "40", "41", "42", "43", "44", "45", "46",
        "47", "48", "49", "50", "51", "52", "53", "54", "55", "56", "57", "58", "59", "60",
    ];
    match usize::try_from(seconds).ok().and_then(|i| SMALL.get(i)) {
        Some(&small) => HeaderValue::from_static(small),
        None => HeaderValue::from(seconds),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_values_read_as_their_number() {
        for seconds in (0..200).chain([3_600, 86_400, u64::MAX]) {
            assert_eq!(
                seconds_value(seconds).to_str().unwrap(),
                seconds.to_string()
            );
        }
    }

    #[test]
    fn digits_are_decimal() {
        for n in [0, 7, 9, 10, 99, 100, 429, 1_000, 4_294_967_294, u64::MAX] {
            assert_eq!(digits(n, &mut [0; 20]), n.to_string().as_bytes());
        }
    }

    /// Values longer than the room a block keeps for one are written whole, in blocks that
    /// fill up: each value as `fmt` would write it.
    #[test]
    fn values_of_long_names_are_written_whole() {
        use crate::decision::{LimitDecision, Source};
        use std::sync::Arc;
        let quota = Quota::per_minute(100).unwrap();
        let allowed = |remaining| Outcome::Allowed {
            remaining,
            reset: Duration::from_millis(1_500),
        };
        for length in [1, 100, 255, 256, 300, 5_000] {
            for round in 0..40u64 {
                let names = ['a', 'b', 'c'].map(|c| c.to_string().repeat(length));
                let decision: Decision = names
                    .iter()
                    .enumerate()
                    .map(|(i, name)| {
                        let outcome = allowed(round * 10 + i as u64);
                        LimitDecision::new(
                            Arc::from(name.as_str()),
                            quota,
                            outcome,
                            Source::Backend,
                            false,
                        )
                    })
                    .collect();
                let expected = names
                    .iter()
                    .enumerate()
                    .map(|(i, name)| format!("\"{name}\";r={};t=2", round * 10 + i as u64))
                    .collect::<Vec<_>>()
                    .join(", ");
                let value = Fields::of(&decision).value().unwrap();
                assert_eq!(value.to_str().unwrap(), expected, "{length} {round}");
            }
        }
    }

    #[test]
    fn seconds_round_up_and_are_never_zero() {
        assert_eq!(whole_seconds(Duration::ZERO), 1);
        assert_eq!(whole_seconds(Duration::from_micros(1)), 1);
        assert_eq!(whole_seconds(Duration::from_millis(12_000)), 12);
        assert_eq!(whole_seconds(Duration::from_millis(12_001)), 13);
    }
}
