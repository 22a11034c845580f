//! The Lua scripts and their arguments and replies.
//!
//! `CHECK` evaluates every check of a batch and writes only if every enforced check admits: one
//! call, one round trip, all-or-nothing. It is the arithmetic of `tollgate_core::algorithm` on
//! the same integers (microseconds); the shared vector file holds both to it. `REFUND` undoes
//! exactly what a `CHECK` wrote, for Redis Cluster batches split over several slots.
//!
//! Lua numbers are doubles: every figure here (microseconds since the epoch, about 2^51 today)
//! is an integer below 2^53 and exact. Lua's own `tostring` and `..` keep only 14 digits, and
//! Redis formats a number passed to `redis.call` as a double (`%.17g`, slow in the C library),
//! so numbers that become strings go through `fmt`, an integer format (`%d`, a C `long`).
//!
//! What a check costs Redis is mostly handling arguments, turning strings into numbers and
//! back, Lua's interpreter and calling commands, so `CHECK` takes each distinct limit's
//! parameters and each distinct key once per call, every request's figures in one packed
//! string, and answers with the state it read rather than the figures computed from it.

use std::sync::Arc;

use tollgate_core::algorithm::{self, WindowState};
use tollgate_core::{
    Algorithm, BackendError, BackendErrorKind, Check, Micros, Quota, Status, Verdict,
};

use crate::keys::{KeyDigest, Suffix};

/// Helpers and `now`, shared by both scripts (prepended to each).
pub(crate) const PRELUDE: &str = r"
local floor = math.floor
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function fmt(x) return string.format('%d', x) end
-- A GCRA key's value: its TAT and the emission interval it was written under.
local function read_tat(key)
  local v = redis.call('GET', key)
  if not v then return false, 0 end
  local t, i = string.match(v, '^(%d+):(%d+)$')
  if not t then return false, 0 end
  return tonumber(t), tonumber(i)
end
local function tat_value(tat, interval) return fmt(tat) .. ':' .. fmt(interval) end
-- Members of a sliding log that one ZADD or ZREM takes: unpack passes at most a few
-- thousand values.
local CHUNK = 1000
-- Adds (`ZADD`, scored at `stamp`) or removes (`ZREM`) a sliding log's members
-- `<stamp>-<from>` to `<stamp>-<to>`: one unique member per unit, a chunk per command.
local function log_units(cmd, key, stamp, from, to)
  local members = {}
  while from <= to do
    local last, n = math.min(from + CHUNK - 1, to), 0
    for s = from, last do
      if cmd == 'ZADD' then
        n = n + 1
        members[n] = stamp
      end
      n = n + 1
      members[n] = stamp .. '-' .. fmt(s)
    end
    redis.call(cmd, key, unpack(members, 1, n))
    from = last + 1
  end
end
local function ttl_ms(us)
  local ms = idiv(us + 999, 1000)
  if ms < 1 then ms = 1 end
  return fmt(ms)
end
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
";

/// Checks and consumes the batches of one or more requests, in order.
///
/// Each request's batch is all-or-nothing on its own: it writes only if every one of its
/// enforced checks admits, and a later request in the same call sees what an earlier one wrote,
/// exactly as if each had been its own call. Merging the batches of concurrent requests into one
/// call saves a round trip and the script's set-up per request.
///
/// `KEYS`: every key the call may touch, each distinct (limit, identity) once, as Redis requires
/// of a script: a GCRA TAT and its emission interval at `<base>:v2`; a fixed window's count at
/// `<base>:<window index>`, declared for the client's current window and the next one (the
/// window that holds the server's `TIME` is not known until the script runs); a sliding log at
/// `<base>:log`, followed by its sequence counter at `<base>:seq`. All share the base key's
/// hash tag, so the same slot. No two algorithms share a key: a limit whose algorithm changes
/// under the same name (old and new replicas side by side during a deploy) never finds a key
/// of the wrong type, which would fail the whole call.
///
/// `ARGV[1]`: `now` in microseconds, or empty to read the server's `TIME`. The override exists
/// for tests (`RedisBackend::check_at`) only.
///
/// `ARGV[2]`: the number `L` of distinct limits in the call, then 4 arguments per limit:
/// algorithm (1 GCRA, 2 fixed window, 3 sliding log) and three parameters (GCRA: emission
/// interval, tolerance, burst; fixed window: period, limit, the index of the client's current
/// window; sliding log: period, limit, 0). If the window that holds `now` is neither the
/// client's current one nor the next, the script writes nothing and answers the error
/// `TOLLGATE_WINDOW <now>`; the client then declares the windows of that `now` and calls again.
///
/// The last argument: one string of little-endian doubles (integers below 2^53), per request
/// its number of checks `n`, then per check two figures: `(cost × 2 + e) × 1024 + l`, where `e`
/// is 1 if the check is enforced and `l` the index of its limit (from 0), and the number of its
/// first key in `KEYS` (from 1). One string rather than an argument per figure: Redis handles each
/// argument of a call as a string of its own and Lua's `tonumber` reads each with the C
/// library's `strtod`, while `struct.unpack` decodes the whole string in one call. Together
/// with each key sent once, that takes about a quarter off Redis' work per request when
/// requests share keys.
///
/// Reply: one string of little-endian doubles (all integers below 2^53): `now`, then per
/// request `committed` and per check its `status` (0 allowed, 1 denied, 2 cost too high) and:
/// - GCRA: the TAT the check read (0 for none), carried to the check's emission interval
///   when it was written under another ([`algorithm::gcra_carry`]);
/// - fixed window: the count the check read in the window that holds `now`;
/// - sliding log: `remaining, reset, retry_after` and the last sequence number the check wrote
///   (what a refund needs).
///
/// The client computes a GCRA or fixed-window verdict from that state with
/// `tollgate_core::algorithm` and checks the status against it: the script only decides,
/// which spares it the arithmetic of the figures and half the reply (about a fifth of its work
/// per request). A sliding log's figures need the log, so the script sends them. One string
/// rather than an array of integers: packing it is one call in Lua, and the client reads it
/// without a parser per item.
pub(crate) const CHECK: &str = r"
-- tollgate_core::algorithm::gcra_carry: now + ceil((tat - now) / from) * to, at most
-- MAX_PERIOD ahead. Every figure below 2^53 is exact; a product above the cap may round, but
-- never to the other side of it.
local MAX_AHEAD = 3155760000000000
local function carry(tat, from, to)
  if (not tat) or tat <= now or from == to or from == 0 then return tat end
  local d = tat - now
  local used = idiv(d, from)
  if used * from < d then used = used + 1 end
  local ahead = used * to
  if ahead > MAX_AHEAD then ahead = MAX_AHEAD end
  return now + ahead
