//! Operators' calls: one key's state read without consuming (`peek`), and forgotten
//! (`reset`).
//!
//! Both are one `EVAL` of a small script on the key's node (in a cluster, routed by its one
//! declared key), with the server's `TIME`, so that the figures are the ones the next `CHECK`
//! would compute. They are rare: the script is sent whole each time, and neither the breaker
//! nor the merged calls are involved; each has the backend's deadline.

use std::sync::Arc;

use redis::Value;
use tollgate_core::algorithm::{self, WindowState};
use tollgate_core::{Algorithm, BackendError, BackendErrorKind, Check, KeyState, Micros};

use crate::backend::Inner;
use crate::conn::breaks_connection;
use crate::failure::map_error;
use crate::keys::{self, BaseKey, Suffix};

/// `KEYS[1]`: the key; for a fixed window, `KEYS[1..4]` are the windows `ARGV[4]` to
/// `ARGV[4] + 3` (the client's estimate of the server's window, less one, and the next three:
/// the script touches only keys it is given). `ARGV`: `peek` or `reset`, the algorithm (`gcra`,
/// `window`, `log`, `slots`), the period in microseconds, the first window's index. Answers the
/// server's time, then for a peek what it read: a GCRA value, a window's count, a log's
/// scores, the slots held. A fixed window whose current window is not among those given
/// answers the error `TOLLGATE_WINDOW <now>`.
const ADMIN: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function fmt(x) return string.format('%d', x) end
local op, alg, period, key = ARGV[1], ARGV[2], tonumber(ARGV[3]), KEYS[1]
if alg == 'window' then
  local i = math.floor(now / period)
  if i * period > now then i = i - 1 elseif (i + 1) * period <= now then i = i + 1 end
  local k = i - tonumber(ARGV[4]) + 1
  if k < 1 or k > 3 then
    return redis.error_reply('TOLLGATE_WINDOW ' .. fmt(now))
  end
  if op == 'reset' then
    redis.call('DEL', KEYS[k], KEYS[k + 1])
    return {fmt(now)}
  end
  return {fmt(now), redis.call('GET', KEYS[k])}
end
if op == 'reset' then
  redis.call('DEL', key)
  return {fmt(now)}
end
if alg == 'log' then
  return {fmt(now), redis.call('ZRANGEBYSCORE', key, '(' .. fmt(now - period), '+inf', 'WITHSCORES')}
end
if alg == 'slots' then
  return {fmt(now), redis.call('ZCOUNT', key, '(' .. fmt(now), '+inf')}
end
return {fmt(now), redis.call('GET', key)}
";

