//! `top.lua`: a limit's reports of refused identities, per bucket a sorted set of counts and
//! a hash of when each was seen; merged into by replicas, read by operators.

use redis::Value;
use tollgate_engine::{BackendError, BackendErrorKind, Micros, Refused};

use super::admin::text;

/// See the script's header for its keys and arguments.
pub(crate) const TOP: &str = include_str!("top.lua");

/// The keys of `limit`'s report for `bucket`: its counts and when each identity was seen.
/// The hash tag wraps the limit's name, so that a limit's buckets share one hash slot.
pub(crate) fn keys(prefix: &str, limit: &str, bucket: u64) -> [String; 2] {
    let counts = format!("{prefix}:top:{{{limit}}}:{bucket}");
    let seen = format!("{counts}:seen");
    [counts, seen]
}

/// The `EVAL` that adds `refused` to the report at `keys`, which keeps the `keep` largest and
/// lives `life_ms` milliseconds.
pub(crate) fn merge(
    keys: &[String; 2],
    keep: usize,
    life_ms: u64,
    refused: &[Refused],
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(TOP).arg(2).arg(&keys[0]).arg(&keys[1]);
    cmd.arg("merge").arg(keep).arg(life_ms);
    for r in refused {
        cmd.arg(&r.identity)
            .arg(r.count)
            .arg(r.error)
            .arg(r.first_seen)
            .arg(r.last_seen);
    }
    cmd
}

/// The `EVAL` that reads the reports at `current` and `previous`.
pub(crate) fn read(current: &[String; 2], previous: &[String; 2]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(TOP).arg(4);
    for key in current.iter().chain(previous) {
        cmd.arg(key);
    }
    cmd.arg("read");
    cmd
}

/// Every identity of a `read`'s reply, one entry per bucket it is in.
///
/// # Errors
///
/// `Protocol` for a reply that is not what the script answers.
pub(crate) fn parse_read(reply: &Value) -> Result<Vec<Refused>, BackendError> {
    let Value::Array(buckets) = reply else {
        return Err(protocol("the reply"));
    };
    let mut out = Vec::new();
    for bucket in buckets {
        let Value::Array(parts) = bucket else {
            return Err(protocol("a bucket"));
        };
        let (Some(Value::Array(counts)), seen) = (parts.first(), parts.get(1)) else {
            return Err(protocol("a bucket's counts"));
        };
        let seen: &[Value] = match seen {
            Some(Value::Array(seen)) => seen,
            _ => &[],
        };
        for (i, pair) in counts.chunks(2).enumerate() {
            let [id, score] = pair else {
                return Err(protocol("a count"));
            };
            let identity = text(id).ok_or_else(|| protocol("an identity"))?;
            let count = text(score)
                .and_then(|s| s.parse::<f64>().ok())
                .filter(|c| c.is_finite() && *c >= 0.0)
                .ok_or_else(|| protocol("a count"))? as u64;
            // A hash value that is missing or malformed (a key written by hand) reads as
            // exact and seen at no time, rather than failing the whole report.
            let (error, first, last) = seen
                .get(i)
                .and_then(text)
                .and_then(|s| parse_seen(&s))
                .unwrap_or((0, 0, 0));
            out.push(Refused::new(identity, count, error, first, last));
        }
    }
    Ok(out)
}

fn parse_seen(s: &str) -> Option<(u64, Micros, Micros)> {
    let mut parts = s.split(':').map(|p| p.parse::<u64>().ok());
    Some((parts.next()??, parts.next()??, parts.next()??))
}

fn protocol(what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("cannot read {what} of a report of refusals from Redis"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limits_buckets_share_one_hash_slot() {
        let [a, b] = keys("app", "per-ip", 7);
        let [c, _] = keys("app", "per-ip", 8);
        assert_eq!(a, "app:top:{per-ip}:7");
        assert_eq!(b, "app:top:{per-ip}:7:seen");
        assert_eq!(crate::keys::hash_slot(&a), crate::keys::hash_slot(&c));
    }
}