end
local limits = {}
local a = 3
for l = 1, tonumber(ARGV[2]) do
  local algo, p1, p2, p3 = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]),
    tonumber(ARGV[a + 3])
  if algo == 2 then
    -- The client declared the keys of its current window (index p3) and the next; before
    -- anything is written, the window that holds now must be one of them.
    local shift = idiv(now, p1) - p3
    if shift ~= 0 and shift ~= 1 then
      return redis.error_reply('TOLLGATE_WINDOW ' .. fmt(now))
    end
    p3 = shift
  end
  limits[l] = {algo, p1, p2, p3}
  a = a + 4
end
-- The requests: sizes, check numbers and key numbers, decoded in one call.
local packed = ARGV[a]
local figures = #packed / 8
local fig = {struct.unpack('<' .. string.rep('d', figures), packed)}
local i = 1
-- The reply, and the index of its last figure.
local out, o = {now}, 1
-- The state of every GCRA and fixed-window key this call touched, read once and written once
-- at the end: requests that share a key (a hot client, a tenant) cost one GET and one write
-- per call, not per request. `false` stands for a key with no state. `written` lists the keys
-- to write, in order; `ttl` holds a written window's TTL, `false` a GCRA key's.
local state, first, written, ttl = {}, {}, {}, {}
-- The emission interval each GCRA key's TAT in `state` is counted in.
local t_of = {}
-- The slots held per concurrency key, counted at its first check in the call.
local in_flight = {}
local function read(key, missing)
  local v = state[key]
  if v == nil then
    v = tonumber(redis.call('GET', key) or '') or missing
    state[key], first[key] = v, v
  end
  return v
