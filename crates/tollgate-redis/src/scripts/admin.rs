//! `admin.lua`: one key's state read without consuming (`peek`), with the server's `TIME`, so
//! that the figures are the ones the next `CHECK` would compute; `reset.lua` and
//! `sanction.lua`: a key forgotten, or its sanctions changed.

use redis::Value;
use tollgate_engine::algorithm::{self, WindowState};
use tollgate_engine::{
    Algorithm, BackendError, BackendErrorKind, Check, KeyState, Limit, Micros, Quota, Status,
    Verdict,
};

use crate::keys::{BaseKey, Suffix};

/// `KEYS[1]`: the key; for a fixed window, `KEYS[1..4]` are the windows `ARGV[4]` to
/// `ARGV[4] + 3` (the client's estimate of the server's window, less one, and the next three:
/// the script touches only keys it is given); a peek declares the key's sanctions last.
/// `ARGV`: `peek`, the algorithm (`gcra`, `window`, `log`, `slots`), the period in
/// microseconds, the first window's index, and for a peek `pb`. Answers the server's time,
/// then for a peek what it read: a GCRA value, a window's count, a log's scores, the slots
/// held, and the sanctions. A fixed window whose current window is not among those given
/// answers the error `TOLLGATE_WINDOW <now>`.
pub(crate) const ADMIN: &str = include_str!("admin.lua");

/// A reset, one call: `reset.lua` deletes the key's values, then `sanction.lua` lifts its
/// sanctions (see [`reset_command`]).
pub(crate) const RESET: &str = concat!(
    include_str!("tat.lua"),
    include_str!("reset.lua"),
    include_str!("sanction.lua")
);

/// The `EVAL` of a reset of `algorithm`'s key under `base`, whose fixed windows are declared
/// for the server's time `server_now` (the client's estimate): `KEYS` are the key's sanctions,
/// then its values (a GCRA value, a log, or four windows from the one before the estimate's).
///
/// # Errors
///
/// `Unsupported` for a concurrency limit (its slots are requests in flight) or an algorithm
/// the script does not know.
pub(crate) fn reset_command(
    base: &BaseKey,
    algorithm: Algorithm,
    quota: &Quota,
    server_now: Micros,
) -> Result<redis::Cmd, BackendError> {
    let period = quota.period_micros();
    let first = (server_now / period).saturating_sub(1);
    let values: Vec<BaseKey> = match algorithm {
        Algorithm::Gcra => vec![base.clone().with(Suffix::Tat)],
        Algorithm::FixedWindow => (first..first + 4)
            .map(|i| base.clone().with(Suffix::Window(i)))
            .collect(),
        Algorithm::SlidingLog => vec![base.clone().with(Suffix::Log)],
        _ => return Err(tollgate_engine::unsupported("redis", "reset")),
    };
    let alg = match algorithm {
        Algorithm::Gcra => "gcra",
        Algorithm::FixedWindow => "window",
        _ => "log",
    };
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(RESET)
        .arg(1 + values.len())
        .arg(base.clone().with(Suffix::Sanction).as_bytes());
    for key in &values {
        cmd.arg(key.as_bytes());
    }
    cmd.arg("lift").arg(0).arg(alg).arg(period).arg(first);
    Ok(cmd)
}

/// `KEYS[1]`: a key's sanctions (`<base>:pb`); `KEYS[2]`, for a GCRA limit, its value
/// (`<base>:v3`), which says until when the sanctions last. `ARGV`: `lift` (a reset's: the
/// block, the refusals and the strikes go, a deny stays), `deny` and its length in
/// microseconds, or `undeny`. Answers the server's time.
pub(crate) const SANCTION: &str = concat!(include_str!("tat.lua"), include_str!("sanction.lua"));

/// `KEYS[1]`: a GCRA key (`<base>:v3`). `ARGV`: the pause in microseconds, the emission
/// interval, the burst. Moves the key's TAT to at least the pause's end plus the burst less
/// one interval (see `tollgate_engine::Backend::pause`). Answers the server's time.
pub(crate) const PAUSE: &str = concat!(include_str!("tat.lua"), include_str!("pause.lua"));

/// The `EVAL` of `op` (`peek` or `reset`) on `limit`'s key under `base`, whose fixed windows
/// are declared for the server's time `server_now` (the client's estimate).
///
/// # Errors
///
/// `Unsupported` for an algorithm the script does not know.
pub(crate) fn command(
    op: &str,
    base: &BaseKey,
    algorithm: Algorithm,
    quota: &Quota,
    server_now: Micros,
) -> Result<redis::Cmd, BackendError> {
    let (key, alg) = match algorithm {
        Algorithm::Gcra => (base.clone().with(Suffix::Tat), "gcra"),
        Algorithm::FixedWindow => (base.clone(), "window"),
        Algorithm::SlidingLog => (base.clone().with(Suffix::Log), "log"),
        Algorithm::Concurrency => (base.clone().with(Suffix::Slots), "slots"),
        _ => return Err(tollgate_engine::unsupported("redis", op)),
    };
    let period = quota.period_micros();
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(ADMIN);
    // A fixed window declares the windows its script may touch, as `CHECK` does.
    let first = (server_now / period).saturating_sub(1);
    // A peek reads the sanctions too: a block or a deny is what the next check meets first.
    let peek = op == "peek";
    let sanctions = base.clone().with(Suffix::Sanction);
    if alg == "window" {
        cmd.arg(4 + usize::from(peek));
        for i in first..first + 4 {
            cmd.arg(base.clone().with(Suffix::Window(i)).as_bytes());
        }
    } else {
        cmd.arg(1 + usize::from(peek)).arg(key.as_bytes());
    }
    if peek {
        cmd.arg(sanctions.as_bytes());
    }
    cmd.arg(op).arg(alg).arg(period).arg(first);
    if peek {
        cmd.arg("pb");
    }
    Ok(cmd)
}