impl Inner {
    /// What a check of one unit of `check` would find now.
    pub(crate) async fn peek(self: Arc<Self>, check: OwnedCheck) -> Result<KeyState, BackendError> {
        let reply = self.admin("peek", &check).await?;
        let (now, state) = split(&reply)?;
        let limit = &check.limit;
        let probe = Check::new(limit, &check.key).with_quota(check.quota);
        let quota = &check.quota;
        let verdict = match limit.algorithm() {
            Algorithm::Gcra => {
                let Some(value) = text(state) else {
                    return Ok(KeyState::fresh(quota));
                };
                let (tat, from) = parse_tat(&value)?;
                let tat = algorithm::gcra_carry(tat, now, from, quota.emission_interval());
                algorithm::gcra(quota, Some(tat), now, 1).0
            }
            Algorithm::FixedWindow => {
                let Some(count) = text(state) else {
                    return Ok(KeyState::fresh(quota));
                };
                let count = count
                    .parse::<u64>()
                    .map_err(|_| protocol("a window's count"))?;
                let window = WindowState {
                    window_end: algorithm::window_end(quota, now),
                    count,
                };
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
            _ => return Err(tollgate_core::unsupported("redis", "peek")),
        };
        Ok(KeyState::from_probe(&probe, verdict))
    }

    /// Forgets `check`'s key in Redis and in this replica's deny cache.
    pub(crate) async fn reset(self: Arc<Self>, check: OwnedCheck) -> Result<(), BackendError> {
        if check.limit.algorithm() == Algorithm::Concurrency {
            return Err(tollgate_core::unsupported("redis", "reset"));
        }
        // This replica's slice of the key is dropped first, so that it admits nothing the
        // reset state does not count; other replicas' slices end with their lifetime.
        self.leases.forget(check.limit.name(), &check.key);
        self.admin("reset", &check).await?;
        self.deny
            .forget(&keys::digest(check.limit.name(), &check.key));
        Ok(())
    }

    async fn admin(&self, op: &str, check: &OwnedCheck) -> Result<Value, BackendError> {
        let digest = keys::digest(check.limit.name(), &check.key);
        let base = BaseKey::new(&self.prefix, check.limit.name(), &digest);
        let (key, alg) = match check.limit.algorithm() {
            Algorithm::Gcra => (base.clone().with(Suffix::Tat), "gcra"),
            Algorithm::FixedWindow => (base.clone(), "window"),
            Algorithm::SlidingLog => (base.clone().with(Suffix::Log), "log"),
            Algorithm::Concurrency => (base.clone().with(Suffix::Slots), "slots"),
            _ => return Err(tollgate_core::unsupported("redis", op)),
        };
        let period = check.quota.period_micros();
        let mut server_now = self.server_time();
        for _ in 0..2 {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(ADMIN);
            // A fixed window declares the windows its script may touch, as `CHECK` does.
            let first = (server_now / period).saturating_sub(1);
            if alg == "window" {
                cmd.arg(4);
                for i in first..first + 4 {
                    cmd.arg(base.clone().with(Suffix::Window(i)).as_bytes());
                }
            } else {
                cmd.arg(1).arg(key.as_bytes());
            }
            cmd.arg(op).arg(alg).arg(period).arg(first);
            let answer = self
                .within_deadline(
                    async {
                        let (generation, mut conn) =
                            self.connector.get().await.map_err(map_error)?;
                        Ok(conn.query(&cmd).await.inspect_err(|e| {
                            if breaks_connection(e) {
                                self.connector.invalidate(generation);
                            }
                        }))
                    },
                    &format!("to {op}"),
                )
                .await?;
            match answer {
                Ok(value) => return Ok(value),
                Err(e) if e.code() == Some("TOLLGATE_WINDOW") => {
                    match e.detail().and_then(|d| d.trim().parse().ok()) {
                        Some(now) => server_now = now,
                        None => return Err(map_error(e)),
                    }
                }
                Err(e) => return Err(map_error(e)),
            }
        }
        Err(protocol("the server's window moved twice in a row"))
    }
}

/// A check's parts, owned, for a call that outlives its caller's borrow.
pub(crate) struct OwnedCheck {
    pub(crate) limit: tollgate_core::Limit,
    pub(crate) key: Vec<u8>,
    pub(crate) quota: tollgate_core::Quota,
}

impl OwnedCheck {
    pub(crate) fn of(check: &Check<'_>) -> Self {
        Self {
            limit: check.limit.clone(),
            key: check.key.to_vec(),
            quota: check.quota,
        }
    }
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

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A GCRA value `<tat>:<interval>`.
fn parse_tat(value: &str) -> Result<(Micros, Micros), BackendError> {
    let (tat, interval) = value
        .split_once(':')
        .ok_or_else(|| protocol("a GCRA value"))?;
    match (tat.parse(), interval.parse()) {
        (Ok(tat), Ok(interval)) => Ok((tat, interval)),
        _ => Err(protocol("a GCRA value")),
    }
}

fn protocol(what: &str) -> BackendError {
    BackendError::new(
        BackendErrorKind::Protocol,
        format!("cannot read {what} from Redis"),
    )
}