end
-- What each admitting check of the current request would write: algorithm, key, value, TTL
-- (of a window), and where a sliding log's reply takes the sequence number the write makes.
local w_algo, w_key, w_val, w_ttl, w_seq = {}, {}, {}, {}, {}
while i <= figures do
  local n = fig[i]
  i = i + 1
  o = o + 1
  local head = o
  out[head] = 0
  local admits = true
  for j = 1, n do
    w_algo[j] = 0
    local code, k = fig[i], fig[i + 1]
    local key = KEYS[k]
    i = i + 2
    local l = code % 1024
    code = (code - l) / 1024
    local enforce = code % 2 == 1
    local cost = (code - code % 2) / 2
    local limit = limits[l + 1]
    local algo, p1, p2, p3 = limit[1], limit[2], limit[3], limit[4]
    local status = 0
    local slot
    if algo == 4 then
      -- A concurrency check also carries its request's slot id, in three parts.
      slot = fmt(fig[i]) .. '-' .. fmt(fig[i + 1]) .. '-' .. fmt(fig[i + 2])
      i = i + 3
    end

    if algo == 1 then
      local interval, burst, tolerance = p1, p3, p2
      local tat = state[key]
      if tat == nil then
        tat, t_of[key] = read_tat(key)
        state[key], first[key] = tat, tat
      end
      -- Written under another quota (a plan, a reload): carry what the key used.
      tat = carry(tat, t_of[key], interval)
      local base = now
      if tat and tat > now then base = tat end
      local new_tat = base + interval * cost
      if cost > burst then
        status = 2
      elseif new_tat - now > tolerance then
        status = 1
      else
        w_algo[j], w_key[j], w_val[j], w_ttl[j] = 1, key, new_tat, interval
      end
      out[o + 1], out[o + 2] = status, tat or 0
      o = o + 2

    elseif algo == 2 then
      local period, limit = p1, p2
      local index = idiv(now, period)
      local wkey = KEYS[k + p3]
      local count = read(wkey, 0)
      if cost > limit then
        status = 2
      elseif count + cost > limit then
        status = 1
      else
        w_algo[j], w_key[j], w_val[j], w_ttl[j] = 2, wkey, cost, (index + 1) * period - now
      end
      out[o + 1], out[o + 2] = status, count
      o = o + 2

    elseif algo == 3 then
      local period, limit = p1, p2
      local remaining, reset, retry = 0, 0, 0
      local log = key
      -- An entry at t counts while t + period > now.
      local oldest = fmt(now - period)
      local count = redis.call('ZCOUNT', log, '(' .. oldest, '+inf')
      if limit > count then remaining = limit - count end
      if count > 0 then
        local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
        reset = tonumber(newest[2]) + period - now
      end
      if cost > limit then
        status = 2
      elseif count + cost > limit then
        local nth = redis.call('ZRANGEBYSCORE', log, '(' .. oldest, '+inf', 'WITHSCORES',
          'LIMIT', count + cost - limit - 1, 1)
        status, retry = 1, tonumber(nth[2]) + period - now
      else
        remaining, reset = limit - count - cost, period
        w_algo[j], w_key[j], w_val[j], w_ttl[j], w_seq[j] = 3, k, cost, period, o + 5
      end
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = status, remaining, reset, retry, 0
      o = o + 5

    elseif algo == 4 then
      local ttl, limit = p1, p2
      -- The slots held: a slot's score is its deadline, and one past it is gone (its holder
      -- crashed, or stopped renewing it). Counted once per call and key, then kept up to date.
      local held = in_flight[key]
      if held == nil then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
        held = redis.call('ZCARD', key)
        in_flight[key] = held
      end
      if cost > limit then
        status = 2
      elseif held + cost > limit then
        status = 1
      else
        w_algo[j], w_key[j], w_val[j], w_ttl[j] = 4, key, slot, ttl
      end
      out[o + 1], out[o + 2] = status, held
      o = o + 2

    else
      return redis.error_reply('tollgate: unknown algorithm ' .. tostring(algo))
    end

    if status ~= 0 and enforce then admits = false end
  end

  if admits then
    for j = 1, n do
      local algo, key = w_algo[j], w_key[j]
      if algo == 1 then
        state[key], t_of[key] = w_val[j], w_ttl[j]
        if ttl[key] == nil then ttl[key] = false; written[#written + 1] = key end
      elseif algo == 2 then
        state[key] = state[key] + w_val[j]
        if ttl[key] == nil then ttl[key] = w_ttl[j]; written[#written + 1] = key end
      elseif algo == 3 then
        local cost, period, log, seq_key = w_val[j], w_ttl[j], KEYS[key], KEYS[key + 1]
        redis.call('ZREMRANGEBYSCORE', log, '-inf', now - period)
        local last = redis.call('INCRBY', seq_key, cost)
        -- A unique member per unit (two units in the same microsecond are two entries).
        log_units('ZADD', log, fmt(now), last - cost + 1, last)
        redis.call('PEXPIRE', log, ttl_ms(period))
        redis.call('PEXPIRE', seq_key, ttl_ms(period))
        out[w_seq[j]] = last
      elseif algo == 4 then
        local slot_ttl = w_ttl[j]
        redis.call('ZADD', key, fmt(now + slot_ttl), w_val[j])
        redis.call('PEXPIRE', key, ttl_ms(slot_ttl))
        in_flight[key] = in_flight[key] + 1
      end
    end
    out[head] = 1
  end
end
for i = 1, #written do
  local key = written[i]
  local v, window_ttl = state[key], ttl[key]
  if not window_ttl then
    -- A GCRA TAT lives until it is in the past.
    redis.call('SET', key, tat_value(v, t_of[key]), 'PX', ttl_ms(v - now))
  else
    -- A window's count: its TTL (the time to the window's turn) is set by its first write.
    redis.call('INCRBY', key, fmt(v - first[key]))
    if first[key] == 0 then redis.call('PEXPIRE', key, ttl_ms(window_ttl)) end
  end
end
return struct.pack('<' .. string.rep('d', o), unpack(out, 1, o))
";

/// A slot id's 128 bits as three integers of at most 43 bits, each exact in a Lua double.
pub(crate) fn slot_parts(id: u128) -> [u64; 3] {
    const MASK: u128 = (1 << 43) - 1;
    [
        (id >> 86) as u64,
        ((id >> 43) & MASK) as u64,
        (id & MASK) as u64,
    ]
}

/// The member under which a slot is held in its sorted set: its three parts in decimal,
/// joined by `-` (what the scripts write from the parts).
pub(crate) fn slot_member(id: u128) -> String {
    let [a, b, c] = slot_parts(id);
    format!("{a}-{b}-{c}")
}

/// Undoes what one `CHECK` call wrote.
///
/// `KEYS[i]`: the key each check to refund wrote (a GCRA TAT, a window's count, a log). `ARGV[1]`: `now` or empty, as for `CHECK`.
/// `ARGV[2 + 4 (i - 1) ..]`: per check: algorithm, then GCRA: `cost * interval`, the TAT the
/// check left when the refund requires it (a leased limit's) or 0, 0; fixed
/// window: window index, cost, 0; sliding log: the `now` of the consume, last sequence number,
/// cost; concurrency: the slot id's three parts ([`slot_member`]).
pub(crate) const REFUND: &str = r"
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 4
  local algo = tonumber(ARGV[a])
  local x, y, z = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local key = KEYS[i]
  if algo == 1 then
    local tat, interval = read_tat(key)
    -- y: the TAT the check left, which a leased key's refund requires (0: any).
    if tat and (y == 0 or tat == y) then
      local back = tat - x
      if back <= now then
        redis.call('DEL', key)
      else
        redis.call('SET', key, tat_value(back, interval), 'PX', ttl_ms(back - now))
      end
    end
  elseif algo == 2 then
    local wkey = key
    local count = tonumber(redis.call('GET', wkey) or '')
    if count ~= nil then
      if count <= y then redis.call('DEL', wkey) else redis.call('DECRBY', wkey, y) end
    end
  elseif algo == 4 then
    redis.call('ZREM', key, fmt(x) .. '-' .. fmt(y) .. '-' .. fmt(z))
  elseif algo == 3 then
    log_units('ZREM', key, fmt(x), y - z + 1, y)
  end
end
return 1
";

/// Settles checks admitted earlier: gives back or consumes the difference between what each
/// reserved and what it should have cost (see `tollgate_core::Settlement` for each algorithm).
///
/// `KEYS`: per settlement, its key (a GCRA TAT at `<base>:v2`, a fixed window's
/// `<base>:<index>`), or two for
/// a sliding log (`<base>:log`, `<base>:seq`). `ARGV[1]`: `now` or empty, as for `CHECK`.
/// `ARGV[2 + 7 (i - 1) ..]`: per settlement: algorithm, refund, charge, then GCRA: interval,
/// the most the TAT may run ahead of now, the TAT a refund requires (0: any; a lease's
/// give-back applies only while the TAT is still the one its take left), 0; fixed window: the end of its window, 0, 0, 0;
/// sliding log: the stamp of its units, their last sequence number, the period, the most
/// units the log may hold. Refunds and charges are cut in the client so that every product
/// here stays an exact integer.
pub(crate) const SETTLE: &str = r"
local k = 1
for i = 0, (#ARGV - 1) / 7 - 1 do
  local a = 2 + i * 7
  local algo, refund, charge = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local x, y, z, w = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local key = KEYS[k]
  if algo == 1 then
    k = k + 1
    local tat, from = read_tat(key)
    if tat and from ~= 0 and from ~= x and tat > now then
      -- Written under another quota: the units used, at this quota's interval (as CHECK).
      local d = tat - now
      local used = idiv(d, from)
      if used * from < d then used = used + 1 end
      tat = now + used * x
      if tat > now + y then tat = now + y end
    end
    if not tat then tat = nil end
    -- z > 0: a lease's give-back, only while nothing has moved the TAT since its take.
    if refund > 0 and tat ~= nil and (z == 0 or tat == z) then
      local back = tat - x * refund
      if back <= now then
        redis.call('DEL', key)
      else
        redis.call('SET', key, tat_value(back, x), 'PX', ttl_ms(back - now))
      end
    elseif charge > 0 then
      local base = now
      if tat ~= nil and tat > now then base = tat end
      local cap = now + y
      if cap < base then cap = base end
      local new = base + x * charge
      if new > cap then new = cap end
      redis.call('SET', key, tat_value(new, x), 'PX', ttl_ms(new - now))
    end
  elseif algo == 2 then
    k = k + 1
    if now < x then
      if refund > 0 then
        local count = tonumber(redis.call('GET', key) or '')
        if count ~= nil then
          if count <= refund then redis.call('DEL', key) else redis.call('DECRBY', key, refund) end
        end
      elseif charge > 0 then
        redis.call('INCRBY', key, charge)
        redis.call('PEXPIRE', key, ttl_ms(x - now))
      end
    end
  elseif algo == 3 then
    local seq_key = KEYS[k + 1]
    k = k + 2
    if refund > 0 then
      log_units('ZREM', key, fmt(x), y - refund + 1, y)
    elseif charge > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now - z)
      local alive = redis.call('ZCARD', key)
      local more = charge
      if alive + more > w then more = w - alive end
      if more > 0 then
        local last = redis.call('INCRBY', seq_key, more)
        log_units('ZADD', key, fmt(now), last - more + 1, last)
        redis.call('PEXPIRE', key, ttl_ms(z))
        redis.call('PEXPIRE', seq_key, ttl_ms(z))
      end
    end
  end
end
return 1
";

/// A Lua script, called by its SHA-1 with `EVALSHA` (see `Conn::invoke`).
pub(crate) struct Script {
    code: String,
    sha: String,
}

impl Script {
    /// The script made of [`PRELUDE`] and `body`.
    pub(crate) fn new(body: &str) -> Self {
        let code = format!("{PRELUDE}{body}");
        let sha = redis::Script::new(&code).get_hash().to_owned();
        Self { code, sha }
    }

    /// An `EVALSHA` of this script with `keys` keys, with room for `args` keys and arguments
    /// of `bytes` bytes in all; the caller adds the keys, then the arguments.
    pub(crate) fn call(&self, keys: usize, args: usize, bytes: usize) -> redis::Cmd {
        let mut cmd = redis::Cmd::with_capacity(3 + args, 64 + bytes);
        cmd.arg("EVALSHA").arg(&self.sha).arg(keys);
        cmd
    }

    /// The script's SHA-1, as `EVALSHA` takes it.
    pub(crate) fn sha(&self) -> &str {
        &self.sha
    }

    /// `SCRIPT LOAD` of this script.
    pub(crate) fn load(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&self.code);
        cmd
    }
}