/// What a check of one unit of `limit` for `key` under `quota` would find, from a `peek`'s
/// `reply`.
///
/// # Errors
///
/// `Protocol` for a reply that is not what the script answers.
pub(crate) fn key_state(
    limit: &Limit,
    key: &[u8],
    quota: &Quota,
    reply: &Value,
) -> Result<KeyState, BackendError> {
    let (now, state) = split(reply)?;
    let probe = Check::new(limit, key).with_quota(*quota);
    if let Some(refused) = standing(reply, now)? {
        // As the next check: a deny, then a block, refuses whatever the key has left.
        return Ok(KeyState::from_probe(&probe, refused));
    }
    let verdict = match limit.algorithm() {
        Algorithm::Gcra => {
            let Some(value) = text(state) else {
                return Ok(KeyState::fresh(quota));
            };
            let (stored, _) = super::tat::parse(&value).ok_or_else(|| protocol("a GCRA value"))?;
            let tat = stored.tat_under(quota.emission_interval(), now);
            algorithm::gcra(quota, Some(tat), now, 1).0
        }
        Algorithm::FixedWindow => {
            let Some(count) = text(state) else {
                return Ok(KeyState::fresh(quota));
            };
            let count = count
                .parse::<u64>()
                .map_err(|_| protocol("a window's count"))?;
            let window = WindowState::new(algorithm::window_end(quota, now), count);
            algorithm::fixed_window(quota, Some(window), now, 1).0
        }
        Algorithm::SlidingLog => {
            let Value::Array(items) = state else {
                return Err(protocol("a sliding log"));
            };
            let mut log = Vec::with_capacity(items.len() / 2);
            for score in items.iter().skip(1).step_by(2) {
                let score = text(score).ok_or_else(|| protocol("a log's score"))?;
                let at = score
                    .parse::<f64>()
                    .map_err(|_| protocol("a log's score"))?;
                log.push(at as Micros);
            }
            if log.is_empty() {
                return Ok(KeyState::fresh(quota));
            }
            algorithm::sliding_log(quota, &log, now, 1).0
        }
        Algorithm::Concurrency => {
            let Value::Int(held) = state else {
                return Err(protocol("a count of slots"));
            };
            let held = u32::try_from(*held).unwrap_or(u32::MAX);
            let busy = limit.busy_retry_after_micros();
            algorithm::concurrency(quota, held, 1, busy).0
        }
        _ => return Err(tollgate_engine::unsupported("redis", "peek")),
    };
    Ok(KeyState::from_probe(&probe, verdict))
}

/// The refusal a peek's sanctions (`<refusals>:<window end>:<blocked until>:<strikes>:<strikes
/// until>:<denied until>`, the reply's third item) make at `now`, if one stands.
fn standing(reply: &Value, now: Micros) -> Result<Option<Verdict>, BackendError> {
    let Value::Array(items) = reply else {
        return Err(protocol("the reply"));
    };
    let Some(value) = items.get(2).and_then(text) else {
        return Ok(None);
    };
    let mut figures = [0; 6];
    let mut parts = value.split(':');
    for figure in &mut figures {
        *figure = parts
            .next()
            .and_then(|p| p.parse::<Micros>().ok())
            .ok_or_else(|| protocol("a key's sanctions"))?;
    }
    let (blocked_until, denied_until) = (figures[2], figures[5]);
    let status = if denied_until > now {
        Status::Denylisted {
            retry_after: denied_until - now,
        }
    } else if blocked_until > now {
        Status::Blocked {
            retry_after: blocked_until - now,
        }
    } else {
        return Ok(None);
    };
    let reset = match status {
        Status::Denylisted { retry_after } | Status::Blocked { retry_after } => retry_after,
        _ => 0,
    };
    Ok(Some(Verdict::new(status, 0, reset)))
}

fn split(reply: &Value) -> Result<(Micros, &Value), BackendError> {
    let Value::Array(items) = reply else {
        return Err(protocol("the reply"));
    };
    let now = items
        .first()
        .and_then(text)
        .and_then(|t| t.parse::<Micros>().ok())
        .ok_or_else(|| protocol("the server's time"))?;
    Ok((now, items.get(1).unwrap_or(&Value::Nil)))
}

/// A reply's value as text: a bulk or simple string, or an integer.
pub(super) fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn protocol(what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("cannot read {what} from Redis"),
    )
}