/// Distinct limits one `CHECK` call can carry (the packing of a check's argument).
pub(crate) const LIMITS_PER_CALL: usize = 1024;

/// One check, ready for the scripts: owned, so the future that runs it can be `'static`.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
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
    /// Whether this check holds the deny cache's lease on its key (see `DenyCache::lookup`).
    pub(crate) leased: bool,
    /// Whether `cost` is a quota lease's slice (the request's cost and more, see `lease`):
    /// its answer says nothing of the request's own cost to the deny cache.
    pub(crate) slice: bool,
    /// The limit is leased: a GCRA refund of this check applies only while the key's TAT is
    /// still the one the check left (see `lease`: other replicas' slices are paced by it).
    pub(crate) guarded: bool,
}

impl Prepared {
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
                (1, [interval, interval.saturating_mul(burst), burst])
            }
            Algorithm::FixedWindow => (2, [quota.period_micros(), u64::from(quota.limit()), 0]),
            Algorithm::SlidingLog => (3, [quota.period_micros(), u64::from(quota.limit()), 0]),
            Algorithm::Concurrency => (4, [quota.period_micros(), u64::from(quota.limit()), 0]),
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
            leased: false,
            slice: false,
            guarded: check.limit.lease().is_some(),
        })
    }

    /// The arguments of this check's limit in a `CHECK` call whose fixed windows are named
    /// for `window_now`.
    pub(crate) fn limit_args(&self, window_now: Micros) -> [u64; 4] {
        let [p1, p2, p3] = self.params;
        match self.code {
            2 => [2, p1, p2, algorithm::window_index(&self.quota, window_now)],
            code => [u64::from(code), p1, p2, p3],
        }
    }

    /// The key this check wrote, for a refund of what `CHECK` answered.
    pub(crate) fn refund_key(&self, answer: &Answer) -> Suffix {
        match self.code {
            1 => Suffix::Tat,
            2 => Suffix::Window(answer.extra),
            4 => Suffix::Slots,
            _ => Suffix::Log,
        }
    }

    /// The one argument of this check in a `CHECK` call, given the index of its limit there.
    pub(crate) fn check_arg(&self, limit: usize) -> u64 {
        let flags = u64::from(self.cost) * 2 + u64::from(self.enforce);
        flags * LIMITS_PER_CALL as u64 + limit as u64
    }

    /// The arguments that undo this check's write, given what `CHECK` answered.
    pub(crate) fn refund_args(&self, now: Micros, answer: &Answer) -> [u64; 4] {
        let cost = u64::from(self.cost);
        match self.code {
            1 => {
                // The TAT this check left (from the TAT it read), which a guarded refund
                // requires (0: any; a TAT no key holds, should the check not have admitted).
                let read = (answer.extra > 0).then_some(answer.extra);
                let left = match self.guarded {
                    true => algorithm::gcra(&self.quota, read, now, self.cost)
                        .1
                        .unwrap_or(u64::MAX),
                    false => 0,
                };
                [1, self.params[0].saturating_mul(cost), left, 0]
            }
            2 => [2, answer.extra, cost, 0],
            4 => {
                let [a, b, c] = slot_parts(self.slot);
                [4, a, b, c]
            }
            _ => [3, now, answer.extra, cost],
        }
    }
}

/// What one `CHECK` call sends for the batches of several requests (see [`CHECK`]).
pub(crate) struct CheckArgs<'p> {
    /// Each distinct limit's parameters, once.
    pub(crate) limits: Vec<[u64; 4]>,
    /// The call's `KEYS`: a check of each distinct (limit, identity), once, and the suffix of
    /// each of its keys.
    pub(crate) keys: Vec<(&'p Prepared, Suffix)>,
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
    pub(crate) fn new(
        batches: &[&'p [Prepared]],
        window_now: Micros,
    ) -> Result<Self, BackendError> {
        // Every check of the call, each with its limit's index and its first key's number:
        // one vector, sorted by key to number the keys, then back into the requests' order.
        let mut all: Vec<Numbered<'p>> = batches
            .iter()
            .flat_map(|b| b.iter())
            .enumerate()
            .map(|(at, p)| Numbered {
                p,
                at,
                limit: 0,
                key: 0,
            })
            .collect();
        // Each check refers to its limit by index.
        let mut limits: Vec<[u64; 4]> = Vec::new();
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
        let mut keys: Vec<(&Prepared, Suffix)> = Vec::with_capacity(2 * all.len());
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
            packed.extend_from_slice(&figure_bytes(batch.len() as u64));
            for c in checks.by_ref().take(batch.len()) {
                packed.extend_from_slice(&figure_bytes(c.p.check_arg(c.limit)));
                packed.extend_from_slice(&figure_bytes(c.key as u64));
                if c.p.code == 4 {
                    for part in slot_parts(c.p.slot) {
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
    p: &'p Prepared,
    at: usize,
    limit: usize,
    key: usize,
}

/// What `CHECK` answered for one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) verdict: Verdict,
    pub(crate) extra: u64,
    /// The server's time of the call that answered.
    pub(crate) at: Micros,
}

/// A whole `CHECK` reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) committed: bool,
    pub(crate) now: Micros,
    pub(crate) answers: Vec<Answer>,
}

fn protocol(msg: impl Into<String>) -> BackendError {
    BackendError::new(BackendErrorKind::Protocol, msg)
}

/// Decodes a `CHECK` reply for one request.
///
/// # Errors
///
/// [`BackendErrorKind::Protocol`] for anything but the expected figures.
#[cfg(test)]
pub(crate) fn parse_reply(value: &redis::Value, batch: &[Prepared]) -> Result<Reply, BackendError> {
    let mut replies = parse_replies(value, &[batch])?;
    replies.pop().ok_or_else(|| protocol("empty script reply"))
}

/// The figures of one check's answer in a `CHECK` reply.
fn answer_len(p: &Prepared) -> usize {
    match p.algorithm {
        Algorithm::Gcra | Algorithm::FixedWindow | Algorithm::Concurrency => 2,
        _ => 5,
    }
}

/// Decodes a `CHECK` reply for the requests of `batches`, in order.
///
/// A GCRA or fixed-window check's verdict is computed here, by `tollgate_core::algorithm`,
/// from the state the script read for it; the script's status must agree with it.
///
/// # Errors
///
/// [`BackendErrorKind::Protocol`] for anything but a string of the expected figures.
pub(crate) fn parse_replies(
    value: &redis::Value,
    batches: &[&[Prepared]],
) -> Result<Vec<Reply>, BackendError> {
    let redis::Value::BulkString(bytes) = value else {
        return Err(protocol(format!("unexpected script reply {value:?}")));
    };
    let expected = 1 + batches
        .iter()
        .map(|b| 1 + b.iter().map(answer_len).sum::<usize>())
        .sum::<usize>();
    if bytes.len() != 8 * expected {
        return Err(protocol(format!(
            "script reply of {} bytes where {} figures were expected",
            bytes.len(),
            expected
        )));
    }
    let mut figures = bytes.chunks_exact(8).map(|c| {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(c);
        figure(f64::from_le_bytes(raw))
    });
    let mut next = || {
        figures
            .next()
            .unwrap_or_else(|| Err(protocol("script reply too short")))
    };
    let now = next()?;
    let mut replies = Vec::with_capacity(batches.len());
    for batch in batches {
        let committed = next()? == 1;
        let mut answers = Vec::with_capacity(batch.len());
        for p in batch.iter() {
            let status = next()?;
            let answer = match p.algorithm {
                Algorithm::Gcra => {
                    let tat = Some(next()?).filter(|&t| t != 0);
                    let (verdict, _) = algorithm::gcra(&p.quota, tat, now, p.cost);
                    Answer {
                        verdict,
                        extra: 0,
                        at: now,
                    }
                }
                Algorithm::FixedWindow => {
                    let state = WindowState {
                        window_end: algorithm::window_end(&p.quota, now),
                        count: next()?,
                    };
                    let (verdict, _) = algorithm::fixed_window(&p.quota, Some(state), now, p.cost);
                    let extra = algorithm::window_index(&p.quota, now);
                    Answer {
                        verdict,
                        extra,
                        at: now,
                    }
                }
                Algorithm::Concurrency => {
                    let held = u32::try_from(next()?).unwrap_or(u32::MAX);
                    let (verdict, _) =
                        algorithm::concurrency(&p.quota, held, p.cost, p.busy_retry_after);
                    Answer {
                        verdict,
                        extra: 0,
                        at: now,
                    }
                }
                _ => {
                    let [remaining, reset, retry_after, extra] =
                        [next()?, next()?, next()?, next()?];
                    let status = match status {
                        0 => Status::Allowed,
                        1 => Status::Denied { retry_after },
                        2 => Status::CostTooHigh,
                        other => return Err(protocol(format!("unknown status {other} in reply"))),
                    };
                    let verdict = Verdict {
                        status,
                        remaining,
                        reset,
                    };
                    Answer {
                        verdict,
                        extra,
                        at: now,
                    }
                }
            };
            if status_code(answer.verdict.status) != status {
                return Err(protocol(format!(
                    "the script answered status {status} where {:?} was expected",
                    answer.verdict.status
                )));
            }
            answers.push(answer);
        }
        replies.push(Reply {
            committed,
            now,
            answers,
        });
    }
    Ok(replies)
}

/// A status as the script writes it.
fn status_code(status: Status) -> u64 {
    match status {
        Status::Allowed => 0,
        Status::Denied { .. } => 1,
        Status::CostTooHigh => 2,
        // No status the script writes.
        _ => u64::MAX,
    }
}

/// A figure of a `CHECK` call's packed argument: a little-endian double. Every figure sent
/// (a request's size, a check's number, a key's number) is below 2^53, so exact.
fn figure_bytes(x: u64) -> [u8; 8] {
    #[allow(clippy::cast_precision_loss)]
    (x as f64).to_le_bytes()
}

/// A figure of a reply: a whole number of at most 2^53, the range in which Lua is exact.
fn figure(x: f64) -> Result<u64, BackendError> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if (0.0..=EXACT).contains(&x) && x.fract() == 0.0 {
        // In range and whole: the conversion is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(x as u64)
    } else {
        Err(protocol(format!(
            "figure {x} in reply is not a whole number"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;
    use tollgate_core::Limit;

    use crate::keys;

    fn packed(figures: &[f64]) -> Value {
        Value::BulkString(figures.iter().flat_map(|f| f.to_le_bytes()).collect())
    }

    const NOW: f64 = 1_000_000_000_000.;

    fn prepared(algorithm: Algorithm, cost: u32) -> Prepared {
        let limit = Limit::new("l", algorithm, Quota::per_minute(5).unwrap()).unwrap();
        let mut check = Check::new(&limit, b"k");
        check.cost = cost;
        Prepared::new(&check, [0; 16]).unwrap()
    }

    #[test]
    fn a_call_sends_each_limit_and_each_key_once() {
        let per_ip = Limit::new("ip", Algorithm::Gcra, Quota::per_minute(5).unwrap()).unwrap();
        let daily = Limit::new("day", Algorithm::FixedWindow, Quota::per_day(9).unwrap()).unwrap();
        let check = |limit: &Limit, key: &[u8], cost| {
            let mut check = Check::new(limit, key);
            check.cost = cost;
            Prepared::new(&check, keys::digest(limit.name(), key)).unwrap()
        };
        let first = [check(&per_ip, b"a", 1)];
        let second = [check(&per_ip, b"a", 2), check(&daily, b"a", 1)];
        let third = [check(&per_ip, b"b", 1)];
        // Two days and a bit after the epoch: the window of day 2.
        let args = CheckArgs::new(&[&first, &second, &third], 2 * 86_400_000_000 + 7).unwrap();
        assert_eq!(args.limits.len(), 2);
        assert!(args.limits.contains(&[2, 86_400_000_000, 9, 2]));
        // (ip, a); (day, a) in windows 2 and 3; (ip, b).
        let suffixes: Vec<Suffix> = args.keys.iter().map(|(_, s)| *s).collect();
        assert_eq!(args.keys.len(), 4);
        assert_eq!(suffixes.iter().filter(|s| **s == Suffix::Tat).count(), 2);
        let window = suffixes
            .iter()
            .position(|s| *s == Suffix::Window(2))
            .unwrap();
        assert_eq!(suffixes[window + 1], Suffix::Window(3));
        let key = |p: &Prepared| {
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

    #[test]
    fn computes_gcra_and_window_verdicts_from_the_state_the_script_read() {
        let batch = [
            prepared(Algorithm::Gcra, 1),
            prepared(Algorithm::FixedWindow, 1),
            prepared(Algorithm::SlidingLog, 6),
        ];
        // now; committed; GCRA allowed on a key never seen; the window refused with its 5
        // units used; the log: cost too high, 3 left.
        let figures = [NOW, 1., 0., 0., 1., 5., 2., 3., 0., 0., 0.];
        let r = parse_reply(&packed(&figures), &batch).unwrap();
        assert!(r.committed);
        assert_eq!(r.now, 1_000_000_000_000);
        let gcra = r.answers[0].verdict;
        assert_eq!(
            (gcra.status, gcra.remaining, gcra.reset),
            (Status::Allowed, 4, 12_000_000)
        );
        // The minute's window that holds now ends 20 s later.
        let window = r.answers[1];
        assert_eq!(
            (
                window.verdict.status,
                window.verdict.remaining,
                window.extra
            ),
            (
                Status::Denied {
                    retry_after: 20_000_000
                },
                0,
                16_666
            )
        );
        assert_eq!(r.answers[2].verdict.status, Status::CostTooHigh);
        assert_eq!(r.answers[2].verdict.remaining, 3);

        // A TAT 40 s ahead leaves 1 unit, then none.
        let ahead = [NOW, 1., 0., NOW + 40e6, 1., 5., 2., 3., 0., 0., 0.];
        let gcra = parse_reply(&packed(&ahead), &batch).unwrap().answers[0].verdict;
        assert_eq!((gcra.remaining, gcra.reset), (0, 52_000_000));
    }

    #[test]
    fn a_status_that_disagrees_with_the_state_is_a_protocol_error() {
        let batch = [prepared(Algorithm::Gcra, 1)];
        assert!(parse_reply(&packed(&[NOW, 1., 0., 0.]), &batch).is_ok());
        // Refused, on a key never seen.
        assert!(parse_reply(&packed(&[NOW, 1., 1., 0.]), &batch).is_err());
        // Allowed, with the bucket full for the next 60 s.
        assert!(parse_reply(&packed(&[NOW, 1., 0., NOW + 60e6]), &batch).is_err());
        let log = [prepared(Algorithm::SlidingLog, 1)];
        assert!(parse_reply(&packed(&[NOW, 1., 3., 0., 0., 0., 0.]), &log).is_err());
    }

    #[test]
    fn only_whole_figures_of_the_expected_number_are_read() {
        let batch = [prepared(Algorithm::Gcra, 1)];
        assert!(parse_reply(&packed(&[NOW, 1., 0.]), &batch).is_err());
        assert!(parse_reply(&packed(&[NOW, 1., 0., 0., 0.]), &batch).is_err());
        assert!(parse_reply(&Value::Nil, &[]).is_err());
        assert!(parse_reply(&packed(&[-1., 0.]), &[]).is_err());
        assert!(parse_reply(&packed(&[0.5, 0.]), &[]).is_err());
        assert!(parse_reply(&packed(&[f64::NAN, 0.]), &[]).is_err());
        assert!(parse_reply(&packed(&[2f64.powi(54), 0.]), &[]).is_err());
        assert_eq!(
            parse_reply(&packed(&[2f64.powi(53), 0.]), &[]).unwrap().now,
            1 << 53
        );
        assert!(parse_reply(&Value::BulkString(vec![0; 15]), &[]).is_err());
    }

    #[tokio::test]
    async fn a_call_for_the_wrong_window_writes_nothing_and_is_made_again_for_the_right_one() {
        use std::sync::atomic::Ordering;
        use tollgate_core::Backend;

        let server = tollgate_testsupport::RedisServer::start();
        let backend = crate::RedisBackend::builder()
            .url(server.url())
            .deadline(std::time::Duration::from_secs(5))
            .build()
            .unwrap();
        let limit = Limit::fixed_window("w", Quota::per_minute(10).unwrap()).unwrap();
        let check = || backend.check(&[Check::new(&limit, b"k")]);
        assert_eq!(check().await.unwrap()[0].remaining, 9);
        server.reset_stats();
        // The client believes the server an hour behind: the windows it declares are not the
        // server's, which refuses the call, says its time, and the call is made again.
        backend.inner.skew.store(-3_600_000_000, Ordering::Relaxed);
        assert_eq!(check().await.unwrap()[0].remaining, 8);
        assert_eq!(server.calls("evalsha"), 2);
        // The server's time is known again: one call.
        assert_eq!(check().await.unwrap()[0].remaining, 7);
        assert_eq!(server.calls("evalsha"), 3);
        // Only the window of the server's time was written.
        assert_eq!(server.dbsize(), 1);
    }

    #[test]
    fn parses_the_reply_of_several_requests() {
        let one = [prepared(Algorithm::Gcra, 1)];
        let two = [prepared(Algorithm::Gcra, 6), prepared(Algorithm::Gcra, 1)];
        // A committed request of one check, a refused one of two (the first costs too much).
        let v = packed(&[NOW, 1., 0., 0., 0., 2., 0., 0., 0.]);
        let r = parse_replies(&v, &[&one, &two]).unwrap();
        assert_eq!(r.len(), 2);
        assert!(r[0].committed && !r[1].committed);
        assert_eq!((r[0].now, r[1].now), (1_000_000_000_000, 1_000_000_000_000));
        assert_eq!(r[0].answers[0].verdict.remaining, 4);
        assert_eq!(r[1].answers[0].verdict.status, Status::CostTooHigh);
        assert_eq!(r[1].answers[1].verdict.status, Status::Allowed);
        assert!(parse_replies(&v, &[&two, &one]).is_err());
        assert!(parse_replies(&v, &[&one]).is_err());
    }
}
